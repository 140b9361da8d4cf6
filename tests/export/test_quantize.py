"""`specrt export --quantize`: MatMulNBits graphs that keep the contract — batch-invariant logits, so
speculative greedy output equals the quantized target's own plain greedy output."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from specrt.cli import cli
from specrt.export import quantize
from specrt.export.bundle import ExportOptions, export_bundle
from specrt.runtime.generate import Generator
from specrt.schema.manifest import Manifest
from tests.helpers import save_tiny_folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer_dir):
    return save_tiny_folder(tmp_path_factory.mktemp("qtiny") / "llama", "llama", tokenizer_dir,
                            vocab_size=49152, max_position_embeddings=64, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def fp32_tiny(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("qb") / "fp32"
    export_bundle(tiny_folder, out, ExportOptions(draft_layers=1, progress=False))
    return out


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized_tiny(request, tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("qb") / request.param
    export_bundle(tiny_folder, out, ExportOptions(draft_layers=1, progress=False, quantize=request.param))
    return out, request.param


def _ops(path):
    return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]


def test_every_weight_matmul_is_quantized_and_recorded(quantized_tiny):
    bundle, name = quantized_tiny
    m = Manifest.load(bundle)
    q = m.artifacts["quantization"]
    assert q["scheme"] == name and q["bits"] == {"int4": 4, "int8": 8}[name]
    for role in ("target", "draft"):
        ops = _ops(bundle / m.graphs[role].file)
        layers = m.graphs[role].config.num_layers
        # q/k/v (fused or not), o, gate/up (fused or not), down per layer, and the LM head
        assert ops.count("MatMulNBits") == q["matmuls"][role] >= 3 * layers + 1
        assert "Gemm" not in ops  # the tied head was untied and quantized
    assert_exact_mode_recorded(m)


def assert_exact_mode_recorded(m: Manifest) -> None:
    """The export measured batch invariance on this machine and found a mode that restores it (which
    mode depends on the CPU's kernels: direct on some, padded passes on others)."""
    from specrt.runtime.invariance import CHECKS
    from specrt.runtime.machine import Fingerprint

    record = m.artifacts["exactness"][f"{Fingerprint.here(2).key}/{m.target.file}"]
    assert record["chosen"] is not None, record["measured"]
    assert all(record["measured"][record["chosen"]][c] == 0.0 for c in CHECKS), record["measured"]


def test_manifest_hashes_match_the_quantized_files(quantized_tiny):
    from specrt.schema.digests import sha256_file

    bundle, _ = quantized_tiny
    entry = Manifest.load(bundle).target
    folder = (bundle / entry.file).parent
    assert entry.sha256 == {f: sha256_file(folder / f) for f in entry.sha256}


@pytest.mark.parametrize("drafter,tree", [("ngram", None), ("draft", None), ("draft", "binary"), ("ngram", "default")])
def test_speculative_equals_own_plain_greedy(quantized_tiny, drafter, tree):
    bundle, _ = quantized_tiny
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 9, 12, 3, 4, 5]
    plain = Generator(bundle, max_seq_len=64).generate_ids(prompt, 40).token_ids
    res = Generator(bundle, drafter=drafter, tree=tree, max_seq_len=64, num_draft_tokens=4).generate_ids(prompt, 40)
    assert res.token_ids == plain
    assert res.stats.steps < len(plain)  # drafts were accepted: the check is not plain vs plain


def test_untie_head_keeps_the_output():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((50, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 50])], [numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((3, 8)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert quantize.untie_head(model) == 1
    assert [n.op_type for n in model.graph.node] == ["MatMul"]
    got = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_quantized_logits_stay_close_to_fp32(quantized_tiny, fp32_tiny):
    """Weight-only quantization moves logits, but not far: same random tiny weights, same inputs."""
    bundle, name = quantized_tiny
    ids = [3, 4, 5, 6, 7, 8]
    outs = []
    for b in (bundle, fp32_tiny):
        g = Generator(b, max_seq_len=16)
        outs.append(g.forward(np.asarray(ids), 0)["logits"][0])
    err = np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max()
    assert err < {"int4": 0.25, "int8": 0.02}[name], err


def test_unknown_scheme_is_refused_before_loading(tmp_path):
    result = CliRunner().invoke(cli, ["export", "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "b"),
                                      "--quantize", "int3"])
    assert result.exit_code != 0 and "int3" in result.output
    with pytest.raises(Exception, match="int3"):
        quantize.scheme("int3")


def test_a_weight_made_of_the_heads_rows_carries_their_blocks():
    """rows_of: a MatMul weight whose rows are rows of the target's head (any order, any subset) takes those rows'
    blocks; a weight with one row that is not the head's, or of another width, takes none."""
    from specrt.export.gguf_blocks import Blocks

    rng = np.random.default_rng(0)
    head = Blocks("q8", 64, rng.integers(-128, 128, (40, 2, 32)).astype(np.int8),
                  rng.uniform(0.01, 0.1, (40, 2)).astype(np.float32))
    dense = head.dense()
    pick = np.array([7, 3, 39, 0, 12])
    other = dense[pick].copy()
    other[2, 5] += 1e-3

    def model(weights):
        nodes = [helper.make_node("MatMul", ["x", name], [f"y{i}"]) for i, name in enumerate(weights)]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                                  [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None)
                                   for i in range(len(weights))],
                                  [numpy_helper.from_array(w, name) for name, w in weights.items()])
        return helper.make_model(graph)

    got = quantize.rows_of(model({"rows": dense[pick].T.copy(), "other": other.T.copy(),
                                  "narrow": dense[pick, :32].T.copy()}), quantize.HeadRows(head))
    assert list(got) == ["rows"]
    b = got["rows"]
    assert np.array_equal(b.q, head.q[pick]) and np.array_equal(b.scales, head.scales[pick])
    assert np.array_equal(b.dense(), dense[pick])


