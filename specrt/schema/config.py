"""The decoder's configuration as plain data, shared by export (torch) and runtime (no torch)."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from specrt.schema.checks import (
    BOOL,
    INT_LIST,
    NON_EMPTY_TEXT,
    POSITIVE_INT,
    POSITIVE_NUMBER,
    Check,
    FieldError,
    check_object,
    is_number,
    list_of,
)


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
    def from_dict(cls, d: dict, key: str = "config") -> DecoderConfig:
        """The config from its JSON form; a FieldError (a ValueError) names field `key`.FIELD when a value
        has the wrong type or range."""
        validate_config(d, key)
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["rope_inv_freq"] = tuple(kw["rope_inv_freq"])
        kw["eos_token_ids"] = tuple(kw.get("eos_token_ids", ()))
        return cls(**kw)


# field -> check: what every reader of a stored config may rely on (types and ranges)
CONFIG_CHECKS: dict[str, Check] = {
    "model_type": NON_EMPTY_TEXT,
    "vocab_size": POSITIVE_INT,
    "hidden_size": POSITIVE_INT,
    "intermediate_size": POSITIVE_INT,
    "num_layers": POSITIVE_INT,
    "num_heads": POSITIVE_INT,
    "num_kv_heads": POSITIVE_INT,
    "head_dim": POSITIVE_INT,
    "rms_norm_eps": POSITIVE_NUMBER,
    "rope_inv_freq": Check("a non-empty list of finite numbers", list_of(is_number, non_empty=True)),
    "rope_attention_scaling": POSITIVE_NUMBER,
    "tie_word_embeddings": BOOL,
    "qkv_bias": BOOL,
    "o_bias": BOOL,
    "mlp_bias": BOOL,
    "qk_norm": BOOL,
    "max_position_embeddings": POSITIVE_INT,
    "eos_token_ids": INT_LIST,
}
OPTIONAL = frozenset(f.name for f in fields(DecoderConfig)
                     if f.default is not MISSING or f.default_factory is not MISSING)

# (field, what it must be, holds): relations between fields, checked once every field has its type
RELATIONS = (
    ("num_heads", "a multiple of num_kv_heads ({num_kv_heads})", lambda c: c["num_heads"] % c["num_kv_heads"] == 0),
    ("rope_inv_freq", "head_dim / 2 = {half_head_dim:g} frequencies",
     lambda c: 2 * len(c["rope_inv_freq"]) == c["head_dim"]),
)


def validate_config(d: object, key: str = "config") -> None:
    """Raise FieldError unless `d` is a stored DecoderConfig with every field of the right type and range."""
    check_object(key, d, CONFIG_CHECKS, OPTIONAL)
    for name, expected, holds in RELATIONS:
        if not holds(d):
            raise FieldError(f"{key}.{name}", expected.format(**d, half_head_dim=d["head_dim"] / 2), d[name])
