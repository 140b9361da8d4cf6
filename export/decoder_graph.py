"""Build the decoder ONNX graph (target or draft LM) from a `DecoderLM`'s weights.

One graph serves prefill, single-token decode and chain/tree verification (see modeling.py for
the contract). Per layer:

    x ─► RMSNormalization ─► qkv_proj (one GEMM, 1/√d folded into q) ─► (qk-norm) ─► RotaryEmbedding
                    k,v ─► TensorScatter(past_kv, at past_len) ═► present_kv (in place)
         q, present_kv, past_len, tree_mask ─► specrt::TreeAttention (ONNX local function)
    x += o_proj(attn);  x += down(silu(gate) * up), gate|up from one GEMM

Family maths (DecoderConfig): Gelu(tanh) for silu, the embedding times embed_scale after the Gather,
sandwich norms (x += norm(o_proj(attn)); x += norm(mlp(norm(x)))), query_pre_attn_scalar in the folded
q scale, TreeAttention's Softcapped variant, tanh-softcapped logits, one rotary table per RoPE table.

L = max(past_len) + T: attention reads only the valid prefix plus the new window. Query heads are
grouped per KV head ([B, kv_heads, groups*T, d]) so K/V are never repeated for GQA. Projections are
fused (q|k|v, gate|up) to cut the node count: on a 2-core CPU, per-node overhead is a visible
share of a decode step.
"""

from __future__ import annotations

import numpy as np

from specrt.export.modeling import DecoderLM
from specrt.plugins import tree_attention
from specrt.plugins.onnx_builder import BOOL, FLOAT, INT64, GraphBuilder
from specrt.schema.config import DecoderConfig

# DecoderConfig.activation -> its nodes on the gate
ACTIVATIONS = {"silu": lambda g, x: g.op("Mul", x, g.op("Sigmoid", x)),
               "gelu_tanh": lambda g, x: g.op("Gelu", x, approximate="tanh")}


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def _norm(module) -> tuple[np.ndarray, float]:
    return _np(module.weight), module.eps


