"""Decoder families as data: what differs between Llama, Mistral, Qwen2 and Qwen3.

Everything downstream (torch module, ONNX builder) reads an `ArchSpec`; adding a family is one
registry entry, never an if/elif on `model_type`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrt.errors import SpecrtError


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool | None = None  # None: read config.attention_bias
    o_bias: bool | None = None  # None: read config.attention_bias
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    mlp_bias_attr: str = "mlp_bias"


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec(),
    "mistral": ArchSpec(qkv_bias=False, o_bias=False),
    "qwen2": ArchSpec(qkv_bias=True, o_bias=False),
    "qwen3": ArchSpec(qk_norm=True),
}


def arch_for(model_type: str) -> ArchSpec:
    try:
        return ARCHS[model_type]
    except KeyError:
        raise SpecrtError(
            f"model_type {model_type!r} is not supported; supported decoder families: "
            f"{', '.join(sorted(ARCHS))}"
        ) from None
