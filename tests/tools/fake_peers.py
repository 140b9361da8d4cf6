"""A test-only peer family: deterministic engines that load in no time, for the worker protocol's tests."""

from __future__ import annotations

import os
import time

from specrt.errors import SpecrtError
from specrt.tools.bench import Peer


def continuation(ids: list[int], n: int) -> list[int]:
    """What the fake engines decode: a function of the prompt only."""
    return [(sum(ids) + 7 * i) % 101 for i in range(n)]


def fake_peers(manifest, threads: int, max_seq_len: int | None = None) -> dict[str, Peer]:
    """`manifest` is a plain string here: "refuse" fails the load like a missing model would."""
    if manifest == "refuse":
        raise SpecrtError("the fake model is not built: run `make fake-model`")
    pid = os.getpid()

    def plain(ids, n):
        t0 = time.perf_counter()
        return continuation(ids, n), time.perf_counter() - t0 + 1e-6

    def failing(ids, n):
        raise SpecrtError(f"fake context 8 < prompt {len(ids)} + {n} new tokens")

    def buggy(ids, n):
        return {}["no such key"]

    def crashing(ids, n):
        os._exit(3)

    settings = {"engine": "fake", "threads": threads, "max_seq_len": max_seq_len, "pid": pid}
    return {"fake-plain": Peer(plain, reference=None, settings=settings),
            "fake-lookup": Peer(plain, reference="fake-plain", settings=settings),
            "fake-failing": Peer(failing, reference="fake-plain"),
            "fake-buggy": Peer(buggy, reference="fake-plain"),
            "fake-crashing": Peer(crashing, reference="fake-plain")}
