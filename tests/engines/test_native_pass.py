"""The native backend's decoder pass on tiny int4 bundles: batch-invariant on every kernel branch (the runtime's
own invariance checks, all exactly 0), bitwise the same on every branch, with a float, half or int8 KV cache,
close to ONNX Runtime's int4 graph, and refusing what it does not compute."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.engines.native import library
from tests.helpers import export_tiny as tiny_bundle

HEAD_DIM_64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)  # the hand-vectorized attention
HEAD_DIM_32 = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)  # the generic loop; int8 blocks fit


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def bundle(request, tmp_path_factory):
    """Llama (head_dim 64) and Qwen2 (q|k|v bias; head_dim 32: the generic attention loop)."""
    extra = HEAD_DIM_64 if request.param == "llama" else HEAD_DIM_32
    return tiny_bundle(tmp_path_factory.mktemp(request.param), request.param, **extra)


KV_DTYPES = ["fp32", "fp16", "int8"]


def decoder(bundle, kernel: str, rows: int = 300, batch: int = 3, backend: str = "native", kv_dtype: str = "fp32"):
    from specrt.engines.registry import make_decoder
    from specrt.schema.manifest import Manifest

    manifest = Manifest.load(bundle)
    cfg = manifest.target.config
    if backend == "native":
        return make_decoder("native", bundle / manifest.target.file, cfg, rows, 2, batch, kernel=kernel,
                            kv_dtype=kv_dtype)
    return make_decoder(backend, manifest.onnx_path(bundle, "target"), cfg, rows, 2, batch)


def needs(kernel: str):
    if not library.supported(kernel):
        pytest.skip(f"this CPU cannot execute the {kernel} kernel (it needs {library.NEEDS[kernel]})")


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("kernel", list(library.KERNELS))
def test_every_invariance_check_is_exactly_zero(bundle, kernel, kv_dtype):
    from specrt.runtime import invariance
    from specrt.runtime.exec_modes import exec_mode

    needs(kernel)
    dec = decoder(bundle, kernel, invariance.ROWS + 8, kv_dtype=kv_dtype)
    m = invariance.measure(dec, dec.cfg.vocab_size, exec_mode("direct"))
    assert m["invariant"] and all(m[c] == 0.0 for c in invariance.CHECKS), m


def _session(dec, rng, vocab):
    """Prefill two slots at different lengths, then a tree window in one and a chain in both: every output."""
    from specrt.runtime.sequence import Pass, pack_windows
    from specrt.runtime.tree import Tree

    outs = []
    dec.select(0, 2)
    prompts = [rng.integers(0, vocab, 37), rng.integers(0, vocab, 11)]
    outs.append(dec.run_all(*pack_windows([Pass(p, 0, Tree.chain(len(p) - 1), np.arange(len(p))) for p in prompts])))
    tree = Tree.from_parents([-1, 0, 0, 1, 2, 2])
    dec.select(0, 1)
    outs.append(dec.run_all(*pack_windows([Pass(rng.integers(0, vocab, 6), 37, tree, np.arange(6))])))
    dec.select(0, 2)
    outs.append(dec.run_all(*pack_windows([Pass(rng.integers(0, vocab, 3), p, Tree.chain(2), np.arange(3))
                                           for p in (43, 11)])))
    # a long prefix (several of the attention's key blocks and a tail), then a tree window over it: the
    # queries of a key/value head read the cache together (Ops::attend_many)
    dec.select(0, 1)
    outs.append(dec.run_all(*pack_windows([Pass(rng.integers(0, vocab, 101), 46, Tree.chain(100), np.arange(101))])))
    outs.append(dec.run_all(*pack_windows([Pass(rng.integers(0, vocab, 6), 147, tree, np.arange(6))])))
    return [{k: v.copy() for k, v in o.items()} for o in outs]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_every_kernel_computes_bitwise_the_same_outputs(bundle, kv_dtype):
    runs = {}
    for kernel in library.available():
        dec = decoder(bundle, kernel, kv_dtype=kv_dtype)
        runs[kernel] = _session(dec, np.random.default_rng(7), dec.cfg.vocab_size) + [{"kv": np.stack(dec.kv)}]
    ref = runs["scalar"]
    for kernel, outs in runs.items():
        for a, b in zip(outs, ref, strict=True):
            assert a.keys() == b.keys()
            for name in a:
                assert np.array_equal(a[name], b[name]), (kernel, name, np.abs(a[name] - b[name]).max())


def test_weights_on_huge_pages_or_the_default_pages_give_bitwise_the_same_outputs(bundle, monkeypatch):
    """A model's weights sit in an arena that asks the system for 2 MiB pages (csrc/arena.h);
    SPECRT_NATIVE_HUGE_PAGES=0 leaves them on its default pages. Either way the same bytes are handed out and
    every output is bitwise the same; the advice is given only when wanted, and taken where the system has
    transparent huge pages."""
    import os

    from specrt.engines.native import calls

    runs, pages = {}, {}
    for value in ("1", "0"):
        monkeypatch.setenv("SPECRT_NATIVE_HUGE_PAGES", value)
        dec = decoder(bundle, "auto")
        pages[value] = calls.model_pages(dec.lib, dec._h)
        runs[value] = _session(dec, np.random.default_rng(7), dec.cfg.vocab_size) + [{"kv": np.stack(dec.kv)}]
    assert pages["1"]["bytes"] == pages["0"]["bytes"] > 0, pages
    assert not pages["0"]["huge_pages"]
    assert pages["1"]["huge_pages"] == os.path.isdir("/sys/kernel/mm/transparent_hugepage"), pages
    for a, b in zip(runs["1"], runs["0"], strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert np.array_equal(a[name], b[name]), name


def test_models_sharing_the_process_pool_run_from_threads_of_their_own(bundle):
    """Every model of a thread count runs on the process's one pool (csrc/pool.h shared_pool), one run at a
    time: decoders driven from four threads at once give bitwise what each gives alone."""
    import threading

    alone = _session(decoder(bundle, "auto"), np.random.default_rng(9), 128)
    decs = [decoder(bundle, "auto") for _ in range(4)]
    got: dict[int, list] = {}
    start = threading.Barrier(len(decs))

    def drive(i):
        start.wait()
        got[i] = [_session(decs[i], np.random.default_rng(9), 128) for _ in range(3)]

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(len(decs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == len(decs)
    for runs in got.values():
        for outs in runs:
            for a, b in zip(outs, alone, strict=True):
                assert all(np.array_equal(a[k], b[k]) for k in b)


def test_a_half_cache_holds_each_key_and_value_rounded_to_the_nearest_half(bundle):
    """fp16: the buffers are float16; layer 0's keys and values (computed from the same inputs either way) are
    the float cache's rounded to nearest; the later layers read the halves, so their outputs move, a little."""
    full, half = decoder(bundle, "auto"), decoder(bundle, "auto", kv_dtype="fp16")
    a = _session(full, np.random.default_rng(5), full.cfg.vocab_size)
    b = _session(half, np.random.default_rng(5), half.cfg.vocab_size)
    assert all(buf.dtype == np.float16 for buf in half.kv) and all(buf.dtype == np.float32 for buf in full.kv)
    assert half.kv[0].nbytes * 2 == full.kv[0].nbytes
    written = slice(0, 153)  # slot 0's rows: the prefill, windows and the long prefix (tree rows beyond are stale)
    for layer0 in (0, 1):  # its key, then its value
        assert np.array_equal(half.kv[layer0][0, :, written], full.kv[layer0][0, :, written].astype(np.float16))
    moved = 0.0
    for x, y in zip(b, a, strict=True):
        scale = np.abs(y["logits"]).max()
        diff = np.abs(x["logits"] - y["logits"]).max()
        assert diff <= 0.02 * scale, (diff, scale)  # as close as ONNX Runtime's int4 graph is (below)
        moved = max(moved, diff)
    assert moved > 0  # the halves are what attention reads


