"""`answer_jobs`'s passes on the native kernels: the bundle's own int4 target, the one the runtime verifies
with, answers the prompts, and its states are the store's features.

A drafter then learns the tokens and the hidden states it meets at run time. The torch target's answers
and the int4 graph's choices part ways often (graph_features.py measures it), so a head trained on the
torch target's answers learns another model's continuations. The native kernels compute every row of a
batched pass as a one-row pass computes it (engines/native/runner.py), so a slot's rows are bitwise
what the runtime's target gives the same sequence alone, whatever the other slots hold.

    slots × KV rows ──► prefill a new job's prompt in its slot (every row's logits) ──► one pass of
    one row per slot in use ──► tokens, hidden and tapped states (fp16), top-k: the store's rows
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class NativePasses:
    """The target of `bundle` on the native kernels (an int4 bundle: the decoder refuses others with the fix),
    `slots` sequences of `capacity` rows, tapping `taps`."""

    def __init__(self, bundle: Path, slots: int, capacity: int, taps: tuple[int, ...], threads: int):
        from specrt.engines.native.runner import NativeDecoder
        from specrt.schema.manifest import Manifest

        manifest = Manifest.load(bundle)
        entry = manifest.graphs["target"]
        self.cfg = entry.config
        self.sha256 = entry.sha256
        self.decoder = NativeDecoder(manifest.onnx_path(bundle, "target"), self.cfg, capacity, threads, batch=slots)
        if list(taps) != self.decoder.taps:
            self.decoder.tap(list(taps))

    def _run(self, ids: np.ndarray, pos: np.ndarray, past: np.ndarray, mask: np.ndarray, index: np.ndarray):
        out = self.decoder.run_all(ids, pos, past, mask, index)
        b, t = ids.shape
        hidden = out["hidden_states"].reshape(b * t, -1).astype(np.float16)
        aux = out.get("aux_hidden_states")
        aux = np.zeros((b * t, 0), np.float16) if aux is None else aux.reshape(b * t, -1).astype(np.float16)
        return torch.from_numpy(out["logits"].reshape(b * index.shape[1], -1).copy()), hidden, aux

    def prefill(self, b: int, prompt: list[int]):
        return self.extend(b, np.asarray(prompt, np.int64), 0)

    def extend(self, b: int, ids: np.ndarray, start: int):
        """Rows `start`.. of slot `b` for token `ids`, after the `start` rows its KV holds (a prefill in
        chunks: replay.py): (logits [t, V], hidden [t, H] fp16, aux [t, A] fp16)."""
        t = len(ids)
        self.decoder.select(b, b + 1)
        rows = np.arange(t, dtype=np.int64)[None]
        return self._run(np.asarray(ids, np.int64)[None], rows + start, np.array([start], np.int64),
                         np.tril(np.ones((t, t), bool))[None], rows)

    def decode(self, lo: int, hi: int, ids: list[int], past: list[int]):
        self.decoder.select(lo, hi)
        n = hi - lo
        past_a = np.asarray(past, np.int64)
        return self._run(np.asarray(ids, np.int64)[:, None], past_a[:, None], past_a, np.ones((n, 1, 1), bool),
                         np.zeros((n, 1), np.int64))
