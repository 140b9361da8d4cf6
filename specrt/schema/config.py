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
    is_int,
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
    # per layer: the sliding attention window W (a key W or more positions behind the query is hidden),
    # 0 for full attention; empty when no layer has a window
    layer_windows: tuple[int, ...] = field(default_factory=tuple)
    # family maths (defaults: Llama's); norm weights are stored as used (Gemma's 1 + w folded at load)
    activation: str = "silu"  # the gated MLP's activation: one of ACTIVATIONS
    embed_scale: float = 1.0  # embeddings are multiplied by it after the lookup (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # post_attention_layernorm on the attention output; pre_/post_feedforward norms
    query_pre_attn_scalar: float = 0.0  # scores are scaled by its -1/2 power (0: head_dim's)
    attn_logit_softcapping: float = 0.0  # scores -> c * tanh(scores / c) before the mask (0: none)
    final_logit_softcapping: float = 0.0  # logits -> c * tanh(logits / c) (0: none)
    # per layer: which RoPE table, 0 rope_inv_freq or 1 local_rope_inv_freq (Gemma-3's sliding layers);
    # empty when every layer reads rope_inv_freq
    layer_rope: tuple[int, ...] = field(default_factory=tuple)
    local_rope_inv_freq: tuple[float, ...] = field(default_factory=tuple)
    local_rope_attention_scaling: float = 1.0

    @property
    def kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attn_scale(self) -> float:
        """What q·k is multiplied by: query_pre_attn_scalar**-0.5, or head_dim**-0.5 without one."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def rope_table(self, layer: int = 0) -> tuple[tuple[float, ...], float]:
        """(inverse frequencies, cos/sin scaling) of layer `layer`'s RoPE table."""
        if self.layer_rope and self.layer_rope[layer]:
            return self.local_rope_inv_freq, self.local_rope_attention_scaling
        return self.rope_inv_freq, self.rope_attention_scaling

    def rope_index(self, layer: int) -> int:
        """Which RoPE table layer `layer` reads (0: rope_inv_freq, 1: local_rope_inv_freq)."""
        return self.layer_rope[layer] if self.layer_rope else 0

    def window(self, layer: int) -> int:
        """Layer `layer`'s attention window (0: the whole prefix)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def truncated(self, num_layers: int) -> DecoderConfig:
        """Same model with only the first `num_layers` decoder layers (a layer-truncated draft)."""
        windows, ropes = self.layer_windows[:num_layers], self.layer_rope[:num_layers]
        return replace(self, num_layers=num_layers, layer_windows=windows if any(windows) else (),
                       layer_rope=ropes if any(ropes) else ())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rope_inv_freq"] = list(self.rope_inv_freq)
        d["eos_token_ids"] = list(self.eos_token_ids)
        for name in ("layer_windows", "layer_rope", "local_rope_inv_freq"):
            d[name] = list(getattr(self, name))
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
        for name in ("layer_windows", "layer_rope", "local_rope_inv_freq"):
            kw[name] = tuple(kw.get(name, ()))
        return cls(**kw)


ACTIVATIONS = ("silu", "gelu_tanh")  # silu(x); gelu with the tanh approximation (torch approximate="tanh")
NON_NEGATIVE_NUMBER = Check("a finite number >= 0", lambda v: is_number(v) and v >= 0)


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
    "layer_windows": INT_LIST,
    "activation": Check(f"one of {', '.join(ACTIVATIONS)}", lambda v: v in ACTIVATIONS),
    "embed_scale": POSITIVE_NUMBER,
    "sandwich_norms": BOOL,
    "query_pre_attn_scalar": NON_NEGATIVE_NUMBER,
    "attn_logit_softcapping": NON_NEGATIVE_NUMBER,
    "final_logit_softcapping": NON_NEGATIVE_NUMBER,
    "layer_rope": Check("a list of 0 / 1", list_of(lambda x: is_int(x) and x in (0, 1))),
    "local_rope_inv_freq": Check("a list of finite numbers", list_of(is_number)),
    "local_rope_attention_scaling": POSITIVE_NUMBER,
}
OPTIONAL = frozenset(f.name for f in fields(DecoderConfig)
                     if f.default is not MISSING or f.default_factory is not MISSING)

# (field, what it must be, holds): relations between fields, checked once every field has its type
RELATIONS = (
    ("num_heads", "a multiple of num_kv_heads ({num_kv_heads})", lambda c: c["num_heads"] % c["num_kv_heads"] == 0),
    ("rope_inv_freq", "head_dim / 2 = {half_head_dim:g} frequencies",
     lambda c: 2 * len(c["rope_inv_freq"]) == c["head_dim"]),
    ("layer_windows", "empty or one window per layer ({num_layers})",
     lambda c: not c.get("layer_windows") or len(c["layer_windows"]) == c["num_layers"]),
    ("layer_rope", "empty or one table index per layer ({num_layers})",
     lambda c: not c.get("layer_rope") or len(c["layer_rope"]) == c["num_layers"]),
    ("local_rope_inv_freq", "head_dim / 2 = {half_head_dim:g} frequencies where layer_rope names it",
     lambda c: not any(c.get("layer_rope", ())) or 2 * len(c.get("local_rope_inv_freq", ())) == c["head_dim"]),
)


def validate_config(d: object, key: str = "config") -> None:
    """Raise FieldError unless `d` is a stored DecoderConfig with every field of the right type and range."""
    check_object(key, d, CONFIG_CHECKS, OPTIONAL)
    for name, expected, holds in RELATIONS:
        if not holds(d):
            raise FieldError(f"{key}.{name}", expected.format(**d, half_head_dim=d["head_dim"] / 2), d.get(name))
