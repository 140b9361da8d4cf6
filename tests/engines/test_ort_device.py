"""ONNX Runtime's device path (`OrtDeviceDecoder`) against the CPU path (`OrtDecoder`), and the registry.

Here the device path runs on the CPU provider: device KV OrtValues bound in place, per-shape
buffers refilled with `update_inplace`, compaction by a tiny ONNX graph. Same provider and graph as
OrtDecoder, so outputs and KV must be bitwise equal. The CUDA test runs only where onnxruntime-gpu
sees a GPU (CUDA vs CPU kernels differ in rounding: a tolerance there, with the argmax exact).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from specrt.engines.ort_cpu.runner import OrtDecoder
from specrt.engines.ort_device.runner import CUDA_HINT, OrtDeviceDecoder
from specrt.engines.registry import BACKENDS, make_decoder, trt_options
from specrt.errors import SpecrtError
from specrt.runtime.tree import Tree
from specrt.schema.manifest import Manifest

CAPACITY = 48
TREE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])  # window 0:root 1:(0) 2:(1) 3:(0,0) 4:(0,1) 5:(0,0,0)
# (tree, accepted window nodes): chains accept a prefix, the tree a root-to-leaf path that needs compaction
STEPS = [(Tree.chain(3), [1, 2]), (TREE, [2]), (TREE, [1, 4]), (Tree.chain(1), []), (Tree.chain(3), [1, 2, 3]),
         (TREE, [1, 3, 5])]
HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.fixture(scope="module")
def target(tiny_bundle):
    manifest = Manifest.load(tiny_bundle)
    return manifest.onnx_path(tiny_bundle, "target"), manifest.target.config


def _pass(dec, windows: np.ndarray, past: np.ndarray, tree: Tree, rows=None) -> dict[str, np.ndarray]:
    """One pass as runtime/generate.py `forward` builds it, for every sequence of the batch."""
    b = windows.shape[0]
    rows = np.arange(tree.size) if rows is None else np.asarray(rows)
    return dec.run_all(windows.astype(np.int64), past[:, None] + tree.depth[None], past.astype(np.int64),
                       np.broadcast_to(tree.mask, (b, tree.size, tree.size)).copy(),
                       np.broadcast_to(rows, (b, len(rows))).astype(np.int64).copy())


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name in want:
        assert got[name].shape == want[name].shape, (what, name, got[name].shape, want[name].shape)
        diff = float(np.max(np.abs(got[name] - want[name])))
        assert np.array_equal(got[name], want[name]), f"{what}: {name} differs (max |diff| {diff:.3g})"


def _assert_kv_same(dev: OrtDeviceDecoder, ref: OrtDecoder, what: str) -> None:
    for i, (got, want) in enumerate(zip(dev.kv_arrays(), ref.kv, strict=True)):
        assert np.array_equal(got, want), f"{what}: KV buffer {i} differs (max |diff| {np.max(np.abs(got - want)):.3g})"


def _speculate(decoders, vocab: int, seed: int = 0) -> list[list[dict]]:
    """Prefill then STEPS (verify, accept a path, compact) on each decoder; the outputs of every pass."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, (1, 11))
    windows = [rng.integers(0, vocab, (1, tree.size)) for tree, _ in STEPS]
    runs = []
    for dec in decoders:
        outs = [_pass(dec, prompt, np.array([0]), Tree.chain(prompt.shape[1] - 1), rows=[prompt.shape[1] - 1])]
        past = prompt.shape[1] - 1  # the last prompt token is the next root: its row is written again
        for (tree, path), window in zip(STEPS, windows, strict=True):
            outs.append(_pass(dec, window, np.array([past]), tree))
            rows = [past + n for n in path]
            if rows != list(range(past + 1, past + 1 + len(path))):
                dec.compact(past + 1, rows)
            past += 1 + len(path)
        runs.append(outs)
    return runs


def test_device_path_equals_cpu_path_bitwise_over_prefill_tree_verify_and_compaction(target):
    path, cfg = target
    ref, dev = OrtDecoder(path, cfg, CAPACITY), OrtDeviceDecoder(path, cfg, CAPACITY, device="cpu")
    want, got = _speculate([ref, dev], cfg.vocab_size)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        _assert_same(g, w, f"pass {i}")
    assert got[0]["logits"].shape == (1, 1, cfg.vocab_size)  # prefill asked for one row
    _assert_kv_same(dev, ref, "after the last step")
    assert np.abs(ref.kv[0][0, :, :20]).sum() > 0  # real rows were written and compared
    # one bucket per (T, R) shape: prefill (11, 1), chain 4, tree 6, chain 2; repeats reuse theirs
    assert dev.num_buckets == 4


