"""Execution modes of the target: how each pass is shaped so that rows do not depend on the pass.

On some CPUs a weight-only int4 MatMul computes a row in an M=1 call with other code (a GEMV) than
the same row in an M≥2 call (a GEMM), while every M≥2 call agrees bit for bit. A k-row verify pass
and plain decoding's one-row passes then disagree, and speculative greedy output drifts from plain
greedy output. A mode that pads every pass to at least `min_rows` window rows, and asks logits for
at least `min_rows` rows, keeps every call on the GEMM path:

    window   [x, d1]          ─► [x, d1, pad]         pad: token 0 at the root's position, sees only
    logits   rows [0, 1]      ─► rows [0, 1, 1]       itself; its KV row lies past the window and is
                                                      overwritten by the next pass
Padding rows are cut off the outputs, so callers never see them. What the kernels see is the pass's
rows over all its sequences (batch × window), so a pass over several sequences that already has
`min_rows` rows is not padded (a batch of single rows stays a batch of single rows, the only batch
GroupQueryAttention takes after a prefix). Which mode a machine needs is measured there
(runtime/invariance.py); the modes are data, tried cheapest first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrt.errors import SpecrtError


@dataclass(frozen=True)
class ExecMode:
    name: str
    min_rows: int  # every pass has at least this many window rows and logits rows
    summary: str


MODES: dict[str, ExecMode] = {m.name: m for m in (
    ExecMode("direct", 1, "passes as the runtime asks for them (no padding)"),
    ExecMode("pad2", 2, "every pass padded to at least 2 rows (int4 GEMM path for single tokens)"),
    ExecMode("pad4", 4, "every pass padded to at least 4 rows"),
)}
MAX_PAD_ROWS = max(m.min_rows for m in MODES.values()) - 1  # KV rows a padded pass may write past the window


def exec_mode(name: str) -> ExecMode:
    if name not in MODES:
        raise SpecrtError(f"unknown execution mode {name!r}: choose auto or one of {', '.join(MODES)}")
    return MODES[name]


def pad_pass(min_rows: int, input_ids, position_ids, past_len, tree_mask, logits_index):
    """The pass's inputs with each sequence's window and `logits_index` padded (repeating its last row)
    so that the pass has at least `min_rows` rows over all its sequences; unchanged when it has."""
    b, t = input_ids.shape
    rows = -(-min_rows // b)  # per sequence
    if t < rows:
        extra = rows - t
        input_ids = np.concatenate([input_ids, np.zeros((b, extra), input_ids.dtype)], axis=1)
        position_ids = np.concatenate([position_ids, np.repeat(position_ids[:, :1], extra, axis=1)], axis=1)
        mask = np.zeros((b, rows, rows), bool)
        mask[:, :t, :t] = tree_mask
        mask[:, np.arange(t, rows), np.arange(t, rows)] = True  # padding rows see only themselves
        tree_mask = mask
    r = logits_index.shape[1]
    if r < rows:
        logits_index = np.concatenate([logits_index, np.repeat(logits_index[:, -1:], rows - r, axis=1)], axis=1)
    return input_ids, position_ids, past_len, tree_mask, logits_index


class ShapedDecoder:
    """A backend decoder whose every pass is shaped by an execution mode; everything else (KV buffers,
    slot selection, compaction, the session) is the wrapped decoder's."""

    def __init__(self, inner, mode: ExecMode):
        self.inner, self.mode = inner, mode

    def __getattr__(self, name):  # kv, session, select, compact, capacity, batch, cfg, ...
        return getattr(self.inner, name)

    def run_all(self, input_ids, position_ids, past_len, tree_mask, logits_index, **extra) -> dict:
        b, t, r = input_ids.shape[0], input_ids.shape[1], logits_index.shape[1]
        if b * t >= self.mode.min_rows and b * r >= self.mode.min_rows:  # the kernels' M: batch × rows
            return self.inner.run_all(input_ids, position_ids, past_len, tree_mask, logits_index, **extra)
        padded = pad_pass(self.mode.min_rows, input_ids, position_ids, past_len, tree_mask, logits_index)
        extra = {k: _pad_rows(v, padded[0].shape[1]) for k, v in extra.items()}
        outs = self.inner.run_all(*padded, **extra)
        return {k: v[:, :r] if k == "logits" else v[:, :t] for k, v in outs.items()}

    def run(self, input_ids, position_ids, past_len, tree_mask, logits_index, **extra):
        outs = self.run_all(input_ids, position_ids, past_len, tree_mask, logits_index, **extra)
        return outs["logits"], outs["hidden_states"]


def _pad_rows(value: np.ndarray, rows: int) -> np.ndarray:
    """Per-row extra inputs (e.g. a drafter's hidden_in [B,T,H]) padded with zero rows."""
    value = np.asarray(value)
    if value.ndim < 2 or value.shape[1] >= rows:
        return value
    pad = np.zeros((value.shape[0], rows - value.shape[1], *value.shape[2:]), value.dtype)
    return np.concatenate([value, pad], axis=1)


def shaped(decoder, mode: ExecMode):
    """`decoder` as `mode` runs it (itself for `direct`)."""
    return decoder if mode.min_rows <= 1 else ShapedDecoder(decoder, mode)