def _q8(x: np.ndarray) -> np.ndarray:
    """numpy's to_q8 of rows [..., d]: bytes [..., d / 32 * 36], each block its float32 scale then its codes."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    m = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(m > 0, np.rint(blocks * (np.float32(127) / m)), 0).clip(-127, 127).astype(np.int8)
    scale = (m / np.float32(127)).astype(np.float32)
    out = np.concatenate([scale.view(np.int8), codes], axis=-1)  # 4 bytes of scale, then 32 codes
    return out.reshape(*x.shape[:-1], -1)


def test_an_int8_cache_holds_each_block_of_32_as_codes_and_a_scale(bundle):
    """int8: layer 0's keys and values (the same inputs either way) are the float cache's rows quantized per
    block of 32 (numpy's rule above, bitwise); the bytes are 0.56 of a half cache's; later layers read the
    codes times their scale, so the outputs move a little more than with halves."""
    full, q8 = decoder(bundle, "auto"), decoder(bundle, "auto", kv_dtype="int8")
    a = _session(full, np.random.default_rng(5), full.cfg.vocab_size)
    b = _session(q8, np.random.default_rng(5), q8.cfg.vocab_size)
    d = full.cfg.head_dim
    assert all(buf.dtype == np.int8 and buf.shape[-1] == d // 32 * 36 for buf in q8.kv)
    assert q8.kv[0].nbytes == full.kv[0].nbytes // (4 * d) * (d // 32 * 36)
    written = slice(0, 153)
    for layer0 in (0, 1):
        assert np.array_equal(q8.kv[layer0][0, :, written], _q8(full.kv[layer0][0, :, written]))
    moved = 0.0
    for x, y in zip(b, a, strict=True):
        scale = np.abs(y["logits"]).max()
        diff = np.abs(x["logits"] - y["logits"]).max()
        assert diff <= 0.05 * scale, (diff, scale)
        moved = max(moved, diff)
    assert moved > 0


def test_an_int8_cache_needs_head_sizes_of_whole_blocks(tmp_path):
    from specrt.errors import SpecrtError

    narrow = tiny_bundle(tmp_path, "qwen2")  # head_dim 16
    with pytest.raises(SpecrtError, match="int8 KV cache needs a head size that is a multiple of 32, not 16"):
        decoder(narrow, "auto", 32, kv_dtype="int8")


def test_a_kv_dtype_the_backend_cannot_hold_is_refused_in_one_line(bundle):
    from specrt.errors import SpecrtError
    from specrt.runtime.target import kv_cache_dtype

    assert kv_cache_dtype("auto", "native") == "fp16" and kv_cache_dtype("auto", "ort") == "fp32"
    for dtype in ("fp16", "int8"):
        with pytest.raises(SpecrtError, match=f"{dtype} runs on --backend native"):
            kv_cache_dtype(dtype, "ort")
    with pytest.raises(SpecrtError, match="native backend's KV cache is one of fp32, fp16"):
        decoder(bundle, "auto", 32, kv_dtype="bf16")


def test_the_native_pass_computes_what_the_int4_graph_computes(bundle):
    """Both run the bundle's int4 weights with int8 activations per block of 32; they round differently,
    so the logits agree closely but not bitwise (each backend is its own exactness reference)."""
    native, ort = decoder(bundle, "auto"), decoder(bundle, "", backend="ort")
    a = _session(native, np.random.default_rng(8), native.cfg.vocab_size)
    b = _session(ort, np.random.default_rng(8), ort.cfg.vocab_size)
    for x, y in zip(a, b, strict=True):
        scale = np.abs(y["logits"]).max()
        assert np.abs(x["logits"] - y["logits"]).max() <= 0.02 * scale
        assert np.abs(x["hidden_states"] - y["hidden_states"]).max() <= 0.02 * np.abs(y["hidden_states"]).max()


def test_a_float_bundle_is_refused_naming_the_fix(tmp_path):
    from specrt.errors import SpecrtError

    b = tiny_bundle(tmp_path, "llama", quantize=None)
    with pytest.raises(SpecrtError, match="float projections.*--quantize int4.*--backend ort"):
        decoder(b, "auto")


def test_a_family_it_does_not_compute_is_refused_by_name(tmp_path):
    from specrt.errors import SpecrtError

    b = tiny_bundle(tmp_path, "qwen3")
    with pytest.raises(SpecrtError, match="does not compute qk-norm .*--backend ort"):
        decoder(b, "auto")


def test_the_tapped_layers_are_output_as_the_int4_graph_outputs_them(trained_int4_bundle):
    """The default bundle's target taps three layers for EAGLE-3: the native pass outputs the same inputs of
    those layers (aux_hidden_states), within the two backends' rounding."""
    native, ort = decoder(trained_int4_bundle, "auto", 64, 1), decoder(trained_int4_bundle, "", 64, 1, "ort")
    assert native.output_width("aux_hidden_states") == ort.output_width("aux_hidden_states") == 3 * 576
    ids = np.random.default_rng(9).integers(0, 49152, (1, 12))
    args = (ids, np.arange(12)[None], np.array([0]), np.tril(np.ones((1, 12, 12), bool)), np.array([[11]]))
    a, b = native.run_all(*args)["aux_hidden_states"], ort.run_all(*args)["aux_hidden_states"]
    assert a.shape == b.shape == (1, 12, 3 * 576)
    assert np.abs(a - b).max() <= 0.02 * np.abs(b).max()


def _ragged_session(dec, rng, vocab, ragged: bool):
    """Slots 0 and 2 prefilled (slot 1 idle), then ONE pass mixing a tree window (slot 0), a prompt chunk
    asking for its last row only (slot 1) and a chain (slot 2): each slot's outputs, as a batch-1 pass
    gives them, and the KV rows each slot wrote."""
    from specrt.runtime.batch import BatchOutputs, pack_ragged
    from specrt.runtime.sequence import Pass, pack_windows
    from specrt.runtime.tree import Tree

    def run(plans):
        dec.select(0, len(plans))
        if ragged:
            pack = pack_ragged(plans)
            return BatchOutputs({k: v.copy() for k, v in dec.run_ragged(pack).items()}, pack.rows, pack.nlogits)
        return BatchOutputs({k: v.copy() for k, v in dec.run_all(*pack_windows(plans)).items()})

    def chain(ids, past, rows=None):
        return Pass(ids, past, Tree.chain(len(ids) - 1), np.arange(len(ids)) if rows is None else rows)

    first = [chain(rng.integers(0, vocab, 37), 0), None, chain(rng.integers(0, vocab, 11), 0)]
    mixed = [Pass(rng.integers(0, vocab, 6), 37, Tree.from_parents([-1, 0, 0, 1, 2, 2]), np.arange(6)),
             chain(rng.integers(0, vocab, 20), 0, np.array([19])), chain(rng.integers(0, vocab, 3), 11)]
    outs = []
    for plans in (first, mixed):
        got = run(plans)
        for i, p in enumerate(plans):
            if p is not None:
                o = got.of(i)
                outs.append({"logits": o["logits"][0, : len(p.rows)], "hidden_states": o["hidden_states"][0, : len(p.window)]})
    ends = [43, 20, 14]
    kv = [buf[b, :, :end].copy() for buf in dec.kv for b, end in enumerate(ends)]
    return outs, kv


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("kernel", list(library.KERNELS))
def test_a_ragged_pass_gives_each_row_what_the_padded_pass_gives(bundle, kernel, kv_dtype):
    """No padding rows, an idle slot running nothing, a prompt chunk beside decode windows in one pass:
    every output row and every KV row bitwise those of padded passes."""
    needs(kernel)
    one, two = decoder(bundle, kernel, 64, kv_dtype=kv_dtype), decoder(bundle, kernel, 64, kv_dtype=kv_dtype)
    padded = _ragged_session(one, np.random.default_rng(3), one.cfg.vocab_size, ragged=False)
    ragged = _ragged_session(two, np.random.default_rng(3), two.cfg.vocab_size, ragged=True)
    for a, b in zip(ragged[0], padded[0], strict=True):
        for name in a:
            assert a[name].shape == b[name].shape and np.array_equal(a[name], b[name]), (name, a[name].shape)
    for a, b in zip(ragged[1], padded[1], strict=True):
        assert np.array_equal(a, b)


def test_a_ragged_pass_of_inconsistent_sizes_is_refused_before_the_library(bundle):
    from specrt.engines.native import calls
    from specrt.errors import SpecrtError
    from specrt.runtime.batch import Ragged

    dec = decoder(bundle, "scalar", 64, batch=2)
    dec.select(0, 2)
    good = Ragged(np.array([1, 2, 3]), np.array([0, 0, 1]), np.array([0, 0]), np.ones(5, np.uint8),
                  np.array([1, 2]), np.array([1, 1]), np.array([0, 1]))
    dec.run_ragged(good)
    for field, bad in [("mask", np.ones(4, np.uint8)), ("ids", np.array([1, 2])), ("rows", np.array([1, 2, 0])),
                       ("logits_index", np.array([0]))]:
        with pytest.raises(SpecrtError, match="inconsistent sizes"):
            dec.run_ragged(Ragged(**{**good.__dict__, field: bad}))
    # the library's own check: a sequence with no rows asks for a logits row
    rows, nlogits = np.array([0, 3], np.int64), np.array([1, 1], np.int64)
    rc = dec.lib.spn_pass_ragged(dec._h, 2, calls.ptr(rows), calls.ptr(nlogits), calls.ptr(good.ids),
                                 calls.ptr(good.pos), calls.ptr(good.past), calls.ptr(good.mask),
                                 calls.ptr(good.logits_index), dec._kv_pointers(0), dec._slot_stride, dec.capacity,
                                 calls.ptr(np.zeros((2, dec.cfg.vocab_size), np.float32)),
                                 calls.ptr(np.zeros((3, dec.cfg.hidden_size), np.float32)), None)
    assert rc != 0 and "sequence 0 has 0 rows and 1 logits rows" in library.last_error()
