"""Int4 blocks fitted to float weights (an HF folder, a GGUF's float tensors, `--requantize`): per block of 32
inputs, a scale d and a minimum m (the `q4_min` format a GGUF's Q4_1 uses: w ≈ d·q + m, q in 0..15), found
without calibration data by alternating the two steps of a least-squares fit:

    codes   q = clip(round((w - m) / d), 0, 15)      for the current d, m
    d, m    the least-squares line through (q, w)    for the current codes

from the block's own range (d = (max - min) / 15, m = min), keeping each block's best fit. Symmetric
round-to-nearest spends one of its 16 levels on nothing and centres every block on zero; this grid follows
each block's range and then its error. docs/quality.md measures both against the float model.
"""

from __future__ import annotations

import numpy as np

from specrt.export.gguf_blocks import BLOCK, Blocks

ROUNDS = 4  # code / line alternations after the range start; the error stops falling after 2-3


def _codes(x: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    safe = np.where(d > 0, d, 1.0)
    return np.where(d[..., None] > 0, np.clip(np.rint((x - m[..., None]) / safe[..., None]), 0, 15), 0)


def _error(x: np.ndarray, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    return np.square(q * d[..., None] + m[..., None] - x).sum(-1)


def fit_q4_min(w: np.ndarray) -> Blocks:
    """Weight rows w [N, K] (K a whole number of blocks) as q4_min blocks."""
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"rows of {k} inputs are not whole blocks of {BLOCK}")
    x = w.astype(np.float64).reshape(n, k // BLOCK, BLOCK)
    lo, hi = x.min(-1), x.max(-1)
    d, m = (hi - lo) / 15, lo
    q = _codes(x, d, m)
    best = (q, d, m, _error(x, q, d, m))
    for _ in range(ROUNDS):
        sq, sqq = q.sum(-1), np.square(q).sum(-1)
        sx, sqx = x.sum(-1), (q * x).sum(-1)
        det = BLOCK * sqq - sq * sq
        ok = det > 0
        d = np.where(ok, (BLOCK * sqx - sq * sx) / np.where(ok, det, 1), best[1])
        d = np.where(d > 0, d, best[1])
        m = np.where(ok, (sx - d * sq) / BLOCK, best[2])
        q = _codes(x, d, m)
        err = _error(x, q, d, m)
        better = err < best[3]
        best = (np.where(better[..., None], q, best[0]), np.where(better, d, best[1]), np.where(better, m, best[2]),
                np.where(better, err, best[3]))
    q, d, m = best[0].astype(np.uint8), best[1].astype(np.float32), best[2].astype(np.float32)
    q = np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4))  # MatMulNBits' packing: input 2j low nibble
    return Blocks("q4_min", k, q, d, m)
