"""Decoder families as data: what differs between Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 1/2/3.

Everything downstream (torch module, ONNX builder) reads an `ArchSpec`; adding a family is one
registry entry, never an if/elif on `model_type`. Each entry says only what transformers' own
modeling file for that family reads from its config (a field the family's model ignores, we ignore).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specrt.errors import SpecrtError


def no_windows(hf_config) -> tuple[int | None, ...]:
    """Every layer attends to the whole prefix (Llama: transformers never reads `sliding_window`)."""
    return (None,) * hf_config.num_hidden_layers


def every_layer_window(hf_config) -> tuple[int | None, ...]:
    """Mistral: `sliding_window` (None: none) applies to every layer."""
    return (getattr(hf_config, "sliding_window", None),) * hf_config.num_hidden_layers


def layer_type_windows(hf_config) -> tuple[int | None, ...]:
    """Qwen2 / Qwen3 / Gemma-2 / Gemma-3: `sliding_window` (Qwen: None unless `use_sliding_window`) on the
    layers whose `layer_types` entry is "sliding_attention" (by default Qwen's at index >= `max_window_layers`,
    Gemma-2's every other one, Gemma-3's five of every six)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in types)


@dataclass(frozen=True)
class FusedWeight:
    """A checkpoint tensor that holds several of our projections stacked on the output axis (Phi-3)."""

    name: str  # suffix in the checkpoint, e.g. "self_attn.qkv_proj.weight"
    parts: tuple[str, ...]  # our parameter suffixes, in stacking order
    sizes: Callable  # DecoderConfig -> rows of each part


QKV = FusedWeight("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                "self_attn.v_proj.weight"),
                  lambda c: (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim))
GATE_UP = FusedWeight("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                      lambda c: (c.intermediate_size, c.intermediate_size))


# transformers' activation name (ACT2FN) -> ours (specrt.schema.config.ACTIVATIONS)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool | None = None  # None: read config.attention_bias
    o_bias: bool | None = None  # None: read config.attention_bias
    mlp_bias: bool | None = False  # None: read config.mlp_bias
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    # the attention window of each layer as transformers' model applies it (None: the whole prefix)
    layer_windows: Callable = field(default=no_windows)
    fused_weights: tuple[FusedWeight, ...] = ()  # split into our projections at load
    activation_field: str = "hidden_act"  # the config field naming the MLP's activation
    norm_offset: float = 0.0  # every RMSNorm multiplies by (offset + weight): Gemma's 1 + w, folded at load
    scaled_embeddings: bool = False  # embeddings times sqrt(hidden_size) after the lookup (Gemma)
    sandwich_norms: bool = False  # Gemma-2/3: normed attention output; pre_/post_feedforward_layernorm
    # config fields the family's model reads (None: it reads none): q·k scale base, tanh softcaps
    query_scale_field: str | None = None  # scores times field**-0.5 instead of head_dim**-0.5
    attn_softcap_field: str | None = None  # scores -> c * tanh(scores / c) before the mask
    final_softcap_field: str | None = None  # logits -> c * tanh(logits / c)
    # rope_parameters is keyed by layer type (Gemma-3: "sliding_attention" local, "full_attention" global)
    rope_per_layer_type: bool = False


# Gemma 1: (1 + w) norms, sqrt(hidden) embedding scale, gelu-tanh; Gemma-2/3 add sandwich norms and
# query_pre_attn_scalar; Gemma-2 softcaps scores and logits, Gemma-3 logits only (its attention never
# reads attn_logit_softcapping), with qk-norm and a RoPE table per layer type
GEMMA = dict(qkv_bias=None, o_bias=None, norm_offset=1.0, scaled_embeddings=True)
GEMMA_2_3 = dict(GEMMA, activation_field="hidden_activation", sandwich_norms=True, layer_windows=layer_type_windows,
                 query_scale_field="query_pre_attn_scalar", final_softcap_field="final_logit_softcapping")


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(mlp_bias=None),
    "mistral": ArchSpec(qkv_bias=False, o_bias=False, layer_windows=every_layer_window),
    "qwen2": ArchSpec(qkv_bias=True, o_bias=False, layer_windows=layer_type_windows),
    "qwen3": ArchSpec(qk_norm=True, layer_windows=layer_type_windows),
    "phi3": ArchSpec(qkv_bias=False, o_bias=False, layer_windows=every_layer_window, fused_weights=(QKV, GATE_UP)),
    "gemma": ArchSpec(**GEMMA),
    "gemma2": ArchSpec(**GEMMA_2_3, attn_softcap_field="attn_logit_softcapping"),
    "gemma3_text": ArchSpec(**GEMMA_2_3, qk_norm=True, rope_per_layer_type=True),
}


def arch_for(model_type: str) -> ArchSpec:
    try:
        return ARCHS[model_type]
    except KeyError:
        raise SpecrtError(
            f"model_type {model_type!r} is not supported; supported decoder families: "
            f"{', '.join(sorted(ARCHS))}"
        ) from None
