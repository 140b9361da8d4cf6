"""What every learned drafter module shares: config I/O, frozen target weights, one decoder layer.

A *feature drafter* (EAGLE, EAGLE-3, MTP) runs one decoder layer over rows r = 0, 1, ...; row r
takes the token x[r+1] and a hidden vector (the target's, or the drafter's own from an earlier
step) and predicts x[r+2]:

    mix(x[r+1], hidden[r]) ─► (attention input, residual) ─► layer ─► out[r] ─► head ─► logits[r]

Only `mix` and `head` differ between kinds (in the graph: `graph_mix`, `graph_head_norm`).
Inference writes K/V rows into a cache like the target (`step`); training attends over explicit
key sets with any boolean mask (`layer_train`), which is how multi-step "training-time test"
unrolling is expressed.

The layer is the drafter's own architecture, not the target's (`one_layer`): a plain pre-norm SwiGLU
layer with full attention over the target's dims, biases, qk-norm, eps and global RoPE table, whatever
the target's family (no windows, sandwich norms, softcaps, query scalar, local RoPE, embedding scale).
The module, its training passes and its ONNX graph (export/drafters/graphs.py) all compute that layer;
the graph writer refuses a layer config that carries family maths (`check_plain`).
"""

from __future__ import annotations

from dataclasses import MISSING, fields, replace

import torch
from torch import nn

from specrt.errors import SpecrtError
from specrt.export.modeling import DecoderLayer, attention_mask, rope_cos_sin
from specrt.plugins.tree_attention import MASK_VALUE
from specrt.schema.config import DecoderConfig

SHARED = ("embed_tokens.weight", "lm_head.weight")  # copied from the target; never saved with a drafter


class FrozenTargetWeights(nn.Module):
    """Holds the target's embedding and LM head (frozen) for a drafter that shares them."""

    shares_head = False
    # the draft vocabulary (sorted target ids) the exported head computes; None: the whole vocabulary
    head_vocab: torch.Tensor | None = None

    def set_head_vocab(self, ids) -> None:
        """Export only these target ids' rows of the LM head (`head_rows`): the graph's logits cover the draft
        vocabulary and the runtime maps a draft id back through `vocab_ids.npy`. The target verifies every
        token, so a smaller head changes what is proposed, never what is output."""
        self.head_vocab = None if ids is None else torch.as_tensor(ids, dtype=torch.long)

    def head_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """`weight` [V, H]'s rows of the draft vocabulary."""
        return weight if self.head_vocab is None else weight[self.head_vocab]

    def attach_target(self, embed: torch.Tensor, lm_head: torch.Tensor | None) -> None:
        self.shares_head = lm_head is not None
        self.embed_tokens = nn.Embedding.from_pretrained(embed.detach().float().clone(), freeze=True)
        if lm_head is not None:
            self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
            self.lm_head.weight = nn.Parameter(lm_head.detach().float().clone(), requires_grad=False)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint stores (everything but the shared target weights)."""
        shared = SHARED if self.shares_head else SHARED[:1]
        return {k: v for k, v in self.state_dict().items() if k not in shared}


class FeatureDrafter(FrozenTargetWeights):
    """Base of EAGLE / EAGLE-3 / MTP modules: `layer` is a `DecoderLayer`-shaped module."""

    dec: DecoderConfig
    layer: DecoderLayer

    def mix(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def head_input(self, out: torch.Tensor) -> torch.Tensor:
        """What the LM head reads (the layer output, or its norm)."""
        return out

    def graph_mix(self, fg, input_ids: str, hidden: str) -> tuple[str, str]:
        """`mix` as ONNX nodes: `fg` is the feature graph being built (export/drafters/graphs.py), the
        arguments and results the names of its values."""
        raise NotImplementedError

    def graph_head_norm(self) -> nn.Module | None:
        """The norm `head_input` applies (None: the head reads the layer output), for the graph."""
        return None

    def head(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (`head_rows`), as the graph computes them."""
        return nn.functional.linear(self.head_input(out), self.head_rows(self.lm_head.weight))

    def _finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        x = residual + attn_out
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    @torch.no_grad()
    def step(self, input_ids, hidden, position_ids, past_len, tree_mask, kv):
        """Inference with a KV cache (the ONNX graph's semantics): (logits [B,T,V'], out [B,T,H])."""
        x_attn, residual = self.mix(input_ids, hidden)
        cos, sin = rope_cos_sin(self.dec, position_ids)
        mask = attention_mask(past_len, tree_mask, int(past_len.max()) + input_ids.shape[1])
        k_cache, v_cache = kv
        out = self._finish(residual, self.layer.self_attn(x_attn, cos, sin, mask, k_cache, v_cache, past_len))
        return self.head(out), out

    def layer_train(self, input_ids, hidden, cos, sin, past: list, mask: torch.Tensor):
        """One layer pass for training. Queries attend over cat(past keys, own keys) where the boolean
        `mask` [T, L] allows; returns (out [B,T,H], (k, v)) so later steps can attend to these rows."""
        x_attn, residual = self.mix(input_ids, hidden)
        attn = self.layer.self_attn
        q, k, v = attn.project(x_attn, cos, sin)
        keys = torch.cat([*(p[0] for p in past), k], 2)
        values = torch.cat([*(p[1] for p in past), v], 2)
        additive = torch.where(mask, 0.0, MASK_VALUE).to(q.dtype)[None, None]
        return self._finish(residual, attn.attend(q, keys, values, additive)), (k, v)

    def new_kv(self, batch: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, self.dec.num_kv_heads, capacity, self.dec.head_dim)
        return torch.zeros(shape), torch.zeros(shape)


