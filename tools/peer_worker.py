"""One peer family in its own process, as users run these engines: `python -m specrt.tools.peer_worker`.

The parent (`in_workers`) starts one worker per family; the worker loads the family once with its
ordinary in-process factory (tools/peers.py) and then serves runs, one JSON object per line:

    parent → worker  {"load": base64(pickle((factory, args, kwargs))), "sys_path": [...]}   (first line)
    worker → parent  {"ready": {engine: {"reference", "settings"}}, "pid": N} | {"error": message}
    parent → worker  {"engine": name, "ids": [...], "max_new_tokens": n}
    worker → parent  {"ids": [...], "seconds": s} | {"error": message}

`seconds` is timed inside the worker around generation only, as the factories time it. Between runs
the worker blocks reading stdin, so its process sleeps and so do its engine's threads once they stop
spinning (the bench's `cooldown` before each run covers that). End of stdin ends the worker. Anything
the engines print goes to the worker's log (stderr), never into the protocol; a worker that dies
raises a SpecrtError naming the peer, the exit status and the log's last lines.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

from specrt.errors import SpecrtError

LOG_TAIL = 12  # lines of a dead worker's log quoted in the error


# ---- the worker process ------------------------------------------------------------------------------

def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, SpecrtError) else f"{type(e).__name__}: {e}"


def serve(inp, out) -> int:
    """Load the family named by the first line of `inp`, then answer runs until `inp` ends."""
    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    first = json.loads(inp.readline() or "{}")
    sys.path[:] = first.get("sys_path") or sys.path  # import the factory as the parent did (unless in a venv of its own)
    try:
        factory, args, kwargs = pickle.loads(base64.b64decode(first["load"]))
        peers = factory(*args, **kwargs)
    except Exception as e:
        traceback.print_exc()
        reply({"error": _describe(e)})
        return 1
    reply({"ready": {n: {"reference": p.reference, "settings": p.settings} for n, p in peers.items()},
           "pid": os.getpid()})
    for line in inp:
        req = json.loads(line)
        peer = peers.get(req.get("engine"))
        if peer is None:
            reply({"error": f"this worker runs {', '.join(peers)}, not {req.get('engine')!r}"})
            continue
        try:
            ids, seconds = peer.run(list(req["ids"]), int(req["max_new_tokens"]))
            reply({"ids": [int(t) for t in ids], "seconds": float(seconds)})
        except Exception as e:
            traceback.print_exc()
            reply({"error": _describe(e)})
    return 0


def main() -> None:
    # The protocol keeps the real stdout; fd 1 then points at stderr, so native code that prints
    # (llama.cpp, ONNX Runtime) lands in the log instead of corrupting a reply.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.exit(serve(sys.stdin, out))


# ---- the parent's handle -----------------------------------------------------------------------------

_LIVE: set[PeerWorker] = set()  # closed at exit if the caller did not


class PeerWorker:
    """A worker process running one peer family; `run(engine, ids, n)` is one generation in it."""

    def __init__(self, family: str, factory: Callable, args: tuple = (), kwargs: dict | None = None,
                 python: str | None = None):
        """`python`: the interpreter of another venv (a peer whose packages conflict with ours, e.g.
        vLLM); it must have specrt installed (`pip install --no-deps -e .`) and keeps its own sys.path."""
        self.family = family
        fd, log = tempfile.mkstemp(prefix=f"specrt-peer-{family}-", suffix=".log")
        os.close(fd)
        self.log = Path(log)
        with self.log.open("ab") as err:  # the child keeps its own handle, appending
            self.proc = subprocess.Popen([python or sys.executable, "-m", "specrt.tools.peer_worker"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         text=True, bufsize=1)
        _LIVE.add(self)
        self.engines: dict[str, dict] = {}
        payload = base64.b64encode(pickle.dumps((factory, tuple(args), dict(kwargs or {})))).decode()
        self._send({"load": payload, "sys_path": None if python else sys.path}, f"peer family {family}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self) -> dict[str, dict]:
        """Block until the family has loaded: {engine: {"reference", "settings"}}."""
        reply = self._receive(f"peer family {self.family}", "while loading")
        if "error" in reply:
            raise SpecrtError(f"peer family {self.family}: {reply['error']}")
        self.engines = reply["ready"]
        return self.engines

    def run(self, engine: str, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        who = f"peer {engine}"
        self._send({"engine": engine, "ids": [int(t) for t in ids], "max_new_tokens": int(max_new_tokens)}, who)
        reply = self._receive(who, "during a run")
        if "error" in reply:
            raise SpecrtError(f"{who}: {reply['error']}")
        return reply["ids"], reply["seconds"]

    def close(self, timeout: float = 10.0) -> None:
        """End the worker (end of stdin, then terminate, then kill) and drop its log."""
        _LIVE.discard(self)
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> PeerWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, obj: dict, who: str) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._died(who, "before a request") from None

    def _receive(self, who: str, when: str) -> dict:
        try:
            line = self.proc.stdout.readline()
        except (OSError, ValueError):
            line = ""
        if not line:
            raise self._died(who, when)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise SpecrtError(f"{who}: its worker (pid {self.pid}) answered {line[:200]!r}, not a JSON "
                              f"reply; its log: {self.log}") from None

    def _died(self, who: str, when: str) -> SpecrtError:
        try:
            rc = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            rc = None
        if rc is None:
            how = "closed its output but is still running"
        elif rc < 0:
            how = f"was killed by {signal.Signals(-rc).name}"
        else:
            how = f"exited with code {rc}"
        try:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-LOG_TAIL:]
        except OSError:
            tail = []
        log = ("; its log ends:\n" + "\n".join(tail)) if tail else " (its log is empty)"
        return SpecrtError(f"{who}: its worker process (pid {self.pid}, family {self.family}) {how} {when}{log}")


class RemoteRun:
    """A Peer's `run` that runs `engine` in its worker process."""

    def __init__(self, worker: PeerWorker, engine: str):
        self.worker, self.engine = worker, engine

    def __call__(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        return self.worker.run(self.engine, ids, max_new_tokens)


def in_workers(families: dict[str, tuple]) -> dict:
    """{engine: Peer} of every family {name: (factory, args, kwargs[, python])}, each family in its own
    worker (run by `python`, another venv's interpreter, where given).

    The workers load side by side (loading is not timed); if one fails, all are closed."""
    from specrt.tools.peer_types import Peer

    workers = []
    try:
        for name, (factory, args, kwargs, *python) in families.items():
            workers.append(PeerWorker(name, factory, args, kwargs, *python))
        peers = {}
        for w in workers:
            for engine, info in w.wait_ready().items():
                peers[engine] = Peer(RemoteRun(w, engine), reference=info["reference"],
                                     settings={**info["settings"], "process": "own"})
        return peers
    except BaseException:
        for w in workers:
            w.close()
        raise


def workers_of(peers: dict) -> list[PeerWorker]:
    """The distinct worker processes behind `peers` (in-process peers have none)."""
    seen: dict[int, PeerWorker] = {}
    for p in peers.values():
        run = getattr(p, "run", p)
        if isinstance(run, RemoteRun):
            seen.setdefault(id(run.worker), run.worker)
    return list(seen.values())


def close_peers(peers: dict) -> None:
    """Close every worker process behind `peers`."""
    for w in workers_of(peers):
        w.close()


@atexit.register
def _close_all() -> None:
    for w in list(_LIVE):
        w.close(timeout=2.0)


if __name__ == "__main__":
    main()
