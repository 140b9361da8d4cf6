"""`--drafter auto`: each request runs the drafter whose measured pay-off is highest, or plain decoding.

Every candidate drafter d keeps its adaptive-depth controller across requests (runtime/adaptive.py). From
d's acceptance a_{d,i} and its measured costs the controller predicts, for each draft depth γ,

    R_d(γ) = (1 + Σ_{j≤γ} Π_{i≤j} a_{d,i}) / (T_p,d(γ) + T_v,d(1 + n_{d,γ}))     committed tokens per second,

R_d(0) = 1 / T_v,d(1) being plain decoding's rate as measured in the same requests. d's pay-off is its best
speculative rate over plain's,

    S_d = max_{γ≥1} R_d(γ) / R_d(0),

a ratio of two rates measured side by side, so a drift of the machine's speed between the requests that
measured two drafters (other jobs, clocks) does not decide between them. A request runs

  1. explore  a candidate not measured yet (fewer than `min_steps` drafting steps), at most `explore`
              requests each, in listing order;
  2. revisit  a candidate that is not the winner and has not run for `revisit` requests: what pays depends
              on the text, so a dropped drafter is measured again now and then. A revisit that leaves it
              behind doubles its interval (up to `max_revisit`), one that makes it the winner resets it;
              at most one request in `revisit_gap` is a revisit, so many losers do not crowd out the winner;
  3. exploit  the winner: argmax_d S_d if that is at least 1 + `margin`, else plain decoding.

Within its request the drafter runs with adaptive depth, so a poor choice (an exploration, a revisit, a
change of text) falls back to plain steps after a few probes: a choice costs little when it is wrong.
Choosing a drafter changes only what is proposed, never what is committed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from specrt.runtime.adaptive import AdaptiveDepth

AUTO = "auto"  # the drafter name that asks for this choice
PLAIN = "plain"


@dataclass(frozen=True)
class Payoff:
    """A drafter controller's prediction (tokens/s): its best speculative rate, at depth `depth`, and plain's."""

    rate: float
    plain: float
    depth: int

    @property
    def speedup(self) -> float:
        """S = R(best γ ≥ 1) / R(0): committed tokens per second over plain decoding's."""
        return self.rate / self.plain


def payoff(control: AdaptiveDepth | None, min_steps: int = 4) -> Payoff | None:
    """What `control` predicts for its drafter; None until it has measured `min_steps` drafting steps."""
    if control is None or control.spec_steps < min_steps:
        return None
    rates = control.rates()
    if rates is None:
        return None
    best = 1 + int(rates[1:].argmax())
    return Payoff(float(rates[best]), float(rates[0]), best)


@dataclass
class Pick:
    drafter: str
    reason: str  # explore | revisit | pays (the best measured pay-off) | plain (no drafter beats plain)
    speedup: dict[str, float | None] = field(default_factory=dict)  # S_d of every candidate (None: unmeasured)

    def to_dict(self) -> dict:
        return {"drafter": self.drafter, "reason": self.reason,
                "speedup": {d: None if s is None else round(s, 3) for d, s in self.speedup.items()}}


class DrafterChoice:
    """The per-request choice among `candidates` (runtime drafter names; plain is always the fallback).
    `choose(payoffs)` with each candidate's current `Payoff` (None: not measured) picks the next request's."""

    def __init__(self, candidates: Sequence[str], explore: int = 2, min_steps: int = 4, revisit: int = 8,
                 max_revisit: int = 64, revisit_gap: int = 8, margin: float = 0.03):
        self.candidates = [c for c in dict.fromkeys(candidates) if c != PLAIN]
        self.explore, self.min_steps, self.margin = explore, min_steps, margin
        self.base_revisit, self.max_revisit, self.revisit_gap = revisit, max_revisit, revisit_gap
        self.last_revisit = -revisit_gap  # the request that last revisited
        self.requests = 0
        self.runs = dict.fromkeys(self.candidates, 0)  # requests each candidate ran
        self.last = dict.fromkeys(self.candidates, -1)  # the request each last ran
        self.interval = dict.fromkeys(self.candidates, revisit)
        self.revisiting: str | None = None
        self.picks: dict[str, int] = {}  # requests per drafter chosen (plain included)

    def winner(self, speedup: Mapping[str, float | None]) -> str:
        """The measured candidate with the highest pay-off S, if it beats plain by the margin; else plain."""
        measured = {d: s for d, s in speedup.items() if s is not None}
        best = max(measured, key=measured.__getitem__, default=None)
        return best if best is not None and measured[best] >= 1 + self.margin else PLAIN

    def choose(self, payoffs: Mapping[str, Payoff | None]) -> Pick:
        speedup = {d: p.speedup if (p := payoffs.get(d)) is not None else None for d in self.candidates}
        best = self.winner(speedup)
        if self.revisiting is not None:  # the previous request revisited a drafter: did it win its place back?
            d = self.revisiting
            self.interval[d] = self.base_revisit if best == d else min(2 * self.interval[d], self.max_revisit)
            self.revisiting = None
        pick = self._explore(speedup) or self._revisit(best) or Pick(best, "plain" if best == PLAIN else "pays")
        pick.speedup = speedup
        if pick.reason == "revisit":
            self.revisiting, self.last_revisit = pick.drafter, self.requests
        if pick.drafter in self.runs:
            self.runs[pick.drafter] += 1
            self.last[pick.drafter] = self.requests
        self.picks[pick.drafter] = self.picks.get(pick.drafter, 0) + 1
        self.requests += 1
        return pick

    def _explore(self, speedup: Mapping[str, float | None]) -> Pick | None:
        for d in self.candidates:
            if speedup[d] is None and self.runs[d] < self.explore:
                return Pick(d, "explore")
        return None

    def _revisit(self, best: str) -> Pick | None:
        due = [d for d in self.candidates if d != best and self.requests - self.last[d] > self.interval[d]]
        if not due or self.requests - self.last_revisit < self.revisit_gap:
            return None
        return Pick(min(due, key=lambda d: self.last[d]), "revisit")  # the one left longest

    def summary(self) -> dict:
        return {"candidates": self.candidates, "requests": self.requests, "picks": dict(self.picks)}
