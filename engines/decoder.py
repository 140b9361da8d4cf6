"""The one protocol every backend's runner implements: a decoder graph with its KV cache bound in place.

    run(input_ids, position_ids, past_len, tree_mask, logits_index, **extra) -> (logits, hidden_states)
    run_all(...) -> {output name: array}      every output, for callers that need more (EAGLE-3's taps)
    select(start, stop)                        which KV slots the next passes run over
    output_shape(name) -> shape | None         a non-KV output's static shape, as the graph/engine declares it
    output_width(name) -> int | None           its last axis when static (EAGLE-3's aux_hidden_states: n·H)
    compact(dst, rows, slot)                   accepted tree nodes' KV rows moved next to the prefix
    capacity / batch                           KV rows per sequence / sequences in the cache

A runner is built by `specrt.engines.registry.open_decoder`; the runtime sees only this class.
"""

from __future__ import annotations

import numpy as np

from specrt.errors import SpecrtError


class Decoder:
    """What every runner offers on top of its own `run_all` (engines/ort_cpu, ort_device, trt)."""

    def run_all(self, input_ids, position_ids, past_len, tree_mask, logits_index, **extra) -> dict:
        raise NotImplementedError

    def output_shape(self, name: str) -> tuple | None:
        """The declared shape of non-KV output `name` (dynamic axes: a name, None or -1, as the backend
        writes them); None when the graph has no such output."""
        raise NotImplementedError

    def output_width(self, name: str) -> int | None:
        """The static size of output `name`'s last axis; None when there is no such output or that
        axis is dynamic. How the runtime sizes buffers for optional outputs (aux_hidden_states)."""
        shape = self.output_shape(name)
        last = shape[-1] if shape else None
        return int(last) if isinstance(last, (int, np.integer)) and last >= 0 else None

    def run(self, input_ids: np.ndarray, position_ids: np.ndarray, past_len: np.ndarray,
            tree_mask: np.ndarray, logits_index: np.ndarray, **extra: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One forward pass; returns (logits [B,R,V], hidden_states [B,T,H]). KV is updated in place."""
        outs = self.run_all(input_ids, position_ids, past_len, tree_mask, logits_index, **extra)
        return outs["logits"], outs["hidden_states"]

    def select(self, start: int, stop: int) -> None:
        """Make the next passes run over sequence slots start..stop-1 (a batch-1 decoder has slot 0 only)."""
        self.check_slots(start, stop)

    def check_slots(self, start: int, stop: int) -> None:
        if not 0 <= start < stop <= self.batch:
            raise SpecrtError(f"internal: slots {start}..{stop - 1} outside the cache's {self.batch}")

    def check_rows(self, past_len: np.ndarray, window: int) -> None:
        end = int(past_len.max()) + window
        if end > self.capacity:
            raise SpecrtError(f"KV capacity {self.capacity} exceeded ({end} rows): raise --max-seq-len")


def compact_host_kv(kv: list[np.ndarray], dst: int, rows: list[int], slot: int | None = None) -> None:
    """Move KV rows `rows` (accepted tree nodes, ascending) to dst, dst+1, ... in every buffer of `kv` (numpy
    arrays [batch, kv_heads, capacity, head_dim]), in sequence `slot` (default: every sequence): the
    `compact` of the runners whose KV lives in host memory (ort, native)."""
    src = np.asarray(rows)
    b = slice(None) if slot is None else slice(slot, slot + 1)
    for buf in kv:
        buf[b, :, dst : dst + len(rows)] = buf[b, :, src]
