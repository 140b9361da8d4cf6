"""The `ort-fused` lowering: each layer's attention block as one ONNX Runtime GroupQueryAttention node.

The exported decoder graph (export/decoder_graph.py) spends about 22 nodes per layer between the
q|k|v projection and o_proj: reshape and transpose to heads, split, RotaryEmbedding, the two
TensorScatter KV writes, the specrt::TreeAttention body, transpose back. ONNX Runtime's contrib op
`com.microsoft.GroupQueryAttention` does all of it in one kernel — rotary on q and k from cos/sin
tables at `position_ids`, the new K/V rows written into the shared (in-place) cache at each
sequence's `past_len`, attention over the valid prefix — with the tree mask as an additive
`attention_bias`. On a 2-core CPU that makes a pass 20–30 % faster (docs/performance.md).

Two more rewrites:

    pad row    GroupQueryAttention runs one row more than the window (a zero q/k/v row after it, which no
               window row sees; its output is cut off, its KV row lies past the window and the next pass
               overwrites it). A one-row pass thus never reaches MLAS's M=1 SGEMM kernels (taken for
               q·kᵀ at scale 1 and always for probs·v), whose sums round differently from the M≥2 kernel:
               a plain step's row is bitwise a verify chain's row without padding the whole pass (exec
               mode pad2 also pads every MatMulNBits to M=2, about 20 % of a one-row pass here). The graph
               says so in its metadata (KV_PAD_ROWS): the runner gives its KV buffers that many rows more.
               The graph for several sequences per pass (`pad_rows=0`, `specrt build` writes both) has
               none: GroupQueryAttention takes one row per sequence there, and those rows go through the
               M=1 kernels, so they are not bitwise the batch-1 graph's.
    norms      each residual Add and the RMSNormalization reading it become one
               com.microsoft.SkipSimplifiedLayerNormalization (its 4th output is the sum), as in
               onnxruntime-genai's graph of the same model; nodes and initializers nothing reads any more
               (the exported rotary tables) are dropped.

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
PAD_ROWS = 1  # rows GroupQueryAttention runs past the window (see "pad row" above)
KV_PAD_ROWS = "specrt.kv_pad_rows"  # metadata: KV rows a pass may write past its window (runner.py reads it)


def _rotary_tables(cfg: DecoderConfig) -> list[onnx.TensorProto]:
    """cos/sin [rows, d/2] at every position, as the exported graph's rotary computes them per token."""
    pos = np.arange(max(cfg.max_position_embeddings, MIN_ROTARY_ROWS), dtype=np.float32)[:, None]
    freqs = pos * np.asarray(cfg.rope_inv_freq, np.float32)[None]
    scale = np.float32(cfg.rope_attention_scaling)
    return [numpy_helper.from_array(np.ascontiguousarray(f(freqs) * scale), f"{PREFIX}.{name}")
            for name, f in (("cos_cache", np.cos), ("sin_cache", np.sin))]


def _shared_nodes(pad: int) -> list[onnx.NodeProto]:
    """For GroupQueryAttention over the window and `pad` more rows (R = T + pad): seqlens_k = past_len + R - 1
    (int32), total = max(past_len) + R (int32 scalar), and the additive bias [B, 1, R, total]:
    TreeAttention's own mask (`tree_attention.visibility`), over the tree mask padded with rows and
    columns that no window row sees. With pad rows also their positions (0) after position_ids and the
    window length T as a 1-D tensor (to cut the output)."""
    g = GraphBuilder(PREFIX, as_function=True, scope=PREFIX)  # constants as nodes named /gqa/...
    t = g.op("Gather", g.op("Shape", "tree_mask"), g.const(1))
    rows, mask = t, "tree_mask"
    if pad:
        g.op("Unsqueeze", t, g.const([0]), out_names=[f"{PREFIX}.rows"])
        rows = g.op("Add", t, g.const(pad))
        g.op("Pad", "position_ids", g.const([0, 0, 0, pad]), out_names=[f"{PREFIX}.position_ids"])
        mask = g.op("Pad", "tree_mask", g.const([0, 0, 0, 0, pad, pad]))
    end = g.op("Add", "past_len", rows)
    g.op("Cast", g.op("Sub", end, g.const(1)), to=TensorProto.INT32, out_names=[f"{PREFIX}.seqlens_k"])
    total = g.op("Add", g.op("ReduceMax", "past_len", keepdims=0), rows)
    g.op("Cast", total, to=TensorProto.INT32, out_names=[f"{PREFIX}.total"])
    *_, add = visibility(g, "past_len", mask, rows, total)
    g.op("Unsqueeze", add, g.const([1]), out_names=[f"{PREFIX}.bias"])
    return g.nodes


def _pad_constants(pad: int) -> list[onnx.TensorProto]:
    """The Pad and Slice operands `_attention` uses (none without pad rows)."""
    if not pad:
        return []
    return [numpy_helper.from_array(np.asarray(v, np.int64), f"{PREFIX}.{name}")
            for name, v in (("zero", [0]), ("one", [1]), ("qkv_pads", [0, 0, 0, 0, pad, 0]))]


