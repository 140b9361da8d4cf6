"""Adaptive draft depth: pick γ each step from the running acceptance and the measured costs.

The controller keeps, from the steps so far of this generation:
  a_d   acceptance at depth d given that depth d-1 was accepted (decayed counts, prior 1/2)
  n_d   window nodes a proposal cut at depth d has (trees: more than d)
  T_v(n), T_p(γ)  seconds of a verify pass over n window rows, of proposing up to depth γ
                  (least-squares lines over recent steps; plain steps measure T_v(1)). Given the
                  machine's measured cost curve (runtime/costs.py), T_v(n) is the recent passes' mean
                  where enough were n rows, else that curve scaled to the recent steps: a pass's cost is
                  flat over a few rows and then steep on a CPU, which no line fits, and a line through
                  one-row and five-row passes prices a two-row pass far too high
and chooses γ ∈ {0, …, k} maximising expected committed tokens per second,
    (1 + Σ_{d≤γ} Π_{i≤d} a_i) / (T_p(γ) + T_v(1 + n_γ)),
γ = 0 being plain decoding. While plain wins, speculation is probed at depth 1 after `probe_every`
plain steps, so a drafter whose acceptance recovers gets its depth back; a probe that accepts
nothing doubles the interval (up to `max_probe_every`), one that accepts resets it. Only what is proposed
changes — never what is committed — so output is unchanged (tests check it for every drafter).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


class _Line:
    """Least-squares y ≈ a + b·x over the last `window` points (fitted once per new point); before two
    distinct x's are seen, y grows in proportion to x."""

    def __init__(self, window: int = 48):
        self.pts: deque[tuple[float, float]] = deque(maxlen=window)
        self.fit: tuple[float, float] | None = None  # (a, b)

    def add(self, x: float, y: float) -> None:
        self.pts.append((x, y))
        self.fit = None

    def __call__(self, x: float) -> float | None:
        if not self.pts:
            return None
        if self.fit is None:
            xs, ys = np.array(self.pts).T
            if np.ptp(xs) == 0:
                self.fit = (0.0, float(ys.mean() / xs[0])) if xs[0] else (float(ys.mean()), 0.0)
            else:
                b, a = np.polyfit(xs, ys, 1)
                self.fit = (float(a), float(b))
        a, b = self.fit
        return max(a + b * x, 1e-6)


class _ScaledCurve:
    """T_v(n) from the machine's measured curve and the running generation's passes: the mean of the recent
    passes over n rows where at least `enough` were seen, else s · curve(n) with s fitted by least squares
    through the origin to every recent pass (s = 1 before the first). The curve gives the shape where the
    steps have not measured it; what the steps measure wins where they have (a busy machine's costs move).
    Fitted once per new point, as `_Line` is: `choose` prices every depth each step."""

    def __init__(self, curve, window: int = 48, enough: int = 4):
        self.curve, self.enough = curve, enough
        self.pts: deque[tuple[float, float, float]] = deque(maxlen=window)  # (rows, curve(rows), seconds)
        self.fit: tuple[float, dict[float, float]] | None = None  # (s, mean seconds by rows seen `enough` times)

    def add(self, x: float, y: float) -> None:
        self.pts.append((float(x), self.curve(x), y))
        self.fit = None

    def __call__(self, x: float) -> float:
        if not self.pts:
            return self.curve(x)
        if self.fit is None:
            n, c, y = np.array(self.pts).T
            rows, counts = np.unique(n, return_counts=True)
            means = {float(r): float(y[n == r].mean()) for r, k in zip(rows, counts, strict=True) if k >= self.enough}
            self.fit = (float((c * y).sum() / (c * c).sum()), means)
        scale, means = self.fit
        return max(means.get(float(x), scale * self.curve(x)), 1e-6)


@dataclass
class Decision:
    depth: int
    probe: bool = False


