"""A compact decoder-only LM (Llama / Mistral / Qwen2 / Qwen3) with specrt's graph contract.

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


def rope_cos_sin(cfg: DecoderConfig, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, 1, T, head_dim] for the given positions."""
    inv_freq = torch.tensor(cfg.rope_inv_freq, dtype=torch.float32)
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    s = cfg.rope_attention_scaling
    return (emb.cos() * s)[:, None], (emb.sin() * s)[:, None]


def attention_mask(past_len: torch.Tensor, tree_mask: torch.Tensor, total: int) -> torch.Tensor:
    """Additive mask [B, 1, T, L] over the first L = total cache rows.

    Row t may see column j if j < past_len (the committed prefix) or if j = past_len + u is a new
    token with tree_mask[t, u].
    """
    _, t, _ = tree_mask.shape
    j = torch.arange(total)[None, :]  # [1, L]
    rel = j - past_len[:, None]  # [B, L]: index into the new window
    in_new = (rel >= 0) & (rel < t)
    idx = rel.clamp(0, t - 1)[:, None, :].expand(-1, t, -1)  # [B, T, L]
    seen_new = torch.gather(tree_mask, 2, idx) & in_new[:, None, :]
    allowed = (rel < 0)[:, None, :] | seen_new
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
        scores = (qg @ keys.transpose(-1, -2)) * cfg.head_dim**-0.5
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


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, k_cache, v_cache, past_len):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, k_cache, v_cache, past_len)
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
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(self.cfg, position_ids)
        total = int(past_len.max()) + input_ids.shape[1]
        mask = attention_mask(past_len, tree_mask, total)
        captured = []
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv, strict=True)):
            if i in taps:
                captured.append(x)
            x = layer(x, cos, sin, mask, k_cache, v_cache, past_len)
        hidden = self.model.norm(x)
        rows = hidden if logits_index is None else torch.gather(
            hidden, 1, logits_index[..., None].expand(-1, -1, hidden.shape[-1]))
        if taps:
            return self.lm_head(rows), hidden, torch.cat(captured, -1)
        return self.lm_head(rows), hidden
