"""specrt::TreeAttention — attention of the new window over the valid KV prefix and its tree ancestors.

    inputs : q [B, H, T, d] (already scaled by 1/√d), k_cache / v_cache [B, KV, S, d] holding the
             window's own rows at past_len .. past_len+T-1, past_len [B], tree_mask [B, T, T] (bool)
    attrs  : num_heads H, num_kv_heads KV, head_dim d (ints); plugin_namespace, plugin_version
    output : [B, H, T, d]

Window token t sees cache row j when j < past_len (committed prefix) or j = past_len + u with
tree_mask[t, u]. `specrt::TreeAttentionWindowed` (attribute `window` W, a sliding-window layer) also
hides keys W or more positions behind the query, as transformers' sliding-window mask does
(key position > query position - W): token t sits at position past_len + depth(t) - 1 (its row count in
tree_mask, the contract's position_ids), committed row j at position j. The `...Softcapped` variants
(attribute `softcap` c, Gemma-2) replace the scores s by c * tanh(s / c) before the mask.
GQA: query head h reads KV head h // (H / KV). The function body uses standard ONNX ops only; TensorRT can swap in the registered plugin of the same name (node attributes
`plugin_namespace`, `plugin_version`).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from specrt.plugins.onnx_builder import GraphBuilder

NAME = "TreeAttention"
WINDOWED_NAME = "TreeAttentionWindowed"  # another name, so a plugin for TreeAttention never replaces it
SOFTCAP_SUFFIX = "Softcapped"  # TreeAttentionSoftcapped, TreeAttentionWindowedSoftcapped: same reason
MASK_VALUE = -1e9  # additive mask; exp() underflows to exactly 0 and fully-masked rows stay finite
PLUGIN_ATTRS = {"plugin_namespace": "specrt", "plugin_version": "1"}
SHAPE_ATTRS = ("num_heads", "num_kv_heads", "head_dim")  # ints on the node; the plugin reads them too
INPUTS = ["q", "k_cache", "v_cache", "past_len", "tree_mask"]


def function_name(windowed: bool = False, softcapped: bool = False) -> str:
    """The op's name for a layer with a sliding window and/or score softcapping."""
    return (WINDOWED_NAME if windowed else NAME) + (SOFTCAP_SUFFIX if softcapped else "")


