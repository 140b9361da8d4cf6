"""Build the decoder ONNX graph (target or draft LM) from a `DecoderLM`'s weights.

One graph serves prefill, single-token decode and chain/tree verification (see modeling.py for
the contract). Per layer:

    x ─► RMSNorm ─► q,k,v proj ─► (qk-norm) ─► RoPE(position_ids)
                                   k,v ─► TensorScatter(past_kv, at past_len) ═► present_kv (in place)
         present_kv[:, :, :L] ─► scores = q·kᵀ/√d + mask(past_len, tree_mask) ─► softmax ─► ·v
    x += o_proj(attn);  x += down(silu(gate(h)) * up(h))

L = max(past_len) + T: attention reads only the valid prefix plus the new window. Query heads are
grouped per KV head ([B, kv_heads, groups*T, d]) so K/V are never repeated for GQA.
"""

from __future__ import annotations

import numpy as np

from specrt.export.modeling import MASK_VALUE, DecoderLM
from specrt.export.onnx_builder import BOOL, FLOAT, INT64, GraphBuilder
from specrt.runtime.config import DecoderConfig


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


class _DecoderGraph:
    def __init__(self, module: DecoderLM, name: str):
        self.m = module
        self.cfg: DecoderConfig = module.cfg
        self.g = GraphBuilder(name)

    # ── small blocks ────────────────────────────────────────────────────────────────────────
    def linear(self, x: str, layer, name: str) -> str:
        g = self.g
        with g.scope(name):
            w = g.weight(f"{self._prefix}.{name}.weight", _np(layer.weight).T)
            y = g.op("MatMul", x, w)
            if layer.bias is not None:
                y = g.op("Add", y, g.weight(f"{self._prefix}.{name}.bias", _np(layer.bias)))
        return y

    def rms_norm(self, x: str, norm, name: str) -> str:
        g = self.g
        with g.scope(name):
            var = g.op("ReduceMean", g.op("Pow", x, g.const(2.0, np.float32)), g.const([-1]), keepdims=1)
            denom = g.op("Sqrt", g.op("Add", var, g.const(norm.eps, np.float32)))
            y = g.op("Div", x, denom)
            return g.op("Mul", y, g.weight(f"{self._prefix}.{name}.weight", _np(norm.weight)))

    def rope(self, x: str, cos: str, sin: str) -> str:
        g = self.g
        with g.scope("rope"):
            half = self.cfg.head_dim // 2
            x1, x2 = g.op("Split", x, g.const([half, half]), axis=-1, outputs=2)
            rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
            return g.op("Add", g.op("Mul", x, cos), g.op("Mul", rotated, sin))

    # ── shared tensors ──────────────────────────────────────────────────────────────────────
    def rope_tables(self, position_ids: str) -> tuple[str, str]:
        g, cfg = self.g, self.cfg
        with g.scope("rotary"):
            pos = g.op("Unsqueeze", g.op("Cast", position_ids, to=FLOAT), g.const([-1]))
            freqs = g.op("Mul", pos, g.weight("rotary.inv_freq", np.array(cfg.rope_inv_freq, np.float32)))
            emb = g.op("Concat", freqs, freqs, axis=-1)
            cos, sin = g.op("Cos", emb), g.op("Sin", emb)
            if cfg.rope_attention_scaling != 1.0:
                s = g.const(cfg.rope_attention_scaling, np.float32)
                cos, sin = g.op("Mul", cos, s), g.op("Mul", sin, s)
            return g.op("Unsqueeze", cos, g.const([1])), g.op("Unsqueeze", sin, g.const([1]))

    def mask(self, past_len: str, tree_mask: str, t: str, total: str) -> str:
        """Additive mask [B, 1, 1, T, L]; see modeling.attention_mask for the rule."""
        g = self.g
        with g.scope("mask"):
            j = g.op("Range", g.const(0), total, g.const(1))
            rel = g.op("Sub", g.op("Unsqueeze", j, g.const([0])), g.op("Unsqueeze", past_len, g.const([1])))
            in_new = g.op("And", g.op("GreaterOrEqual", rel, g.const(0)), g.op("Less", rel, t))
            idx = g.op("Clip", rel, g.const(0), g.op("Sub", t, g.const(1)))
            one = g.const([1])
            idx = g.op("Expand", g.op("Unsqueeze", idx, one),
                       g.op("Concat", one, g.op("Unsqueeze", t, g.const([0])), one, axis=0))
            seen = g.op("And", g.op("GatherElements", tree_mask, idx, axis=2), g.op("Unsqueeze", in_new, one))
            allowed = g.op("Or", g.op("Unsqueeze", g.op("Less", rel, g.const(0)), one), seen)
            add = g.op("Where", allowed, g.const(0.0, np.float32), g.const(MASK_VALUE, np.float32))
            return g.op("Unsqueeze", add, g.const([1, 2]))

    # ── attention and layers ────────────────────────────────────────────────────────────────
    def attention(self, i: int, h: str, cos: str, sin: str, mask: str, past_len: str, total_1d: str) -> str:
        g, cfg, attn = self.g, self.cfg, self.m.model.layers[i].self_attn
        nh, kvh, d, grp = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.kv_groups
        with g.scope("self_attn"):
            q = g.op("Reshape", self.linear(h, attn.q_proj, "q_proj"), g.const([0, 0, nh, d]))
            k = g.op("Reshape", self.linear(h, attn.k_proj, "k_proj"), g.const([0, 0, kvh, d]))
            v = g.op("Reshape", self.linear(h, attn.v_proj, "v_proj"), g.const([0, 0, kvh, d]))
            if cfg.qk_norm:
                q = self.rms_norm(q, attn.q_norm, "q_norm")
                k = self.rms_norm(k, attn.k_norm, "k_norm")
            q = self.rope(g.op("Transpose", q, perm=[0, 2, 1, 3]), cos, sin)
            k = self.rope(g.op("Transpose", k, perm=[0, 2, 1, 3]), cos, sin)
            v = g.op("Transpose", v, perm=[0, 2, 1, 3])
            present_k, present_v = f"present_key.{i}", f"present_value.{i}"
            g.op("TensorScatter", f"past_key.{i}", k, past_len, axis=2, name="k_scatter", out_names=[present_k])
            g.op("TensorScatter", f"past_value.{i}", v, past_len, axis=2, name="v_scatter", out_names=[present_v])
            zero, axis2 = g.const([0]), g.const([2])
            keys = g.op("Slice", present_k, zero, total_1d, axis2)
            values = g.op("Slice", present_v, zero, total_1d, axis2)
            qg = g.op("Reshape", q, g.const([0, kvh, -1, d]))
            scores = g.op("MatMul", qg, g.op("Transpose", keys, perm=[0, 1, 3, 2]))
            scores = g.op("Mul", scores, g.const(d**-0.5, np.float32))
            scores = g.op("Reshape", scores, g.op("Concat", g.const([0, kvh, grp, -1]), total_1d, axis=0))
            probs = g.op("Softmax", g.op("Add", scores, mask), axis=-1)
            probs = g.op("Reshape", probs, g.op("Concat", g.const([0, kvh, -1]), total_1d, axis=0))
            out = g.op("Reshape", g.op("MatMul", probs, values), g.const([0, nh, -1, d]))
            out = g.op("Reshape", g.op("Transpose", out, perm=[0, 2, 1, 3]), g.const([0, 0, nh * d]))
            return self.linear(out, attn.o_proj, "o_proj")

    def mlp(self, i: int, h: str) -> str:
        g, mlp = self.g, self.m.model.layers[i].mlp
        with g.scope("mlp"):
            gate = self.linear(h, mlp.gate_proj, "gate_proj")
            act = g.op("Mul", gate, g.op("Sigmoid", gate))
            return self.linear(g.op("Mul", act, self.linear(h, mlp.up_proj, "up_proj")), mlp.down_proj, "down_proj")

    def build(self, progress=None):
        g, cfg = self.g, self.cfg
        kv_shape = ["batch", cfg.num_kv_heads, "capacity", cfg.head_dim]
        input_ids = g.input("input_ids", INT64, ["batch", "tokens"])
        position_ids = g.input("position_ids", INT64, ["batch", "tokens"])
        past_len = g.input("past_len", INT64, ["batch"])
        tree_mask = g.input("tree_mask", BOOL, ["batch", "tokens", "tokens"])
        logits_index = g.input("logits_index", INT64, ["batch", "rows"])
        for i in range(cfg.num_layers):
            g.input(f"past_key.{i}", FLOAT, kv_shape)
            g.input(f"past_value.{i}", FLOAT, kv_shape)

        self._prefix = "model"
        with g.scope("model"):
            t = g.op("Squeeze", g.op("Slice", g.op("Shape", input_ids), g.const([1]), g.const([2])), g.const([0]))
            total = g.op("Add", g.op("ReduceMax", past_len, keepdims=0), t)
            total_1d = g.op("Unsqueeze", total, g.const([0]))
            cos, sin = self.rope_tables(position_ids)
            mask = self.mask(past_len, tree_mask, t, total)
            embed = g.weight("model.embed_tokens.weight", _np(self.m.model.embed_tokens.weight))
            x = g.op("Gather", embed, input_ids, name="embed_tokens")
            for i, layer in enumerate(self.m.model.layers):
                self._prefix = f"model.layers.{i}"
                with g.scope(f"layers.{i}"):
                    x = g.op("Add", x, self.attention(i, self.rms_norm(x, layer.input_layernorm, "input_layernorm"),
                                                      cos, sin, mask, past_len, total_1d))
                    x = g.op("Add", x, self.mlp(i, self.rms_norm(x, layer.post_attention_layernorm,
                                                                 "post_attention_layernorm")))
                if progress:
                    progress(1)
            self._prefix = "model"
            hidden = self.rms_norm(x, self.m.model.norm, "norm")
        with g.scope("lm_head"):
            idx = g.op("Expand", g.op("Unsqueeze", logits_index, g.const([-1])), g.const([1, 1, cfg.hidden_size]))
            rows = g.op("GatherElements", hidden, idx, axis=1)
            head = embed if cfg.tie_word_embeddings else g.weight("lm_head.weight", _np(self.m.lm_head.weight))
            flat = g.op("Reshape", rows, g.const([-1, cfg.hidden_size]))
            logits = g.op("Gemm", flat, head, transB=1)
            logits = g.op("Reshape", logits, g.op("Concat", g.op("Shape", logits_index), g.const([-1]), axis=0))
        g.output(logits, "logits", FLOAT, ["batch", "rows", cfg.vocab_size])
        g.output(hidden, "hidden_states", FLOAT, ["batch", "tokens", cfg.hidden_size])
        for i in range(cfg.num_layers):
            g.output(f"present_key.{i}", f"present_key.{i}", FLOAT, kv_shape)
            g.output(f"present_value.{i}", f"present_value.{i}", FLOAT, kv_shape)
        return g.model(doc=f"specrt decoder ({cfg.model_type}, {cfg.num_layers} layers)")


def build_decoder_graph(module: DecoderLM, name: str = "decoder", progress=None):
    """The decoder ONNX ModelProto (weights inline; save it with external data)."""
    return _DecoderGraph(module, name).build(progress)
