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

    def summary(self) -> str:
        if self.lossless:
            return f"exact in mode {self.mode.name} on {Fingerprint.from_dict(self.record['fingerprint']).describe()}"
        return f"NOT exact: {self.reason}"

    def to_dict(self) -> dict:
        return {"lossless": self.lossless, "mode": self.mode.name, "reason": self.reason, "source": self.source,
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


def judge(record: dict, requested: str, source: str) -> Exactness:
    """The mode to run and its verdict, from a record of measurements."""
    chosen, measured = record["chosen"], record["measured"]
    where = Fingerprint.from_dict(record["fingerprint"]).describe()
    if requested == "auto":
        if chosen is not None:
            return Exactness(exec_mode(chosen), True, "", record, source)
        return Exactness(exec_mode("direct"), False,
                         f"no execution mode makes verify passes batch-invariant on {where} "
                         f"(max |Δlogits| {describe_measured(measured)})",
                         record, source)
    mode = exec_mode(requested)
    if measured[requested]["invariant"]:
        return Exactness(mode, True, "", record, source)
    better = f"; --exec-mode auto would run {chosen}" if chosen else ""
    return Exactness(mode, False, f"mode {requested} is not batch-invariant on {where} "
                     f"(max |Δlogits| {describe_measured({requested: measured[requested]})}){better}", record, source)


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
    chosen, measured = invariance.choose(decoder, cfg.vocab_size, trees=entry.trees)
    for name in modes or ():
        if name not in measured:
            measured[name] = invariance.measure(decoder, cfg.vocab_size, exec_mode(name), trees=entry.trees)
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


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def resolve(bundle: Path, manifest, threads: int, backend: str = "ort", requested: str = "auto",
            capacity: int | None = None) -> Exactness:
    """The execution mode and exactness verdict for running `bundle`'s target here (see the module doc)."""
    if requested != "auto":
        exec_mode(requested)  # a bad name fails before anything is measured
    forced = pick("exec_mode", requested)
    found = _resolve(bundle, manifest, threads, backend, forced.value, capacity)
    return dataclasses.replace(found, forced_by=forced.forced_by)


def _resolve(bundle: Path, manifest, threads: int, backend: str, requested: str, capacity: int | None) -> Exactness:
    from specrt.engines.registry import graph_path

    fp = Fingerprint.here(threads, backend)
    graph = graph_path(backend, bundle, manifest, "target")
    record = manifest.artifacts.get(RECORDS, {}).get(record_key({"key": fp.key, "graph": _relative(graph, bundle)}))
    if record is not None and (requested == "auto" or requested in record["measured"]):
        return judge(record, requested, "bundle record")
    try:
        cache = cache_path(bundle, manifest, graph, fp)
    except OSError as e:
        raise SpecrtError(f"cannot read the target graph {graph} ({e}): export the bundle again") from None
    if cache.is_file():
        try:
            record = json.loads(cache.read_text())
        except (OSError, json.JSONDecodeError):
            record = None  # a damaged cache is measured again
        if record is not None and (requested == "auto" or requested in record.get("measured", {})):
            return judge(record, requested, "machine cache")
    extra = [] if requested == "auto" else [requested]
    record = measure_record(bundle, manifest, threads, backend, capacity, extra, graph)
    try:
        _write_atomic(cache, json.dumps(record, indent=1))
    except OSError:
        pass  # a read-only home: measured again next time, still correct
    return judge(record, requested, "measured now")
