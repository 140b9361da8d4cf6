"""specrt::RejectionSample and specrt::GreedyAccept — verify a drafted tree against the target.

Window nodes 0..M-1 (0 = root, the last committed token), each with its token, parent and rank
among siblings. RejectionSample (lossless sampling):

    at node n (from the root), with p = target distribution at n:
      for each child c in rank order:          c's token x was drawn from q_c (one-hot if deterministic)
          accept c with probability min(1, p(x) / q_c(x))  → move to c, repeat
          else p ← norm(max(0, p − q_c))                   (recursive rejection over siblings)
      no child accepted → emit a token sampled from p; stop

    inputs : target_probs [M, V], draft_probs [M, V] (row c: the q that c was drawn from; row 0
             unused), tokens [M], parents [M] (parents[0] = -1), ranks [M], tree_mask [M, M]
             (ancestor-or-self), uniforms [M] (uniforms[c] tests node c; uniforms[0] draws the
             final token)
    outputs: path [A] (accepted window nodes, root excluded, by depth), next_token [] int64

GreedyAccept (temperature 0) walks the target's argmax: a child is accepted when its token is the
argmax at its parent; next_token is the argmax at the last accepted node. Inputs: target_logits
[M, V], tokens, parents, ranks, tree_mask.

The NumPy references below are the sequential algorithms; the ONNX function bodies compute the same
thing vectorized over nodes (a Loop over sibling rank carries the residual distributions).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from specrt.plugins.onnx_builder import GraphBuilder

PLUGIN_ATTRS = {"plugin_namespace": "specrt", "plugin_version": "1"}
TINY = 1e-30  # guards the renormalisation of an all-zero residual (then nothing was rejectable)


# ── NumPy references ────────────────────────────────────────────────────────────────────────────
def normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(x.sum(-1, keepdims=True), np.float32(TINY))


def sample_from(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: the first index whose cumulative mass exceeds u · total."""
    cdf = np.cumsum(p, dtype=np.float32)
    return int(min(np.count_nonzero(cdf <= np.float32(u) * cdf[-1]), len(p) - 1))


def children(parents, node: int) -> list[int]:
    return [c for c in range(1, len(parents)) if parents[c] == node]  # window order = rank order


def rejection_sample_reference(target_probs, draft_probs, tokens, parents, uniforms) -> tuple[list[int], int]:
    node, path = 0, []
    while True:
        p = target_probs[node].astype(np.float32)
        for c in children(parents, node):
            x, q = int(tokens[c]), draft_probs[c].astype(np.float32)
            if np.float32(uniforms[c]) * q[x] < p[x]:
                path.append(c)
                node = c
                break
            p = normalize(np.maximum(p - q, np.float32(0)))
        else:
            return path, sample_from(p, uniforms[0])


def greedy_accept_reference(target_logits, tokens, parents) -> tuple[list[int], int]:
    node, path = 0, []
    while True:
        best = int(np.argmax(target_logits[node]))
        nxt = next((c for c in children(parents, node) if int(tokens[c]) == best), None)
        if nxt is None:
            return path, best
        path.append(nxt)
        node = nxt


# ── ONNX function bodies ────────────────────────────────────────────────────────────────────────
def _walk(g: GraphBuilder, accept: str, parents: str, ranks: str, tree_mask: str) -> tuple[str, str]:
    """From per-node acceptance (each test assuming its lower-rank siblings failed) to the path.

    first[n]   = accept[n] and no lower-rank sibling accepted
    on_path[n] = first[a] for every ancestor-or-self a of n (root excluded)
    last       = the deepest node on the path (the root if none)
    """
    with g.scope("walk"):
        same_parent = g.op("Equal", g.op("Unsqueeze", parents, g.const([1])), g.op("Unsqueeze", parents, g.const([0])))
        lower_rank = g.op("Less", g.op("Unsqueeze", ranks, g.const([0])), g.op("Unsqueeze", ranks, g.const([1])))
        earlier = g.op("And", g.op("And", same_parent, lower_rank), g.op("Unsqueeze", accept, g.const([0])))
        earlier_any = g.op("Cast", g.op("ReduceMax", g.op("Cast", earlier, to=TensorProto.INT64), g.const([1]),
                                        keepdims=0), to=TensorProto.BOOL)
        first = g.op("And", accept, g.op("Not", earlier_any))
        is_root = g.op("Equal", g.op("Range", g.const(0), g.op("Size", parents), g.const(1)), g.const(0))
        ok = g.op("Or", first, is_root)  # the root is always "on the path"
        blocked = g.op("And", tree_mask, g.op("Unsqueeze", g.op("Not", ok), g.const([0])))
        on_path = g.op("Not", g.op("Cast", g.op("ReduceMax", g.op("Cast", blocked, to=TensorProto.INT64),
                                                g.const([1]), keepdims=0), to=TensorProto.BOOL))
        depth = g.op("ReduceSum", g.op("Cast", tree_mask, to=TensorProto.INT64), g.const([1]), keepdims=0)
        score = g.op("Mul", g.op("Cast", on_path, to=TensorProto.INT64), depth)
        last = g.op("ArgMax", score, axis=0, keepdims=0)
        nodes = g.op("Range", g.const(0), g.op("Size", parents), g.const(1))
        g.op("Compress", nodes, g.op("And", on_path, g.op("Not", is_root)), axis=0, out_names=["path"])
    return "path", last


