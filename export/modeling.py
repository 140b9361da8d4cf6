"""A compact decoder-only LM (Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma 1-3) with specrt's graph contract.

Sliding-window layers (cfg.layer_windows) hide keys W or more positions behind the query. The family's
maths is data on the config: activation, embedding scale, sandwich norms (Gemma-2/3), the q·k scale,
tanh softcapping of scores and logits, a RoPE table per layer (Gemma-3).

Parameter names mirror Hugging Face's, so a `transformers` state dict loads as is. The forward
pass is the contract every exported graph follows:

    inputs : input_ids [B,T], position_ids [B,T], past_len [B], tree_mask [B,T,T] (bool),
             kv: per layer (k, v), each [B, kv_heads, S, head_dim], preallocated
    effect : new K/V rows are written into kv at past_len .. past_len+T-1 (in place)
    outputs: logits [B,R,V] for the rows in logits_index [B,R] (all rows if None),
             hidden_states [B,T,H] (last layer, after the final norm)

Token t of the new window sees every cached row < past_len and the new rows u with
tree_mask[t, u]; a causal lower triangle is plain prefill / chain verification.
"""

from __future__ import annotations

import torch
from torch import nn

from specrt.plugins.tree_attention import MASK_VALUE
from specrt.schema.config import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(cfg: DecoderConfig, position_ids: torch.Tensor, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, 1, T, head_dim] for the given positions, from layer `layer`'s RoPE table."""
    table, s = cfg.rope_table(layer)
    inv_freq = torch.tensor(table, dtype=torch.float32)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * s)[:, None], (emb.sin() * s)[:, None]


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma-2's score and logit softcapping); x itself when cap is 0."""
    return torch.tanh(x / cap) * cap if cap else x


