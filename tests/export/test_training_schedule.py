"""The training schedule: warm-up, then a cosine that ends at the step count or the time limit."""

from __future__ import annotations

import math

import pytest

from specrt.export.training.loop import lr_scale


def test_warm_up_then_peak_then_the_floor_at_the_last_step():
    assert lr_scale(0, 1000, 0.0, 600.0) == pytest.approx(1 / 50)
    assert lr_scale(49, 1000, 0.0, 600.0) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.049)))  # warm
    assert lr_scale(500, 1000, 1.0, 600.0) == pytest.approx(0.55)  # half way by steps
    assert lr_scale(1000, 1000, 1.0, 600.0) == pytest.approx(0.1)


def test_the_time_limit_ends_the_cosine_when_it_comes_first():
    assert lr_scale(100, 1000, 300.0, 600.0) == pytest.approx(0.55)  # half way by time, a tenth by steps
    assert lr_scale(100, 1000, 600.0, 600.0) == pytest.approx(0.1)
    assert lr_scale(100, 1000, 900.0, 600.0) == pytest.approx(0.1)  # past the limit: stays at the floor
    steps_only = [lr_scale(s, 1000, 0.0, 1e9) for s in range(50, 1001, 50)]
    assert steps_only == sorted(steps_only, reverse=True)  # decays monotonically after the warm-up
