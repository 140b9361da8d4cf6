"""The native pool's phases (engines/native/csrc/pool.h), compiled with the compiler the native backend builds
with and driven by tests/engines/pool_check.cpp: every item of a phase runs once whatever the thread count, a
phase sees what the previous one wrote, and a phase ends without a thread that has not arrived (the property
that keeps a pass from waiting a time slice at every step when another process shares the cores). A deadlock,
the way a barrier-per-phase pool fails the third check, is caught by the timeout, not by timing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from specrt.engines.native import library

CHECK = Path(__file__).with_name("pool_check.cpp")


@pytest.fixture(scope="module")
def pool_check(tmp_path_factory) -> Path:
    cxx = library.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler here: the native backend is not built either")
    exe = tmp_path_factory.mktemp("pool") / "pool_check"
    done = subprocess.run([cxx, "-O2", "-std=c++17", "-pthread", f"-I{library.SOURCES}", "-o", str(exe), str(CHECK)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return exe


def test_phases_run_every_item_once_in_order_and_never_wait_for_a_thread_that_has_not_arrived(pool_check):
    try:
        done = subprocess.run([str(pool_check)], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("the pool's checks did not finish in 300 s: a phase waited for a thread that had not arrived")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout[-2000:] + done.stderr[-2000:]
