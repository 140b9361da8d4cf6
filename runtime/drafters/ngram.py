"""Prompt lookup: find the latest earlier occurrence of the context's suffix and propose what followed.

Tries suffix sizes max_n down to min_n; the first size with a match that has a continuation wins.
No model, no state.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specrt.errors import SpecrtError
from specrt.runtime.drafters import DrafterContext, register


def lookup(tokens: list[int] | np.ndarray, k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    if min_n < 1 or max_n < min_n:
        raise SpecrtError(f"n-gram sizes must satisfy 1 <= min_n <= max_n (got min_n={min_n}, max_n={max_n})")
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    if k <= 0:
        return []
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = arr[size - n:]
        # windows starting at 0 .. size-n-1: every earlier occurrence, not the suffix itself
        windows = sliding_window_view(arr[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


@register("ngram")
class NGram:
    name = "ngram"

    def __init__(self, ctx: DrafterContext | None = None):
        opts = ctx.options if ctx else {}
        self.max_n = int(opts.get("ngram_max", 3))
        self.min_n = int(opts.get("ngram_min", 1))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return lookup(tokens, k, self.max_n, self.min_n)

    def observe(self, tokens: list[int]) -> None:
        pass
