"""Medusa's heads (export/drafters/medusa.py) on the native kernels: two products a proposal, no graph interpreter.

Head k is h ─► ResBlock × L (x + SiLU(W_kj x + b_kj)) ─► the shared LM head over the draft vocabulary. Every
head's first block reads the same h, so their K weights run as one product of K·H columns; deeper blocks
(L > 1) run per head; the shared head then takes the K heads' rows in one product. The products are the
target's int4 kernels (csrc/w4a8.h, via `spn_linear_run`), the SiLU and residual numpy's float32. A proposal
decides only what is drafted: the target's verify decides every token.

`medusa_unsupported(path)` says why a Medusa graph cannot run here (float weights, heads with LM heads of their
own); the runtime then runs it on ONNX Runtime (runtime/drafters/medusa.py).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from specrt.engines.native import calls, library
from specrt.engines.native.feature import read_graph
from specrt.engines.native.runner import check_threads
from specrt.engines.native.weights import Linear, float_projections, int4_projection
from specrt.errors import SpecrtError

BLOCK = re.compile(r"medusa_head\.(\d+)\.(\d+)\.linear\.weight")
OWN_HEADS = "medusa_head.lm_heads"  # export/drafters/medusa.py: one LM head per Medusa head, [K, H, V']


def medusa_unsupported(path: Path, cfg=None) -> str:
    """Why the Medusa graph at `path` cannot run natively, as a phrase; "" when it can. (`cfg`: unused, the
    signature of runtime/drafters/features.py's checks.)"""
    model, inits, _ = read_graph(path)
    if OWN_HEADS in inits:
        return "its heads have LM heads of their own"
    if float_projections(model):
        return "it has float projections (export it with --quantize int4)"
    return ""


def _stack(parts: list[Linear]) -> Linear:
    """Projections of one K side by side along N: one product computes them all."""
    first = parts[0]
    if any(p.k != first.k or p.format != first.format or (p.bias is None) != (first.bias is None) for p in parts):
        raise SpecrtError("internal: Medusa blocks of different shapes or formats cannot be stacked")
    cat = lambda name: None if getattr(first, name) is None else np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return dataclasses.replace(first, n=sum(p.n for p in parts), q=cat("q"), scales=cat("scales"), mins=cat("mins"),
                               bias=cat("bias"))


def _silu(y: np.ndarray) -> np.ndarray:
    """y·sigmoid(y) in float32 (a very negative y gives 0, not an overflow warning)."""
    with np.errstate(over="ignore"):
        return y / (np.float32(1) + np.exp(-y))


class NativeMedusaHeads:
    """`run(hidden [R, H])` -> logits [R, K, V'] over the draft vocabulary, as the graph computes them."""

    def __init__(self, path: Path, threads: int = 2, kernel: str = "auto"):
        why = medusa_unsupported(path)
        if why:
            raise SpecrtError(f"{path}: the native backend cannot run these Medusa heads: {why}")
        check_threads(threads)
        self.lib = library.load()
        self.kernel, self.kernel_record = library.kernel(kernel)
        self.threads = int(threads)
        self._handles: list[int] = []  # spn_linear_new's, freed with this object
        _, inits, by_weight = read_graph(path)
        found = sorted({(int(m[1]), int(m[2])) for w in by_weight if (m := BLOCK.match(w))})
        self.heads = 1 + max((k for k, _ in found), default=-1)
        self.layers = 1 + max((j for _, j in found), default=-1)
        if not found or len(found) != self.heads * self.layers:
            raise SpecrtError(f"{path}: Medusa blocks {found[:6]} are not K heads × L blocks: export the bundle again")

        def block(k: int, j: int) -> Linear:
            lin = int4_projection(path, inits, by_weight, f"medusa_head.{k}.{j}.linear.weight")
            bias = inits.get(f"medusa_head.{k}.{j}.linear.bias")
            if bias is not None:
                from specrt.engines.tables import tensor_array

                lin.bias = np.ascontiguousarray(tensor_array(path, bias), np.float32)
            return lin

        head = int4_projection(path, inits, by_weight, "lm_head.weight")
        self.hidden, self.vocab = head.k, head.n
        # products: the first blocks of every head at once, then each head's deeper blocks, then the shared head
        self._first = self._new(_stack([block(k, 0) for k in range(self.heads)]))
        self._deeper = [[self._new(block(k, j)) for j in range(1, self.layers)] for k in range(self.heads)]
        self._head = self._new(head)
        self.calls = 0

    def _new(self, lin: Linear) -> int:
        h = calls.linear_new(self.lib, lin)
        if not h:
            raise SpecrtError(f"native backend: loading a Medusa projection failed: {library.last_error()}")
        self._handles.append(h)
        return h

    def __del__(self):
        for h in getattr(self, "_handles", ()):
            self.lib.spn_linear_free(h)
        self._handles = []

    def _product(self, h: int, x: np.ndarray, n: int) -> np.ndarray:
        return calls.product(self.lib, h, library.KERNELS[self.kernel], self.threads, x, n, "Medusa product")

    def run(self, hidden: np.ndarray) -> np.ndarray:
        """hidden [R, H] -> logits [R, K, V']."""
        h = np.ascontiguousarray(hidden, np.float32)
        if h.ndim != 2 or h.shape[1] != self.hidden:
            raise SpecrtError(f"internal: Medusa heads read rows of {self.hidden}, given {h.shape}")
        r, width, heads = h.shape[0], self.hidden, self.heads
        self.calls += 1
        x = h[:, None, :] + _silu(self._product(self._first, h, heads * width).reshape(r, heads, width))
        for k, blocks in enumerate(self._deeper):
            for handle in blocks:
                xk = np.ascontiguousarray(x[:, k])
                x[:, k] = xk + _silu(self._product(handle, xk, width))
        rows = np.ascontiguousarray(x.reshape(r * heads, width))
        return self._product(self._head, rows, self.vocab).reshape(r, heads, self.vocab)
