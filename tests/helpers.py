"""Shared builders for tests: tiny random models of every supported family, tiny bundles."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)

# One tiny config per supported family; tests/export/test_modeling_parity.py fails if a family lacks one.
FAMILY_OVERRIDES = {
    "llama": dict(attention_bias=False),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(),
    "qwen3": dict(head_dim=16),
}


def tiny_hf_model(model_type: str, seed: int = 0, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**TINY, **FAMILY_OVERRIDES[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases so that a wrong placement cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def save_tiny_folder(folder: Path, model_type: str, tokenizer_dir: Path | None, seed: int = 0, **overrides) -> Path:
    """A Hugging Face folder (config + safetensors + tokenizer files) with a tiny random model."""
    model = tiny_hf_model(model_type, seed, **overrides)
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, folder / f.name)
    return folder