def test_compact_moves_rows_on_the_device_in_place(target):
    path, cfg = target
    dev = OrtDeviceDecoder(path, cfg, CAPACITY, device="cpu")
    _pass(dev, np.arange(100, 112)[None], np.array([0]), Tree.chain(11))
    before = dev.kv_arrays()
    ptrs = [v.data_ptr() for v in dev.kv]
    dev.compact(3, [5, 7, 8])
    after = dev.kv_arrays()
    assert [v.data_ptr() for v in dev.kv] == ptrs  # no new buffers: the decoder's bindings stay valid
    for b, a in zip(before, after, strict=True):
        want = b.copy()
        want[:, :, 3:6] = b[:, :, [5, 7, 8]]
        assert not np.array_equal(want, b)  # the move changes something
        assert np.array_equal(a, want)


def test_batch_of_two_with_different_past_lengths(target):
    """Sequence 1 rolls back two rows (past 6 vs 4): each sees its own prefix and writes at its own row."""
    path, cfg = target
    ref2, dev2 = OrtDecoder(path, cfg, CAPACITY, batch=2), OrtDeviceDecoder(path, cfg, CAPACITY, batch=2)
    singles = [OrtDecoder(path, cfg, CAPACITY) for _ in range(2)]
    rng = np.random.default_rng(1)
    prompts, step = rng.integers(0, cfg.vocab_size, (2, 6)), rng.integers(0, cfg.vocab_size, (2, 6))
    past = np.array([6, 4])
    for dec in (ref2, dev2):
        _assert_same(_pass(dec, prompts, np.array([0, 0]), Tree.chain(5)),
                     _pass(ref2 if dec is dev2 else dev2, prompts, np.array([0, 0]), Tree.chain(5)), "prefill")
    want, got = _pass(ref2, step, past, TREE), _pass(dev2, step, past, TREE)
    _assert_same(got, want, "batch-2 tree step")
    for s, single in enumerate(singles):  # against batch 1: same maths, GEMM blocking may round differently
        _pass(single, prompts[s : s + 1], np.array([0]), Tree.chain(5))
        one = _pass(single, step[s : s + 1], past[s : s + 1], TREE)
        np.testing.assert_allclose(got["logits"][s], one["logits"][0], rtol=1e-4, atol=1e-4)
    assert not np.allclose(got["logits"][0], got["logits"][1], atol=1e-3)
    for dec in (ref2, dev2):
        dec.compact(7, [8, 10])
    _assert_kv_same(dev2, ref2, "batch-2 after compact")


def test_one_slot_of_a_batch_runs_and_compacts_alone(target):
    """`select(1, 2)`: the passes run over sequence 1 only (batch-1 inputs), bitwise as a batch-1
    decoder; `compact(..., slot=1)` moves its rows and leaves sequence 0's."""
    path, cfg = target
    dev, single = OrtDeviceDecoder(path, cfg, CAPACITY, batch=2), OrtDecoder(path, cfg, CAPACITY)
    rng = np.random.default_rng(2)
    prompt, window = rng.integers(0, cfg.vocab_size, (1, 7)), rng.integers(0, cfg.vocab_size, (1, TREE.size))
    dev.select(0, 1)
    _pass(dev, prompt[:, ::-1].copy(), np.array([0]), Tree.chain(6))  # sequence 0: other tokens
    seq0 = [kv[0].copy() for kv in dev.kv_arrays()]
    dev.select(1, 2)
    for dec in (dev, single):
        _pass(dec, prompt, np.array([0]), Tree.chain(6))
    _assert_same(_pass(dev, window, np.array([6]), TREE), _pass(single, window, np.array([6]), TREE), "slot 1")
    for dec in (dev, single):
        dec.compact(7, [8, 10], **({"slot": 1} if dec is dev else {}))
    for got, want, zero in zip(dev.kv_arrays(), single.kv, seq0, strict=True):
        assert np.array_equal(got[1], want[0])
        assert np.array_equal(got[0], zero)  # sequence 0 untouched by the slot-1 pass and compaction
    with pytest.raises(SpecrtError, match="outside"):
        dev.select(1, 3)


