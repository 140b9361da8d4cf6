"""Serving fixtures: a plain single-request reference and engines over the tiny and the real bundle."""

from __future__ import annotations

import pytest


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


def slow_model(scheduler, seconds: float) -> None:
    """Make every target pass take at least `seconds` (a stand-in for a big model), so a test can act
    while a request is still running."""
    import time

    run_all = scheduler.gen.target.run_all

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return run_all(*args, **kwargs)

    scheduler.gen.target.run_all = slow
