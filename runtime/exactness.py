"""Is speculative output exact where the bundle runs? The measured answer, and the mode that makes it so.

A bundle is exported once and copied to many machines; batch invariance belongs to the machine
(CPU features, ONNX Runtime version, threads, backend), so it is looked up by that fingerprint:

    1. the bundle's own record for it (`specrt export` / `specrt build` measure on their machine)
    2. else this machine's cache, $SPECRT_HOME/cache/exactness/<id>.json
    3. else measured now (seconds, once; runtime/invariance.py) and cached

`resolve` returns an `Exactness`: the execution mode to run the target in, whether speculative
output is lossless in it, and if not, why — one line the user, the server's clients and the metrics
are told. Nothing silently runs lossy. A mode named by the caller (`--exec-mode`) or, where the caller
asks for auto, by SPECRT_EXEC_MODE (runtime/branches.py) is forced; `forced_by` says which.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.runtime.branches import pick
from specrt.runtime.exec_modes import MAX_PAD_ROWS, ExecMode, exec_mode
from specrt.runtime.machine import Fingerprint

RECORDS = "exactness"  # manifest.artifacts[RECORDS][<fingerprint key>/<graph file>] = record


@dataclass
class Exactness:
    mode: ExecMode
    lossless: bool
    reason: str  # why not lossless; "" when it is
    record: dict  # fingerprint, graph, every measured mode's checks, the mode auto chooses
    source: str  # "bundle record", "machine cache" or "measured now"
    forced_by: str = ""  # "" (auto: the measured choice), "option" or "SPECRT_EXEC_MODE"
    # batched passes are exact in `mode` (the batch checks: windows where the backend batches windows, one
    # row per sequence where it does not), whether or not drafted windows are (`lossless`)
    plain_batches: bool = False

    def summary(self) -> str:
        if self.lossless:
            return f"exact in mode {self.mode.name} on {Fingerprint.from_dict(self.record['fingerprint']).describe()}"
        return f"NOT exact: {self.reason}"

    def to_dict(self) -> dict:
        return {"lossless": self.lossless, "plain_batches": self.plain_batches,
                "mode": self.mode.name, "reason": self.reason, "source": self.source,
                "auto_mode": self.record["chosen"], "forced_by": self.forced_by,
                "fingerprint": self.record["fingerprint"],
                "measured": self.record["measured"]}


def worst(measurement: dict) -> float:
    """The largest |Δlogits| over a mode's checks (0.0: invariant)."""
    from specrt.runtime.invariance import CHECKS

    return max(measurement[c] for c in CHECKS if measurement.get(c) is not None)


def describe_measured(measured: dict) -> str:
    """Each measured mode's worst |Δlogits| against plain decoding, e.g. "direct 1.3e+00, pad2 0 (invariant)"."""
    return ", ".join(f"{name} {'0 (invariant)' if m['invariant'] else f'{worst(m):.1e}'}"
                     for name, m in measured.items())


