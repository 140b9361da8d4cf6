"""The target side of a generator: a bundle's verified manifest, its tokenizer, the target graph on a
backend with preallocated KV buffers, and what this machine's kernels make exact.

    TargetModel(bundle, ...)      checks the bundle, measures exactness, opens the decoder
    .run_pass(p) / .forward(...)  one batch-1 target pass (KV slot 0)
    .run_batch(windows, start)    one pass over consecutive KV slots (the serving scheduler's)
    .terms(acceptance, drafter)   what a sequence in it is held to (runtime/settings.py)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.engines.registry import BACKENDS, backend_entry, open_decoder, resolve_backend
from specrt.errors import SpecrtError
from specrt.runtime.batch import BatchOutputs, pack_ragged
from specrt.runtime.drafters.features import TargetState
from specrt.runtime.exactness import Exactness, resolve
from specrt.runtime.exec_modes import shaped
from specrt.runtime.machine import threads_note, usable_cpus
from specrt.runtime.sequence import Pass, pack_one, pack_windows
from specrt.runtime.settings import SequenceTerms
from specrt.runtime.tokenizer import Tokenizer
from specrt.runtime.tree import Tree
from specrt.schema.integrity import verify_bundle
from specrt.schema.manifest import Manifest

WINDOW_MARGIN = 66  # KV rows beyond capacity for padded batched windows: root + up to 64 nodes (+1 spare)


def kv_capacity(max_seq_len: int | None, cfg) -> int:
    """KV rows per sequence: `max_seq_len`, default min(2048, the model's maximum), never past the positions
    the model was trained for (max_position_embeddings)."""
    if max_seq_len is None:
        return min(2048, cfg.max_position_embeddings)
    if int(max_seq_len) < 2:
        raise SpecrtError(f"--max-seq-len {max_seq_len} is too small: it must be at least 2")
    if int(max_seq_len) > cfg.max_position_embeddings:
        raise SpecrtError(f"--max-seq-len {max_seq_len} exceeds the model's max_position_embeddings "
                          f"{cfg.max_position_embeddings} (manifest.json): use --max-seq-len "
                          f"{cfg.max_position_embeddings} or less")
    return int(max_seq_len)


KV_DTYPES = ("auto", "fp32", "fp16", "int8")


def kv_cache_dtype(requested: str, backend: str) -> str:
    """The KV cache's dtype on `backend` for --kv-dtype `requested`: auto is fp16 where the backend's cache holds
    halves (engines/registry.py `kv_dtypes`: half the bytes attention streams per pass, half the memory per
    slot), fp32 elsewhere; a dtype the backend cannot hold is refused."""
    if requested not in KV_DTYPES:
        raise SpecrtError(f"--kv-dtype {requested!r}: choose one of {', '.join(KV_DTYPES)}")
    held = backend_entry(backend).kv_dtypes
    if requested == "auto":
        return "fp16" if "fp16" in held else "fp32"
    if requested != "fp32" and requested not in held:
        able = " or ".join(name for name, entry in BACKENDS.items() if requested in entry.kv_dtypes)
        raise SpecrtError(f"--kv-dtype {requested}: the {backend} backend keeps its KV cache in fp32; {requested} "
                          f"runs on --backend {able} (or use --kv-dtype auto)")
    return requested


class TargetModel:
    """A bundle's target graph, ready to run: see Generator for the arguments."""

    def __init__(self, bundle: str | Path, max_seq_len: int | None = None, threads: int = 2, backend: str = "auto",
                 exec_mode: str = "auto", slots: int = 1, allow_inexact: bool = False, verify: bool = False,
                 kv_dtype: str = "auto"):
        self.bundle = Path(bundle)
        self.manifest = Manifest.load(self.bundle)
        verify_bundle(self.bundle, self.manifest, full=verify)
        cfg = self.manifest.target.config
        self.capacity = kv_capacity(max_seq_len, cfg)
        self.eos = frozenset(cfg.eos_token_ids)
        self.tokenizer = Tokenizer(self.bundle, self.manifest.tokenizer)
        self.notes: list[str] = []  # one-line notices for the user (the CLI prints them)
        self._curve = None  # the verify cost curve, looked up on first use (cost_curve)
        self.curve_source = ""
        if note := threads_note(int(threads), usable_cpus()):
            self.note(note)
        backend, why = resolve_backend(backend, self.bundle, self.manifest)  # auto: the fastest exact one here
        if why:
            self.note(why)
        self.exactness: Exactness = resolve(self.bundle, self.manifest, threads, backend, exec_mode, self.capacity,
                                            batched=int(slots) > 1)
        self.allow_inexact = allow_inexact
        self.slots = int(slots)
        if self.slots > 1 and not (self.exactness.plain_batches or allow_inexact):
            self.note(f"note: batching {self.slots} sequences per pass is not exact here "
                      f"({self.exactness.reason}); serving one sequence at a time. --allow-inexact batches anyway.")
            self.slots = 1
        # padded passes (batched windows, execution modes) write KV rows past the window: room for them
        mode = self.exactness.mode
        rows = self.capacity + (WINDOW_MARGIN if self.slots > 1 else mode.min_rows - 1)
        if backend_entry(backend).pinned_capacity:  # engines built for `capacity` rows: the margin comes off it
            rows, self.capacity = self.capacity, self.capacity - (mode.min_rows - 1)
        self.backend, self.threads = backend, threads
        self.kv_dtype = kv_cache_dtype(kv_dtype, backend)
        options = {"kv_dtype": self.kv_dtype} if backend_entry(backend).kv_dtypes else {}
        self.decoder = shaped(open_decoder(backend, self.bundle, self.manifest, "target", rows, threads, self.slots,
                                           **options), mode)

    def cost_curve(self):
        """What a verify pass of n rows costs here (runtime/costs.py): this machine's cached curve, else
        measured now on a decoder of its own; looked up once per target."""
        if self._curve is None:
            from specrt.runtime.costs import load

            self._curve, self.curve_source = load(self.bundle, self.manifest, self.threads, self.backend,
                                                  self.exactness.mode, self.capacity)
        return self._curve

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    @property
    def batches_exact(self) -> bool:
        """Does this target's batching (if it batches) keep every row plain decoding's?"""
        return self.slots == 1 or self.exactness.plain_batches

    @property
    def drafts_exact(self) -> bool:
        """May passes carry drafts (at batch 1, and in batched passes where this target batches)?"""
        return (self.exactness.lossless and self.batches_exact) or self.allow_inexact

    def lossless_with(self, drafter: str) -> bool:
        """Does what a sequence drafted by `drafter` commits equal plain batch-1 decoding of this target?"""
        return self.batches_exact and (self.exactness.lossless or drafter == "plain")

    def terms(self, acceptance: str | None, drafter: str) -> SequenceTerms:
        return SequenceTerms(self.capacity, self.eos, acceptance, exact=self.lossless_with(drafter),
                             chains_only=not backend_entry(self.backend).trees)

    def new_state(self) -> TargetState:
        """Room for one sequence's target hidden states (learned drafters read them), with the tapped
        layers' too when the target graph outputs them (EAGLE-3: aux_hidden_states [B, T, n·H])."""
        aux = self.decoder.output_width("aux_hidden_states")  # the Decoder protocol: any backend
        return TargetState.allocate(self.capacity + 1, self.manifest.target.config.hidden_size, aux)

    def compactor(self, slot: int):
        """`compact(dst, rows)` of KV slot `slot`: what a Sequence calls to move its accepted rows."""
        return lambda dst, rows: self.decoder.compact(dst, rows, slot)

    def run_pass(self, p: Pass) -> dict[str, np.ndarray]:
        """One batch-1 target pass over `p` in KV slot 0: every output, batch axis kept (logits
        [1, R, V] for `p.rows`, hidden_states [1, T, H], aux_hidden_states when the graph has them)."""
        self.decoder.select(0, 1)
        return self.decoder.run_all(*pack_one(p))

    @property
    def ragged(self) -> bool:
        """Does the decoder run ragged passes (runtime/batch.py)? Not through an execution mode's shaping."""
        return callable(getattr(type(self.decoder), "run_ragged", None))

    def prefault(self) -> int:
        """Touch every page of the host KV buffers now (bytes touched). They are allocated lazily, so the
        first passes to reach each page otherwise pay for it: the first wave of 16 requests to a server
        took 12 s instead of 3 s on a 2-core VM (transparent huge pages, 1.6 GB of KV)."""
        touched = 0
        for buf in getattr(self.decoder, "kv", ()):
            if isinstance(buf, np.ndarray):
                buf.fill(0)
                touched += buf.nbytes
        return touched

    @property
    def host_kv(self) -> bool:
        """Are the KV rows host arrays that `kv_rows` / `set_kv_rows` copy (engines/registry.py `host_kv`)?"""
        return backend_entry(self.backend).host_kv

    def kv_rows(self, slot: int, start: int, stop: int) -> np.ndarray:
        """A copy of KV rows start..stop-1 of sequence `slot`: [2 * layers, kv_heads, stop - start, head_dim],
        the decoder's buffers in their order."""
        return np.stack([buf[slot, :, start:stop] for buf in self._host_kv()])

    def set_kv_rows(self, slot: int, start: int, rows: np.ndarray) -> None:
        """Write `rows` (as `kv_rows` returns them) at KV rows start.. of sequence `slot`."""
        bufs = self._host_kv()
        if rows.shape[0] != len(bufs) or start + rows.shape[2] > self.capacity:
            raise SpecrtError(f"internal: {rows.shape} KV rows at {start} do not fit {len(bufs)} buffers of "
                              f"{self.capacity} rows")
        for buf, r in zip(bufs, rows, strict=True):
            buf[slot, :, start : start + r.shape[1]] = r

    def _host_kv(self) -> list[np.ndarray]:
        if not self.host_kv:
            raise SpecrtError(f"the {self.backend} backend's KV cache is not in host memory: its rows cannot be copied")
        return self.decoder.kv

    def run_batch(self, windows: list[Pass | None], start: int) -> BatchOutputs:
        """One target pass over KV slots start..start+len(windows)-1, slot start+i running `windows[i]`
        (None: an idle slot). Ragged where the decoder runs such passes (native: no padding rows, an idle
        slot runs nothing), else padded to the longest window (an idle slot: a dummy row at its row 0);
        either way `.of(i)` is slot start+i's outputs as a batch-1 pass gives them (runtime/batch.py)."""
        self.decoder.select(start, start + len(windows))
        if self.ragged:
            pack = pack_ragged(windows)
            return BatchOutputs(self.decoder.run_ragged(pack), pack.rows, pack.nlogits)
        return BatchOutputs(self.decoder.run_all(*pack_windows(windows)))

    def forward(self, window, past: int, tree: Tree | None = None, rows=None) -> dict[str, np.ndarray]:
        """One target pass over `window` (a chain unless `tree`) written at KV rows past..; every output
        as `run_pass` gives them: `forward(...)["logits"][0]` is logits [R, V] for window `rows`
        (default: all)."""
        tree = tree or Tree.chain(len(window) - 1)
        rows = np.arange(tree.size) if rows is None else np.asarray(rows, np.int64)
        return self.run_pass(Pass(np.asarray(window, np.int64), past, tree, rows))