class _DecoderGraph:
    def __init__(self, module: DecoderLM, name: str):
        self.m = module
        self.cfg: DecoderConfig = module.cfg
        self.g = GraphBuilder(name)

    # ── small blocks ────────────────────────────────────────────────────────────────────────
    def linear(self, x: str, layers: list, name: str, scale: np.ndarray | None = None) -> str:
        """x @ W (+ b) for one or several projections fused along the output axis (one GEMM).

        `scale` multiplies the output columns (folded into W and b at export).
        """
        g = self.g
        with g.scope(name):
            w = np.concatenate([_np(layer.weight) for layer in layers], axis=0)
            b = [_np(layer.bias) for layer in layers if layer.bias is not None]
            b = np.concatenate(b) if b else None
            if scale is not None:
                w = w * scale[:, None]
                b = b * scale if b is not None else None
            y = g.op("MatMul", x, g.weight(f"{self._prefix}.{name}.weight", w.T))
            if b is not None:
                y = g.op("Add", y, g.weight(f"{self._prefix}.{name}.bias", b))
        return y

    def rms_norm(self, x: str, weight: np.ndarray, eps: float, name: str) -> str:
        """RMSNorm over the last axis: one standard RMSNormalization (opset 23) node; a per-head weight
        of more than one row (qk-norm: [heads, 1, d]) multiplies a unit-scale norm."""
        g = self.g
        with g.scope(name):
            w = g.weight(f"{self._prefix}.{name}.weight", weight)
            if weight.ndim == 1:
                return g.op("RMSNormalization", x, w, axis=-1, epsilon=eps)
            unit = g.const(np.ones(weight.shape[-1]), np.float32)
            return g.op("Mul", g.op("RMSNormalization", x, unit, axis=-1, epsilon=eps), w)

    def rope(self, x: str, cos: str, sin: str) -> str:
        """Rotary embedding of x [B, heads, T, d] (halves rotated, not interleaved): one standard
        RotaryEmbedding (opset 23) node reading per-token cos/sin tables [B, T, d/2]."""
        with self.g.scope("rope"):
            return self.g.op("RotaryEmbedding", x, cos, sin)

    # ── shared tensors ──────────────────────────────────────────────────────────────────────
    def rope_tables(self, position_ids: str, layer: int = 0) -> tuple[str, str]:
        """cos, sin [B, T, d/2] at position_ids from layer `layer`'s RoPE table (table 0: `rotary`)."""
        g, cfg = self.g, self.cfg
        inv_freq, scaling = cfg.rope_table(layer)
        name = "rotary" if cfg.rope_index(layer) == 0 else "rotary_local"
        with g.scope(name):
            pos = g.op("Unsqueeze", g.op("Cast", position_ids, to=FLOAT), g.const([-1]))
            freqs = g.op("Mul", pos, g.weight(f"{name}.inv_freq", np.array(inv_freq, np.float32)))
            cos, sin = g.op("Cos", freqs), g.op("Sin", freqs)  # [B, T, d/2]
            if scaling != 1.0:
                s = g.const(scaling, np.float32)
                cos, sin = g.op("Mul", cos, s), g.op("Mul", sin, s)
            return cos, sin

    def softcap(self, x: str, cap: float) -> str:
        """cap * tanh(x / cap); x itself when cap is 0."""
        if not cap:
            return x
        c = self.g.const(cap, np.float32)
        return self.g.op("Mul", self.g.op("Tanh", self.g.op("Div", x, c)), c)

    # ── attention and layers ────────────────────────────────────────────────────────────────
    def attention(self, attn, i: int, h: str, cos: str, sin: str, past_len: str, tree_mask: str) -> str:
        """Self-attention of module `attn` over KV buffers past_key.i / past_value.i."""
        g, cfg = self.g, self.cfg
        nh, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        scale = cfg.attn_scale  # folded into the q projection (or into q_norm's weight when there is one)
        with g.scope("self_attn"):
            col_scale = None if cfg.qk_norm else np.r_[np.full(nh * d, scale), np.ones(2 * kvh * d)].astype(np.float32)
            qkv = self.linear(h, [attn.q_proj, attn.k_proj, attn.v_proj], "qkv_proj", col_scale)
            qkv = g.op("Transpose", g.op("Reshape", qkv, g.const([0, 0, nh + 2 * kvh, d])), perm=[0, 2, 1, 3])
            qk, v = g.op("Split", qkv, g.const([nh + kvh, kvh]), axis=1, outputs=2)
            if cfg.qk_norm:  # per-head RMSNorm, q heads then k heads: weights stacked [nh+kvh, 1, d]
                w = np.concatenate([np.tile(_np(attn.q_norm.weight) * scale, (nh, 1)),
                                    np.tile(_np(attn.k_norm.weight), (kvh, 1))])[:, None, :]
                qk = self.rms_norm(qk, w, attn.q_norm.eps, "qk_norm")
            q, k = g.op("Split", self.rope(qk, cos, sin), g.const([nh, kvh]), axis=1, outputs=2)
            present_k, present_v = f"present_key.{i}", f"present_value.{i}"
            g.op("TensorScatter", f"past_key.{i}", k, past_len, axis=2, name="k_scatter", out_names=[present_k])
            g.op("TensorScatter", f"past_value.{i}", v, past_len, axis=2, name="v_scatter", out_names=[present_v])
            window = cfg.window(i)  # a sliding-window layer calls TreeAttentionWindowed
            cap = cfg.attn_logit_softcapping  # and a softcapped one a ...Softcapped variant
            extra = {**({"window": window} if window else {}), **({"softcap": float(cap)} if cap else {})}
            out = g.call(tree_attention.function(windowed=bool(window), softcapped=bool(cap)), q, present_k,
                         present_v, past_len, tree_mask, num_heads=nh, num_kv_heads=kvh, head_dim=d,
                         **tree_attention.PLUGIN_ATTRS, **extra)
            out = g.op("Reshape", g.op("Transpose", out, perm=[0, 2, 1, 3]), g.const([0, 0, nh * d]))
            return self.linear(out, [attn.o_proj], "o_proj")

    def mlp(self, mlp, h: str) -> str:
        g = self.g
        with g.scope("mlp"):
            inter = self.cfg.intermediate_size
            gate, up = g.op("Split", self.linear(h, [mlp.gate_proj, mlp.up_proj], "gate_up_proj"),
                            g.const([inter, inter]), axis=-1, outputs=2)
            act = ACTIVATIONS[self.cfg.activation](g, gate)
            return self.linear(g.op("Mul", act, up), [mlp.down_proj], "down_proj")

    def layer(self, layer, i: int, x: str, cos: str, sin: str, past_len: str, tree_mask: str) -> str:
        h = self.rms_norm(x, *_norm(layer.input_layernorm), "input_layernorm")
        attn = self.attention(layer.self_attn, i, h, cos, sin, past_len, tree_mask)
        if self.cfg.sandwich_norms:  # Gemma-2/3: norms on the attention output and around the MLP
            x = self.g.op("Add", x, self.rms_norm(attn, *_norm(layer.post_attention_layernorm), "post_attention_layernorm"))
            h = self.rms_norm(x, *_norm(layer.pre_feedforward_layernorm), "pre_feedforward_layernorm")
            out = self.rms_norm(self.mlp(layer.mlp, h), *_norm(layer.post_feedforward_layernorm),
                                "post_feedforward_layernorm")
            return self.g.op("Add", x, out)
        x = self.g.op("Add", x, attn)
        h = self.rms_norm(x, *_norm(layer.post_attention_layernorm), "post_attention_layernorm")
        return self.g.op("Add", x, self.mlp(layer.mlp, h))

    def inputs(self, num_layers: int) -> tuple[str, ...]:
        """The contract's inputs: input_ids, position_ids, past_len, tree_mask, logits_index, KV."""
        g = self.g
        input_ids = g.input("input_ids", INT64, ["batch", "tokens"])
        position_ids = g.input("position_ids", INT64, ["batch", "tokens"])
        past_len = g.input("past_len", INT64, ["batch"])
        tree_mask = g.input("tree_mask", BOOL, ["batch", "tokens", "tokens"])
        logits_index = g.input("logits_index", INT64, ["batch", "rows"])
        for i in range(num_layers):
            g.input(f"past_key.{i}", FLOAT, self.kv_shape)
            g.input(f"past_value.{i}", FLOAT, self.kv_shape)
        return input_ids, position_ids, past_len, tree_mask, logits_index

    @property
    def kv_shape(self) -> list:
        return ["batch", self.cfg.num_kv_heads, "capacity", self.cfg.head_dim]

    def lm_head(self, hidden: str, logits_index: str, head: str, vocab: int, softcap: float = 0.0) -> None:
        """Logits of the rows `logits_index` asks for, as graph output `logits` (`softcap`: tanh-capped)."""
        g, cfg = self.g, self.cfg
        with g.scope("lm_head"):
            idx = g.op("Expand", g.op("Unsqueeze", logits_index, g.const([-1])), g.const([1, 1, cfg.hidden_size]))
            rows = g.op("GatherElements", hidden, idx, axis=1)
            flat = g.op("Reshape", rows, g.const([-1, cfg.hidden_size]))
            logits = g.op("Gemm", flat, head, transB=1)
            logits = g.op("Reshape", logits, g.op("Concat", g.op("Shape", logits_index), g.const([-1]), axis=0))
            logits = self.softcap(logits, softcap)
        g.output(logits, "logits", FLOAT, ["batch", "rows", vocab])

    def kv_outputs(self, num_layers: int) -> None:
        for i in range(num_layers):
            for kind in ("key", "value"):
                self.g.output(f"present_{kind}.{i}", f"present_{kind}.{i}", FLOAT, self.kv_shape)

    def build(self, progress=None, taps: tuple[int, ...] = ()):
        g, cfg = self.g, self.cfg
        input_ids, position_ids, past_len, tree_mask, logits_index = self.inputs(cfg.num_layers)

        self._prefix = "model"
        with g.scope("model"):
            first = {cfg.rope_index(i): i for i in reversed(range(cfg.num_layers))}  # a layer per RoPE table
            ropes = {table: self.rope_tables(position_ids, i) for table, i in sorted(first.items())}
            embed = g.weight("model.embed_tokens.weight", _np(self.m.model.embed_tokens.weight))
            x = g.op("Gather", embed, input_ids, name="embed_tokens")
            if cfg.embed_scale != 1.0:  # Gemma: sqrt(hidden) as a float32 scalar, after the lookup
                x = g.op("Mul", x, g.const(cfg.embed_scale, np.float32), name="embed_scale")
            captured = []
            for i, layer in enumerate(self.m.model.layers):
                if i in taps:
                    captured.append(x)
                self._prefix = f"model.layers.{i}"
                with g.scope(f"layers.{i}"):
                    x = self.layer(layer, i, x, *ropes[cfg.rope_index(i)], past_len, tree_mask)
                if progress:
                    progress(1)
            self._prefix = "model"
            hidden = self.rms_norm(x, *_norm(self.m.model.norm), "norm")
        head = embed if cfg.tie_word_embeddings else g.weight("lm_head.weight", _np(self.m.lm_head.weight))
        self.lm_head(hidden, logits_index, head, cfg.vocab_size, cfg.final_logit_softcapping)
        g.output(hidden, "hidden_states", FLOAT, ["batch", "tokens", cfg.hidden_size])
        if taps:  # inputs of the tapped layers (EAGLE-3's low / middle / high features)
            aux = g.op("Concat", *captured, axis=-1, name="aux_hidden_states")
            g.output(aux, "aux_hidden_states", FLOAT, ["batch", "tokens", len(taps) * cfg.hidden_size])
        self.kv_outputs(cfg.num_layers)
        return g.model(doc=f"specrt decoder ({cfg.model_type}, {cfg.num_layers} layers)")


def build_decoder_graph(module: DecoderLM, name: str = "decoder", progress=None, taps: tuple[int, ...] = ()):
    """The decoder ONNX ModelProto (weights inline; save it with external data). `taps`: layers whose
    inputs are also output, concatenated, as `aux_hidden_states`."""
    return _DecoderGraph(module, name).build(progress, taps)
