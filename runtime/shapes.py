"""The draft shape a dynamic-tree drafter (EAGLE-2, EAGLE-3) runs when none is given: from what a verify
pass costs here and how often the head's drafts are accepted. Shapes are chains, and fans: the first draft
step's w best candidates side by side, the chain going on under the best one.

A chain of d drafts with acceptance a_i at depth i (given depth i-1 accepted) commits
τ(d) = 1 + a_1 + a_1·a_2 + … tokens a step, and a step costs a verify pass over 1 + d rows plus d draft
passes. Over plain decoding that is

    S(d) = τ(d) · T_v(1) / (T_v(1 + d) + d · T_p)

with T_v the machine's measured verify curve (runtime/costs.py) and T_p one draft pass. On a CPU a pass is
nearly flat over 2 rows and steep past 4, so short chains win; where the curve is flat, deeper ones do. The
shape is the one of fewest rows whose S is within ROW_MARGIN of the largest, at least 1 draft (the user asked
for this drafter; `--drafter auto` is the choice that falls back to plain decoding); a prediction below 1 is
told to the user.

  a_i  the head's held-out acceptance by draft step (manifest `acceptance_by_depth`; the last value repeats
       deeper): as the run time drafts (`acceptance_measured` "run time": scripts/runtime_acceptance.py on the
       shipped held-out prompts), else as training measured it (teacher-forced top-1 agreement, which ran
       0.52 / 0.47 where the run time gave 0.40 / 0.38 for the shipped EAGLE-3 head); else 1/2 at every depth
       (the adaptive controller's prior)
  T_p  T_v(1) times the draft pass's share of the target's weights (a pass at one row streams its weights:
       runtime/drafters/eagle.py says what a draft pass reads)

A fan of w first drafts with a chain of d drafts through the best one verifies w + d rows (the root and
the d - 1 drafts below the best candidate) for the same d draft passes, and commits

    τ(w, d) = 1 + A_w + a_1·(a_2 + a_2·a_3 + … )      A_w  the head's held-out share of first steps whose
                                                          token is among its w best (manifest
                                                          `acceptance_top_k`; A_1 = a_1)

(a side candidate accepted ends the step: nothing was drafted below it). On a CPU, where 3 rows cost
about what 2 do, a fan of 2–3 buys more than a second chain draft for no draft pass. A head without
`acceptance_top_k` gets chains only. Other trees are not priced: `--tree-nodes` / `--beam` give one, and
`specrt tune` measures them against these shapes end to end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specrt.runtime.costs import CostCurve

PRIOR_ACCEPTANCE = 0.5
PRIOR_SOURCE = "no training record: a prior of 1/2"
MAX_CHAIN = 8  # the deepest chain considered (a deeper one is never worth its pass on any curve measured)
MAX_FAN = 4  # the widest first step considered (training counts agreement within the head's 4 best)
# A shape is taken over one of fewer rows only where it predicts more than this over it: on a noisy
# 2-core VM one measured curve put 3 rows at 1.03-1.32x the one-row pass from run to run (1.25x in the
# steps themselves), and a shape chosen on a low reading runs slower for as long as the curve is cached
ROW_MARGIN = 0.05


@dataclass(frozen=True)
class Shape:
    """A chain of `depth` drafts, fanned to the first step's `width` best candidates (1: a plain chain),
    and its predicted speed-up over plain."""

    depth: int
    speedup: float
    acceptance: tuple[float, ...]  # a_1.. used
    source: str  # where the acceptance came from
    width: int = 1
    within: float | None = None  # A_width, for a fan

    @property
    def beam(self) -> int:
        return 1

    @property
    def nodes(self) -> int:
        return self.width + self.depth - 1

    def to_dict(self) -> dict:
        return {"depth": self.depth, "width": self.width, "beam": self.beam, "nodes": self.nodes,
                "predicted_speedup": self.speedup, "acceptance": list(self.acceptance),
                **({"acceptance_within_width": self.within} if self.width > 1 else {}),
                "acceptance_source": self.source}

    def describe(self, drafter: str, curve: CostCurve) -> str:
        costs = ", ".join(f"{n} rows {curve.ratio(n):.2f}×" for n in (2, 3, 5))
        acc = ", ".join(f"{a:.2f}" for a in self.acceptance[:3])
        chain = f"a chain of {self.depth} draft{'s' * (self.depth > 1)}"
        what = chain if self.width == 1 else (f"a fan of the {self.width} best first drafts (held-out "
                                              f"{self.within:.2f} within them) and {chain} through the best")
        line = (f"note: {drafter}: {what}, sized to this machine's verify "
                f"costs ({costs} one row) and the head's acceptance by depth ({acc}; {self.source}): predicted "
                f"{self.speedup:.2f}× plain; --tree-nodes, --beam and -k choose another shape")
        if self.speedup < 1:
            line += "; below 1: --drafter auto runs plain decoding where no drafter pays"
        return line


def acceptance_prior(entry: dict, depth: int) -> tuple[tuple[float, ...], str]:
    """a_1..a_depth from a drafter's manifest entry (see the module doc), and where they came from."""
    measured = [float(a) for a in entry.get("acceptance_by_depth") or () if 0 <= float(a) <= 1]
    if not measured:
        return (PRIOR_ACCEPTANCE,) * depth, PRIOR_SOURCE
    where = "held-out, at run time" if entry.get("acceptance_measured") == "run time" else "held-out, at training"
    return tuple(measured[min(i, len(measured) - 1)] for i in range(depth)), where


