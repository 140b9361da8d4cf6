"""specrt::TreeAttention: the ONNX function body (run by ONNX Runtime) equals the NumPy reference."""

from __future__ import annotations

import zlib

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specrt.plugins import tree_attention as ta
from specrt.plugins.onnx_builder import CUSTOM_DOMAIN, OPSET
from specrt.runtime.tree import Tree


@pytest.fixture(scope="module")
def sessions():
    return {}


def session_for(sessions, heads, kv_heads, dim):
    if (heads, kv_heads, dim) in sessions:
        return sessions[(heads, kv_heads, dim)]
    vi = helper.make_tensor_value_info
    node = helper.make_node(ta.NAME, ta.INPUTS, ["out"], domain=CUSTOM_DOMAIN, num_heads=heads,
                            num_kv_heads=kv_heads, head_dim=dim, **ta.PLUGIN_ATTRS)
    graph = helper.make_graph([node], "g", [
        vi("q", TensorProto.FLOAT, ["B", "H", "T", "D"]), vi("k_cache", TensorProto.FLOAT, ["B", "KV", "S", "D"]),
        vi("v_cache", TensorProto.FLOAT, ["B", "KV", "S", "D"]), vi("past_len", TensorProto.INT64, ["B"]),
        vi("tree_mask", TensorProto.BOOL, ["B", "T", "T"])], [vi("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, functions=[ta.function()], opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    model.ir_version = 11
    sessions[(heads, kv_heads, dim)] = ort.InferenceSession(model.SerializeToString(),
                                                            providers=["CPUExecutionProvider"])
    return sessions[(heads, kv_heads, dim)]


def random_case(rng, batch, heads, kv_heads, tree: Tree, past: list[int], dim=8, capacity=40):
    t = tree.size
    q = rng.normal(size=(batch, heads, t, dim)).astype(np.float32)
    k = rng.normal(size=(batch, kv_heads, capacity, dim)).astype(np.float32)
    v = rng.normal(size=(batch, kv_heads, capacity, dim)).astype(np.float32)
    mask = np.broadcast_to(tree.mask, (batch, t, t)).copy()
    return q, k, v, np.asarray(past, np.int64), mask


TREES = {"single": Tree.chain(0), "chain": Tree.chain(4),
         "tree": Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])}


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("past", [[0], [7], [3, 11]])
def test_function_matches_reference(sessions, tree, heads, kv_heads, past):
    session = session_for(sessions, heads, kv_heads, 8)
    rng = np.random.default_rng(zlib.crc32(repr((tree, heads, kv_heads, past)).encode()))
    q, k, v, pl, mask = random_case(rng, len(past), heads, kv_heads, TREES[tree], past)
    got = session.run(None, {"q": q, "k_cache": k, "v_cache": v, "past_len": pl, "tree_mask": mask})[0]
    want = ta.reference(q, k, v, pl, mask)
    assert got.shape == want.shape == q.shape
    err = np.abs(got - want).max()
    assert err < 1e-5, f"max |Δ| {err:.2e}"


def test_rows_beyond_the_window_and_hidden_siblings_are_ignored(sessions):
    """Stale cache rows past the window, and a sibling's row, must not change a node's output."""
    session = session_for(sessions, 2, 2, 8)
    rng = np.random.default_rng(3)
    tree = TREES["tree"]
    q, k, v, pl, mask = random_case(rng, 1, 2, 2, tree, [5])
    feeds = {"q": q, "k_cache": k, "v_cache": v, "past_len": pl, "tree_mask": mask}
    base = session.run(None, feeds)[0]
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 5 + tree.size:] += 100.0  # stale rows after the window
    k2[:, :, 5 + 2] += 50.0  # node 2 is a sibling of node 1 and not an ancestor of nodes 3, 4, 6
    v2[:, :, 5 + 2] -= 50.0
    got = session.run(None, {**feeds, "k_cache": k2, "v_cache": v2})[0]
    for node in (0, 1, 3, 4, 6):
        np.testing.assert_allclose(got[0, :, node], base[0, :, node], atol=1e-6)
    assert np.abs(got[0, :, 2] - base[0, :, 2]).max() > 1e-3  # node 2 itself does see its own row


def test_exported_decoder_carries_plugin_attributes(tmp_path):
    from specrt.export.decoder_graph import build_decoder_graph
    from specrt.export.loading import module_from_hf
    from tests.helpers import tiny_hf_model

    model = build_decoder_graph(module_from_hf(tiny_hf_model("llama")))
    calls = [n for n in model.graph.node if n.op_type == ta.NAME]
    assert len(calls) == 2  # one per layer
    for n in calls:
        assert n.domain == CUSTOM_DOMAIN
        attrs = {a.name: a.s.decode() if a.type == a.STRING else a.i for a in n.attribute}
        assert attrs == {**ta.PLUGIN_ATTRS, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    assert [f.name for f in model.functions] == [ta.NAME]
    assert {o.domain for o in model.opset_import} == {"", CUSTOM_DOMAIN}
