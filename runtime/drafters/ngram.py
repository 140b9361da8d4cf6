"""Prompt lookup: find earlier occurrences of the context's suffix and propose what followed.

Chain: suffix sizes max_n down to min_n; the latest occurrence of the longest matching suffix wins,
and a match of n tokens proposes at most 2n.
Tree: several continuations (longest suffixes first, latest occurrences first, distinct ones only)
merged into a token trie. No model, no state; drafts are deterministic (one-hot q).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specrt.errors import SpecrtError
from specrt.runtime.drafters import Drafter, DrafterContext, Proposal


def _check(max_n: int, min_n: int) -> None:
    if min_n < 1 or max_n < min_n:
        raise SpecrtError(f"n-gram sizes must satisfy 1 <= min_n <= max_n (got min_n={min_n}, max_n={max_n})")


TOKENS_PER_MATCHED = 2  # a match of n tokens proposes at most 2n: short matches are weak evidence


def continuations(tokens, k: int, max_n: int = 3, min_n: int = 1, limit: int = 1) -> list[list[int]]:
    """Up to `limit` distinct continuations following earlier occurrences of a suffix.

    A continuation after an n-token match has at most min(k, 2n) tokens, so a lone 1-token match
    costs a short verify window rather than a long one that is rarely accepted.
    """
    _check(max_n, min_n)
    arr = np.asarray(tokens, dtype=np.int64)
    size = arr.shape[0]
    found: list[list[int]] = []
    if k <= 0:
        return found
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = arr[size - n:]
        windows = sliding_window_view(arr[: size - 1], n)  # every earlier start, not the suffix itself
        for hit in np.flatnonzero((windows == suffix).all(axis=1))[::-1]:
            cont = arr[hit + n : hit + n + min(k, TOKENS_PER_MATCHED * n)].tolist()
            if cont and cont not in found:
                found.append(cont)
                if len(found) == limit:
                    return found
    return found


def lookup(tokens, k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    found = continuations(tokens, k, max_n, min_n, limit=1)
    return found[0] if found else []


def trie(paths: list[list[int]], max_nodes: int) -> Proposal:
    """Merge token paths into a trie, nodes in insertion order (parents first, siblings by first use)."""
    prop, index = Proposal(), {}
    for path in paths:
        parent = 0
        for depth in range(len(path)):
            key = tuple(path[: depth + 1])
            if key not in index:
                if len(prop) == max_nodes:
                    return prop
                prop.tokens.append(path[depth])
                prop.parents.append(parent)
                index[key] = len(prop)
            parent = index[key]
    return prop


class NGram(Drafter):
    name = "ngram"

    def __init__(self, ctx: DrafterContext | None = None):
        opts = ctx.options if ctx else {}
        self.max_n = int(opts.get("ngram_max", 3))
        self.min_n = int(opts.get("ngram_min", 1))
        _check(self.max_n, self.min_n)
        tree = ctx.tree if ctx else None
        self.depth = int(tree.depth.max()) if tree is not None else 5
        self.branches = len(tree.children(0)) if tree is not None else 1
        self.nodes = tree.size - 1 if tree is not None else self.depth

    def propose(self, tokens, max_nodes, max_depth, sampling, rng) -> Proposal:
        k = min(self.depth, max_depth)
        paths = continuations(tokens, k, self.max_n, self.min_n, limit=self.branches)
        return trie(paths, min(self.nodes, max_nodes))

    def observe(self, tokens: list[int], state=None) -> None:
        pass
