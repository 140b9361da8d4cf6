"""Trees are data: a list of paths compiled once into mask, depths, parents and ranks.

A path like (0, 1) means "the 2nd candidate (rank 1) under the 1st candidate (rank 0) of the root".
Nodes are numbered in the verify window: 0 is the root (the last committed token), then every path
sorted by (depth, path) — so parents come before children and siblings are in rank order.

    paths [[0], [1], [0, 0], [0, 1], [0, 0, 0]]     window  0:root 1:(0) 2:(1) 3:(0,0) 4:(0,1) 5:(0,0,0)
    parents  [-1, 0, 0, 1, 1, 3]   depth [0, 1, 1, 2, 2, 3]   rank [0, 0, 1, 0, 1, 0]

`mask[i, j]` is true when node j is i itself or an ancestor of i: what tree attention lets i see.
A chain of k drafts is the one-path tree [[0], [0, 0], ...]. Dynamic trees (built by a drafter
per step) produce the same `Tree` through `Tree.from_parents`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError

EMPTY_TREE_FIX = ("a tree needs at least one path like [[0]]; for plain decoding use --drafter plain, and for the "
                  "default chain omit --tree")


@dataclass(frozen=True)
class Tree:
    parents: tuple[int, ...]  # per window node; -1 for the root
    ranks: tuple[int, ...]  # order among siblings (0 = first candidate); 0 for the root

    @classmethod
    def from_paths(cls, paths: list[list[int]] | list[tuple[int, ...]]) -> Tree:
        """The tree of `paths` (at least one: an empty tree drafts nothing, which is plain decoding)."""
        if not paths:
            raise SpecrtError(f"tree paths {list(paths)} are empty: {EMPTY_TREE_FIX}")
        norm = sorted({tuple(int(c) for c in p) for p in paths}, key=lambda p: (len(p), p))
        if len(norm) != len(paths):
            raise SpecrtError(f"tree paths contain duplicates: {paths}")
        index = {(): 0}
        parents, ranks = [-1], [0]
        for p in norm:
            if not p or min(p) < 0:
                raise SpecrtError(f"tree path {list(p)} is invalid: paths are non-empty lists of ranks >= 0")
            if p[:-1] not in index:
                raise SpecrtError(f"tree path {list(p)} has no parent path {list(p[:-1])}: list every prefix")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
                raise SpecrtError(f"tree path {list(p)} skips rank {p[-1] - 1}: siblings must be ranks 0..n-1")
            index[p] = len(parents)
            parents.append(index[p[:-1]])
            ranks.append(p[-1])
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def from_parents(cls, parents: list[int]) -> Tree:
        """A tree from window parent indices (parents[0] == -1, each parent before its child). The same
        parents give the same Tree object (compiled once: drafters propose a handful of shapes, step after
        step); its arrays are read-only."""
        return _from_parents(tuple(parents)) if cls is Tree else cls._build(list(parents))

    @classmethod
    def _build(cls, parents: list[int]) -> Tree:
        if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
            raise SpecrtError(f"invalid tree parents {parents}: root first, each parent before its child")
        seen: dict[int, int] = {}
        ranks = [0]
        for p in parents[1:]:
            ranks.append(seen.get(p, 0))
            seen[p] = ranks[-1] + 1
        return cls(tuple(parents), tuple(ranks))

    @classmethod
    def chain(cls, k: int) -> Tree:
        return cls.from_parents(list(range(-1, k)))

    # ── compiled views ──────────────────────────────────────────────────────────────────────
    @property
    def size(self) -> int:
        """Window length: root + drafted nodes."""
        return len(self.parents)

    @cached_property
    def depth(self) -> np.ndarray:
        if self.is_chain:
            return _frozen(np.arange(self.size, dtype=np.int64))
        d = np.zeros(self.size, np.int64)
        for i in range(1, self.size):
            d[i] = d[self.parents[i]] + 1
        return _frozen(d)

    @cached_property
    def mask(self) -> np.ndarray:
        if self.is_chain:
            return _frozen(np.tril(np.ones((self.size, self.size), bool)))
        m = np.eye(self.size, dtype=bool)
        for i in range(1, self.size):
            m[i] |= m[self.parents[i]]
        return _frozen(m)

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def paths(self) -> list[list[int]]:
        out: list[list[int]] = [[]]
        for i in range(1, self.size):
            out.append(out[self.parents[i]] + [self.ranks[i]])
        return out[1:]

    def kept(self, max_nodes: int, max_depth: int) -> list[int]:
        """The window nodes within both limits: a prefix in window order, depth <= max_depth. Every
        kept node's parent is kept (or is the root), so they still form a tree."""
        return [i for i in range(1, min(self.size, max_nodes + 1)) if self.depth[i] <= max_depth]

    def children(self, node: int) -> list[int]:
        return [i for i in range(1, self.size) if self.parents[i] == node]


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)  # shared by every step and sequence that drafts this shape
    return a


@lru_cache(maxsize=1024)  # shapes seen; a 64-node tree holds ~4 KB of mask
def _from_parents(parents: tuple[int, ...]) -> Tree:
    return Tree._build(list(parents))


# A sensible static tree for the default model: 12 nodes, deepest along the first candidates.
NAMED_TREES: dict[str, list[list[int]]] = {
    "default": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0],
                [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]],
    "wide": [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]],
    "binary": [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 0, 0, 0]],
}


def resolve_tree(spec: str | None, k: int) -> Tree:
    """`None`/"chain": a chain of k; a name from NAMED_TREES; or a JSON file holding a list of paths."""
    if spec in (None, "", "chain"):
        return Tree.chain(k)
    if spec in NAMED_TREES:
        return Tree.from_paths(NAMED_TREES[spec])
    path = Path(spec)
    if not path.is_file():
        raise SpecrtError(f"--tree {spec!r} is neither a tree name ({', '.join(['chain', *NAMED_TREES])}) "
                          "nor a JSON file of paths")
    try:
        paths = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise SpecrtError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}): expected a JSON list of paths "
                          "like [[0], [1], [0, 0]]") from None
    except OSError as e:
        raise SpecrtError(f"cannot read --tree file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SpecrtError(f"{path}: not valid JSON ({e.msg}): expected a list of paths like [[0], [1], [0, 0]]") from None
    if not isinstance(paths, list) or not all(isinstance(p, list) and all(type(c) is int for c in p) for p in paths):
        raise SpecrtError(f"{path}: expected a JSON list of paths (lists of integers, not true/false or 1.0) like "
                          "[[0], [1], [0, 0]]")
    if not paths:
        raise SpecrtError(f"{path}: the tree is empty ([]): {EMPTY_TREE_FIX}")
    return Tree.from_paths(paths)