class AdaptiveDepth:
    def __init__(self, max_depth: int, decay: float = 0.95, probe_every: int = 8, warmup: int = 3,
                 max_probe_every: int = 64, curve=None):
        """`curve`: the verify cost curve measured on this machine (runtime/costs.py; None: a line)."""
        self.k = max_depth
        self.decay, self.warmup = decay, warmup
        self.probe_every, self.base_probe, self.max_probe = probe_every, probe_every, max_probe_every
        self.probing = False
        self.reached = np.ones(max_depth)  # decayed counts: steps that drafted depth d with d-1 accepted
        self.passed = np.full(max_depth, 0.5)  # … and accepted depth d (prior a_d = 1/2)
        self.nodes = np.arange(1, max_depth + 1, dtype=float)  # window nodes up to depth d (chain prior)
        self.verify = _ScaledCurve(curve) if curve is not None else _Line()
        self.propose = _Line()
        self.steps = self.since_spec = 0
        self.spec_steps = 0  # steps that drafted (the measurements behind the acceptance and T_p)

    def begin(self, carry: float = 0.5) -> AdaptiveDepth:
        """A new generation: the costs measured so far still hold (same machine, same graphs); the
        acceptance counts are kept at `carry` weight as the prior for the new text."""
        self.reached = 1 + carry * (self.reached - 1).clip(0)
        self.passed = 0.5 + carry * (self.passed - 0.5).clip(0)
        self.since_spec, self.probe_every = 0, self.base_probe
        return self

    def acceptance(self) -> np.ndarray:
        return self.passed / self.reached

    def expected(self) -> np.ndarray:
        """Expected tokens committed per step for γ = 0..k."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()))])

    def rates(self) -> np.ndarray | None:
        """Expected committed tokens per second for γ = 0..k (γ = 0: plain decoding, 1 / T_v(1)); None
        until both costs have been measured."""
        costs = [self.verify(1)]
        for g in range(1, self.k + 1):
            tv, tp = self.verify(1 + self.nodes[g - 1]), self.propose(g)
            costs.append(None if tv is None or tp is None else tv + tp)
        if any(c is None for c in costs):
            return None
        return self.expected() / np.asarray(costs)

    def choose(self) -> Decision:
        self.steps += 1
        if self.steps <= self.warmup:  # measure the full depth first
            return Decision(self.k)
        rate = self.rates()
        if rate is None:
            return Decision(self.k)
        best = int(rate.argmax())
        self.probing = best == 0 and self.since_spec + 1 >= self.probe_every
        if self.probing:
            return Decision(1, probe=True)
        return Decision(best)

    def update(self, depth: int, proposal_depths: np.ndarray, accepted: int,
               t_propose: float, t_verify: float) -> None:
        """After a step that drafted up to `depth` (node depths `proposal_depths`) and accepted
        `accepted` nodes along the path."""
        window = 1 + len(proposal_depths)
        self.verify.add(window, t_verify)
        if depth == 0:
            self.since_spec += 1
            return
        self.since_spec = 0
        self.spec_steps += 1
        if self.probing:  # back off while probes find nothing
            self.probe_every = self.base_probe if accepted else min(2 * self.probe_every, self.max_probe)
        self.propose.add(depth, t_propose)
        drafted = int(proposal_depths.max()) if len(proposal_depths) else 0
        d = min(drafted, self.k)
        self.reached *= self.decay
        self.passed *= self.decay
        # depth i (1-based) was tried when the proposal reached it and depth i-1 was accepted
        tried = min(d, accepted + 1)
        self.reached[:tried] += 1
        self.passed[:min(accepted, tried)] += 1
        for g in range(1, d + 1):
            self.nodes[g - 1] = 0.8 * self.nodes[g - 1] + 0.2 * float((proposal_depths <= g).sum())

    def summary(self) -> dict:
        return {"acceptance_by_depth": [round(float(a), 3) for a in self.acceptance()]}
