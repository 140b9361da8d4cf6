"""ONNX graphs of the learned drafters, built with the target's layer code (same conventions).

    medusa   hidden_in [B,R,H] ─► logits [B,R,K,V]                                    (no KV)
    feature  input_ids, hidden_in [B,T,H], position_ids, past_len, tree_mask, logits_index,
             past_key.0 / past_value.0 ─► logits [B,R,V'], hidden_states (the layer output
             [B,T,H], fed back for drafted rows), present_key.0 / present_value.0 (in place)
    fuse     aux_hidden_states [B,T,n·H] ─► hidden [B,T,H]                           (EAGLE-3 fc)

Kind-specific pieces (how token and feature are mixed, which head) are registered per module class.
The layer is always the drafter's plain one (export/drafters/base.py `one_layer`): pre-norm, SwiGLU,
full attention; a config that carries a target family's maths is refused, never silently dropped.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from specrt.export.decoder_graph import _DecoderGraph, _norm, _np
from specrt.export.drafters.base import check_plain
from specrt.export.drafters.block import BlockHead
from specrt.export.drafters.eagle import Eagle3Head, EagleHead
from specrt.export.drafters.medusa import MedusaHeads
from specrt.export.drafters.mtp import MtpModule
from specrt.plugins.onnx_builder import FLOAT, GraphBuilder


class _FeatureGraph(_DecoderGraph):
    def __init__(self, module, name: str):
        self.m, self.cfg, self.g = module, module.dec, GraphBuilder(name)
        self._prefix = ""

    def weight_of(self, name: str, tensor) -> str:
        return self.g.weight(name, _np(tensor))

    def embed(self, input_ids: str) -> str:
        return self.g.op("Gather", self.weight_of("embed_tokens.weight", self.m.embed_tokens.weight), input_ids,
                         name="embed_tokens")

    def build(self):
        g, m, cfg = self.g, self.m, self.cfg
        input_ids, position_ids, past_len, tree_mask, logits_index = self.inputs(1)
        hidden_in = g.input("hidden_in", FLOAT, ["batch", "tokens", cfg.hidden_size])
        cos, sin = self.rope_tables(position_ids)
        x_attn, residual = MIX[type(m)](self, input_ids, hidden_in)
        layer = m.layer
        self._prefix = "layer"
        with g.scope("layer"):
            x = g.op("Add", residual, self.attention(layer.self_attn, 0, x_attn, cos, sin, past_len, tree_mask))
            h = self.rms_norm(x, *_norm(layer.post_attention_layernorm), "post_attention_layernorm")
            out = g.op("Add", x, self.mlp(layer.mlp, h))
        normed, norm = out, HEAD_NORM[type(m)]
        if norm is not None:
            self._prefix = "head"
            normed = self.rms_norm(out, *_norm(norm(m)), "head_norm")
        self.lm_head(normed, logits_index, self.weight_of("lm_head.weight", m.lm_head.weight), m.lm_head.weight.shape[0])
        g.output(out, "hidden_states", FLOAT, ["batch", "tokens", cfg.hidden_size])
        self.kv_outputs(1)
        return g.model(doc=f"specrt {type(m).__name__} drafter layer")


def _eagle_mix(fg: _FeatureGraph, ids: str, hidden: str):
    m, g = fg.m, fg.g
    fg._prefix = "eagle"
    x = fg.linear(g.op("Concat", fg.embed(ids), hidden, axis=-1), [m.fc], "fc")
    if isinstance(m.layer.input_layernorm, nn.Identity):
        return x, x
    return fg.rms_norm(x, *_norm(m.layer.input_layernorm), "input_layernorm"), x


def _eagle3_mix(fg: _FeatureGraph, ids: str, hidden: str):
    m, g = fg.m, fg.g
    fg._prefix = "midlayer"
    e = fg.rms_norm(fg.embed(ids), *_norm(m.midlayer.input_layernorm), "input_layernorm")
    h = fg.rms_norm(hidden, *_norm(m.midlayer.hidden_norm), "hidden_norm")
    return g.op("Concat", e, h, axis=-1), hidden


def _mtp_mix(fg: _FeatureGraph, ids: str, hidden: str):
    m, g = fg.m, fg.g
    fg._prefix = "mtp"
    e = fg.rms_norm(fg.embed(ids), *_norm(m.enorm), "enorm")
    h = fg.rms_norm(hidden, *_norm(m.hnorm), "hnorm")
    x = fg.linear(g.op("Concat", e, h, axis=-1), [m.eh_proj], "eh_proj")
    return fg.rms_norm(x, *_norm(m.block.input_layernorm), "input_layernorm"), x


def _block_mix(fg: _FeatureGraph, ids: str, hidden: str):
    """EAGLE-3's mix, with mask rows (id < 0) reading the learned mask embedding and feature:

        masked = ids < 0 ─► Where(masked, mask_embed, Gather(embed, max(ids, 0)))
                         └► Where(masked, mask_hidden, hidden_in)
    """
    m, g = fg.m, fg.g
    fg._prefix = "midlayer"
    masked = g.op("Unsqueeze", g.op("Less", ids, g.const([0])), g.const([-1]), name="mask_rows")
    e = g.op("Where", masked, fg.weight_of("mask_embed", m.mask_embed), fg.embed(g.op("Max", ids, g.const([0]))))
    h = g.op("Where", masked, fg.weight_of("mask_hidden", m.mask_hidden), hidden)
    e = fg.rms_norm(e, *_norm(m.midlayer.input_layernorm), "input_layernorm")
    return g.op("Concat", e, fg.rms_norm(h, *_norm(m.midlayer.hidden_norm), "hidden_norm"), axis=-1), h


MIX = {EagleHead: _eagle_mix, Eagle3Head: _eagle3_mix, MtpModule: _mtp_mix, BlockHead: _block_mix}
HEAD_NORM = {EagleHead: None, Eagle3Head: lambda m: m.norm, MtpModule: lambda m: m.shared_head.norm,
             BlockHead: lambda m: m.norm}


def feature_graph(module, name: str):
    """The ONNX ModelProto of one feature-drafter layer (EAGLE, EAGLE-3 or one MTP module)."""
    check_plain(module.dec, f"{type(module).__name__} graph {name!r}")
    return _FeatureGraph(module, name).build()


def fuse_graph(module: Eagle3Head, name: str = "eagle3_fuse"):
    g = GraphBuilder(name)
    n = module.fc.in_features
    aux = g.input("aux_hidden_states", FLOAT, ["batch", "tokens", n])
    y = g.op("MatMul", aux, g.weight("fc.weight", _np(module.fc.weight).T), name="fc")
    g.output(y, "hidden", FLOAT, ["batch", "tokens", module.fc.out_features])
    return g.model(doc="specrt EAGLE-3 feature fusion")


def medusa_graph(module: MedusaHeads, name: str = "medusa"):
    g = GraphBuilder(name)
    cfg, dec = module.cfg, module.dec
    h, v = dec.hidden_size, dec.vocab_size
    hidden = g.input("hidden_in", FLOAT, ["batch", "rows", h])
    feats = []
    for k, head in enumerate(module.medusa_head):
        x = hidden
        with g.scope(f"medusa_head.{k}"):
            for j in range(cfg.num_layers):
                lin = head[j].linear
                y = g.op("Add", g.op("MatMul", x, g.weight(f"medusa_head.{k}.{j}.linear.weight", _np(lin.weight).T)),
                         g.weight(f"medusa_head.{k}.{j}.linear.bias", _np(lin.bias)))
                x = g.op("Add", x, g.op("Mul", y, g.op("Sigmoid", y)))
        feats.append(g.op("Unsqueeze", x, g.const([2])))
    stacked = g.op("Concat", *feats, axis=2)  # [B, R, K, H]
    if cfg.own_heads:
        w = np.stack([_np(head[-1].weight).T for head in module.medusa_head])  # [K, H, V]
        per_head = g.op("Transpose", stacked, perm=[2, 0, 1, 3])  # [K, B, R, H]
        logits = g.op("Transpose", g.op("MatMul", g.op("Reshape", per_head, g.const([cfg.num_heads, -1, h])),
                                        g.weight("medusa_head.lm_heads", w)), perm=[1, 0, 2])  # [B·R, K, V]
        logits = g.op("Reshape", logits, g.op("Concat", g.op("Shape", hidden, end=2), g.const([cfg.num_heads, v]),
                                              axis=0))
    else:
        logits = g.op("MatMul", stacked, g.weight("lm_head.weight", _np(module.lm_head.weight).T))
    g.output(logits, "logits", FLOAT, ["batch", "rows", cfg.num_heads, v])
    return g.model(doc=f"specrt Medusa heads ({cfg.num_heads})")