def attention_mask(past_len: torch.Tensor, tree_mask: torch.Tensor, total: int, window: int = 0) -> torch.Tensor:
    """Additive mask [B, 1, T, L] over the first L = total cache rows.

    Row t may see column j if j < past_len (the committed prefix) or if j = past_len + u is a new
    token with tree_mask[t, u]; with a sliding `window` W > 0, only if also query position - key
    position < W (transformers' sliding-window rule), where row t is at past_len + depth(t) - 1
    (depth: its count of tree_mask entries) and committed row j at j.
    """
    _, t, _ = tree_mask.shape
    j = torch.arange(total)[None, :]  # [1, L]
    rel = j - past_len[:, None]  # [B, L]: index into the new window
    in_new = (rel >= 0) & (rel < t)
    idx = rel.clamp(0, t - 1)[:, None, :].expand(-1, t, -1)  # [B, T, L]
    seen_new = torch.gather(tree_mask, 2, idx) & in_new[:, None, :]
    allowed = (rel < 0)[:, None, :] | seen_new
    if window:
        depth = tree_mask.sum(-1)  # [B, T]
        start = past_len[:, None] - 1
        key_pos = torch.where(in_new, start + torch.gather(depth, 1, rel.clamp(0, t - 1)), j)  # [B, L]
        allowed &= ((start + depth)[:, :, None] - key_pos[:, None, :]) < window
    return torch.where(allowed, 0.0, MASK_VALUE)[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, in_features: int | None = None):
        super().__init__()
        h, d = in_features or cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def project(self, x, cos, sin):
        """q [B, heads, T, d] and k, v [B, kv_heads, T, d], RoPE applied (q unscaled)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, q, keys, values, mask):
        """softmax(q·k/√d + mask)·v then o_proj; keys/values [B, kv_heads, L, d], mask [B, 1, T, L]."""
        cfg = self.cfg
        b, _, t, _ = q.shape
        total = keys.shape[2]
        # GQA without repeating K/V: group the query heads of each KV head together.
        g = cfg.kv_groups
        qg = q.reshape(b, cfg.num_kv_heads, g * t, cfg.head_dim)
        scores = softcap((qg @ keys.transpose(-1, -2)) * cfg.attn_scale, cfg.attn_logit_softcapping)
        scores = scores.view(b, cfg.num_kv_heads, g, t, total) + mask[:, :, None]
        probs = scores.softmax(-1).view(b, cfg.num_kv_heads, g * t, total)
        out = (probs @ values).view(b, cfg.num_heads, t, cfg.head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, cos, sin, mask, k_cache, v_cache, past_len):
        q, k, v = self.project(x, cos, sin)
        t = x.shape[1]
        if t == 1:  # one new row per sequence (batched decoding): one indexed write per buffer
            rows = torch.arange(x.shape[0])
            k_cache[rows, :, past_len] = k[:, :, 0]
            v_cache[rows, :, past_len] = v[:, :, 0]
        else:
            for i in range(x.shape[0]):  # write the new rows in place (ONNX: TensorScatter)
                p = int(past_len[i])
                k_cache[i, :, p : p + t] = k[i]
                v_cache[i, :, p : p + t] = v[i]
        total = mask.shape[-1]
        return self.attend(q, k_cache[:, :, :total], v_cache[:, :, :total], mask)


# DecoderConfig.activation -> the gated MLP's activation
ACTIVATION_FNS = {"silu": nn.functional.silu,
                  "gelu_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.act = ACTIVATION_FNS[cfg.activation]
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block; with cfg.sandwich_norms (Gemma-2/3) post_attention_layernorm normalizes the
    attention output and pre_/post_feedforward_layernorm wrap the MLP."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, k_cache, v_cache, past_len):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, k_cache, v_cache, past_len)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_kv(self, batch: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (batch, self.cfg.num_kv_heads, capacity, self.cfg.head_dim)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(self.cfg.num_layers)]

    @torch.no_grad()
    def forward(self, input_ids, position_ids, past_len, tree_mask, kv, logits_index=None, taps=()):
        """(logits, hidden_states) — plus the inputs of the layers in `taps`, concatenated on the
        feature axis, when `taps` is given (EAGLE-3's low/middle/high features)."""
        hidden, captured = self.hidden_states(input_ids, position_ids, past_len, tree_mask, kv, taps)
        rows = hidden if logits_index is None else torch.gather(
            hidden, 1, logits_index[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = self.logits(rows)
        if taps:
            return logits, hidden, torch.cat(captured, -1)
        return logits, hidden

    def logits(self, rows: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head over `rows` [.., H], softcapped as the family does; `weight`: some of the head's
        rows instead of all (training's label vocabulary: the same logits, restricted). The head is
        called as a module otherwise (a dynamic-int8 copy swaps it for its quantized Linear)."""
        logits = self.lm_head(rows) if weight is None else nn.functional.linear(rows, weight)
        return softcap(logits, self.cfg.final_logit_softcapping)

    def hidden_states(self, input_ids, position_ids, past_len, tree_mask, kv,
                      taps=()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward`'s body up to the final norm, with gradients allowed (training runs exactly what is
        exported): (hidden_states [B,T,H], the inputs of the layers in `taps`). Writes K/V into kv."""
        cfg = self.cfg
        x = self.model.embed_tokens(input_ids)
        if cfg.embed_scale != 1.0:  # Gemma: times sqrt(hidden), as a float32 scalar (transformers' cast)
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        layers = range(cfg.num_layers)
        first = {cfg.rope_index(i): i for i in reversed(layers)}  # a layer per RoPE table
        ropes = {table: rope_cos_sin(cfg, position_ids, i) for table, i in first.items()}
        total = int(past_len.max()) + input_ids.shape[1]
        masks = {w: attention_mask(past_len, tree_mask, total, w) for w in {cfg.window(i) for i in layers}}
        captured = []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv, strict=True)):
            if i in taps:
                captured.append(x)
            x = layer(x, *ropes[cfg.rope_index(i)], masks[cfg.window(i)], k_cache, v_cache, past_len)
        return self.model.norm(x), captured
