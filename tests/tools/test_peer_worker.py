"""Peers in their own processes (tools/peer_worker.py), with a test-only family (tests/tools/fake_peers.py):

- make_peers loads a registered family in a worker of another PID, and runs round-trip through it;
- a run's error comes back as a SpecrtError naming the peer; the worker keeps serving;
- a family that fails to load, or a worker that dies or is killed, raises a clear SpecrtError;
- the workers are closed at the end, and an idle worker uses no CPU.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import pytest

from specrt.errors import SpecrtError
from specrt.tools import peers as peers_mod
from specrt.tools.peer_worker import PeerWorker, RemoteRun, close_peers, in_workers, workers_of
from tests.helpers import eventually
from tests.tools.fake_peers import continuation, fake_peers

ENGINES = ["fake-plain", "fake-lookup", "fake-failing", "fake-buggy", "fake-crashing"]


@pytest.fixture
def fake(monkeypatch):
    """The fake family registered as a peer and loaded in one worker; closed after the test."""
    monkeypatch.setitem(peers_mod.PEERS, "fake", fake_peers)
    peers = peers_mod.make_peers("fake", manifest="a manifest", threads=3, max_seq_len=99)
    yield peers
    close_peers(peers)


READ_SYSCALL = {"x86_64": 0, "aarch64": 63}.get(platform.machine())  # read(2)'s number, where known


def thread_activity(pid: int) -> dict[str, tuple]:
    """Per thread of `pid`: (state, utime + stime in clock ticks, voluntary and involuntary context
    switches). A thread blocked in the kernel keeps all of these exactly as they are until it wakes."""
    activity = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
        status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        activity[task.name] = (stat[0], int(stat[11]) + int(stat[12]),
                               int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
    return activity


def blocked_reading_stdin(pid: int) -> bool:
    """Every thread of `pid` sleeps (state S), its main thread inside read(2) on fd 0 where the kernel
    says which system call it is in (/proc/PID/syscall: number, then arguments)."""
    if any(state != "S" for state, *_ in thread_activity(pid).values()):
        return False
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:  # not readable here: the states alone
        return True
    return READ_SYSCALL is None or call[:2] == [str(READ_SYSCALL), "0x0"]


def test_a_registered_family_runs_in_its_own_process(fake):
    assert list(fake) == ENGINES
    [worker] = workers_of(fake)
    assert worker.pid != os.getpid() and worker.proc.poll() is None
    plain = fake["fake-plain"]
    assert plain.settings == {"engine": "fake", "threads": 3, "max_seq_len": 99, "pid": worker.pid,
                              "process": "own"}  # the factory's arguments reached it, and it ran there
    assert (plain.reference, fake["fake-lookup"].reference) == (None, "fake-plain")
    for ids, n in (([1, 2, 3], 5), ([40000, 17], 1), (list(range(300)), 64)):
        got, seconds = plain.run(ids, n)
        assert got == continuation(ids, n) and isinstance(seconds, float) and seconds > 0
        assert fake["fake-lookup"].run(ids, n)[0] == got


def test_a_runs_error_names_the_peer_and_the_worker_keeps_serving(fake):
    with pytest.raises(SpecrtError, match=r"^peer fake-failing: fake context 8 < prompt 2 \+ 9 new tokens$"):
        fake["fake-failing"].run([5, 6], 9)
    with pytest.raises(SpecrtError, match=r"^peer fake-buggy: KeyError: 'no such key'$"):
        fake["fake-buggy"].run([5], 1)
    assert fake["fake-plain"].run([5, 6], 3)[0] == continuation([5, 6], 3)


def test_a_family_that_fails_to_load_raises_its_error_and_leaves_no_worker(monkeypatch):
    from specrt.tools import peer_worker

    monkeypatch.setitem(peers_mod.PEERS, "fake", fake_peers)
    before = set(map(id, peer_worker._LIVE))  # other tests' workers may still be open
    with pytest.raises(SpecrtError, match=r"^peer family fake: the fake model is not built: run `make fake-model`"):
        peers_mod.make_peers("fake", manifest="refuse", threads=1)
    assert set(map(id, peer_worker._LIVE)) <= before


def test_a_worker_that_exits_raises_a_clear_error(fake):
    with pytest.raises(SpecrtError, match=r"peer fake-crashing: its worker process \(pid \d+, family fake\) "
                                          r"exited with code 3 during a run"):
        fake["fake-crashing"].run([1], 1)
    with pytest.raises(SpecrtError, match=r"peer fake-plain: its worker process .* exited with code 3"):
        fake["fake-plain"].run([1], 1)  # every engine of that worker, from then on


def test_a_killed_worker_raises_a_clear_error(fake):
    [worker] = workers_of(fake)
    fake["fake-plain"].run([1], 1)
    worker.proc.kill()
    worker.proc.wait()
    with pytest.raises(SpecrtError, match=r"peer fake-lookup: its worker process \(pid \d+, family fake\) "
                                          r"was killed by SIGKILL"):
        fake["fake-lookup"].run([1, 2], 4)


def test_workers_close_and_an_idle_one_sleeps(fake):
    """Between runs the worker blocks in read(2) on its stdin: every thread asleep in the kernel, and
    not one CPU tick or context switch more while it has no work (a spinning worker burns ticks, a
    polling one wakes: a switch each time), however fast or loaded the machine."""
    [worker] = workers_of(fake)
    fake["fake-plain"].run([1, 2], 8)
    assert eventually(lambda: blocked_reading_stdin(worker.pid), 60), "not blocked reading its stdin"  # ms, normally
    before = thread_activity(worker.pid)
    time.sleep(0.2)  # a window for a poller to wake in; the verdict does not depend on its length
    assert thread_activity(worker.pid) == before and blocked_reading_stdin(worker.pid), before
    log = worker.log
    close_peers(fake)
    assert worker.proc.returncode == 0 and not log.exists()
    close_peers(fake)  # closing twice is harmless


def test_families_load_side_by_side_in_separate_workers():
    families = {"a": (fake_peers, ("m", 1, None), {}), "b": (fake_peers, ("m", 2, None), {})}
    with pytest.raises(SpecrtError):  # both load, the second fails: the first is closed too
        in_workers({**families, "bad": (fake_peers, ("refuse", 1, None), {})})
    peers = in_workers({"a": families["a"]})
    try:
        assert isinstance(peers["fake-plain"].run, RemoteRun)
        with PeerWorker("b", fake_peers, ("m", 2, None)) as other:
            assert other.wait_ready()["fake-plain"]["settings"]["threads"] == 2
            assert other.pid != workers_of(peers)[0].pid
            assert other.run("fake-plain", [9], 2)[0] == continuation([9], 2)
            with pytest.raises(SpecrtError, match="this worker runs fake-plain, .* not 'nope'"):
                other.run("nope", [9], 2)
        assert other.proc.returncode == 0
    finally:
        close_peers(peers)


def test_in_process_peers_are_the_factories_own():
    peers = fake_peers("m", 1)
    assert not workers_of(peers)
    close_peers(peers)  # nothing to close