def judge(record: dict, requested: str, source: str, batched: bool = False) -> Exactness:
    """The mode to run and its verdict, from a record of measurements. `batched`: the caller batches
    sequences (serving). Where no mode is invariant in every check, auto takes, for a batched caller, the
    first mode that batches plain decoding exactly (speculation then off), else the first mode whose
    drafted windows are exact at batch 1 (batching then off)."""
    from specrt.runtime.invariance import SPECULATION, exact_for, plain_batches

    chosen, measured = record["chosen"], record["measured"]
    where = Fingerprint.from_dict(record["fingerprint"]).describe()
    if requested == "auto":
        if chosen is not None:
            return Exactness(exec_mode(chosen), True, "", record, source, plain_batches=True)
        batches = [n for n, m in measured.items() if plain_batches(m)]
        if batched and batches:
            return Exactness(exec_mode(batches[0]), False,
                             f"drafted verify passes are not batch-invariant in mode {batches[0]} on {where}, which "
                             f"batches plain decoding exactly (max |Δlogits| {describe_measured(measured)})",
                             record, source, plain_batches=True)
        single = [n for n, m in measured.items() if exact_for(m, SPECULATION)]
        if single:
            return Exactness(exec_mode(single[0]), True, "", record, source,
                             plain_batches=plain_batches(measured[single[0]]))
        return Exactness(exec_mode("direct"), False,
                         f"no execution mode makes verify passes batch-invariant on {where} "
                         f"(max |Δlogits| {describe_measured(measured)})",
                         record, source)
    mode = exec_mode(requested)
    m = measured[requested]
    if m["invariant"] or (not batched and exact_for(m, SPECULATION)):
        return Exactness(mode, True, "", record, source, plain_batches=m["invariant"] or plain_batches(m))
    better = f"; --exec-mode auto would run {chosen}" if chosen else ""
    return Exactness(mode, False, f"mode {requested} is not batch-invariant on {where} "
                     f"(max |Δlogits| {describe_measured({requested: m})}){better}", record, source,
                     plain_batches=plain_batches(m))


def measure_record(bundle: Path, manifest, threads: int, backend: str, capacity: int | None = None,
                   modes: list[str] | None = None, graph: Path | None = None) -> dict:
    """Measure the target graph (default: the one the runtime loads) on this machine: `direct`, then the
    padded modes until one is invariant, plus any named in `modes`."""
    from specrt.engines.registry import backend_entry, graph_path, make_decoder, open_decoder
    from specrt.runtime import invariance

    entry = backend_entry(backend)
    batch = min(len(invariance.BATCH), entry.max_batch)
    graph = Path(graph) if graph is not None else graph_path(backend, bundle, manifest, "target")
    cfg = manifest.target.config
    if entry.pinned_capacity:  # engines built for one capacity (TensorRT): measure at it
        decoder = open_decoder(backend, bundle, manifest, "target", capacity, threads, batch)
    else:
        decoder = make_decoder(backend, graph, cfg, invariance.ROWS + MAX_PAD_ROWS, threads, batch)
    how = {"trees": entry.trees, "batch_windows": entry.batch_windows}
    chosen, measured = invariance.choose(decoder, cfg.vocab_size, **how)
    for name in modes or ():
        if name not in measured:
            measured[name] = invariance.measure(decoder, cfg.vocab_size, exec_mode(name), **how)
    fp = Fingerprint.here(threads, backend)
    return {"fingerprint": fp.to_dict(), "key": fp.key, "graph": _relative(graph, bundle), "chosen": chosen,
            "measured": measured, "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")}


def _relative(path: Path, bundle: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path(bundle).resolve()))
    except ValueError:
        return str(path)


def record_key(record: dict) -> str:
    return f"{record['key']}/{record['graph']}"


def store_in_manifest(manifest, record: dict) -> None:
    """Keep `record` in the manifest (one per machine fingerprint and graph file); the caller saves it."""
    manifest.artifacts.setdefault(RECORDS, {})[record_key(record)] = record


def cache_path(bundle: Path, manifest, graph: Path, fp: Fingerprint) -> Path:
    """This machine's cache file for the graph `graph` of `bundle` (keyed by the graph's identity)."""
    from specrt.paths import home

    stat = graph.stat()
    ident = json.dumps([manifest.target.sha256, _relative(graph, bundle), stat.st_size, stat.st_mtime_ns, fp.key])
    return home() / "cache" / "exactness" / (hashlib.sha256(ident.encode()).hexdigest()[:24] + ".json")


