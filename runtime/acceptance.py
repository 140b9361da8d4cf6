"""Acceptance rules, registered by name: given the target's logits over a drafted window, which nodes
are accepted and which token comes next.

- greedy     (temperature 0): the GreedyAccept walk — lossless: equals plain greedy decoding
- rejection  (temperature > 0): specrt::RejectionSample — lossless: follows the target distribution
- typical    Medusa-style typical acceptance — LOSSY (opt-in): accepts a draft whose target
             probability exceeds min(ε, α·exp(−H(p))); output no longer follows the target exactly

The custom ops run through ONNX Runtime as tiny models wrapping the same ONNX functions TensorRT
would replace with plugins; their NumPy references live beside them in specrt.plugins. Greedy
acceptance runs its reference walk on the host (a few argmaxes; `greedy_op` is the op, held equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from specrt.errors import SpecrtError
from specrt.plugins import rejection_sample as rs
from specrt.plugins.onnx_builder import CUSTOM_DOMAIN, OPSET
from specrt.runtime.sampling import SamplingParams, warp
from specrt.runtime.tree import Tree

LOSSY = {"typical"}


@dataclass
class Window:
    """The verify window: root (last committed token) plus the drafted tree, and draft distributions."""

    tokens: np.ndarray  # [M] int64
    tree: Tree
    draft_probs: np.ndarray | None = None  # [M, V] (row 0 unused); None: deterministic drafts (one-hot)


def _op_model(function: onnx.FunctionProto, inputs: list[tuple[str, int, list]]) -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    node = helper.make_node(function.name, [n for n, _, _ in inputs], ["path", "next_token"],
                            domain=CUSTOM_DOMAIN, name=f"/{function.name}", **rs.PLUGIN_ATTRS)
    graph = helper.make_graph([node], function.name, [vi(n, t, s) for n, t, s in inputs],
                              [vi("path", TensorProto.INT64, ["accepted"]), vi("next_token", TensorProto.INT64, [])])
    model = helper.make_model(graph, functions=[function], opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(CUSTOM_DOMAIN, 1)])
    model.ir_version = 11
    return model


TREE_INPUTS = [("tokens", TensorProto.INT64, ["M"]), ("parents", TensorProto.INT64, ["M"]),
               ("ranks", TensorProto.INT64, ["M"]), ("tree_mask", TensorProto.BOOL, ["M", "M"])]


@cache
def _session(kind: str) -> ort.InferenceSession:
    if kind == "greedy":
        model = _op_model(rs.greedy_accept_function(), [("target_logits", TensorProto.FLOAT, ["M", "V"]), *TREE_INPUTS])
    else:
        model = _op_model(rs.rejection_sample_function(), [
            ("target_probs", TensorProto.FLOAT, ["M", "V"]), ("draft_probs", TensorProto.FLOAT, ["M", "V"]),
            *TREE_INPUTS, ("uniforms", TensorProto.FLOAT, ["M"])])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _tree_feeds(w: Window) -> dict:
    return {"tokens": w.tokens.astype(np.int64), "parents": np.asarray(w.tree.parents, np.int64),
            "ranks": np.asarray(w.tree.ranks, np.int64), "tree_mask": w.tree.mask}


def one_hot_rows(tokens: np.ndarray, vocab: int) -> np.ndarray:
    q = np.zeros((len(tokens), vocab), np.float32)
    q[np.arange(len(tokens)), tokens] = 1.0
    return q


def greedy(w: Window, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator):
    """The greedy walk over the rows it visits (`greedy_accept_reference`). On the host that is a few argmaxes:
    a session run of the op's tiny model cost ~0.26 ms a step, for every sequence of a batch.
    `greedy_op` is the same rule as the ONNX function a device engine runs as a plugin; the tests hold the two
    equal."""
    if len(w.tokens) == 1:  # nothing drafted (a plain step)
        return [], int(logits[0].argmax())
    return rs.greedy_accept_reference(logits, w.tokens, w.tree.parents)


def greedy_op(w: Window, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator):
    """specrt::GreedyAccept through ONNX Runtime: the function body TensorRT would replace with its plugin."""
    if len(w.tokens) == 1:  # the op would return ([], argmax of the root)
        return [], int(logits[0].argmax())
    path, nxt = _session("greedy").run(None, {"target_logits": logits.astype(np.float32), **_tree_feeds(w)})
    return path.tolist(), int(nxt)


def rejection(w: Window, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator):
    p = warp(logits, params)
    q = w.draft_probs if w.draft_probs is not None else one_hot_rows(w.tokens, logits.shape[-1])
    u = rng.random(len(w.tokens), dtype=np.float32)
    path, nxt = _session("rejection").run(None, {"target_probs": p, "draft_probs": q.astype(np.float32),
                                                 "uniforms": u, **_tree_feeds(w)})
    return path.tolist(), int(nxt)


TYPICAL_EPSILON, TYPICAL_ALPHA = 0.09, 0.3  # Medusa's posterior_threshold and posterior_alpha


def typical(w: Window, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator):
    """LOSSY: accept the first child whose target probability beats min(ε, α·exp(−entropy))."""
    p = warp(logits, params)
    ent = -(p * np.log(np.maximum(p, 1e-30))).sum(-1)
    threshold = np.minimum(TYPICAL_EPSILON, TYPICAL_ALPHA * np.exp(-ent))
    node, path = 0, []
    while True:
        nxt = next((c for c in rs.children(w.tree.parents, node) if p[node, w.tokens[c]] > threshold[node]), None)
        if nxt is None:
            return path, rs.sample_from(p[node], float(rng.random()))
        path.append(nxt)
        node = nxt


Rule = Callable[[Window, np.ndarray, SamplingParams, np.random.Generator], tuple[list[int], int]]
ACCEPTANCE: dict[str, Rule] = {"greedy": greedy, "rejection": rejection, "typical": typical}


def acceptance_for(name: str | None, params: SamplingParams) -> tuple[str, Rule]:
    """The rule to use: `name`, or greedy/rejection by temperature when None ("auto")."""
    if name in (None, "auto"):
        name = "greedy" if params.greedy else "rejection"
    if name not in ACCEPTANCE:
        raise SpecrtError(f"unknown acceptance {name!r}: choose auto, greedy, rejection or typical (lossy)")
    if name == "typical" and params.greedy:
        raise SpecrtError("--acceptance typical needs --temperature > 0 (at temperature 0 use greedy, which is lossless)")
    if name == "rejection" and params.greedy:
        name = "greedy"  # temperature 0: rejection sampling with a one-hot target is the greedy walk
    return name, ACCEPTANCE[name]
