"""The clock whose seconds the runtime's decisions read.

Adaptive depth chooses each step's draft depth from the measured seconds of proposing and verifying
(runtime/adaptive.py, fed by runtime/sequence.py); the serving scheduler chooses between plain rows and
drafts from the measured seconds of its passes (serving/pass_policy.py) and orders prefills by when
requests arrived. All of them read time through one clock, `Generator(clock=...)`: a function returning
seconds (only differences count). It is `time.perf_counter` unless a test injects a `FakeClock`, whose time
moves only when the test says what a step cost, so those decisions follow the test's script, not how busy
the machine happens to be.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Clock = Callable[[], float]


class FakeClock:
    """A clock that stands still until `advance(seconds)` moves it; the scheduler's thread and the
    test's may both read and advance it."""

    def __init__(self, now: float = 0.0):
        self.now = now
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds
