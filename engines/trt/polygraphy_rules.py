"""What `specrt validate --polygraphy` holds a graph to: one rule per (graph precision, reference precision).

Every bound is relative to the output's own range, so one rule fits a 2-layer test model and a
30-layer one alike:

    max |Δ|  ≤  peak × max |reference|      every element (Polygraphy's `simple`, elementwise, rtol 0)
    cosine   ≥  min_cosine                   the whole output (Polygraphy's cosine similarity)

Outputs are grouped by kind: logits, hidden_states, aux_hidden_states, kv (every present_key.i /
present_value.i). The measurements below are SmolLM2-135M-Instruct (the default model, 30 layers; its
4-layer truncated draft likewise) exported by `specrt export`, the saved reference window (6 seeded
token ids, a branching tree) run on ONNX Runtime 1.32 CPU, 2 threads, AMD EPYC AVX-512; worst over
target and draft. Rerun them with `specrt validate BUNDLE --polygraphy --json` (each output's
`max_abs`, `ref_peak`, `cosine`).

fp32 graph vs the fp32 PyTorch module: only the rounding of fp32 arithmetic differs.
    measured max |Δ| / max |ref|: logits 1.6e-6, hidden_states 5.8e-7, kv 1.8e-6 (≤ 30 fp32 unit
    roundoffs, u = 2⁻²⁴ ≈ 6e-8).  Bound: 2e-5 everywhere, 11x the worst measured. Scaling one layer's
    o_proj by 1.01 gives 8.2e-4 on the default model's logits (40x the bound).
int4 / int8 graph (weight-only MatMulNBits, block 32, int8 activations) vs the fp32 PyTorch module:
    the difference is the quantization noise itself, so the bounds are the measured noise with a
    margin of 1.5 (on max |Δ| / max |ref| and on 1 − cosine):
                           int4 measured → bound                 int8 measured → bound
        output           peak          cosine                   peak          cosine
        logits           0.38 → 0.57   0.9863 → 0.979           0.058 → 0.087 0.99979 → 0.9996
        hidden_states    0.23 → 0.35   0.9233 → 0.885           0.032 → 0.049 0.99911 → 0.9986
        kv               0.91 → none   0.7293 → 0.59            0.069 → 0.10  0.99737 → 0.996
        aux_hidden       not measured: cosine 0.998 measured before (an EAGLE-3 tapped int4 bundle) → 0.997,
                         for int8 too; peak not bounded
    int4's kv peak is not bounded elementwise: its noise reaches 0.91 of the range at the last layer's
    values, so only the cosine says something there. These bounds are the default model's noise; another
    model quantizes with other noise, and a failure there may mean its noise is larger, not a broken graph.
fp16 / bf16 TensorRT engines vs the fp32 ONNX Runtime graph: NOT MEASURED (TensorRT never ran here).
    fp16: peak 5e-2 (≈ 100 fp16 unit roundoffs, u = 2⁻¹¹), cosine 0.999; bf16: peak 0.1, cosine 0.995.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrt.errors import SpecrtError

KINDS = ("logits", "hidden_states", "aux_hidden_states", "kv")


@dataclass(frozen=True)
class Bound:
    """One output kind's bound: max |Δ| ≤ peak × max |reference| (None: not bounded per element) and
    cosine similarity ≥ min_cosine (None: not checked)."""

    peak: float | None
    min_cosine: float | None = None


@dataclass(frozen=True)
class Rule:
    bounds: dict[str, Bound]  # by output kind (KINDS)
    basis: str  # where the numbers come from, one line (the module docstring has the measurements)


def _same(bound: Bound) -> dict[str, Bound]:
    return dict.fromkeys(KINDS, bound)


# (graph precision, reference precision) -> rule; the measurements are in the module docstring
RULES: dict[tuple[str, str], Rule] = {
    ("fp32", "fp32"): Rule(_same(Bound(2e-5)),
                           "fp32 rounding: measured ≤ 1.8e-6 of the range on the default model, bound 11x that"),
    ("int4", "fp32"): Rule({"logits": Bound(0.57, 0.979), "hidden_states": Bound(0.35, 0.885),
                            "aux_hidden_states": Bound(None, 0.997), "kv": Bound(None, 0.59)},
                           "int4 quantization noise measured on the default model, margin 1.5"),
    ("int8", "fp32"): Rule({"logits": Bound(0.087, 0.9996), "hidden_states": Bound(0.049, 0.9986),
                            "aux_hidden_states": Bound(None, 0.997), "kv": Bound(0.10, 0.996)},
                           "int8 quantization noise measured on the default model, margin 1.5"),
    ("fp16", "fp32"): Rule(_same(Bound(5e-2, 0.999)), "fp16 engine: about 100 fp16 roundoffs; not measured"),
    ("bf16", "fp32"): Rule(_same(Bound(0.1, 0.995)), "bf16 engine: not measured"),
}


def rule_for(graph: str, reference: str) -> Rule:
    """The rule a `graph`-precision output is held to against a `reference`-precision one."""
    try:
        return RULES[(graph, reference)]
    except KeyError:
        known = ", ".join(f"{g} vs {r}" for g, r in RULES)
        raise SpecrtError(f"no Polygraphy rule for a {graph} graph against a {reference} reference "
                          f"(rules: {known})") from None


def output_kind(name: str) -> str:
    """The kind of a graph output: present_key.i / present_value.i are "kv", the rest are named."""
    return "kv" if name.startswith(("present_key.", "present_value.")) else name


def bound_of(rule: Rule, name: str) -> Bound:
    kind = output_kind(name)
    if kind not in rule.bounds:
        raise SpecrtError(f"no Polygraphy bound for output {name!r}: the rules know {', '.join(rule.bounds)}")
    return rule.bounds[kind]
