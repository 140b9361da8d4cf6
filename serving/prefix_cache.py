"""Automatic prefix caching: the KV rows of prompts the server has computed, reused by the next request
whose prompt starts with the same tokens (vLLM's automatic prefix caching, llama.cpp's `cache_prompt`).

    match(tokens)        -> [Block]   the cached blocks of the longest prefix of `tokens` short of its last
                                      token (a prompt prefills at least one row: its logits give the first
                                      new token)
    insert(tokens, read) -> int       the full blocks of `tokens` not cached yet, their rows copied out by
                                      read(start, stop); the blocks added

A prefix is cut into blocks of `block` tokens. A block is keyed by its parent block's id and its own tokens,
compared exactly: no hash stands in for tokens, so a collision cannot hand a request another prompt's rows.
The scheduler (serving/core.py) copies a new request's matched rows into its KV slot and prefills the
rest; its prompt's rows join the cache after its last prompt chunk, its answer's when it ends (so the
next turn of a conversation, which resends both, finds them).

Exact by the kernels' batch invariance: a KV row depends on the tokens at and before it, never on the pass
that wrote it (its chunk, its batch, a verify window), so a copied row is bitwise the row a prefill would
write, and a served answer stays the plain single-request answer (tests/serving/test_prefix_cache.py).
Where the target is not exact (`--allow-inexact`), copied rows are as exact as the passes are.

Memory is bounded by `capacity_bytes`: when a new block does not fit, the least recently used leaf blocks
go first (a block whose children are cached stays: they would be unreachable without it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

BLOCK = 8  # tokens a block: SmolLM2's chat template shares its first 24 tokens across every request
DEFAULT_MB = 256


def cache_mb(requested: int | None, host_kv: bool) -> int:
    """The prefix cache's megabytes for `--prefix-cache-mb requested` (None: DEFAULT_MB where the target's
    KV rows are in host memory, else none; the scheduler refuses a size it cannot honour)."""
    if requested is None:
        return DEFAULT_MB if host_kv else 0
    return int(requested)


@dataclass(eq=False)
class Block:
    id: int
    parent: Block | None
    key: tuple
    rows: np.ndarray  # [2 * layers, kv_heads, block, head_dim], TargetModel.kv_rows' layout
    children: int = 0
    used: int = 0  # the cache's clock when a request last matched or wrote it


class PrefixCache:
    def __init__(self, capacity_bytes: int, block: int = BLOCK):
        if block < 1 or capacity_bytes < 0:
            raise ValueError(f"a prefix cache of {capacity_bytes} bytes in blocks of {block} tokens")
        self.capacity, self.block = int(capacity_bytes), int(block)
        self.blocks: dict[tuple, Block] = {}
        self.nbytes = 0
        self._ids, self._clock = itertools.count(1), itertools.count(1)

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, tokens) -> list[Block]:
        path, parent = [], 0
        for i in range((len(tokens) - 1) // self.block):
            blk = self.blocks.get((parent, tuple(tokens[i * self.block : (i + 1) * self.block])))
            if blk is None:
                break
            path.append(blk)
            parent = blk.id
        now = next(self._clock)
        for blk in path:
            blk.used = now
        return path

    def insert(self, tokens, read: Callable[[int, int], np.ndarray]) -> int:
        path, parent, fresh, added = [], None, None, 0
        for i in range(len(tokens) // self.block):
            key = (parent.id if parent else 0, tuple(tokens[i * self.block : (i + 1) * self.block]))
            blk = self.blocks.get(key)
            if blk is None:
                if fresh is None:  # the rows from here to the last full block, copied out at once
                    start = i * self.block
                    fresh = read(start, len(tokens) // self.block * self.block)
                rows = fresh[:, :, i * self.block - start : (i + 1) * self.block - start].copy()
                if not self._make_room(rows.nbytes, keep=parent):
                    break
                blk = self.blocks[key] = Block(next(self._ids), parent, key, rows)
                self.nbytes += rows.nbytes
                added += 1
                if parent is not None:
                    parent.children += 1
            path.append(blk)
            parent = blk
        now = next(self._clock)
        for blk in path:
            blk.used = now
        return added

    def _make_room(self, size: int, keep: Block | None) -> bool:
        """Evict least recently used leaves until `size` more bytes fit (never `keep`, the block the new one
        hangs from); False when they cannot."""
        if size > self.capacity:
            return False
        while self.nbytes + size > self.capacity:
            leaves = sorted((b for b in self.blocks.values() if b.children == 0 and b is not keep),
                            key=lambda b: b.used)
            if not leaves:
                return False
            for victim in leaves:
                if self.nbytes + size <= self.capacity:
                    break
                self._drop(victim)
        return True

    def _drop(self, blk: Block) -> None:
        del self.blocks[blk.key]
        self.nbytes -= blk.rows.nbytes
        if blk.parent is not None:
            blk.parent.children -= 1
