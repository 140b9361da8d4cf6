"""ONNX graph of a feature drafter's layer, built with the target's layer code (same conventions).

    feature  input_ids, inputs_embeds [B,T,H], hidden_in [B,T,H], position_ids, past_len, tree_mask,
             logits_index, past_key.0 / past_value.0 ─► logits [B,R,V'], hidden_states (the layer
             output [B,T,H], fed back for drafted rows), present_key.0 / present_value.0 (in place)

`inputs_embeds` is the target's embedding row of each input id (of max(id, 0): the block drafter's mask
rows read their own embedding): a drafter's embedding is always the target's, frozen (export/drafters/
base.py), so the layer stores no copy of the table; the runtime gathers rows from the target graph's own
(runtime/drafters/features.py).

Kind-specific pieces (how token and feature are mixed, which norm the head reads) are the module's
own: `FeatureDrafter.graph_mix` and `graph_head_norm`, next to `mix` and `head_input` in the kind's
module (export/drafters/<kind>.py), which also holds any other graph the kind has.
The layer is always the drafter's plain one (export/drafters/base.py `one_layer`): pre-norm, SwiGLU,
full attention; a config that carries a target family's maths is refused, never silently dropped.
"""

from __future__ import annotations

from specrt.export.decoder_graph import _DecoderGraph, _norm, _np
from specrt.export.drafters.base import check_plain
from specrt.plugins.onnx_builder import FLOAT, GraphBuilder


class FeatureGraph(_DecoderGraph):
    """The graph being built; `graph_mix` methods add their nodes through `g`, `named`, `embed`,
    `weight_of`, `linear` and `norm`."""

    def __init__(self, module, name: str):
        self.m, self.cfg, self.g = module, module.dec, GraphBuilder(name)
        self._prefix = ""
        self._embeds = False

    def named(self, prefix: str) -> FeatureGraph:
        """Weights written next are named `prefix.NAME` (the module's parameter names)."""
        self._prefix = prefix
        return self

    def weight_of(self, name: str, tensor) -> str:
        return self.g.weight(name, _np(tensor))

    def norm(self, x: str, module, name: str) -> str:
        """RMSNorm with the weight and eps of the torch norm `module`."""
        return self.rms_norm(x, *_norm(module), name)

    def embed(self, input_ids: str) -> str:
        """The target's embedding of each id (ids below 0 read row 0; a mix replaces those rows): the
        `inputs_embeds` input, declared once."""
        if not self._embeds:
            self.g.input("inputs_embeds", FLOAT, ["batch", "tokens", self.cfg.hidden_size])
            self._embeds = True
        return "inputs_embeds"

    def build(self):
        g, m, cfg = self.g, self.m, self.cfg
        input_ids, position_ids, past_len, tree_mask, logits_index = self.inputs(1)
        hidden_in = g.input("hidden_in", FLOAT, ["batch", "tokens", cfg.hidden_size])
        cos, sin = self.rope_tables(position_ids)
        x_attn, residual = m.graph_mix(self, input_ids, hidden_in)
        layer = m.layer
        self._prefix = "layer"
        with g.scope("layer"):
            x = g.op("Add", residual, self.attention(layer.self_attn, 0, x_attn, cos, sin, past_len, tree_mask))
            h = self.rms_norm(x, *_norm(layer.post_attention_layernorm), "post_attention_layernorm")
            out = g.op("Add", x, self.mlp(layer.mlp, h))
        normed, norm = out, m.graph_head_norm()
        if norm is not None:
            self._prefix = "head"
            normed = self.rms_norm(out, *_norm(norm), "head_norm")
        head = m.head_rows(m.lm_head.weight)  # the draft vocabulary's rows
        self.lm_head(normed, logits_index, self.weight_of("lm_head.weight", head), head.shape[0])
        g.output(out, "hidden_states", FLOAT, ["batch", "tokens", cfg.hidden_size])
        self.kv_outputs(1)
        return g.model(doc=f"specrt {type(m).__name__} drafter layer")


def feature_graph(module, name: str):
    """The ONNX ModelProto of one feature-drafter layer (EAGLE, EAGLE-3, block or one MTP module)."""
    check_plain(module.dec, f"{type(module).__name__} graph {name!r}")
    return FeatureGraph(module, name).build()
