"""What a verify pass of n rows costs on this machine: the measured curve draft shapes are sized by.

On a CPU a pass is memory-bound at one row and bound by integer dot products past a few rows, so its cost
is nearly flat from 1 to 2 rows and then steep (verify(2) ≈ 1.06×, verify(4) ≈ 1.3×, verify(8) ≈ 2.2×,
verify(16) ≈ 5× one row on Zen 4); a GPU's curve stays flat much longer. No straight line fits both ends,
so the adaptive controller (runtime/adaptive.py) and the default EAGLE-2/3 shape (runtime/shapes.py) read
this curve instead. It belongs to the machine (CPU, kernels, threads, backend, execution mode, every
branch forced by a variable), so it is looked up like exactness (runtime/exactness.py):

    1. this machine's cache, $SPECRT_HOME/cache/costs/<id>.json
    2. else measured now on a decoder of its own (a fraction of a second; the live KV cache is untouched)
       and cached

`CostCurve(n)` interpolates the measured points linearly and extends the last segment past them.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrt.errors import SpecrtError
from specrt.runtime.clock import Clock

ROWS = (1, 2, 3, 4, 5, 6, 8, 11, 16)  # window sizes measured: chains of 0..4 drafts, trees up to 15 nodes
CONTEXT = 128  # KV rows before the measured window
# bump when what is measured changes: older cache files are measured again (2: sizes in turns, fastest pass;
# 3: ratios to the round's one-row pass, their median; 4: each timed pass after an untimed one of its size)
VERSION = 4


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one verify pass by window rows, measured at `rows` (ascending, starting at 1)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self):
        rows, secs = tuple(int(r) for r in self.rows), tuple(float(s) for s in self.seconds)
        if len(rows) != len(secs) or not rows or rows[0] != 1 or any(np.diff(rows) <= 0):
            raise SpecrtError(f"a cost curve needs ascending rows from 1, one time each (got rows {rows})")
        if not all(np.isfinite(secs)) or min(secs) <= 0:
            raise SpecrtError(f"a cost curve's times must be positive and finite (got {secs})")
        object.__setattr__(self, "rows", rows)
        object.__setattr__(self, "seconds", secs)

    def __call__(self, n: float) -> float:
        """Seconds of a pass over `n` rows (n ≥ 1; past the last point, the last segment's slope)."""
        r, s = self.rows, self.seconds
        if len(r) == 1:
            return s[0] * max(float(n), 1.0)
        if n <= r[-1]:
            return float(np.interp(n, r, s))
        slope = (s[-1] - s[-2]) / (r[-1] - r[-2])
        return s[-1] + max(slope, 0.0) * (n - r[-1])

    def ratio(self, n: float) -> float:
        """A pass over `n` rows over a one-row pass."""
        return self(n) / self.seconds[0]

    def to_dict(self) -> dict:
        return {"rows": list(self.rows), "seconds": [round(s, 7) for s in self.seconds]}

    @classmethod
    def from_dict(cls, d: dict) -> CostCurve:
        return cls(tuple(d["rows"]), tuple(d["seconds"]))


def measure(decoder, vocab: int, rows: Sequence[int] = ROWS, repeats: int = 11, warmup: int = 2,
            context: int = CONTEXT, clock: Clock | None = None, seed: int = 0) -> CostCurve:
    """Time chain windows of each size in `rows` after `context` prompt rows on `decoder` (a Decoder, slot 0;
    its KV rows 0..context+max(rows) are overwritten), `repeats` rounds after `warmup`. The sizes take turns
    (1, 2, 4, ..., then again), so a stretch when other work shares the CPU slows a round's sizes alike. A
    one-row pass costs its fastest; each other size, that times the median over the rounds of its pass over
    the same round's one-row pass. A curve measured on a busy or drifting machine is cached and sizes drafts
    long after, so neither a slow stretch nor a lucky pass may bend it: ratios taken within a round cancel the
    stretch, and their median drops the rounds a stretch began or ended in. Each timed pass follows an untimed
    one of its own size, as a verify pass follows one of its shape in generation: timed right after the round's
    16-row pass, the one-row pass ran 10-15 % slow on a 2-core Zen 4 and bent every ratio down (2 rows 0.95x,
    3 rows 1.04-1.07x one row, where generation's steps took 1.11x and 1.38x), which sized eagle3 to a fan of
    two first drafts that ran at plain speed."""
    import time

    from specrt.runtime.sequence import Pass, pack_windows
    from specrt.runtime.tree import Tree

    clock = clock or time.perf_counter
    rng = np.random.default_rng(seed)
    decoder.select(0, 1)

    def run(tokens, past):
        p = Pass(np.asarray(tokens, np.int64), past, Tree.chain(len(tokens) - 1), np.arange(len(tokens)))
        decoder.run_all(*pack_windows([p]))

    run(rng.integers(0, vocab, context), 0)
    times: list[list[float]] = [[] for _ in rows]
    for i in range(warmup + repeats):
        for j, n in enumerate(rows):
            run(rng.integers(0, vocab, n), context)  # untimed: the timed pass follows one of its own size
            window = rng.integers(0, vocab, n)
            t0 = clock()
            run(window, context)
            if i >= warmup:
                times[j].append(clock() - t0)
    one = np.asarray(times[0])
    fastest = float(one.min())
    seconds = [fastest * float(np.median(np.asarray(t) / one)) for t in times]  # the one-row size's ratio is 1
    # 0.1 µs: what the cache keeps
    return CostCurve(tuple(rows), tuple(max(round(s, 7), 1e-7) for s in seconds))


def key(bundle: Path, manifest, threads: int, backend: str, mode: str) -> str:
    """This machine's id for the curve of `bundle`'s target on `backend` in execution mode `mode`."""
    from specrt.engines.registry import graph_path
    from specrt.runtime.branches import BRANCHES
    from specrt.runtime.machine import Fingerprint

    graph = graph_path(backend, bundle, manifest, "target")
    stat = graph.stat()
    forced = {b.env: os.environ.get(b.env, "") for b in BRANCHES.values()}
    ident = [VERSION, manifest.target.sha256, str(graph.resolve()), stat.st_size, stat.st_mtime_ns,
             Fingerprint.here(threads, backend).key, mode, forced]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def cache_path(ident: str) -> Path:
    from specrt.paths import home

    return home() / "cache" / "costs" / f"{ident}.json"


def load(bundle: Path, manifest, threads: int, backend: str, mode, capacity: int | None = None) -> tuple[
        CostCurve, str]:
    """The target's verify cost curve here, and where it came from ("machine cache" or "measured now")."""
    from specrt.engines.registry import backend_entry, graph_path, make_decoder, open_decoder
    from specrt.runtime.exactness import _write_atomic
    from specrt.runtime.exec_modes import shaped

    try:
        path = cache_path(key(bundle, manifest, threads, backend, mode.name))
    except OSError as e:
        raise SpecrtError(f"cannot read the target graph of {bundle} ({e}): export the bundle again") from None
    if path.is_file():
        try:
            return CostCurve.from_dict(json.loads(path.read_text())["curve"]), "machine cache"
        except (OSError, ValueError, KeyError, TypeError, SpecrtError):
            pass  # a damaged cache is measured again
    cfg = manifest.target.config
    need, context, rows = CONTEXT + max(ROWS) + mode.min_rows, CONTEXT, ROWS
    if backend_entry(backend).pinned_capacity:  # engines built for one capacity (TensorRT): what fits in it
        cap = capacity or need
        decoder = open_decoder(backend, bundle, manifest, "target", cap, threads)
        context = max(1, min(CONTEXT, cap // 2))
        rows = tuple(r for r in ROWS if context + r + mode.min_rows <= cap) or (1,)
    else:
        decoder = make_decoder(backend, graph_path(backend, bundle, manifest, "target"), cfg, need, threads)
    curve = measure(shaped(decoder, mode), cfg.vocab_size, rows=rows, context=context)
    del decoder
    record = {"curve": curve.to_dict(), "backend": backend, "threads": int(threads), "mode": mode.name,
              "context": context,
              "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        _write_atomic(path, json.dumps(record, indent=1))
    except OSError:
        pass  # a read-only home: measured again next time
    return curve, "measured now"