def test_capacity_and_inputs_are_checked(target, tmp_path):
    path, cfg = target
    dev = OrtDeviceDecoder(path, cfg, 16, device="cpu")
    with pytest.raises(SpecrtError, match="KV capacity 16 exceeded"):
        _pass(dev, np.zeros((1, 4), np.int64), np.array([14]), Tree.chain(3))
    with pytest.raises(SpecrtError, match="missing"):
        OrtDeviceDecoder(tmp_path / "none.onnx", cfg, 16)
    with pytest.raises(SpecrtError, match="CUDA graphs need device 'cuda'"):
        OrtDeviceDecoder(path, cfg, 16, device="cpu", cuda_graphs=True)
    with pytest.raises(SpecrtError, match="unknown ONNX Runtime device 'tpu'"):
        OrtDeviceDecoder(path, cfg, 16, device="tpu")


# ── the registry ──────────────────────────────────────────────────────────────────────────────────
def test_registry_builds_each_cpu_backend_and_refuses_unknown_names_and_options(target):
    path, cfg = target
    assert set(BACKENDS) == {"native", "ort", "ort-fused", "ort-device", "ort-cuda", "trt"}
    assert type(make_decoder("ort", path, cfg, CAPACITY)) is OrtDecoder
    dev = make_decoder("ort-device", path, cfg, CAPACITY, batch=2, spin=False)
    assert isinstance(dev, OrtDeviceDecoder) and dev.device == "cpu" and not dev.cuda_graphs and dev.batch == 2
    with pytest.raises(SpecrtError) as e:
        make_decoder("onnx", path, cfg, CAPACITY)
    assert all(name in str(e.value) for name in BACKENDS) and "'onnx'" in str(e.value)
    with pytest.raises(SpecrtError, match="takes no option cuda_graphs"):
        make_decoder("ort", path, cfg, CAPACITY, cuda_graphs=True)
    with pytest.raises(SpecrtError, match="engine_path and max_window"):
        make_decoder("trt", path, cfg, CAPACITY)
    with pytest.raises(SpecrtError, match="batch 1"):
        make_decoder("trt", path, cfg, CAPACITY, batch=2, engine_path=path, max_window=8)


def test_trt_options_come_from_the_manifest(tiny_bundle):
    manifest = Manifest.load(tiny_bundle)
    with pytest.raises(SpecrtError, match="--backend trt"):
        trt_options(tiny_bundle, manifest, "target", CAPACITY)
    manifest.artifacts = {**manifest.artifacts, "tensorrt": {
        "capacity": 32, "max_window": 8, "graphs": {"target": {"file": "target/decoder.fp16.engine"}}}}
    with pytest.raises(SpecrtError, match="built for KV capacity 32"):
        trt_options(tiny_bundle, manifest, "target", CAPACITY)
    assert trt_options(tiny_bundle, manifest, "target", 32) == {
        "engine_path": tiny_bundle / "target/decoder.fp16.engine", "max_window": 8}


@pytest.mark.skipif(HAS_CUDA, reason="ONNX Runtime's CUDA provider is installed: the gate does not fire")
def test_ort_cuda_without_the_cuda_provider_is_one_line(target):
    path, cfg = target
    with pytest.raises(SpecrtError) as e:
        make_decoder("ort-cuda", path, cfg, CAPACITY)
    assert str(e.value) == CUDA_HINT and "\n" not in CUDA_HINT
    assert "pip install onnxruntime-gpu" in CUDA_HINT and "GPU" in CUDA_HINT


# ── on a GPU ──────────────────────────────────────────────────────────────────────────────────────
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu and a CUDA GPU (CUDAExecutionProvider missing)")
def test_cuda_with_graphs_matches_cpu(target):
    """The same passes four times on one CUDA decoder: ORT warms each graph id up, captures it on a
    later run and replays it after, so the last repetitions run captured graphs."""
    path, cfg = target
    (want,) = _speculate([OrtDecoder(path, cfg, CAPACITY)], cfg.vocab_size)
    try:
        dev = OrtDeviceDecoder(path, cfg, CAPACITY, device="cuda", cuda_graphs=True)
    except SpecrtError as e:
        if "GPU" in str(e):
            pytest.skip(f"no usable CUDA GPU: {e}")
        raise
    for rep in range(4):
        (got,) = _speculate([dev], cfg.vocab_size)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            for name in w:
                np.testing.assert_allclose(g[name], w[name], rtol=2e-3, atol=2e-3, err_msg=f"rep {rep} pass {i} {name}")
            assert np.array_equal(g["logits"].argmax(-1), w["logits"].argmax(-1)), (rep, i)