def reference(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, past_len: np.ndarray,
              tree_mask: np.ndarray, window: int = 0, softcap: float = 0.0) -> np.ndarray:
    """Plain NumPy, one (batch, head) at a time, in float64; `window` > 0: TreeAttentionWindowed;
    `softcap` > 0: the Softcapped variants."""
    b_sz, heads, t, _ = q.shape
    groups = heads // k_cache.shape[1]
    out = np.zeros(q.shape, np.float64)
    for b in range(b_sz):
        p = int(past_len[b])
        allowed = np.concatenate([np.ones((t, p), bool), tree_mask[b]], axis=1)  # [T, p+T]
        if window:
            depth = tree_mask[b].sum(-1)
            key_pos = np.concatenate([np.arange(p), p + depth - 1])
            allowed &= (p + depth - 1)[:, None] - key_pos[None, :] < window
        for h in range(heads):
            keys = k_cache[b, h // groups, : p + t].astype(np.float64)
            values = v_cache[b, h // groups, : p + t].astype(np.float64)
            scores = q[b, h].astype(np.float64) @ keys.T
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            scores = np.where(allowed, scores, -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, h] = (w / w.sum(-1, keepdims=True)) @ values
    return out


def visibility(g: GraphBuilder, past_len: str, tree_mask: str, t: str, total: str,
               window: str | None = None) -> tuple[str, str, str, str]:
    """The mask as graph nodes in `g`: (j, in_new, idx, add) with j = 0..L-1 (L = `total`), in_new [B, L]
    whether column j is a window column, idx [B, T, L] its window index (clipped), and the additive
    mask add [B, T, L] = 0 where row t sees column j (j < past_len, or tree_mask[t, j - past_len]) and
    MASK_VALUE elsewhere. `t` is the window length T, `total` L (int64 scalars); `window` (an int64 scalar
    W) also hides keys at W or more positions behind the row's. The function body and the `ort-fused`
    lowering's attention bias (engines/ort_cpu/fuse.py) both build it here."""
    zero, one = g.const([0]), g.const([1])
    j = g.op("Range", g.const(0), total, g.const(1))
    rel = g.op("Sub", g.op("Unsqueeze", j, zero), g.op("Unsqueeze", past_len, one))  # [B, L]
    in_new = g.op("And", g.op("GreaterOrEqual", rel, g.const(0)), g.op("Less", rel, t))
    idx = g.op("Clip", rel, g.const(0), g.op("Sub", t, g.const(1)))
    idx = g.op("Expand", g.op("Unsqueeze", idx, one), g.op("Concat", one, g.op("Unsqueeze", t, zero), one, axis=0))
    seen = g.op("And", g.op("GatherElements", tree_mask, idx, axis=2), g.op("Unsqueeze", in_new, one))
    allowed = g.op("Or", g.op("Unsqueeze", g.op("Less", rel, g.const(0)), one), seen)  # [B, T, L]
    if window is not None:  # positions: committed row j at j, window row u at past_len + depth(u) - 1
        start = g.op("Sub", g.op("Unsqueeze", past_len, one), one)  # [B, 1]
        depth = g.op("ReduceSum", g.op("Cast", tree_mask, to=TensorProto.INT64), g.const([2]), keepdims=0)  # [B,T]
        q_pos = g.op("Add", start, depth)
        k_pos = g.op("Where", in_new, g.op("Add", start, g.op("GatherElements", depth, g.op(
            "Clip", rel, g.const(0), g.op("Sub", t, g.const(1))), axis=1)), g.op("Unsqueeze", j, zero))  # [B, L]
        near = g.op("Less", g.op("Sub", g.op("Unsqueeze", q_pos, g.const([2])), g.op("Unsqueeze", k_pos, one)), window)
        allowed = g.op("And", allowed, near)
    add = g.op("Where", allowed, g.const(0.0, np.float32), g.const(MASK_VALUE, np.float32))
    return j, in_new, idx, add


def function(windowed: bool = False, softcapped: bool = False) -> onnx.FunctionProto:
    """The op as an ONNX local function whose body uses standard ops only (`windowed`: TreeAttentionWindowed,
    whose mask covers every column: P below is 0; `softcapped`: q · kᵀ -> c * tanh(q · kᵀ / c) first).

        L = max(past_len) + T
        mask[b, t, j] = 0 if j < past_len[b] or tree_mask[b, t, j - past_len[b]] else -1e9
        q  [B,H,T,d] ─► [B, KV, G*T, d]         (query heads grouped per KV head; K/V never repeated)
        P = min(past_len): columns < P are every row's committed prefix, in place; the tail P..L-1
        s  = [q · k[:P]ᵀ | permute(q · k[P:L]ᵀ + mask[P:L])]   (only the tail is masked and permuted:
             per row, to (prefix, ancestors by depth, rest))
        out = [softmax(s)[:P] | permute⁻¹(softmax(s)[P:])] · v[:L] ─► [B, H, T, d]
    """
    g = GraphBuilder(function_name(windowed, softcapped), as_function=True)
    q, k_cache, v_cache, past_len, tree_mask = INPUTS
    zero, one = g.const([0]), g.const([1])
    t = g.op("Gather", g.op("Shape", tree_mask), g.const(1))  # from tree_mask: shared by every layer
    total = g.op("Add", g.op("ReduceMax", past_len, keepdims=0), t)
    total_1d = g.op("Unsqueeze", total, zero)
    # head counts come from the node's attributes, so every layer computes the same mask and
    # column order from the same inputs and ONNX Runtime folds them into one computation
    heads, kv_heads, head_dim = (g.op("Unsqueeze", g.attr_int(a), zero) for a in SHAPE_ATTRS)
    groups = g.op("Div", heads, kv_heads)
    with g.scope("mask"):
        window = g.op("Unsqueeze", g.attr_int("window"), zero) if windowed else None
        j, in_new, idx, add = visibility(g, past_len, tree_mask, t, total, window)
        rep = g.op("Concat", one, groups, one, axis=0)
        t_1d = g.op("Unsqueeze", t, zero)
    with g.scope("order"):
        # Column order per row: committed prefix, then the row's ancestors by depth, then the rest.
        # For a chain this is the identity; for a tree it puts an accepted node's visible columns
        # exactly where a chain (or plain decoding) has them, so the softmax reduces the same
        # numbers in the same order and tree verification stays bitwise equal to plain decoding.
        depth = g.op("ReduceSum", g.op("Cast", tree_mask, to=TensorProto.INT64), g.const([2]), keepdims=1)  # [B,T,1]
        col_depth = g.op("Transpose", depth, perm=[0, 2, 1])  # [B, 1, T]
        other = g.op("Add", g.op("Range", g.const(0), t, g.const(1)), g.op("Add", t, g.const(1)))  # after any depth
        key = g.op("Where", tree_mask, col_depth, other)
        _, order = g.op("TopK", g.op("Neg", key), t_1d, axis=2, largest=1, sorted=1, outputs=2)
        # its inverse (argsort of a permutation), to put the probabilities back in cache order
        _, back = g.op("TopK", g.op("Neg", order), t_1d, axis=2, largest=1, sorted=1, outputs=2)
        offset = g.op("Unsqueeze", g.op("Unsqueeze", past_len, one), one)
        cols = g.op("Expand", g.op("Unsqueeze", j, zero), g.op("Shape", idx))
        keep = g.op("Unsqueeze", in_new, one)
        perm = g.op("Where", keep, g.op("Add", g.op("GatherElements", order, idx, axis=2), offset), cols)
        unperm = g.op("Where", keep, g.op("Add", g.op("GatherElements", back, idx, axis=2), offset), cols)
        # Only the tail from the shortest prefix on (pmin = min(past_len)) holds window columns; below
        # it every row sees every column in place. So the mask and both permutations touch the tail
        # only: T × (L - pmin) entries per row group instead of T × L (a long prompt's chunks).
        # (a window hides committed columns too: then the whole row is the tail)
        pmin = g.const([0]) if windowed else g.op("Unsqueeze", g.op("ReduceMin", past_len, keepdims=0), zero)
        tail = g.op("Sub", total_1d, pmin)
        axis = g.const([2])
        # the tail's mask and indices are spread to full size [B, KV, G*T, L - pmin] from the shared
        # inputs and attributes only, so ONNX Runtime computes them once per pass for every layer
        # (common subexpressions), not per layer, and each layer's Add and gathers run without broadcasting
        full = g.op("Concat", g.op("Shape", tree_mask, start=0, end=1), kv_heads, g.op("Mul", groups, t_1d), tail,
                    axis=0)

        def spread(p):  # [B, T, L - pmin] -> [B, KV, G*T, L - pmin]
            return g.op("Expand", g.op("Unsqueeze", g.op("Tile", p, rep), one), full)

        mask = spread(g.op("Slice", add, pmin, total_1d, axis))
        perm, unperm = (spread(g.op("Sub", g.op("Slice", p, pmin, total_1d, axis), pmin)) for p in (perm, unperm))
    head_keys, tail_keys = (g.op("Transpose", g.op("Slice", k_cache, lo, hi, axis), perm=[0, 1, 3, 2])
                            for lo, hi in ((zero, pmin), (pmin, total_1d)))
    values = g.op("Slice", v_cache, zero, total_1d, axis)
    qg = g.op("Reshape", q, g.op("Concat", zero, kv_heads, g.const([-1]), head_dim, axis=0))
    cap = g.attr_float("softcap") if softcapped else None

    def logits(keys):  # q · kᵀ, softcapped in the Softcapped variants
        s = g.op("MatMul", qg, keys)
        return g.op("Mul", g.op("Tanh", g.op("Div", s, cap)), cap) if cap else s

    tail_scores = g.op("Add", logits(tail_keys), mask)
    scores = g.op("Concat", logits(head_keys), g.op("GatherElements", tail_scores, perm, axis=3), axis=3)
    head_probs, tail_probs = g.op("Split", g.op("Softmax", scores, axis=-1), g.op("Concat", pmin, tail, axis=0),
                                  axis=3, outputs=2)
    probs = g.op("Concat", head_probs, g.op("GatherElements", tail_probs, unperm, axis=3), axis=3)  # cache order
    out = g.op("MatMul", probs, values)
    g.op("Reshape", out, g.op("Concat", zero, heads, g.const([-1]), head_dim, axis=0), out_names=["out"])
    attributes = [*PLUGIN_ATTRS, *SHAPE_ATTRS, *(["window"] if windowed else []), *(["softcap"] if softcapped else [])]
    return g.function(INPUTS, ["out"], attributes=attributes, doc=function.__doc__)