def greedy_accept_function() -> onnx.FunctionProto:
    g = GraphBuilder("GreedyAccept", as_function=True)
    best = g.op("ArgMax", "target_logits", axis=1, keepdims=0)  # [M]
    parent_best = g.op("Gather", best, g.op("Clip", "parents", g.const(0)), axis=0)
    not_root = g.op("Greater", "parents", g.const(-1))
    accept = g.op("And", g.op("Equal", "tokens", parent_best), not_root)
    _, last = _walk(g, accept, "parents", "ranks", "tree_mask")
    g.op("Gather", best, last, axis=0, out_names=["next_token"])
    return g.function(["target_logits", "tokens", "parents", "ranks", "tree_mask"], ["path", "next_token"],
                      attributes=list(PLUGIN_ATTRS), doc="Greedy tree verification (see module docstring).")


def _rank_loop_body() -> onnx.GraphProto:
    """One sibling rank r: test every rank-r node against its parent's residual, then update residuals.

    carried: residual [M, V] (per parent, after rejecting its children of rank < r), accept [M] bool
    """
    g = GraphBuilder("rank_step", as_function=True, scope="rank_step")
    r = g.op("Cast", "iter", to=TensorProto.INT64)
    is_r = g.op("And", g.op("Equal", "ranks", r), g.op("Greater", "parents", g.const(-1)))
    parent = g.op("Clip", "parents", g.const(0))
    at_parent = g.op("Gather", "residual_in", parent, axis=0)  # [M, V]
    tok = g.op("Unsqueeze", "tokens", g.const([1]))
    p_x = g.op("Squeeze", g.op("GatherElements", at_parent, tok, axis=1), g.const([1]))
    q_x = g.op("Squeeze", g.op("GatherElements", "draft_probs", tok, axis=1), g.const([1]))
    passed = g.op("And", is_r, g.op("Less", g.op("Mul", "uniforms", q_x), p_x))
    g.op("Or", "accept_in", passed, out_names=["accept_out"])
    # residual[p] ← norm(max(0, residual[p] − q_c)) for the rank-r child c of each parent p
    size = g.op("Size", "parents")
    onehot = g.op("Cast", g.op("And", g.op("Equal", g.op("Unsqueeze", parent, g.const([1])),
                                               g.op("Unsqueeze", g.op("Range", g.const(0), size, g.const(1)),
                                                    g.const([0]))),
                                   g.op("Unsqueeze", is_r, g.const([1]))), to=TensorProto.FLOAT)  # [child, parent]
    per_parent = g.op("Transpose", onehot, perm=[1, 0])  # [parent, child]
    q_child = g.op("MatMul", per_parent, "draft_probs")  # exact: one non-zero term per row
    has_child = g.op("Greater", g.op("ReduceSum", per_parent, g.const([1]), keepdims=1), g.const(0.0, np.float32))
    rest = g.op("Max", g.op("Sub", "residual_in", q_child), g.const(0.0, np.float32))
    total = g.op("Max", g.op("ReduceSum", rest, g.const([1]), keepdims=1), g.const(TINY, np.float32))
    g.op("Where", has_child, g.op("Div", rest, total), "residual_in", out_names=["residual_out"])
    g.op("Identity", "cond_in", out_names=["cond_out"])
    vi = helper.make_tensor_value_info
    return helper.make_graph(
        g.nodes, "rank_step",
        [vi("iter", TensorProto.INT64, []), vi("cond_in", TensorProto.BOOL, []),
         vi("residual_in", TensorProto.FLOAT, None), vi("accept_in", TensorProto.BOOL, None)],
        [vi("cond_out", TensorProto.BOOL, []), vi("residual_out", TensorProto.FLOAT, None),
         vi("accept_out", TensorProto.BOOL, None)])


def rejection_sample_function() -> onnx.FunctionProto:
    g = GraphBuilder("RejectionSample", as_function=True)
    trips = g.op("Add", g.op("ReduceMax", "ranks", keepdims=0), g.const(1))
    no_accept = g.op("Less", "parents", g.const(-1))  # all false, shape [M]
    residual, accept = g.op("Loop", trips, "", "target_probs", no_accept, body=_rank_loop_body(), outputs=2)
    _, last = _walk(g, accept, "parents", "ranks", "tree_mask")
    with g.scope("final"):  # draw from the last node's residual (all its children rejected)
        dist = g.op("Gather", residual, last, axis=0)  # [V]
        cdf = g.op("CumSum", dist, g.const(0))
        total = g.op("Gather", cdf, g.op("Sub", g.op("Size", cdf), g.const(1)), axis=0)
        u0 = g.op("Gather", "uniforms", g.const(0), axis=0)
        below = g.op("Cast", g.op("LessOrEqual", cdf, g.op("Mul", u0, total)), to=TensorProto.INT64)
        count = g.op("ReduceSum", below, g.const([0]), keepdims=0)
        g.op("Min", count, g.op("Sub", g.op("Size", cdf), g.const(1)), out_names=["next_token"])
    return g.function(["target_probs", "draft_probs", "tokens", "parents", "ranks", "tree_mask", "uniforms"],
                      ["path", "next_token"], attributes=list(PLUGIN_ATTRS),
                      doc="Lossless tree rejection sampling (see module docstring).")
