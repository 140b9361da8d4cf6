"""Which transformers config values specrt's decoder computes exactly, as a table: field -> rule.

A field that changes the maths is either honoured (the module and graph compute what transformers'
model for that family computes) or refused at load with one line naming the field, its value and what
is supported. Nothing is silently ignored: a model that exports computes what transformers computes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specrt.errors import SpecrtError
from specrt.export.archs import ACTIVATIONS, ArchSpec, arch_for

# RoPE types whose frequencies are fixed at load time (transformers' ROPE_INIT_FUNCTIONS, no per-call update)
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "longrope")


# a rope_per_layer_type family's tables: layer type -> table index in DecoderConfig (0 global, 1 local)
ROPE_LAYER_TYPES = {"full_attention": 0, "sliding_attention": 1}


def rope_params(hf_config, layer_type: str | None = None) -> dict:
    """The config's RoPE parameters (transformers 5 `rope_parameters`, older `rope_scaling`); those of
    `layer_type` where they are keyed by layer type (Gemma-3)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    return dict(params.get(layer_type) or {}) if layer_type is not None else params


def rope_layer_types(hf_config, spec: ArchSpec | None = None) -> tuple[str | None, ...]:
    """The keys of the config's RoPE parameter sets: (None,) for one set, else the layer types used."""
    if spec is None or not spec.rope_per_layer_type:
        return (None,)
    return tuple(sorted(set(hf_config.layer_types)))


def rope_type(hf_config, layer_type: str | None = None) -> str:
    params = rope_params(hf_config, layer_type)
    return params.get("rope_type", params.get("type", "default"))


def partial_rotary_factor(hf_config, layer_type: str | None = None) -> float:
    return float(rope_params(hf_config, layer_type).get("partial_rotary_factor",
                                                        getattr(hf_config, "partial_rotary_factor", 1.0)))


def longrope_switch(hf_config, layer_type: str | None = None) -> int | None:
    """LongRoPE's original_max_position_embeddings where a sequence can pass it (transformers then swaps
    the short factors for the long ones: not one static table); None where it cannot."""
    if rope_type(hf_config, layer_type) != "longrope":
        return None
    original = rope_params(hf_config, layer_type).get("original_max_position_embeddings",
                                                      getattr(hf_config, "original_max_position_embeddings", None))
    return original if original is None or hf_config.max_position_embeddings > original else None


def per_rope_set(read: Callable, ok: Callable) -> Callable:
    """A rule's reader over every RoPE parameter set: the first value `ok` refuses, else the first value."""
    def reader(hf_config, spec: ArchSpec):
        values = [read(hf_config, t) for t in rope_layer_types(hf_config, spec)]
        return next((v for v in values if not ok(v)), values[0])
    return reader


def activation(hf_config, spec: ArchSpec) -> str:
    return getattr(hf_config, spec.activation_field, None) or "silu"


def effective_windows(hf_config, spec: ArchSpec) -> tuple[int, ...]:
    """Each layer's attention window (0: the whole prefix), honoured (sliding_window, use_sliding_window,
    max_window_layers, layer_types as the family reads them: export/archs.py); a window of at least
    max_position_embeddings never hides a key (query minus key position < max positions): none."""
    limit = int(getattr(hf_config, "max_position_embeddings", 2048))
    return tuple(int(w) if w is not None and w < limit else 0 for w in spec.layer_windows(hf_config))


@dataclass(frozen=True)
class FieldRule:
    field: str  # as the message names it
    read: Callable[[Any, ArchSpec], Any]  # the value, from transformers' config (after its defaults)
    ok: Callable[[Any], bool]
    supported: str  # what the message offers instead
    named: Callable[[ArchSpec], str] | None = None  # the field's name in this family's config (default: field)


def _static(v) -> bool:
    return v in STATIC_ROPE


RULES: tuple[FieldRule, ...] = (
    FieldRule("hidden_act", activation, lambda v: v in ACTIVATIONS,
              f"{', '.join(ACTIVATIONS)} (a gated MLP)", lambda a: a.activation_field),
    FieldRule("rope_parameters.rope_type", per_rope_set(rope_type, _static), _static,
              f"static RoPE: {', '.join(STATIC_ROPE)} ('dynamic' rescales with the sequence length at run time)"),
    FieldRule("rope_parameters.original_max_position_embeddings", per_rope_set(longrope_switch, lambda v: v is None),
              lambda v: v is None, "longrope only with original_max_position_embeddings >= max_position_embeddings "
              "(above it transformers switches to the long factors at run time)"),
    FieldRule("partial_rotary_factor", per_rope_set(partial_rotary_factor, lambda v: v == 1.0), lambda v: v == 1.0,
              "1.0 (rotary over the whole head)"),
    FieldRule("use_bidirectional_attention", lambda c, a: bool(getattr(c, "use_bidirectional_attention", False)),
              lambda v: not v, "causal attention only (use_bidirectional_attention false)"),
    FieldRule("layer_types", lambda c, a: tuple(getattr(c, "layer_types", None) or ()),
              lambda v: set(v) <= set(ROPE_LAYER_TYPES), f"layer types {' and '.join(ROPE_LAYER_TYPES)}"),
)


def check_config(hf_config, source: str = "") -> ArchSpec:
    """The family's spec, or SpecrtError (one line) for the first config value specrt would not compute
    exactly as transformers does."""
    spec = arch_for(hf_config.model_type)
    where = f"{source}: " if source else ""
    for rule in RULES:
        value = rule.read(hf_config, spec)
        if not rule.ok(value):
            name = rule.named(spec) if rule.named else rule.field
            raise SpecrtError(f"{where}{hf_config.model_type} config {name} = {value!r} is not supported; "
                              f"specrt supports {rule.supported}")
    return spec