def test_a_learned_drafters_own_head_is_int8_and_its_layers_int4():
    """A learned drafter's head of its own rows (not the target's) keeps int8 blocks under --quantize int4: it
    ranks the draft candidates. Its codes are Q8_0's rounding (each weight within half a step of its block's
    scale); the other MatMuls, and a decoder's head, stay int4."""
    rng = np.random.default_rng(1)
    w = {"lm_head.weight.T": rng.standard_normal((64, 96)).astype(np.float32),
         "layer.up.weight": rng.standard_normal((64, 64)).astype(np.float32)}
    w["lm_head.weight.T"][:32, 5] = 0.0  # a block of zeros: scale 0, codes 0

    def model():
        nodes = [helper.make_node("MatMul", ["x", "layer.up.weight"], ["h"], name="/layer/up/MatMul"),
                 helper.make_node("MatMul", ["h", "lm_head.weight.T"], ["logits"], name="/lm_head/MatMul")]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                                  [numpy_helper.from_array(v, k) for k, v in w.items()])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])

    def bits(m):
        return {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in m.graph.node
                if n.op_type == "MatMulNBits"}

    learned, _, _ = quantize.quantize_model(model(), quantize.scheme("int4"), fit=False, learned=True)
    assert bits(learned) == {"/layer/up/MatMul_Q4": 4, "/lm_head/MatMul_Q8": 8}
    decoder, _, _ = quantize.quantize_model(model(), quantize.scheme("int4"), fit=False)
    assert set(bits(decoder).values()) == {4}
    b = quantize.q8_blocks(w["lm_head.weight.T"].T)
    assert b.format == "q8" and b.q.dtype == np.int8 and np.abs(b.q).max() == 127
    err = np.abs(b.dense() - w["lm_head.weight.T"].T).reshape(96, 2, 32)
    assert (err <= b.scales[..., None] / 2 + 1e-7).all()
    assert b.scales[5, 0] == 0 and not b.q[5, 0].any()
    x = rng.standard_normal((1, 64)).astype(np.float32)
    sess = ort.InferenceSession(learned.SerializeToString(), providers=["CPUExecutionProvider"])
    want = x @ w["layer.up.weight"] @ w["lm_head.weight.T"]
    got = sess.run(None, {"x": x})[0]
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_a_drafter_precision_without_quantize_is_refused(tmp_path):
    result = CliRunner().invoke(cli, ["export", "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "b"),
                                      "--drafter-quantize", "int8"])
    assert result.exit_code == 2 and "--drafter-quantize" in result.output and "needs --quantize" in result.output
    assert not (tmp_path / "b").exists()


def test_carried_blocks_must_be_the_graphs_weights_to_2_pow_minus_20():
    """The check that a model file's blocks are the weights the graph holds (quantize._check) agrees with
    np.allclose(rtol=2^-20, atol=0): a weight off by 2^-22 of itself passes, by 2^-18 fails, NaN fails."""
    from types import SimpleNamespace

    from specrt.errors import SpecrtError

    want = np.random.default_rng(3).standard_normal((64, 96)).astype(np.float32)
    for scale, ok in ((1 + 2**-22, True), (1 + 2**-18, False)):
        got = want.copy()
        got[5, 7] *= np.float32(scale)
        assert quantize._close(got, want, 2**-20) == np.allclose(got, want, rtol=2**-20, atol=0) == ok
        block = SimpleNamespace(dense=lambda got=got: got)
        if ok:
            quantize._check("w", block, want, exact=True)
        else:
            with pytest.raises(SpecrtError, match="the model file's blocks for w are not the weights"):
                quantize._check("w", block, want, exact=True)
    got = want.copy()
    got[0, 0] = np.nan
    assert not quantize._close(got, want, 2**-20)
