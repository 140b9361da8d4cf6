"""One target pass over several sequences, and each sequence's share of its outputs.

    padded   pack_windows (runtime/sequence.py): every window padded to the longest, outputs [B, T, ...]
    ragged   pack_ragged: the windows one after the other, no padding rows (a slot with nothing to run
             has none), outputs [Σ rows, ...]; on a backend that runs such passes (native)

`BatchOutputs.of(i)` gives sequence i's outputs shaped as a batch-1 pass gives them (logits [1, R_i, V],
hidden_states [1, T_i, H], ...), whichever way the pass was packed, so a sequence commits from either.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.runtime.sequence import Pass

ROW_OUTPUTS = ("hidden_states", "aux_hidden_states")  # outputs with a row per window row (logits: per asked row)


@dataclass
class Ragged:
    """The inputs of a ragged pass over consecutive KV slots, one entry per slot."""

    ids: np.ndarray  # [Σ rows] int64
    pos: np.ndarray  # [Σ rows] int64
    past: np.ndarray  # [B] int64
    mask: np.ndarray  # [Σ rows²] uint8: each window's tree mask, flattened, one after the other
    rows: np.ndarray  # [B] int64: window rows of each slot (0: an idle slot)
    nlogits: np.ndarray  # [B] int64: logits rows each slot asks for
    logits_index: np.ndarray  # [Σ nlogits] int64: within each slot's own window


def pack_ragged(plans: list[Pass | None]) -> Ragged:
    """The windows of `plans` (one per consecutive KV slot; None, or a placeholder asking for no logits: an
    idle slot, which runs no row) one after the other."""
    plans = [p if p is not None and len(p.rows) else None for p in plans]
    live = [p for p in plans if p is not None]
    rows = np.array([0 if p is None else len(p.window) for p in plans], np.int64)
    nlogits = np.array([0 if p is None else len(p.rows) for p in plans], np.int64)
    past = np.array([0 if p is None else p.past for p in plans], np.int64)
    return Ragged(np.concatenate([p.window for p in live]).astype(np.int64),
                  np.concatenate([p.past + p.tree.depth for p in live]).astype(np.int64), past,
                  np.concatenate([np.asarray(p.tree.mask, np.uint8).reshape(-1) for p in live]),
                  rows, nlogits, np.concatenate([np.asarray(p.rows, np.int64) for p in live]))


class BatchOutputs:
    """A pass's outputs and how they split per sequence: padded ([B, ...] each) or ragged (`rows`,
    `nlogits`: each sequence's window rows and logits rows, its outputs one after the other)."""

    def __init__(self, outs: dict[str, np.ndarray], rows: np.ndarray | None = None,
                 nlogits: np.ndarray | None = None):
        self.outs = outs
        self._ragged = rows is not None
        if self._ragged:
            self._start = np.concatenate([[0], np.cumsum(rows)])
            self._rstart = np.concatenate([[0], np.cumsum(nlogits)])

    def of(self, i: int) -> dict[str, np.ndarray]:
        """Sequence i's outputs as a batch-1 pass gives them."""
        if not self._ragged:
            return {k: v[i : i + 1] for k, v in self.outs.items()}
        s, e, rs, re = self._start[i], self._start[i + 1], self._rstart[i], self._rstart[i + 1]
        return {k: (v[s:e] if k in ROW_OUTPUTS else v[rs:re])[None] for k, v in self.outs.items()}
