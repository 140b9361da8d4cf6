"""The verify cost curve (runtime/costs.py): measured on the clock it is given, cached per machine and
bundle, and what adaptive depth prices passes by (runtime/adaptive.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.clock import FakeClock
from specrt.runtime.costs import ROWS, CostCurve, cache_path, key, load, measure
from specrt.runtime.exec_modes import exec_mode
from specrt.schema.manifest import Manifest

# a CPU's shape (docs/performance.md, Zen 4): flat to 2 rows, steep past 4
CPU = CostCurve((1, 2, 3, 4, 5, 8, 16), (3.0e-3, 3.2e-3, 3.6e-3, 4.0e-3, 4.6e-3, 6.8e-3, 13.0e-3))


def test_curve_interpolates_and_extends_its_last_segment():
    assert CPU(1) == 3.0e-3 and CPU(4) == 4.0e-3
    assert CPU(2.5) == pytest.approx(3.4e-3)
    assert CPU(6) == pytest.approx(4.6e-3 + (6.8e-3 - 4.6e-3) / 3)
    assert CPU(20) == pytest.approx(13.0e-3 + 4 * (13.0e-3 - 6.8e-3) / 8)
    assert CPU.ratio(16) == pytest.approx(13.0 / 3.0)
    assert CostCurve.from_dict(json.loads(json.dumps(CPU.to_dict()))) == CPU


@pytest.mark.parametrize("rows,secs", [((2, 3), (1.0, 2.0)), ((1, 3, 2), (1.0, 2.0, 3.0)), ((1, 2), (1.0,)),
                                       ((1, 2), (1.0, 0.0)), ((1, 2), (1.0, float("nan"))), ((), ())])
def test_bad_curves_are_refused(rows, secs):
    with pytest.raises(SpecrtError, match="cost curve"):
        CostCurve(rows, secs)


class _PacedDecoder:
    """A decoder whose passes cost `cost(rows)` on `clock` (and record what they were asked)."""

    def __init__(self, clock: FakeClock, cost):
        self.clock, self.cost, self.calls = clock, cost, []

    def select(self, start, stop):
        assert (start, stop) == (0, 1)

    def run_all(self, ids, pos, past, mask, rows):
        self.calls.append((ids.shape[1], int(past[0])))
        self.clock.advance(self.cost(ids.shape[1]))
        return {}


def test_measure_reads_the_clock_it_is_given():
    clock = FakeClock()
    dec = _PacedDecoder(clock, lambda n: 0.002 + 0.0005 * max(n - 2, 0))
    curve = measure(dec, 100, rows=(1, 2, 4, 8), repeats=3, warmup=1, context=16, clock=clock)
    assert curve.rows == (1, 2, 4, 8)
    assert curve.seconds == pytest.approx((0.002, 0.002, 0.003, 0.005))
    assert dec.calls[0] == (16, 0)  # the context first, then every window after it
    assert all(past == 16 for _, past in dec.calls[1:]) and len(dec.calls) == 1 + 4 * 4 * 2  # untimed, timed


def test_a_busy_stretch_does_not_bend_the_curve():
    """Other work takes the CPU for a while (every pass 3x slower from the 6th to the 13th): the sizes take turns
    and each keeps its fastest pass, so the curve is the quiet machine's, not one with a bump where the load was."""
    clock = FakeClock()
    dec = _PacedDecoder(clock, lambda n: 0.0)
    quiet = lambda n: 0.002 + 0.0005 * max(n - 2, 0)  # noqa: E731
    dec.cost = lambda n: quiet(n) * (3 if 6 <= len(dec.calls) <= 13 else 1)
    curve = measure(dec, 100, rows=(1, 2, 4, 8), repeats=4, warmup=1, context=16, clock=clock)
    assert curve.seconds == pytest.approx(tuple(quiet(n) for n in (1, 2, 4, 8)))
    assert [n for n, _ in dec.calls[1:9]] == [1, 1, 2, 2, 4, 4, 8, 8]  # each size twice (untimed, timed), then again


