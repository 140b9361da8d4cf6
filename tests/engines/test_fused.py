"""The `ort-fused` backend: each layer's attention lowered to GroupQueryAttention (engines/ort_cpu/fuse.py).

On the tiny 2-layer Llama (fp32) the fused graph computes what the exported graph computes — logits
and the KV rows it writes, to rounding — for a prefill, a chain and a tree; the runtime then verifies
chains only on it (a tree proposal is cut to its top-ranked path) and judges its exactness like any
graph's, so speculative output equals its own plain output wherever it says lossless.
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from specrt.engines.ort_cpu.fuse import (
    KV_PAD_ROWS,
    PAD_ROWS,
    _attention,
    _pad_constants,
    _rotary_tables,
    _shared_nodes,
    fuse_attention,
)
from specrt.engines.ort_cpu.runner import OrtDecoder
from specrt.engines.registry import BACKENDS, fused_graph
from specrt.errors import SpecrtError
from specrt.plugins.tree_attention import NAME
from specrt.runtime.drafters import Proposal
from specrt.runtime.tree import Tree
from specrt.schema.manifest import Manifest
from specrt.tools.roofline import op_counts
from tests.helpers import built_copy

CAPACITY = 64


@pytest.fixture(scope="module")
def built(tiny_bundle, tmp_path_factory):
    """A copy of the tiny bundle after `specrt build`'s ONNX Runtime step (which writes the fused graphs)."""
    bundle = built_copy(tiny_bundle, tmp_path_factory.mktemp("fused") / "bundle")
    return bundle, Manifest.load(bundle)


def _run(dec: OrtDecoder, tokens, past: int, tree: Tree) -> dict:
    t = tree.size
    return dec.run_all(np.asarray([tokens], np.int64), (past + tree.depth)[None].astype(np.int64),
                       np.array([past], np.int64), tree.mask[None], np.arange(t)[None].astype(np.int64))


