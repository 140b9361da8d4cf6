"""Load a Hugging Face folder or a GGUF file into the compact `DecoderLM`.

`transformers` (with `gguf` for .gguf files) reads and dequantizes the weights; we keep only its
state dict and config, so no Hugging Face model file is forked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specrt.errors import SpecrtError
from specrt.export.archs import ACTIVATIONS, ArchSpec, arch_for
from specrt.export.config_rules import (
    ROPE_LAYER_TYPES,
    activation,
    check_config,
    effective_windows,
    rope_params,
    rope_type,
)
from specrt.export.modeling import DecoderLM
from specrt.export.safetensors_file import check_folder
from specrt.export.source_checks import check_tokenizer, split_source
from specrt.schema.config import DecoderConfig


@dataclass
class LoadedModel:
    """Our module plus what the bundle needs from the source: tokenizer and a description."""

    module: DecoderLM
    tokenizer: Any  # a transformers tokenizer, saved into the bundle
    source: str
    hf_config: Any
    hf_model: Any = None  # the transformers model, kept for parity checks; drop it when done


def rope_tables(hf_config, layer_type: str | None = None) -> tuple[list[float], float]:
    """Inverse frequencies and cos/sin scaling for the config's RoPE type (static types only); those of
    `layer_type` where the parameters are keyed by layer type (Gemma-3)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params, kind = rope_params(hf_config, layer_type), rope_type(hf_config, layer_type)
    if kind == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(dim * getattr(hf_config, "partial_rotary_factor", 1.0))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return inv.tolist(), 1.0
    if kind not in ROPE_INIT_FUNCTIONS:
        raise SpecrtError(f"rope_type {kind!r} is not supported")
    layer_kw = {"layer_type": layer_type} if layer_type is not None else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu", **layer_kw)
    return inv.float().tolist(), float(scaling)


def layer_ropes(hf_config, spec: ArchSpec) -> dict:
    """The DecoderConfig fields of a family with a RoPE table per layer type (Gemma-3's local and global
    tables, `layer_rope` choosing per layer); {} for one table."""
    if not spec.rope_per_layer_type:
        return {}
    index = [ROPE_LAYER_TYPES[kind] for kind in hf_config.layer_types]
    inv, scaling = rope_tables(hf_config, "sliding_attention") if any(index) else ([], 1.0)
    return dict(layer_rope=tuple(index) if any(index) else (), local_rope_inv_freq=tuple(inv),
                local_rope_attention_scaling=scaling)


def family_maths(hf_config, spec: ArchSpec) -> dict:
    """The DecoderConfig fields the family's registry entry reads from the config (export/archs.py)."""
    def field(name: str | None) -> float:
        return float(getattr(hf_config, name, None) or 0.0) if name else 0.0

    return dict(activation=ACTIVATIONS[activation(hf_config, spec)],
                embed_scale=hf_config.hidden_size**0.5 if spec.scaled_embeddings else 1.0,
                sandwich_norms=spec.sandwich_norms, query_pre_attn_scalar=field(spec.query_scale_field),
                attn_logit_softcapping=field(spec.attn_softcap_field),
                final_logit_softcapping=field(spec.final_softcap_field), **layer_ropes(hf_config, spec))


def _eos_ids(hf_config, generation_config, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (generation_config, hf_config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if e is not None and e not in ids:
                ids.append(int(e))
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None and tok_eos not in ids:
        ids.append(int(tok_eos))
    return tuple(ids)


def decoder_config(hf_config, eos_token_ids: tuple[int, ...] = ()) -> DecoderConfig:
    """Translate a transformers config into our `DecoderConfig` (the arch registry fills gaps); a value
    specrt would not compute as transformers does is refused (export/config_rules.py)."""
    spec = check_config(hf_config)
    attn_bias = bool(getattr(hf_config, "attention_bias", False))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    inv_freq, scaling = rope_tables(hf_config, "full_attention" if spec.rope_per_layer_type else None)
    if len(inv_freq) * 2 != head_dim:
        raise SpecrtError(f"partial rotary embeddings (rotary dim {len(inv_freq) * 2} < head_dim {head_dim}) are not supported")
    return DecoderConfig(
        model_type=hf_config.model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_inv_freq=tuple(inv_freq),
        rope_attention_scaling=scaling,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=attn_bias if spec.qkv_bias is None else spec.qkv_bias,
        o_bias=attn_bias if spec.o_bias is None else spec.o_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)) if spec.mlp_bias is None else spec.mlp_bias,
        qk_norm=spec.qk_norm,
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 2048)),
        eos_token_ids=eos_token_ids,
        layer_windows=windows if any(windows := effective_windows(hf_config, spec)) else (),
        **family_maths(hf_config, spec),
    )


def module_from_hf(hf_model, eos_token_ids: tuple[int, ...] = ()) -> DecoderLM:
    """Build our module from a loaded transformers causal LM (its weights are copied)."""
    cfg = decoder_config(hf_model.config, eos_token_ids)
    module = DecoderLM(cfg)
    spec = arch_for(cfg.model_type)
    state = {k: v.detach().float() for k, v in hf_model.state_dict().items()
             if not k.endswith("rotary_emb.inv_freq")}
    if spec.norm_offset:  # Gemma's RMSNorm multiplies by 1 + w (in fp32): fold the 1 in once
        state = {k: v + spec.norm_offset if k.endswith("norm.weight") else v for k, v in state.items()}
    for fused in spec.fused_weights:  # e.g. Phi-3's qkv_proj -> q_proj, k_proj, v_proj
        for key in [k for k in state if k.endswith(fused.name)]:
            prefix = key[: -len(fused.name)]
            for part, w in zip(fused.parts, state.pop(key).split(list(fused.sizes(cfg))), strict=True):
                state[prefix + part] = w
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise SpecrtError(f"weights do not match the {cfg.model_type} layout: missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}")
    return module.eval()


def load_model(path: str | Path, keep_hf: bool = True) -> LoadedModel:
    """Load a Hugging Face folder or .gguf file (dequantized to fp32) into a `LoadedModel`.

    `keep_hf` keeps the transformers model too (for parity checks and the transformers peer).
    """
    from specrt.export.gguf_once import gguf_parsed_once

    path = Path(path)
    src, kw = split_source(path)
    with gguf_parsed_once():  # transformers reads a .gguf four times over otherwise
        return _load(path, src, kw, keep_hf)


def _load(path: Path, src: str, kw: dict, keep_hf: bool) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:
        hf_config = AutoConfig.from_pretrained(src, **kw)
    except Exception as e:  # transformers raises many types for unreadable inputs
        raise SpecrtError(f"cannot read the model config from {path}: {str(e).splitlines()[0]}") from None
    check_config(hf_config, str(path))  # refuse unsupported families and values before loading any weight
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, **kw)
    except Exception as e:
        raise SpecrtError(f"cannot load the tokenizer of {path}: {str(e).splitlines()[0]}") from None
    check_tokenizer(path, hf_config, tokenizer)  # before the weights: a mismatch fails fast
    if path.is_dir():
        check_folder(path, "re-download the model, or convert its weights to safetensors in a trusted environment")
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw)
    except Exception as e:
        raise SpecrtError(f"cannot load model weights from {path}: {str(e).splitlines()[0]}") from None
    try:
        gen_cfg = GenerationConfig.from_pretrained(src, **kw)
    except Exception:
        gen_cfg = None
    module = module_from_hf(hf_model, _eos_ids(hf_config, gen_cfg, tokenizer))
    return LoadedModel(module=module, tokenizer=tokenizer, source=str(path), hf_config=hf_config,
                       hf_model=hf_model if keep_hf else None)