def test_a_drifting_machine_and_a_lucky_pass_do_not_bend_the_curve():
    """The VM's speed drifts from round to round (each round's passes 1-2x slower alike) and one 4-row pass
    runs at half its cost: each size's ratio to its round's one-row pass, their median, gives the quiet curve
    (the fastest pass of each size would take the lucky one, and the rounds where a size ran slowest)."""
    clock = FakeClock()
    dec = _PacedDecoder(clock, lambda n: 0.0)
    quiet = lambda n: 0.002 + 0.0005 * max(n - 2, 0)  # noqa: E731
    pace = [1.0, 1.7, 1.3, 2.0, 1.1, 1.5, 1.9]  # one per round, the warm-up's first
    lucky = {}

    def cost(n):
        i = len(dec.calls) - 2  # this window pass: 0 is the warm-up round's first
        factor = pace[i // 8]  # a round: each size untimed, then timed
        if n == 4 and i // 8 == 3:
            lucky[n] = 0.5
            factor *= 0.5
        return quiet(n) * factor

    dec.cost = cost
    curve = measure(dec, 100, rows=(1, 2, 4, 8), repeats=6, warmup=1, context=16, clock=clock)
    assert lucky  # the lucky pass ran
    assert curve.seconds == pytest.approx(tuple(quiet(n) * 1.1 for n in (1, 2, 4, 8)))


def test_a_pass_slowed_by_the_one_before_it_does_not_bend_the_curve():
    """A pass right after a bigger one runs 15 % slow (what a 16-row pass left behind did to the next one-row pass
    on a 2-core Zen 4): each timed pass follows an untimed one of its own size, as in generation, so the curve is
    the steady one; timed straight after the round's largest pass, the one-row pass bent every ratio down."""
    clock = FakeClock()
    dec = _PacedDecoder(clock, lambda n: 0.0)
    quiet = lambda n: 0.002 + 0.0005 * max(n - 2, 0)  # noqa: E731

    def cost(n):
        before = dec.calls[-2][0] if len(dec.calls) > 1 else n
        return quiet(n) * (1.15 if before > n else 1.0)

    dec.cost = cost
    curve = measure(dec, 100, rows=(1, 2, 4, 8), repeats=4, warmup=1, context=16, clock=clock)
    assert curve.seconds == pytest.approx(tuple(quiet(n) for n in (1, 2, 4, 8)))


def test_a_curve_measured_the_old_way_is_measured_again(tiny_bundle, monkeypatch):
    """The way of measuring is part of the cache key: a curve cached by an older version is not read."""
    from specrt.runtime import costs

    manifest = Manifest.load(tiny_bundle)
    now = key(tiny_bundle, manifest, 1, "ort", "direct")
    monkeypatch.setattr(costs, "VERSION", costs.VERSION - 1)
    assert key(tiny_bundle, manifest, 1, "ort", "direct") != now


def test_cached_per_machine_and_measured_again_when_damaged(tiny_bundle, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRT_HOME", str(tmp_path))
    manifest, mode = Manifest.load(tiny_bundle), exec_mode("direct")
    curve, source = load(tiny_bundle, manifest, 1, "ort", mode)
    assert source == "measured now" and curve.rows == ROWS
    path = cache_path(key(tiny_bundle, manifest, 1, "ort", "direct"))
    assert json.loads(path.read_text())["curve"] == curve.to_dict()
    again, source = load(tiny_bundle, manifest, 1, "ort", mode)
    assert (again, source) == (curve, "machine cache")
    path.write_text("{not json")
    assert load(tiny_bundle, manifest, 1, "ort", mode)[1] == "measured now"
    # what the machine's branches and threads decide is part of the key: another value is another curve
    monkeypatch.setenv("SPECRT_NATIVE_KERNEL", "scalar")
    assert key(tiny_bundle, manifest, 1, "ort", "direct") != path.stem
    monkeypatch.delenv("SPECRT_NATIVE_KERNEL")
    assert key(tiny_bundle, manifest, 2, "ort", "direct") != path.stem
    assert key(tiny_bundle, manifest, 1, "ort", "pad2") != path.stem


def test_a_generator_on_a_fake_clock_gets_no_measured_curve(tiny_bundle):
    from specrt.runtime.generate import Generator

    assert Generator(tiny_bundle, "ngram", max_seq_len=64, clock=FakeClock()).cost_curve() is None
    gen = Generator(tiny_bundle, "ngram", max_seq_len=64, clock=FakeClock(), costs=CPU)
    assert gen.cost_curve() is CPU
    with pytest.raises(SpecrtError, match="costs 'fast'"):
        Generator(tiny_bundle, "ngram", max_seq_len=64, costs="fast")


def _after_warmup(ctrl: AdaptiveDepth, acceptance: float) -> AdaptiveDepth:
    """The state after three warm-up steps at depth 4 (five-row passes) and four plain steps: the
    acceptance at depth 1 is `acceptance`, drafting one token costs 0.15 of a one-row pass."""
    for _ in range(3):
        ctrl.choose()
        ctrl.update(4, np.arange(1, 5), 0, 4 * 0.15 * CPU(1), CPU(5))
    for _ in range(4):
        ctrl.update(0, np.array([]), 0, 0.0, CPU(1))
    ctrl.reached[:] = 100.0
    ctrl.passed[:] = 100.0 * acceptance
    return ctrl


def test_adaptive_depth_prices_rows_it_has_not_run_by_the_curve():
    """Steps have run one-row and five-row passes only. A line through them prices a two-row pass at
    1.13× one row where the curve says 1.07×, so at acceptance 0.25 (a chain of 1: 1.03× plain on the curve,
    0.97× on the line) the line chooses plain decoding and the curve one draft."""
    by_curve, by_line = _after_warmup(AdaptiveDepth(4, curve=CPU), 0.25), _after_warmup(AdaptiveDepth(4), 0.25)
    assert by_curve.verify(2) == pytest.approx(CPU(2))
    assert by_line.verify(2) == pytest.approx(CPU(1) + (CPU(5) - CPU(1)) / 4)
    assert by_curve.choose().depth == 1
    assert by_line.choose().depth == 0


def test_measured_passes_override_the_curve_where_there_are_enough():
    """A busy machine: every pass costs twice the cached curve, two-row passes three times. The level comes
    from the steps at once; the two-row cost from the two-row passes once four are seen."""
    ctrl = AdaptiveDepth(2, curve=CPU)
    assert ctrl.verify(2) == pytest.approx(CPU(2))
    for _ in range(4):
        ctrl.verify.add(1, 2 * CPU(1))
    assert ctrl.verify(3) == pytest.approx(2 * CPU(3))
    for _ in range(4):
        ctrl.verify.add(2, 3 * CPU(2))
    assert ctrl.verify(2) == pytest.approx(3 * CPU(2))
