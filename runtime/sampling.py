"""Sampling parameters and the logits warp applied identically to target and draft distributions."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.errors import SpecrtError
from specrt.schema.checks import is_int, is_number


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None

    def __post_init__(self):
        """Refuse what would sample garbage silently: nan or inf temperature (every draw token 0), nan top_p,
        a negative seed (numpy refuses it mid-generation)."""
        if not is_number(self.temperature) or self.temperature < 0:
            raise SpecrtError(f"--temperature {self.temperature!r} must be a finite number >= 0 (0 means greedy)")
        if not is_int(self.top_k) or self.top_k < 0:
            raise SpecrtError(f"--top-k {self.top_k!r} must be an integer >= 0 (0 means off)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise SpecrtError(f"--top-p {self.top_p!r} must be a number in (0, 1] (1 means off)")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise SpecrtError(f"--seed {self.seed!r} must be an integer >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities [..., V] after temperature, then top-k, then top-p (float32).

    Ties at the top-k boundary are all kept; top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p (always at least one token).

    Every temperature > 0 is exact, however small: the row's maximum is subtracted before scaling, so
    the best logit scales to 0 and the others to finite negatives or -inf, never to inf - inf = nan.
    As T -> 0 that is softmax's own limit, all the mass on the argmax (shared among ties): a tiny
    temperature samples greedy's tokens, by the sampling rule the user asked for. Dividing first
    overflowed float32 for T below ~1e-37 (or made T itself 0 below ~1e-45), every draw token 0.
    """
    if params.greedy:
        raise SpecrtError("warp() is for temperature > 0; greedy decoding uses the argmax")
    x = logits.astype(np.float32)
    x = x - x.max(-1, keepdims=True)  # <= 0, the best exactly 0
    with np.errstate(over="ignore"):  # below -float32 max: -inf, probability 0 (exp underflows there anyway)
        x = (x.astype(np.float64) / float(params.temperature)).astype(np.float32)
    v = x.shape[-1]
    if 0 < params.top_k < v:
        kth = np.partition(x, v - params.top_k, axis=-1)[..., v - params.top_k, None]
        x = np.where(x >= kth, x, -np.inf)
    x = x - x.max(-1, keepdims=True)
    p = np.exp(x)
    p /= p.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p  # mass strictly above each token
        keep_sorted = before < np.float32(params.top_p)
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p = np.where(keep, p, 0).astype(np.float32)
        p /= p.sum(-1, keepdims=True)
    return p.astype(np.float32)


def top_desc(x: np.ndarray, r: int) -> np.ndarray:
    """Indices of the r largest entries of a 1-D array, best first (O(V), not a full sort)."""
    r = min(r, x.shape[-1])
    if r == 1:
        return np.array([int(x.argmax())])
    top = np.argpartition(-x, r - 1)[:r]
    return top[np.argsort(-x[top], kind="stable")]
