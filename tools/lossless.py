"""Statistics for lossless checks: does an empirical sequence distribution match the exact one?

Pearson's chi-square over the outcomes, cells with expected count < 5 pooled into one, against the
(1 − α) quantile of χ²(df) (Wilson–Hilferty approximation, accurate to ~1% for df ≥ 3): with α =
1e-3 a correct sampler is flagged once in a thousand checks.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from statistics import NormalDist

ALPHA = 1e-3


@dataclass
class ChiSquare:
    statistic: float
    threshold: float
    dof: int
    samples: int
    alpha: float
    total_variation: float

    @property
    def verdict(self) -> str:
        return "pass" if self.statistic <= self.threshold else "fail"

    def to_dict(self) -> dict:
        return {"statistic": round(self.statistic, 3), "threshold": round(self.threshold, 3), "dof": self.dof,
                "samples": self.samples, "alpha": self.alpha, "total_variation": round(self.total_variation, 4),
                "verdict": self.verdict}


def chi2_quantile(dof: int, alpha: float) -> float:
    z = NormalDist().inv_cdf(1 - alpha)
    c = 2.0 / (9.0 * dof)
    return dof * (1 - c + z * math.sqrt(c)) ** 3


def chi_square(samples: list[tuple], exact: dict[tuple, float], alpha: float = ALPHA) -> ChiSquare:
    """Compare sampled outcomes with exact probabilities (outcomes outside `exact` count as impossible)."""
    n = len(samples)
    counts = Counter(samples)
    impossible = sum(c for o, c in counts.items() if exact.get(o, 0.0) <= 0.0)
    stat, dof, pooled_obs, pooled_exp = 0.0, 0, 0, 0.0
    for outcome, p in exact.items():
        if p <= 0:
            continue
        expected, observed = n * p, counts.get(outcome, 0)
        if expected < 5:
            pooled_obs += observed
            pooled_exp += expected
            continue
        stat += (observed - expected) ** 2 / expected
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    if impossible:
        stat = math.inf  # a sequence the target can never produce was sampled
    tv = 0.5 * (sum(abs(counts.get(o, 0) / n - p) for o, p in exact.items()) + impossible / n)
    dof = max(dof - 1, 1)
    return ChiSquare(stat, chi2_quantile(dof, alpha), dof, n, alpha, tv)
