"""The `ort-fused` lowering: each layer's attention block as one ONNX Runtime GroupQueryAttention node.

The exported decoder graph (export/decoder_graph.py) spends about 22 nodes per layer between the
q|k|v projection and o_proj: reshape and transpose to heads, split, RotaryEmbedding, the two
TensorScatter KV writes, the specrt::TreeAttention body, transpose back. ONNX Runtime's contrib op
`com.microsoft.GroupQueryAttention` does all of it in one kernel — rotary on q and k from cos/sin
tables at `position_ids`, the new K/V rows written into the shared (in-place) cache at each
sequence's `past_len`, attention over the valid prefix — with the tree mask as an additive
`attention_bias`. On a 2-core CPU that makes a pass 20–30 % faster (docs/performance.md).

What it does not keep: tree rows. GroupQueryAttention's softmax sums a row's visible columns where the
tree put them, with masked columns between, so a tree node's logits are not bitwise those of the same
tokens as a chain (TreeAttention permutes the columns for that). Chains — prefill, plain decoding,
chain verification, ragged batches of chains — keep their rows (measured per machine like any graph:
runtime/exactness.py), so the backend is registered as verifying chains only and the runtime cuts a
tree proposal to its top-ranked path there.

The lowering reads the writer's own scopes (`/model/layers.{i}/self_attn/...`), so it applies to
graphs specrt exported; one it cannot lower (qk-norm, sliding-window layers, softcapped scores, a RoPE
table per layer, or another layout) returns None.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt.plugins.onnx_builder import GraphBuilder
from specrt.plugins.tree_attention import NAME, visibility
from specrt.schema.config import DecoderConfig

DOMAIN = "com.microsoft"
PREFIX = "gqa"  # names of the shared tensors this lowering adds
MIN_ROTARY_ROWS = 8192  # cos/sin table rows at least (GroupQueryAttention needs one per KV row it attends)


def _rotary_tables(cfg: DecoderConfig) -> list[onnx.TensorProto]:
    """cos/sin [rows, d/2] at every position, as the exported graph's rotary computes them per token."""
    pos = np.arange(max(cfg.max_position_embeddings, MIN_ROTARY_ROWS), dtype=np.float32)[:, None]
    freqs = pos * np.asarray(cfg.rope_inv_freq, np.float32)[None]
    scale = np.float32(cfg.rope_attention_scaling)
    return [numpy_helper.from_array(np.ascontiguousarray(f(freqs) * scale), f"{PREFIX}.{name}")
            for name, f in (("cos_cache", np.cos), ("sin_cache", np.sin))]


def _shared_nodes() -> list[onnx.NodeProto]:
    """seqlens_k = past_len + T - 1 (int32), total = max(past_len) + T (int32 scalar), and the additive
    bias [B, 1, T, total]: TreeAttention's own mask (`tree_attention.visibility`)."""
    g = GraphBuilder(PREFIX, as_function=True, scope=PREFIX)  # constants as nodes named /gqa/...
    t = g.op("Gather", g.op("Shape", "tree_mask"), g.const(1))
    end = g.op("Add", "past_len", t)
    g.op("Cast", g.op("Sub", end, g.const(1)), to=TensorProto.INT32, out_names=[f"{PREFIX}.seqlens_k"])
    total = g.op("Add", g.op("ReduceMax", "past_len", keepdims=0), t)
    g.op("Cast", total, to=TensorProto.INT32, out_names=[f"{PREFIX}.total"])
    *_, add = visibility(g, "past_len", "tree_mask", t, total)
    g.op("Unsqueeze", add, g.const([1]), out_names=[f"{PREFIX}.bias"])
    return g.nodes


# (holds for the config, what it is): attention this lowering does not write as GroupQueryAttention; such a
# graph is left unfused (`--backend ort` runs it)
NOT_LOWERED: tuple[tuple[Callable[[DecoderConfig], bool], str], ...] = (
    (lambda c: c.qk_norm, "per-head q/k norms (GroupQueryAttention has none between projection and rotary)"),
    (lambda c: any(c.layer_windows), "sliding-window attention"),
    (lambda c: bool(c.attn_logit_softcapping), "softcapped attention scores"),
    (lambda c: any(c.layer_rope), "two RoPE tables (one cos/sin table serves every layer here)"),
)


def not_lowered(cfg: DecoderConfig) -> str | None:
    """Why `cfg`'s attention is not lowered to GroupQueryAttention, or None where it can be."""
    return next((why for holds, why in NOT_LOWERED if holds(cfg)), None)


def fuse_attention(model: onnx.ModelProto, cfg: DecoderConfig) -> onnx.ModelProto | None:
    """A copy of `model` with every layer's attention block replaced by GroupQueryAttention; None when the
    config's attention is one NOT_LOWERED names, or a layer does not have the block this lowering knows
    (the graph is then left as it is)."""
    if not_lowered(cfg):
        return None
    nodes = list(model.graph.node)
    kept, per_layer = [], {}
    for node in nodes:
        if "/self_attn/" in node.name and not any(s in node.name for s in ("/qkv_proj/", "/o_proj/")):
            layer = node.name.split("/layers.")[1].split("/")[0] if "/layers." in node.name else None
            if layer is None:
                return None
            per_layer.setdefault(int(layer), []).append(node)
            continue
        kept.append(node)
    if sorted(per_layer) != list(range(cfg.num_layers)):
        return None
    heads = {}
    for i, block in per_layer.items():
        ops = [n.op_type for n in block]
        if ops.count(NAME) != 1 or ops.count("TensorScatter") != 2 or ops[0] != "Reshape":
            return None
        inside = {o for n in block for o in n.output}
        heads[i] = (block[0].input[0], next(o for n in block if n.op_type == "Reshape" and n is not block[0]
                                            for o in n.output))
        if heads[i][0] in inside:
            return None
    out = []
    for node in kept:
        out.append(node)
        for i, (qkv, attn_out) in heads.items():
            if qkv in node.output:
                out.append(helper.make_node(
                    "GroupQueryAttention",
                    [qkv, "", "", f"past_key.{i}", f"past_value.{i}", f"{PREFIX}.seqlens_k", f"{PREFIX}.total",
                     f"{PREFIX}.cos_cache", f"{PREFIX}.sin_cache", "position_ids", f"{PREFIX}.bias"],
                    [attn_out, f"present_key.{i}", f"present_value.{i}"], domain=DOMAIN,
                    name=f"/model/layers.{i}/self_attn/GroupQueryAttention", num_heads=cfg.num_heads,
                    kv_num_heads=cfg.num_kv_heads, scale=1.0,  # 1/sqrt(d) is folded into q's weights
                    do_rotary=1, rotary_interleaved=0, local_window_size=-1))
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    del fused.graph.node[:]
    fused.graph.node.extend(_shared_nodes() + out)
    fused.graph.initializer.extend(_rotary_tables(cfg))
    kept_functions = [f for f in fused.functions if f.name != NAME]  # TreeAttention is no longer called
    del fused.functions[:]
    fused.functions.extend(kept_functions)
    if not any(o.domain == DOMAIN for o in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    fused.doc_string = model.doc_string + " · attention lowered to com.microsoft.GroupQueryAttention (ort-fused)"
    return fused
