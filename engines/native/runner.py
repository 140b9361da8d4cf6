"""The native backend: a bundle's int4 target run by specrt's own kernels (csrc/), every row of every pass
computed by one per-row arithmetic, so a pass over many rows gives each row bitwise what a one-row pass gives.

KV buffers are numpy arrays of the `ort` backend's layout ([batch, kv_heads, capacity, head_dim] per layer,
key and value), written in place by the pass; `compact` moves accepted tree rows as the `ort` runner does.
They hold float16 (`kv_dtype`, the default: what the runtime's `--kv-dtype auto` runs, so a store's
answers, cost curves and exactness checks see the cache the runtime has) or float32; a half is each key
and value rounded to nearest when it is written, read back exactly, so a row's arithmetic still depends on
that row alone; half the bytes for attention to read (it streams every sequence's cache in every layer)
and for the cache to hold. `int8` (--kv-dtype int8) holds each row of a head as blocks of 32 codes and a
float scale (the activations' rounding rule, csrc/ops.inc to_q8; [.., capacity, head_dim / 32 * 36] bytes):
0.56 of a half cache's bytes. Its rounding is coarser than a half's, so it changes what the model computes
(as llama.cpp's q8_0 cache does), and like a half it is a function of the row alone: speculation stays
exact against plain decoding on the same cache.
Output buffers are reused across passes while nothing else refers to them (as engines/ort_cpu/runner.py).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

from specrt.engines.decoder import Decoder, compact_host_kv
from specrt.engines.native import calls, library
from specrt.engines.native.weights import PROJECTIONS, read, rope_tables
from specrt.errors import SpecrtError
from specrt.schema.config import DecoderConfig


def check_threads(threads: int) -> None:
    if not 1 <= int(threads) <= library.MAX_THREADS:
        raise SpecrtError(f"--threads {threads}: the native backend runs 1 to {library.MAX_THREADS} threads, and "
                          "more than this machine's CPUs only slow it: use --threads $(nproc) or fewer")


# --kv-dtype -> (csrc/ops.h KvFormat, the buffers' numpy dtype, a row's size in that dtype for head size d):
# int8 rows are blocks of 32 values, each a float32 scale then 32 int8 codes (36 bytes)
KV_DTYPES = {"fp32": (0, np.float32, lambda d: d), "fp16": (1, np.float16, lambda d: d),
             "int8": (2, np.int8, lambda d: d // 32 * 36)}


class NativeDecoder(Decoder):
    def __init__(self, path: Path, cfg: DecoderConfig, capacity: int, threads: int = 2, batch: int = 1,
                 spin: bool = True, kernel: str = "auto", kv_dtype: str = "fp16"):
        if kv_dtype not in KV_DTYPES:
            raise SpecrtError(f"--kv-dtype {kv_dtype!r}: the native backend's KV cache is one of {', '.join(KV_DTYPES)}")
        if not Path(path).is_file():
            raise SpecrtError(f"ONNX graph {path} is missing: export the bundle again")
        check_threads(threads)
        self.lib = library.load()
        self.kernel, self.kernel_record = library.kernel(kernel)
        w = read(Path(path), cfg)
        self.path, self.cfg, self.capacity, self.batch, self.threads = Path(path), cfg, capacity, batch, threads
        self.taps = list(w.taps)
        lib = self.lib
        h = lib.spn_model_new(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              cfg.intermediate_size, cfg.vocab_size, float(cfg.rms_norm_eps), float(cfg.embed_scale),
                              library.KERNELS[self.kernel], int(threads), 0)
        if not h:
            raise SpecrtError(f"native backend: {library.last_error()}")
        self._h = h
        self._embed = w.embed  # read in place (spn_use_embed): one table in memory, kept alive here
        ok = calls.use_embed(lib, h, self._embed) and calls.set_norm(lib, h, 0, 2, w.final_norm)
        for i, ((ln1, ln2), projections) in enumerate(zip(w.norms, w.layers, strict=True)):
            ok &= calls.set_norm(lib, h, i, 0, ln1) and calls.set_norm(lib, h, i, 1, ln2)
            for which, name in enumerate(PROJECTIONS):
                ok &= calls.set_linear(lib, h, i, which, projections[name])
        ok &= calls.set_linear(lib, h, -1, 0, w.head)
        # positions a pass may reach: the KV rows plus the padded rows an execution mode adds
        self.rope_rows = capacity + 64
        ok &= calls.set_rope(lib, h, *rope_tables(cfg, self.rope_rows))
        ok &= calls.set_taps(lib, h, self.taps)
        fmt, dtype, row = KV_DTYPES[kv_dtype]
        ok &= lib.spn_set_kv_format(h, fmt) == 0
        if not ok:
            raise SpecrtError(f"native backend: loading {path} failed: {library.last_error()}")
        shape = (batch, cfg.num_kv_heads, capacity, row(cfg.head_dim))
        self.kv_dtype = kv_dtype
        # every layer's keys and values in one allocation (numpy advises 2 MiB pages for one this large, as
        # csrc/arena.h does for the weights: passes at context 800 ran 0.93x their time on 60 small arrays)
        self._kv_block = np.zeros((2 * cfg.num_layers, *shape), dtype)
        self.kv = list(self._kv_block)
        self._slot_stride = cfg.num_kv_heads * capacity * shape[3]
        self._kv_ptrs: dict[int, ctypes.Array] = {}
        self.slots = (0, batch)
        self._outputs: dict[str, list] = {}

    def __del__(self):
        h = getattr(self, "_h", None)
        if h:
            self.lib.spn_model_free(h)
            self._h = None

    def tap(self, layers: list[int]) -> None:
        """Output the inputs of `layers` as aux_hidden_states from now on (a distillation store's taps, which
        may differ from the graph's own)."""
        if not calls.set_taps(self.lib, self._h, list(layers)):
            raise SpecrtError(f"native backend: taps {list(layers)}: {library.last_error()}")
        self.taps = list(layers)

    def output_shape(self, name: str) -> tuple | None:
        cfg = self.cfg
        shapes = {"logits": ("batch", "rows", cfg.vocab_size), "hidden_states": ("batch", "tokens", cfg.hidden_size)}
        if self.taps:
            shapes["aux_hidden_states"] = ("batch", "tokens", len(self.taps) * cfg.hidden_size)
        return shapes.get(name)

    def select(self, start: int, stop: int) -> None:
        self.check_slots(start, stop)
        self.slots = (start, stop)

    def _kv_pointers(self, start: int) -> ctypes.Array:
        if start not in self._kv_ptrs:
            arr = (ctypes.c_void_p * len(self.kv))(*[buf[start].ctypes.data for buf in self.kv])
            self._kv_ptrs[start] = arr
        return self._kv_ptrs[start]

    def _buffer(self, name: str, shape: tuple) -> np.ndarray:
        """Output `name`'s buffer: the last one when it has `shape` and the caller no longer holds it."""
        held = self._outputs.get(name)
        if held is not None and held[0].shape == shape and sys.getrefcount(held[0]) == held[1]:
            return held[0]
        buf = np.empty(shape, np.float32)
        self._outputs[name] = held = [buf, 0]
        held[1] = sys.getrefcount(buf) - 1  # this list's reference, with `buf` gone at return
        return buf

    def run_all(self, input_ids, position_ids, past_len, tree_mask, logits_index, **extra) -> dict[str, np.ndarray]:
        if extra:
            raise SpecrtError(f"the native backend's target graph takes no input {', '.join(sorted(extra))}")
        start, stop = self.slots
        ids = np.ascontiguousarray(input_ids, np.int64)
        b, t = ids.shape
        if b != stop - start:
            raise SpecrtError(f"internal: a pass of {b} sequences over slots {start}..{stop - 1}")
        pos = np.ascontiguousarray(position_ids, np.int64).reshape(b, t)
        past = np.ascontiguousarray(past_len, np.int64).reshape(b)
        mask = np.ascontiguousarray(tree_mask, np.bool_).reshape(b, t, t)
        index = np.ascontiguousarray(logits_index, np.int64)
        r = index.shape[1]
        self.check_rows(past, t)
        if int(pos.max(initial=0)) >= self.rope_rows:
            raise SpecrtError(f"position {int(pos.max())} is past this decoder's rotary table ({self.rope_rows} rows)")
        cfg = self.cfg
        out = {"logits": self._buffer("logits", (b, r, cfg.vocab_size)),
               "hidden_states": self._buffer("hidden_states", (b, t, cfg.hidden_size))}
        if self.taps:
            out["aux_hidden_states"] = self._buffer("aux_hidden_states", (b, t, len(self.taps) * cfg.hidden_size))
        rc = self.lib.spn_pass(self._h, b, t, calls.ptr(ids), calls.ptr(pos), calls.ptr(past), calls.ptr(mask), r, calls.ptr(index),
                               self._kv_pointers(start), self._slot_stride, self.capacity, calls.ptr(out["logits"]),
                               calls.ptr(out["hidden_states"]), calls.ptr(out.get("aux_hidden_states")))
        if rc != 0:
            raise SpecrtError(f"native pass failed: {library.last_error()}")
        return out

    def run_ragged(self, pack) -> dict[str, np.ndarray]:
        """A pass over the selected slots without padding rows (runtime/batch.py's `Ragged`: each slot's
        window one after the other; an idle slot has none): logits [Σ nlogits, V], hidden_states
        [Σ rows, H], aux_hidden_states [Σ rows, taps·H]. Every size is checked here before the call."""
        start, stop = self.slots
        b = stop - start
        rows, nlogits = np.ascontiguousarray(pack.rows, np.int64), np.ascontiguousarray(pack.nlogits, np.int64)
        ids, pos = np.ascontiguousarray(pack.ids, np.int64), np.ascontiguousarray(pack.pos, np.int64)
        past = np.ascontiguousarray(pack.past, np.int64)
        mask = np.ascontiguousarray(pack.mask, np.uint8)
        index = np.ascontiguousarray(pack.logits_index, np.int64)
        m, rt = int(rows.sum()), int(nlogits.sum())
        if (rows.shape != (b,) or nlogits.shape != (b,) or past.shape != (b,) or ids.shape != (m,) or pos.shape != (m,)
                or mask.shape != (int((rows * rows).sum()),) or index.shape != (rt,) or m < 1 or rt < 1
                or (rows < 0).any() or (nlogits < 0).any()):
            raise SpecrtError(f"internal: a ragged pass over slots {start}..{stop - 1} with inconsistent sizes")
        self.check_rows(past + rows, 0)  # each slot's last row
        if int(pos.max()) >= self.rope_rows:
            raise SpecrtError(f"position {int(pos.max())} is past this decoder's rotary table ({self.rope_rows} rows)")
        cfg = self.cfg
        out = {"logits": self._buffer("logits", (rt, cfg.vocab_size)),
               "hidden_states": self._buffer("hidden_states", (m, cfg.hidden_size))}
        if self.taps:
            out["aux_hidden_states"] = self._buffer("aux_hidden_states", (m, len(self.taps) * cfg.hidden_size))
        rc = self.lib.spn_pass_ragged(self._h, b, calls.ptr(rows), calls.ptr(nlogits), calls.ptr(ids), calls.ptr(pos),
                                      calls.ptr(past), calls.ptr(mask), calls.ptr(index), self._kv_pointers(start),
                                      self._slot_stride, self.capacity, calls.ptr(out["logits"]),
                                      calls.ptr(out["hidden_states"]), calls.ptr(out.get("aux_hidden_states")))
        if rc != 0:
            raise SpecrtError(f"native pass failed: {library.last_error()}")
        return out

    def compact(self, dst: int, rows: list[int], slot: int | None = None) -> None:
        compact_host_kv(self.kv, dst, rows, slot)