def _attention(i: int, qkv: str, out: str, cfg: DecoderConfig, pad: int) -> list[onnx.NodeProto]:
    """Layer i's attention: GroupQueryAttention over q|k|v [B, T, .] (rotary, the in-place KV write, the
    masked softmax); with `pad`, q|k|v gets that many zero rows after the window and the output is cut
    back to the T window rows."""
    scope = f"/model/layers.{i}/self_attn"
    gqa_in, gqa_out, positions = qkv, out, "position_ids"
    nodes = []
    if pad:
        gqa_in, gqa_out, positions = f"{scope}/PadRows_output_0", f"{scope}/GroupQueryAttention_output_0", \
            f"{PREFIX}.position_ids"
        nodes.append(helper.make_node("Pad", [qkv, f"{PREFIX}.qkv_pads"], [gqa_in], name=f"{scope}/PadRows"))
    nodes.append(helper.make_node(
        "GroupQueryAttention",
        [gqa_in, "", "", f"past_key.{i}", f"past_value.{i}", f"{PREFIX}.seqlens_k", f"{PREFIX}.total",
         f"{PREFIX}.cos_cache", f"{PREFIX}.sin_cache", positions, f"{PREFIX}.bias"],
        [gqa_out, f"present_key.{i}", f"present_value.{i}"], domain=DOMAIN,
        name=f"{scope}/GroupQueryAttention", num_heads=cfg.num_heads,
        kv_num_heads=cfg.num_kv_heads, scale=1.0,  # 1/sqrt(d) is folded into q's weights
        do_rotary=1, rotary_interleaved=0, local_window_size=-1))
    if pad:
        nodes.append(helper.make_node("Slice", [gqa_out, f"{PREFIX}.zero", f"{PREFIX}.rows", f"{PREFIX}.one"],
                                      [out], name=f"{scope}/WindowRows"))
    return nodes


def _skip_norms(nodes: list[onnx.NodeProto], initializers: set[str]) -> list[onnx.NodeProto]:
    """Each Add of two computed [B, T, H] tensors read by an RMSNormalization over the last axis, with
    that norm, as one SkipSimplifiedLayerNormalization (outputs: the norm, and the sum as its 4th) placed
    where the Add was; the sum keeps its name for its other readers (the next residual Add)."""
    made = {n.output[0]: n for n in nodes if n.op_type == "Add" and not n.domain
            and not initializers.intersection(n.input) and len(n.input) == 2}
    fused, dropped = {}, set()
    for n in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        add = made.get(n.input[0]) if n.op_type == "RMSNormalization" and not n.domain else None
        if add is None or id(add) in fused or attrs.get("axis", -1) != -1 or len(n.input) != 2:
            continue
        fused[id(add)] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [*add.input, n.input[1]], [n.output[0], "", "", add.output[0]],
            domain=DOMAIN, name=n.name.rsplit("/", 1)[0] + "/SkipSimplifiedLayerNormalization",
            epsilon=float(attrs.get("epsilon", 1e-5)))
        dropped.add(id(n))
    return [fused.get(id(n), n) for n in nodes if id(n) not in dropped]


def _prune(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` less those no graph output depends on (the exported rotary tables, once GroupQueryAttention
    computes rotary itself)."""
    needed, kept = set(outputs), []
    for n in reversed(nodes):
        if needed.intersection(o for o in n.output if o):
            kept.append(n)
            needed.update(n.input)
    return kept[::-1]


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


def fuse_attention(model: onnx.ModelProto, cfg: DecoderConfig, pad_rows: int = PAD_ROWS) -> onnx.ModelProto | None:
    """A copy of `model` with every layer's attention block replaced by GroupQueryAttention; None when the
    config's attention is one NOT_LOWERED names, or a layer does not have the block this lowering knows
    (the graph is then left as it is). `pad_rows`: the attention's pad rows ("pad row" above); 0 for a
    graph that runs several sequences per pass (GroupQueryAttention refuses more than one row per
    sequence there, and each pass is then one row per sequence)."""
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
                out.extend(_attention(i, qkv, attn_out, cfg, pad_rows))
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    del fused.graph.node[:]
    fused.graph.initializer.extend(_rotary_tables(cfg) + _pad_constants(pad_rows))
    initializers = {t.name for t in fused.graph.initializer}
    nodes = _prune(_skip_norms(_shared_nodes(pad_rows) + out, initializers), {o.name for o in fused.graph.output})
    fused.graph.node.extend(nodes)
    read = {i for n in nodes for i in n.input}
    kept_inits = [t for t in fused.graph.initializer if t.name in read]
    del fused.graph.initializer[:]
    fused.graph.initializer.extend(kept_inits)
    kept_functions = [f for f in fused.functions if f.name != NAME]  # TreeAttention is no longer called
    del fused.functions[:]
    fused.functions.extend(kept_functions)
    if not any(o.domain == DOMAIN for o in fused.opset_import):
        fused.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    helper.set_model_props(fused, {**{p.key: p.value for p in model.metadata_props}, KV_PAD_ROWS: str(pad_rows)})
    fused.doc_string = model.doc_string + " · attention lowered to com.microsoft.GroupQueryAttention (ort-fused)"
    return fused