def speedups(curve: CostCurve, acceptance: Sequence[float], draft_pass: float) -> list[float]:
    """S(d) for d = 0..len(acceptance) (S(0) = 1: plain decoding); `draft_pass` in seconds."""
    out, tau, run = [1.0], 1.0, 1.0
    for d, a in enumerate(acceptance, start=1):
        run *= a
        tau += run
        out.append(tau * curve(1) / (curve(1 + d) + d * draft_pass))
    return out


def top_k_prior(entry: dict, a1: float) -> tuple[float, ...]:
    """A_1..A_k from a drafter's manifest entry (A_1 is a_1; each A_w at least the one before), or (a_1,)
    where training did not count them."""
    within = [float(a) for a in entry.get("acceptance_top_k") or () if 0 <= float(a) <= 1][:MAX_FAN]
    out = [a1]
    for a in within[1:]:
        out.append(max(a, out[-1]))
    return tuple(out)


def fan_speedup(curve: CostCurve, acceptance: Sequence[float], within: float, width: int, draft_pass: float) -> float:
    """S(w, d) for a fan of `width` first drafts (A_w = `within`) and a chain of len(acceptance) drafts."""
    tau, run = 1.0 + within, acceptance[0]
    for a in acceptance[1:]:
        run *= a
        tau += run
    d = len(acceptance)
    return tau * curve(1) / (curve(width + d) + d * draft_pass)


def chain_shape(curve: CostCurve, entry: dict, pass_fraction: float, max_depth: int) -> Shape:
    """Of the chains of 1..max_depth drafts (at most MAX_CHAIN), fanned at their first step to as many of the
    head's best candidates as were counted (≤ MAX_FAN), the one of fewest rows predicted within ROW_MARGIN of
    the largest speed-up (the fastest of those)."""
    depth = max(1, min(int(max_depth), MAX_CHAIN))
    acc, source = acceptance_prior(entry, depth)
    within = top_k_prior(entry, acc[0]) if source != PRIOR_SOURCE else acc[:1]
    draft_pass = pass_fraction * curve(1)
    priced = [(fan_speedup(curve, acc[:d], within[w - 1], w, draft_pass), -(w + d), w, d)
              for w in range(1, len(within) + 1) for d in range(1, depth + 1)]
    best = max(p[0] for p in priced)
    # the fewest rows predicted within ROW_MARGIN of the best, the fastest of those
    s, _, w, d = max((p for p in priced if p[0] * (1 + ROW_MARGIN) >= best), key=lambda p: (p[1], p[0]))
    return Shape(d, round(s, 3), acc[:d], source, w, within[w - 1] if w > 1 else None)


def layer_weights(cfg, in_width: int, vocab: int, layers: int) -> int:
    """Matmul weights of `layers` decoder layers whose q/k/v read `in_width` features, plus a `vocab`-row
    head: what a one-row pass streams."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = in_width * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size
    return layers * per_layer + vocab * h