def content_key(graph: Path, fp: Fingerprint) -> str:
    """An id of the bytes `graph` runs with (the file and each external-data file beside it that it names)
    on the machine `fp`, for the measurements invariance.py makes today."""
    from specrt.runtime import invariance

    h = hashlib.sha256(json.dumps([fp.key, list(invariance.CHECKS), invariance.ROWS, invariance.BATCH]).encode())
    data = graph.read_bytes()
    h.update(data)
    for other in sorted(graph.parent.glob("*.data")):
        if other.name.encode() in data:  # an external-data location is stored as its file name
            with other.open("rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()[:24]


def measured_here(bundle: Path, manifest, threads: int, backend: str) -> dict:
    """`measure_record` of the target graph `backend` runs, or this machine's record for a graph of the same
    bytes measured before (an export or build of the same target again): the same answer, seconds sooner.
    Keyed by content, not by file times as `resolve`'s cache is, since an export writes new files."""
    from specrt.engines.registry import graph_path
    from specrt.paths import home

    graph = graph_path(backend, bundle, manifest, "target")
    fp = Fingerprint.here(threads, backend)
    try:
        path = home() / "cache" / "exactness" / f"content-{content_key(graph, fp)}.json"
    except OSError as e:
        raise SpecrtError(f"cannot read the target graph {graph} ({e}): export the bundle again") from None
    record = _read_cached(path)
    if (isinstance(record, dict) and record.get("key") == fp.key and record.get("graph") == _relative(graph, bundle)
            and usable(record, backend, "auto")):
        return record
    record = measure_record(bundle, manifest, threads, backend, graph=graph)
    _keep(path, record)
    return record


def _read_cached(path: Path):
    """The record cached at `path`, or None (none yet, or damaged: measured again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _keep(path: Path, record: dict) -> None:
    try:
        _write_atomic(path, json.dumps(record, indent=1))
    except OSError:
        pass  # a read-only home: measured again next time, still correct


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def resolve(bundle: Path, manifest, threads: int, backend: str = "ort", requested: str = "auto",
            capacity: int | None = None, batched: bool = False) -> Exactness:
    """The execution mode and exactness verdict for running `bundle`'s target here (see the module doc);
    `batched`: for a caller that batches sequences (`judge`)."""
    if requested != "auto":
        exec_mode(requested)  # a bad name fails before anything is measured
    forced = pick("exec_mode", requested)
    found = _resolve(bundle, manifest, threads, backend, forced.value, capacity, batched)
    return dataclasses.replace(found, forced_by=forced.forced_by)


def usable(record: dict, backend: str, requested: str) -> bool:
    """Does `record` answer for `requested` on `backend`: that mode measured (auto: any), and the batch
    check made wherever the backend batches sequences (a record from before it did is measured again)?"""
    from specrt.engines.registry import backend_entry
    from specrt.runtime import invariance

    measured = record.get("measured", {})
    if requested != "auto" and requested not in measured:
        return False
    if backend_entry(backend).max_batch >= len(invariance.BATCH):
        return all(m.get("batch_kv") is not None for m in measured.values())
    return True


def _resolve(bundle: Path, manifest, threads: int, backend: str, requested: str, capacity: int | None,
             batched: bool = False) -> Exactness:
    from specrt.engines.registry import graph_path

    fp = Fingerprint.here(threads, backend)
    graph = graph_path(backend, bundle, manifest, "target", batched)
    record = manifest.artifacts.get(RECORDS, {}).get(record_key({"key": fp.key, "graph": _relative(graph, bundle)}))
    if record is not None and usable(record, backend, requested):
        return judge(record, requested, "bundle record", batched)
    try:
        cache = cache_path(bundle, manifest, graph, fp)
    except OSError as e:
        raise SpecrtError(f"cannot read the target graph {graph} ({e}): export the bundle again") from None
    record = _read_cached(cache)
    if record is not None and usable(record, backend, requested):
        return judge(record, requested, "machine cache", batched)
    extra = [] if requested == "auto" else [requested]
    record = measure_record(bundle, manifest, threads, backend, capacity, extra, graph)
    _keep(cache, record)
    return judge(record, requested, "measured now", batched)
