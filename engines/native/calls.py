"""The library's setters and products called with numpy arrays: each array's dtype and layout are made what
the C side reads, and its element count goes along, so the C side checks every size against the model's
dimensions before it reads (csrc/model.cpp) and a wrong call is an error, not a read past an end."""

from __future__ import annotations

import ctypes

import numpy as np

from specrt.engines.native.weights import FORMATS, Linear
from specrt.engines.tables import EmbeddingTable


def f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32)


def ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def use_embed(lib: ctypes.CDLL, h: int, table: EmbeddingTable) -> bool:
    """The table (float rows or int8 blocks) is read in place: the caller keeps it alive while the model is."""
    if table.dense is None:
        codes, scales = table.codes, table.scales
        if codes.dtype != np.uint8 or scales.dtype != np.float32 or not (codes.flags.c_contiguous and
                                                                        scales.flags.c_contiguous):
            return False
        return lib.spn_use_embed_blocks(h, ptr(codes), codes.size, ptr(scales), scales.size, codes.shape[0],
                                        codes.shape[1], table.block) == 0
    dense = table.dense
    if dense.ndim != 2 or dense.dtype != np.float32 or not dense.flags.c_contiguous:
        return False
    return lib.spn_use_embed(h, ptr(dense), dense.shape[0], dense.shape[1]) == 0


def set_norm(lib: ctypes.CDLL, h: int, layer: int, which: int, weights: np.ndarray) -> bool:
    w = f32(weights).reshape(-1)
    return lib.spn_set_norm(h, layer, which, ptr(w), w.size) == 0


def _linear_args(lin: Linear) -> tuple:
    """(arrays kept alive, the C call's weight arguments: format, K, N, q, scales, mins, bias and their sizes)."""
    q = np.ascontiguousarray(lin.q).view(np.uint8) if np.asarray(lin.q).dtype.itemsize == 1 else None
    if q is None:
        raise ValueError(f"a projection's blocks are bytes (uint8 or int8), not {np.asarray(lin.q).dtype}")
    s = f32(lin.scales)
    m = None if lin.mins is None else f32(lin.mins)
    b = None if lin.bias is None else f32(lin.bias)
    if lin.format not in FORMATS:
        raise ValueError(f"weight format {lin.format!r}: one of {', '.join(FORMATS)}")
    args = (FORMATS[lin.format], lin.k, lin.n, ptr(q), q.size, ptr(s), s.size, ptr(m), 0 if m is None else m.size,
            ptr(b), 0 if b is None else b.size)
    return (q, s, m, b), args


def set_linear(lib: ctypes.CDLL, h: int, layer: int, which: int, lin: Linear) -> bool:
    _keep, args = _linear_args(lin)
    return lib.spn_set_linear(h, layer, which, *args) == 0


def set_rope(lib: ctypes.CDLL, h: int, cos: np.ndarray, sin: np.ndarray) -> bool:
    cos, sin = f32(cos), f32(sin)
    if cos.ndim != 2 or cos.shape != sin.shape:
        return False
    return lib.spn_set_rope(h, cos.shape[0], cos.shape[1], ptr(cos), ptr(sin)) == 0


def set_taps(lib: ctypes.CDLL, h: int, taps: list[int]) -> bool:
    t = np.asarray(taps, np.int32)
    return lib.spn_set_taps(h, len(t), ptr(t)) == 0


def linear_new(lib: ctypes.CDLL, lin: Linear) -> int | None:
    """A product of its own (spn_linear_run); None when refused (library.last_error says why)."""
    _keep, args = _linear_args(lin)
    return lib.spn_linear_new(*args)


def linear_factors(lib: ctypes.CDLL, h: int) -> dict[str, str]:
    """How a product keeps its scales and minimums: "half" (every one a half exactly) or "float"."""
    bits = lib.spn_linear_factors(h)
    return {"scales": "half" if bits & 1 else "float", "mins": "half" if bits & 2 else "float"}


def linear_streams(lib: ctypes.CDLL, h: int) -> bool:
    """Whether a product's weights are prefetched non-temporal (SPECRT_NATIVE_STREAM, read when it was made)."""
    return bool(lib.spn_linear_factors(h) & 4)


def linear_run(lib: ctypes.CDLL, h: int, kernel: int, threads: int, x: np.ndarray, y: np.ndarray) -> int:
    """y[M, N] = x[M, K] · W on kernel code `kernel`; 0 when done."""
    for a in (x, y):
        if a.dtype != np.float32 or not a.flags.c_contiguous or a.ndim != 2:
            raise ValueError("linear_run takes C-contiguous float32 [rows, columns] arrays")
    return lib.spn_linear_run(h, kernel, threads, x.shape[0], ptr(x), x.size, ptr(y), y.size)


def product(lib: ctypes.CDLL, h: int, kernel: int, threads: int, x: np.ndarray, n: int, what: str) -> np.ndarray:
    """x[M, K] · W as a new [M, n] array (linear_run); a failure is a SpecrtError naming `what`."""
    from specrt.engines.native import library
    from specrt.errors import SpecrtError

    y = np.empty((x.shape[0], n), np.float32)
    if linear_run(lib, h, kernel, threads, x, y) != 0:
        raise SpecrtError(f"native {what} failed: {library.last_error()}")
    return y


def model_pages(lib: ctypes.CDLL, h: int) -> dict[str, int | bool]:
    """Where a model's weights live (csrc/arena.h): the bytes its arena handed out, and whether the system took
    the advice to back them with 2 MiB pages (False under SPECRT_NATIVE_HUGE_PAGES=0 or without huge pages)."""
    out = (ctypes.c_int64 * 2)()
    lib.spn_model_pages(h, out)
    return {"bytes": int(out[0]), "huge_pages": bool(out[1])}
