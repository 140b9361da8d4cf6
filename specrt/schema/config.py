"""The decoder's configuration as plain data, shared by export (torch) and runtime (no torch)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float = 1.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def truncated(self, num_layers: int) -> DecoderConfig:
        """Same model with only the first `num_layers` decoder layers (a layer-truncated draft)."""
        return replace(self, num_layers=num_layers)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope_inv_freq"] = list(self.rope_inv_freq)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DecoderConfig:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["rope_inv_freq"] = tuple(kw["rope_inv_freq"])
        kw["eos_token_ids"] = tuple(kw.get("eos_token_ids", ()))
        return cls(**kw)
