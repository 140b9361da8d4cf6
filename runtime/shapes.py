"""The draft shape a dynamic-tree drafter (EAGLE-2, EAGLE-3) runs when none is given: from what a verify
pass costs here and how often the head's drafts are accepted.

A chain of d drafts with acceptance a_i at depth i (given depth i-1 accepted) commits
τ(d) = 1 + a_1 + a_1·a_2 + … tokens a step, and a step costs a verify pass over 1 + d rows plus d draft
passes. Over plain decoding that is

    S(d) = τ(d) · T_v(1) / (T_v(1 + d) + d · T_p)

with T_v the machine's measured verify curve (runtime/costs.py) and T_p one draft pass. On a CPU a pass is
nearly flat over 2 rows and steep past 4, so short chains win; where the curve is flat, deeper ones do. The
shape is the depth with the largest S, at least 1 (the user asked for this drafter; `--drafter auto` is
the choice that falls back to plain decoding); a prediction below 1 is told to the user.

  a_i  the head's held-out acceptance by draft step, as its training measured it (manifest
       `acceptance_by_depth`, teacher-forced top-1 agreement; the last value repeats deeper), else 1/2 at
       every depth (the adaptive controller's prior)
  T_p  T_v(1) times the draft pass's share of the target's weights (a pass at one row streams its weights:
       runtime/drafters/eagle.py says what a draft pass reads)

Trees are not chosen here: pricing one needs the head's top-k agreement by depth, which training does not
record yet. `--tree-nodes` / `--beam` give one, and `specrt tune` measures them against chains end to end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specrt.runtime.costs import CostCurve

PRIOR_ACCEPTANCE = 0.5
MAX_CHAIN = 8  # the deepest chain considered (a deeper one is never worth its pass on any curve measured)


@dataclass(frozen=True)
class Shape:
    """A chain of `depth` drafts (one node per depth: beam 1) and its predicted speed-up over plain."""

    depth: int
    speedup: float
    acceptance: tuple[float, ...]  # a_1.. used
    source: str  # where the acceptance came from

    @property
    def beam(self) -> int:
        return 1

    @property
    def nodes(self) -> int:
        return self.depth

    def to_dict(self) -> dict:
        return {"depth": self.depth, "beam": self.beam, "nodes": self.nodes, "predicted_speedup": self.speedup,
                "acceptance": list(self.acceptance), "acceptance_source": self.source}

    def describe(self, drafter: str, curve: CostCurve) -> str:
        costs = ", ".join(f"{n} rows {curve.ratio(n):.2f}×" for n in (2, 3, 5))
        acc = ", ".join(f"{a:.2f}" for a in self.acceptance[:3])
        line = (f"note: {drafter}: a chain of {self.depth} draft{'s' * (self.depth > 1)}, sized to this machine's verify "
                f"costs ({costs} one row) and the head's acceptance by depth ({acc}; {self.source}): predicted "
                f"{self.speedup:.2f}× plain; --tree-nodes, --beam and -k choose another shape")
        if self.speedup < 1:
            line += "; below 1: --drafter auto runs plain decoding where no drafter pays"
        return line


def acceptance_prior(entry: dict, depth: int) -> tuple[tuple[float, ...], str]:
    """a_1..a_depth from a drafter's manifest entry (see the module doc), and where they came from."""
    measured = [float(a) for a in entry.get("acceptance_by_depth") or () if 0 <= float(a) <= 1]
    if not measured:
        return (PRIOR_ACCEPTANCE,) * depth, "no training record: a prior of 1/2"
    return tuple(measured[min(i, len(measured) - 1)] for i in range(depth)), "held-out, at training"


def speedups(curve: CostCurve, acceptance: Sequence[float], draft_pass: float) -> list[float]:
    """S(d) for d = 0..len(acceptance) (S(0) = 1: plain decoding); `draft_pass` in seconds."""
    out, tau, run = [1.0], 1.0, 1.0
    for d, a in enumerate(acceptance, start=1):
        run *= a
        tau += run
        out.append(tau * curve(1) / (curve(1 + d) + d * draft_pass))
    return out


def chain_shape(curve: CostCurve, entry: dict, pass_fraction: float, max_depth: int) -> Shape:
    """The chain depth (1..max_depth, at most MAX_CHAIN) with the largest predicted speed-up."""
    depth = max(1, min(int(max_depth), MAX_CHAIN))
    acc, source = acceptance_prior(entry, depth)
    s = speedups(curve, acc, pass_fraction * curve(1))
    best = max(range(1, depth + 1), key=lambda d: s[d])
    return Shape(best, round(s[best], 3), acc[:best], source)


def layer_weights(cfg, in_width: int, vocab: int, layers: int) -> int:
    """Matmul weights of `layers` decoder layers whose q/k/v read `in_width` features, plus a `vocab`-row
    head: what a one-row pass streams."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = in_width * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return layers * per_layer + vocab * h
