"""Serving fixtures: a plain single-request reference and engines over the tiny and the real bundle."""

from __future__ import annotations

import math
import threading

import pytest

from tests.helpers import eventually


@pytest.fixture(scope="session")
def tiny_reference(tiny_bundle):
    """Single-request plain decoding on the tiny bundle: what every served greedy request must equal."""
    from specrt.runtime.generate import Generator

    return Generator(tiny_bundle, drafter="plain", max_seq_len=64)


@pytest.fixture(scope="module")
def served(tiny_bundle):
    """(base URL, scheduler) of a real HTTP server on loopback over the tiny bundle (ngram, 4 slots)."""
    from specrt.runtime.generate import Generator
    from specrt.serving.api import create_app
    from specrt.serving.scheduler import Scheduler
    from specrt.tools.loadgen import loopback_server as running

    scheduler = Scheduler(Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=4), max_waiting=32)
    with running(create_app(scheduler, "tiny", default_max_tokens=16)) as url:
        yield url, scheduler


HOLD_S = 60.0  # a pass held longer fails (its requests get a 500): a broken test fails, it never hangs


class Gate:
    """The scheduler's target passes run only as the test lets them, so "the request holds its slot" (or
    "is queued", "has not finished") is a fact when the test acts, on a machine of any speed. Passes are
    numbered as they reach the gate (`started`).

        Gate(closed=False)              give `gate.runner(gen)` to the Scheduler as its `runner`
        close() / open()                passes reaching the gate from now on wait / every pass runs
        allow(n)                        n more passes run (the first n the gate holds, or will)
        hold(until)                     besides, every pass waits until `until()` is true (None: no such
                                        condition; `until` runs on the scheduler's thread, at the pass)
        wait_started(n)                 True once n passes have reached the gate
        reset()                         open, no hold

    The scheduler's thread waits at the gate holding none of its locks: requests are still submitted,
    queued and refused meanwhile."""

    def __init__(self, closed: bool = False):
        self._lock = threading.Lock()
        self.started = 0
        self._allowed = 0 if closed else math.inf
        self._until = None

    def runner(self, gen):
        """The scheduler's runner (serving/scheduler.py): `gen`'s passes, each through the gate."""
        def run(bp):
            self._wait()
            return gen.model.run_batch(bp.windows, bp.start)

        return run

    def _wait(self) -> None:
        with self._lock:
            self.started += 1
            n = self.started
        if not eventually(lambda: n <= self._allowed and (self._until is None or self._until()), HOLD_S):
            raise RuntimeError(f"target pass {n} was held at the gate for {HOLD_S:g} s: the test never let it run")

    def close(self) -> None:
        with self._lock:
            self._allowed = self.started

    def open(self) -> None:
        self._allowed = math.inf

    def allow(self, n: int = 1) -> None:
        with self._lock:
            self._allowed += n

    def hold(self, until) -> None:
        self._until = until

    def reset(self) -> None:
        self._until = None
        self.open()

    def wait_started(self, n: int) -> bool:
        return bool(eventually(lambda: self.started >= n))

