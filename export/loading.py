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
from specrt.export.archs import arch_for
from specrt.export.modeling import DecoderLM
from specrt.export.safetensors_file import check_folder
from specrt.export.source_checks import check_tokenizer
from specrt.schema.config import DecoderConfig


@dataclass
class LoadedModel:
    """Our module plus what the bundle needs from the source: tokenizer and a description."""

    module: DecoderLM
    tokenizer: Any  # a transformers tokenizer, saved into the bundle
    source: str
    hf_config: Any
    hf_model: Any = None  # the transformers model, kept for parity checks; drop it when done


def _split_source(path: Path) -> tuple[str, dict]:
    """(pretrained path, extra from_pretrained kwargs) for a folder or a .gguf file."""
    if not path.exists():
        raise SpecrtError(f"model path {path} does not exist: pass a Hugging Face model folder or a .gguf file")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SpecrtError(f"{path} is a file but not a .gguf: pass a Hugging Face model folder or a .gguf file")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise SpecrtError(f"{path} is not a GGUF file (bad magic bytes): the file is corrupt or of another format")
        return str(path.parent), {"gguf_file": path.name}
    if not (path / "config.json").is_file():
        raise SpecrtError(f"{path} has no config.json: pass a Hugging Face model folder or a .gguf file")
    return str(path), {}


def rope_tables(hf_config) -> tuple[list[float], float]:
    """Inverse frequencies and cos/sin scaling for the config's RoPE type (static types only)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic":
        raise SpecrtError("rope_type 'dynamic' depends on the sequence length at run time and is not exportable; "
                          "use a model with static RoPE (default, linear, llama3, yarn)")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        dim = int(dim * getattr(hf_config, "partial_rotary_factor", 1.0))
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return inv.tolist(), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise SpecrtError(f"rope_type {rope_type!r} is not supported")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv.float().tolist(), float(scaling)


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
    """Translate a transformers config into our `DecoderConfig` (the arch registry fills gaps)."""
    spec = arch_for(hf_config.model_type)
    attn_bias = bool(getattr(hf_config, "attention_bias", False))
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    inv_freq, scaling = rope_tables(hf_config)
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
        mlp_bias=bool(getattr(hf_config, spec.mlp_bias_attr, False)),
        qk_norm=spec.qk_norm,
        max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", 2048)),
        eos_token_ids=eos_token_ids,
    )


def module_from_hf(hf_model, eos_token_ids: tuple[int, ...] = ()) -> DecoderLM:
    """Build our module from a loaded transformers causal LM (its weights are copied)."""
    cfg = decoder_config(hf_model.config, eos_token_ids)
    module = DecoderLM(cfg)
    state = {k: v.detach().float() for k, v in hf_model.state_dict().items()
             if not k.endswith("rotary_emb.inv_freq")}
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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path = Path(path)
    src, kw = _split_source(path)
    try:
        hf_config = AutoConfig.from_pretrained(src, **kw)
    except Exception as e:  # transformers raises many types for unreadable inputs
        raise SpecrtError(f"cannot read the model config from {path}: {str(e).splitlines()[0]}") from None
    arch_for(hf_config.model_type)  # refuse unsupported families before loading any weight
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
