"""The static-tree level walk shared by the drafters that draft a fixed tree shape (the draft model,
EAGLE-1 and Medusa).

The tree is expanded level by level. At depth d, the children of each depth-(d-1) node p are, as
the tree's paths say, ranks 0..n-1 under p:

    greedy      child of rank r = the r-th best candidate under p      (`ranked(p, n)`, best first)
    sampling    every child an i.i.d. draw from p's distribution q     (`dist(p)`, recorded as q)

then, if a deeper level follows, the drafter evaluates the new level (`evaluate(level, drafted)`:
one pass over the nodes drafted so far) so that its nodes can be parents in turn. Random draws are
taken in window order, parents in ascending order and their children in rank order.

Nodes are the shape's window indices (0 = the root). What differs between drafters is only where
the candidates under a node come from, which the three callables say:

    draft model   its own logits at p (one tree-masked pass per level)
    EAGLE-1       the feature layer's logits at p (one tree-masked pass per level)
    Medusa        head depth(p)'s logits, whatever p is (no pass: `evaluate` is None)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import numpy as np

from specrt.plugins.rejection_sample import sample_from
from specrt.runtime.drafters import Proposal, renumber
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tree import Tree

Ranked = Callable[[int, int], Sequence[int]]  # (parent p, n) -> the n best token ids under p, best first
Dist = Callable[[int], np.ndarray]  # parent p -> the distribution (target vocabulary) p's children are drawn from
Evaluate = Callable[[list[int], dict[int, int]], None]  # (a level's nodes, node -> token so far) -> None


def sibling_groups(shape: Tree, level: list[int]) -> list[tuple[int, list[int]]]:
    """(parent, its children in `level` in rank order) for every parent of `level`, ascending."""
    return [(p, [i for i in level if shape.parents[i] == p]) for p in sorted({shape.parents[i] for i in level})]


def expand_static(shape: Tree, keep: list[int], sampling: SamplingParams, rng: np.random.Generator, *,
                  ranked: Ranked, dist: Dist, evaluate: Evaluate | None = None) -> Proposal:
    """Draft the nodes `keep` of `shape` (from `Tree.kept`) level by level; the proposal lists them
    in window order (with the distribution each was drawn from, when sampling)."""
    if not keep:
        return Proposal()
    drafted: dict[int, int] = {}
    q_rows: dict[int, np.ndarray] = {}
    last = int(shape.depth[keep].max())
    for d in range(1, last + 1):
        level = [i for i in keep if shape.depth[i] == d]
        for p, kids in sibling_groups(shape, level):
            if sampling.greedy:
                drafted.update(zip(kids, (int(t) for t in ranked(p, len(kids))), strict=True))
            else:
                q = dist(p)
                for i in kids:
                    drafted[i] = sample_from(q, float(rng.random()))
                    q_rows[i] = q
        if d < last and evaluate is not None:
            evaluate(level, drafted)
    q = None if sampling.greedy else np.stack([q_rows[i] for i in keep])
    return Proposal([drafted[i] for i in keep], renumber(keep, shape.parents), q)


def expand_by_depth(shape: Tree, keep: list[int], logits: np.ndarray, vocab, sampling: SamplingParams,
                    rng: np.random.Generator) -> Proposal:
    """`expand_static` where every node at depth d takes depth d's candidates, whatever its parent (Medusa's
    heads, the block drafter's rows): `logits[d-1]` over the draft vocabulary `vocab` (a DraftVocab), each
    depth ranked and warped once."""
    width = max(shape.ranks[i] for i in keep) + 1 if keep else 0
    top = cache(lambda d: vocab.top(logits[d], width))
    q = cache(lambda d: vocab.dist(logits[d], sampling))
    return expand_static(shape, keep, sampling, rng, ranked=lambda p, n: top(int(shape.depth[p]))[:n],
                         dist=lambda p: q(int(shape.depth[p])))