# DecoderConfig fields a drafter's layer takes from the target (dims, biases, qk-norm, eps, the global
# RoPE table, labels) and the family maths it resets to the defaults (Llama's); every field is in one
# (tests/export/test_drafters_every_family.py)
KEPT_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "rms_norm_eps", "rope_inv_freq", "rope_attention_scaling",
               "tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "qk_norm", "max_position_embeddings",
               "eos_token_ids")
FAMILY_FIELDS = ("layer_windows", "activation", "embed_scale", "sandwich_norms", "query_pre_attn_scalar",
                 "attn_logit_softcapping", "final_logit_softcapping", "layer_rope", "local_rope_inv_freq",
                 "local_rope_attention_scaling")


def default_taps(num_layers: int) -> list[int]:
    """The target layers whose inputs fused-feature drafters (EAGLE-3, block) read, and the distillation
    data records, by default: EAGLE-3's low / middle / high choice, inputs of layers 2, L/2 and L-3."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


def _defaults() -> dict:
    by_name = {f.name: f for f in fields(DecoderConfig)}
    return {n: by_name[n].default_factory() if by_name[n].default is MISSING else by_name[n].default
            for n in FAMILY_FIELDS}


def one_layer(dec: DecoderConfig) -> DecoderConfig:
    """The config of a drafter's one layer for target settings `dec`: one plain pre-norm SwiGLU layer
    with full attention, head_dim**-0.5 scores and the target's global RoPE table (FAMILY_FIELDS reset)."""
    return replace(dec, num_layers=1, **_defaults())


def check_plain(dec: DecoderConfig, what: str) -> None:
    """Refuse a drafter layer config with family maths the drafter graph writers do not compute."""
    carried = [f"{n} = {getattr(dec, n)!r}" for n, v in _defaults().items() if getattr(dec, n) != v]
    if carried or dec.num_layers != 1:
        raise SpecrtError(f"{what}: a drafter layer is a plain one-layer config, but this one has "
                          f"{', '.join(carried) or f'num_layers = {dec.num_layers}'}: build it with "
                          "export.drafters.base.one_layer(target config)")


def plain_layer_state(layer: DecoderLayer) -> dict[str, torch.Tensor]:
    """A target layer's weights as a drafter's plain layer takes them (warm starts): with sandwich norms
    (Gemma-2/3) the norm before the MLP is pre_feedforward_layernorm; the output norms have no place."""
    state = layer.state_dict()
    if not layer.sandwich:
        return state
    dropped = ("post_attention_layernorm.", "post_feedforward_layernorm.")
    return {k.replace("pre_feedforward_layernorm.", "post_attention_layernorm."): v
            for k, v in state.items() if not k.startswith(dropped)}
