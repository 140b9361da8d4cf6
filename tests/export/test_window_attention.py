"""specrt::TreeAttentionWindowed: the ONNX function body (ONNX Runtime) and the torch module's mask equal
the NumPy reference, on trees and ragged batches, and the window hides exactly the keys transformers'
sliding-window rule hides (query position - key position >= W). The Softcapped variants (Gemma-2's
c * tanh(s / c) on the scores) too."""

from __future__ import annotations

import zlib

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from specrt.export.modeling import attention_mask
from specrt.plugins import tree_attention as ta
from specrt.plugins.onnx_builder import CUSTOM_DOMAIN, OPSET
from specrt.runtime.tree import Tree

HEADS, KV_HEADS, DIM, CAPACITY = 4, 2, 8, 40
TREES = {"chain": Tree.chain(4), "tree": Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])}


def session(window: int, softcap: float = 0.0) -> ort.InferenceSession:
    vi = helper.make_tensor_value_info
    extra = {**({"window": window} if window else {}), **({"softcap": softcap} if softcap else {})}
    node = helper.make_node(ta.function_name(bool(window), bool(softcap)), ta.INPUTS, ["out"], domain=CUSTOM_DOMAIN,
                            num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, **extra, **ta.PLUGIN_ATTRS)
    graph = helper.make_graph([node], "g", [
        vi("q", TensorProto.FLOAT, ["B", "H", "T", "D"]), vi("k_cache", TensorProto.FLOAT, ["B", "KV", "S", "D"]),
        vi("v_cache", TensorProto.FLOAT, ["B", "KV", "S", "D"]), vi("past_len", TensorProto.INT64, ["B"]),
        vi("tree_mask", TensorProto.BOOL, ["B", "T", "T"])], [vi("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, functions=[ta.function(bool(window), bool(softcap))], opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    model.ir_version = 11
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def case(tree: Tree, past: list[int], seed: int):
    rng = np.random.default_rng(seed)
    b, t = len(past), tree.size
    q = rng.normal(size=(b, HEADS, t, DIM)).astype(np.float32)
    k, v = (rng.normal(size=(b, KV_HEADS, CAPACITY, DIM)).astype(np.float32) for _ in range(2))
    return q, k, v, np.asarray(past, np.int64), np.broadcast_to(tree.mask, (b, t, t)).copy()


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("window", [1, 2, 5])
@pytest.mark.parametrize("past", [[0], [9], [3, 11]])
def test_function_matches_reference(tree, window, past):
    q, k, v, pl, mask = case(TREES[tree], past, zlib.crc32(repr((tree, window, past)).encode()))
    got = session(window).run(None, {"q": q, "k_cache": k, "v_cache": v, "past_len": pl, "tree_mask": mask})[0]
    want = ta.reference(q, k, v, pl, mask, window)
    err = np.abs(got - want).max()
    assert err < 1e-5, f"max |Δ| {err:.2e}"
    assert np.abs(want - ta.reference(q, k, v, pl, mask)).max() > 1e-3 or max(past) == 0 and window >= 5, \
        "the window hides nothing in this case"


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("past", [[9], [3, 11]])
def test_softcapped_function_matches_reference(tree, window, past):
    """Scores far above the cap (q scaled up): the capped answer is another one, and the body gives it."""
    q, k, v, pl, mask = case(TREES[tree], past, zlib.crc32(repr((tree, window, past, "cap")).encode()))
    q = 4 * q
    feeds = {"q": q, "k_cache": k, "v_cache": v, "past_len": pl, "tree_mask": mask}
    got = session(window, softcap=2.5).run(None, feeds)[0]
    want = ta.reference(q, k, v, pl, mask, window, softcap=2.5)
    err = np.abs(got - want).max()
    assert err < 1e-5, f"max |Δ| {err:.2e}"
    assert np.abs(want - ta.reference(q, k, v, pl, mask, window)).max() > 1e-2, "the cap changes nothing here"


def test_module_mask_is_the_sliding_rule():
    """The torch module's mask: row t (position past_len + depth - 1) sees committed row j iff
    pos - j < W, and an ancestor u iff depth(t) - depth(u) < W."""
    tree, past, window = TREES["tree"], 6, 2
    mask = torch.from_numpy(tree.mask.copy())[None]  # a Tree's arrays are read-only (shared per shape)
    allowed = attention_mask(torch.tensor([past]), mask, past + tree.size, window)[0, 0] == 0
    depth = tree.mask.sum(-1)
    key_pos = np.r_[np.arange(past), past + depth - 1]
    want = np.c_[np.ones((tree.size, past), bool), tree.mask] & ((past + depth - 1)[:, None] - key_pos < window)
    assert np.array_equal(allowed.numpy(), want)
    assert allowed[0].tolist() == [False] * 5 + [True] + [True] + [False] * (tree.size - 1)  # root: rows 5, 6