def test_build_writes_a_fused_graph_for_each_decoder(built):
    bundle, manifest = built
    assert set(manifest.artifacts["onnxruntime"]["fused"]) == {"target", "draft"}
    model = onnx.load(str(fused_graph(bundle, manifest, "target")), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    cfg = manifest.target.config
    assert ops.count("GroupQueryAttention") == cfg.num_layers and NAME not in ops and "TensorScatter" not in ops
    original = onnx.load(str(bundle / manifest.graphs["target"].file), load_external_data=False)
    assert sum(op_counts(model).values()) < sum(op_counts(original).values()) / 2  # function bodies counted


@pytest.mark.parametrize("batched", [False, True])
def test_fused_graph_computes_what_the_exported_graph_computes(built, batched):
    bundle, manifest = built
    cfg = manifest.target.config
    plain = OrtDecoder(bundle / manifest.graphs["target"].file, cfg, CAPACITY, threads=1)
    fused = OrtDecoder(fused_graph(bundle, manifest, "target", batched=batched), cfg, CAPACITY, threads=1)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, 20).tolist()
    tree = Tree.from_paths([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    for tokens, past, shape in ((prompt, 0, Tree.chain(19)), (rng.integers(0, cfg.vocab_size, 4).tolist(), 20,
                                                              Tree.chain(3)),
                                (rng.integers(0, cfg.vocab_size, tree.size).tolist(), 20, tree)):
        a, b = _run(plain, tokens, past, shape), _run(fused, tokens, past, shape)
        np.testing.assert_allclose(b["logits"], a["logits"], atol=2e-4, rtol=1e-4)
        assert (b["logits"].argmax(-1) == a["logits"].argmax(-1)).all()
        for buf_a, buf_b in zip(plain.kv, fused.kv, strict=True):  # the rows each pass wrote, in place
            np.testing.assert_allclose(buf_b[:, :, : past + len(tokens)], buf_a[:, :, : past + len(tokens)],
                                       atol=1e-5)


def test_the_fused_graphs_have_genais_node_structure(built):
    """Per layer one GroupQueryAttention and two SkipSimplifiedLayerNormalization (residual Add + RMSNorm),
    the exported rotary tables dropped; the batch-1 graph pads its attention (and says so in its metadata,
    so its runner gives the KV buffers that row), the batched one does not."""
    bundle, manifest = built
    layers = manifest.target.config.num_layers
    for batched, pad in ((False, PAD_ROWS), (True, 0)):
        model = onnx.load(str(fused_graph(bundle, manifest, "target", batched=batched)), load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        assert ops.count("SkipSimplifiedLayerNormalization") == 2 * layers and ops.count("RMSNormalization") == 1
        assert "Sin" not in ops and "Cos" not in ops  # GroupQueryAttention reads its own cos/sin tables
        assert ops.count("Pad") == (layers + 2 if pad else 0) and ops.count("Slice") == (layers if pad else 0)
        assert {p.key: p.value for p in model.metadata_props}[KV_PAD_ROWS] == str(pad)
        dec = OrtDecoder(fused_graph(bundle, manifest, "target", batched=batched), manifest.target.config,
                         CAPACITY, threads=1)
        assert dec.kv[0].shape[2] == CAPACITY + pad and dec.capacity == CAPACITY
    plain = OrtDecoder(bundle / manifest.graphs["target"].file, manifest.target.config, CAPACITY, threads=1)
    assert plain.kv[0].shape[2] == CAPACITY


def _attention_only(cfg, pad: int, capacity: int) -> ort.InferenceSession:
    """One layer's lowered attention alone: q|k|v in, GroupQueryAttention's window rows out."""
    vi = onnx.helper.make_tensor_value_info
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    kv = [1, cfg.num_kv_heads, capacity, cfg.head_dim]
    inputs = [vi("qkv", onnx.TensorProto.FLOAT, [1, "tokens", width]),
              vi("position_ids", onnx.TensorProto.INT64, [1, "tokens"]), vi("past_len", onnx.TensorProto.INT64, [1]),
              vi("tree_mask", onnx.TensorProto.BOOL, [1, "tokens", "tokens"]),
              vi("past_key.0", onnx.TensorProto.FLOAT, kv), vi("past_value.0", onnx.TensorProto.FLOAT, kv)]
    outputs = [vi("out", onnx.TensorProto.FLOAT, None), vi("present_key.0", onnx.TensorProto.FLOAT, kv),
               vi("present_value.0", onnx.TensorProto.FLOAT, kv)]
    graph = onnx.helper.make_graph(_shared_nodes(pad) + _attention(0, "qkv", "out", cfg, pad), "attention", inputs,
                                   outputs, _rotary_tables(cfg) + _pad_constants(pad))
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 24),
                                                         onnx.helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 11
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_the_pad_row_gives_a_single_row_the_attention_of_a_chains_first_row(built):
    """What makes `ort-fused` exact without padding whole passes: with its pad row, a one-row pass's
    attention output is bit for bit row 0 of a chain after the same prefix (GroupQueryAttention never runs
    MLAS's M=1 SGEMM kernels, whose sums round otherwise), and the rows it writes in the KV cache match."""
    cfg = Manifest.load(built[0]).target.config
    past, chain, capacity = 300, 4, 320  # a prefix past the 128/256-column blocks of the SGEMM kernels
    rng = np.random.default_rng(0)
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    prefix = rng.standard_normal((2, 1, cfg.num_kv_heads, capacity, cfg.head_dim)).astype(np.float32)
    qkv = rng.standard_normal((1, chain, width)).astype(np.float32)
    sess = _attention_only(cfg, PAD_ROWS, capacity)

    def run(rows: int) -> tuple[np.ndarray, np.ndarray]:
        k, v = prefix[0].copy(), prefix[1].copy()
        b = sess.io_binding()
        b.bind_output("out")  # first: copy_outputs_to_cpu() lists outputs in binding order
        for name, buf in (("key", k), ("value", v)):
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            b.bind_ortvalue_input(f"past_{name}.0", value)
            b.bind_ortvalue_output(f"present_{name}.0", value)
        b.bind_cpu_input("qkv", np.ascontiguousarray(qkv[:, :rows]))
        b.bind_cpu_input("position_ids", (past + np.arange(rows))[None].astype(np.int64))
        b.bind_cpu_input("past_len", np.array([past], np.int64))
        b.bind_cpu_input("tree_mask", Tree.chain(rows - 1).mask[None])
        sess.run_with_iobinding(b)
        return b.copy_outputs_to_cpu()[0], k

    one, k_one = run(1)
    many, k_many = run(chain)
    assert one.shape == (1, 1, cfg.num_heads * cfg.head_dim) and many.shape[1] == chain
    assert np.array_equal(one[0, 0], many[0, 0])
    assert np.array_equal(k_one[:, :, : past + 1], k_many[:, :, : past + 1])


def test_a_graph_it_cannot_lower_is_left_alone(built):
    bundle, manifest = built
    model = onnx.load(str(bundle / manifest.graphs["target"].file), load_external_data=False)
    assert fuse_attention(model, dataclasses.replace(manifest.target.config, qk_norm=True)) is None
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    for n in renamed.graph.node:
        n.name = n.name.replace("/layers.1/", "/block.1/")
    assert fuse_attention(renamed, manifest.target.config) is None


def test_the_backend_needs_a_built_bundle(tiny_bundle):
    with pytest.raises(SpecrtError, match="specrt build"):
        fused_graph(tiny_bundle, Manifest.load(tiny_bundle), "target")
    assert BACKENDS["ort-fused"].trees is False and BACKENDS["ort-fused"].batch_windows is False


def test_a_tree_proposal_is_cut_to_its_top_ranked_path():
    q = np.eye(6, dtype=np.float32)
    prop = Proposal([10, 11, 12, 13, 14], [0, 0, 1, 1, 3], q[:5])  # root→10→12→14, 11 and 13 siblings
    path = prop.first_path()
    assert path.tokens == [10, 12, 14] and path.parents == [0, 1, 2] and path.tree().is_chain
    assert np.array_equal(path.q, q[[0, 2, 4]])
    chain = Proposal([1, 2], [0, 1])
    assert chain.first_path() is chain


def test_speculation_on_the_fused_backend_reproduces_its_own_plain_output(built):
    from specrt.runtime.generate import Generator

    bundle, _ = built
    plain = Generator(bundle, "plain", max_seq_len=CAPACITY, threads=1, backend="ort-fused")
    assert plain.exactness.mode is not None and plain.exactness.to_dict()["lossless"] in (True, False)
    prompt = [5, 17, 99, 5, 17, 99, 5, 17]
    want = plain.generate_ids(prompt, 24).token_ids
    for drafter, tree in (("ngram", None), ("draft", "binary")):  # a chain, and a static tree cut to a chain
        gen = plain.use(drafter, tree)
        res = gen.generate_ids(prompt, 24)
        if gen.lossless:
            assert res.token_ids == want, drafter


def test_build_records_digests_that_loading_verifies(built, tmp_path, monkeypatch):
    """Every file `specrt build` wrote is in the manifest with its sha256, so changed bytes in a built
    graph (the one the runtime loads) are refused like those of an exported one."""
    from specrt.schema.digests import sha256_file
    from specrt.schema.integrity import recorded_digests, verify_bundle

    bundle, manifest = built
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path / "home"))
    for section in ("graphs", "fused"):
        for role, entry in manifest.artifacts["onnxruntime"][section].items():
            folder = (bundle / entry["file"]).parent
            assert entry["sha256"] and all(sha256_file(folder / n) == d for n, d in entry["sha256"].items()), role
    built_files = {rel for key, rel, _ in recorded_digests(manifest) if key.startswith("artifacts.")}
    assert "target/decoder.ort-opt.onnx.data" in built_files and "target/decoder.ort-fused.onnx" in built_files
    verify_bundle(bundle, manifest)

    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    with (copy / "target" / "decoder.ort-opt.onnx.data").open("r+b") as f:
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(SpecrtError, match=r"ort-opt.onnx.data is corrupt .*artifacts.onnxruntime.graphs.target"):
        verify_bundle(copy, Manifest.load(copy))
