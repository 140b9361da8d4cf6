"""The logits warp: temperature, then top-k (ties kept), then top-p (smallest prefix reaching p)."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.sampling import SamplingParams, warp


def test_temperature_is_softmax_of_scaled_logits():
    logits = np.array([1.0, 2.0, 3.0], np.float32)
    p = warp(logits, SamplingParams(temperature=0.5))
    e = np.exp((logits - 3) / 0.5)
    np.testing.assert_allclose(p, e / e.sum(), rtol=1e-6)


def test_top_k_keeps_ties_at_the_boundary():
    logits = np.array([5.0, 3.0, 3.0, 1.0], np.float32)
    p = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p > 0).tolist() == [True, True, True, False]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    assert (warp(logits, SamplingParams(temperature=1.0, top_p=0.8)) > 0).tolist() == [True, True, False, False]
    assert (warp(logits, SamplingParams(temperature=1.0, top_p=0.81)) > 0).tolist() == [True, True, True, False]
    assert (warp(logits, SamplingParams(temperature=1.0, top_p=0.1)) > 0).tolist() == [True, False, False, False]
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=1.0, top_p=0.8)).sum(), 1.0, rtol=1e-6)


def test_batched_rows_are_independent():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 7)).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    np.testing.assert_array_equal(warp(logits, params), np.stack([warp(row, params) for row in logits]))


@pytest.mark.parametrize("kw,needle", [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top-k"),
                                       ({"top_p": 0.0}, "top-p"), ({"top_p": 1.5}, "top-p")])
def test_bad_parameters_are_refused(kw, needle):
    with pytest.raises(SpecrtError, match=needle):
        SamplingParams(**kw)


@pytest.mark.parametrize("params, named", [
    (dict(temperature=float("nan")), "--temperature nan"),
    (dict(temperature=float("inf")), "--temperature inf"),
    (dict(temperature="0.7"), "--temperature '0.7'"),
    (dict(temperature=1.0, top_p=float("nan")), "--top-p nan"),
    (dict(temperature=1.0, top_k=2.5), "--top-k 2.5"),
    (dict(temperature=1.0, seed=-1), "--seed -1"),
])
def test_values_that_would_sample_garbage_are_refused(params, named):
    """nan/inf temperature made every draw token 0; a negative seed failed inside numpy mid-generation."""
    with pytest.raises(SpecrtError, match=f"^{named} must be "):
        SamplingParams(**params)


def test_numpy_scalars_are_valid_settings():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9), seed=np.int64(7))
    assert warp(np.array([1.0, 2.0, 3.0, 4.0], np.float32), p).sum() == pytest.approx(1.0)


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 1e-45, 5e-324])
def test_tiny_temperatures_are_softmax_limit_not_nan(temperature):
    """logits / T overflowed float32 below T ~ 1e-37 (and float32(1e-300) is 0): inf - inf = nan, every
    draw token 0. The limit of softmax(logits / T) as T -> 0 is all the mass on the argmax, shared by ties."""
    logits = np.array([[1.0, 7.5, -3.0, 7.5 - 1e-5, -np.inf], [0.5, -2.0, 9.0, 9.0, 1.0]], np.float32)
    p = warp(logits, SamplingParams(temperature=temperature))
    assert np.isfinite(p).all(), p
    np.testing.assert_array_equal(p, [[0, 1, 0, 0, 0], [0, 0, 0.5, 0.5, 0]])
    topped = warp(logits, SamplingParams(temperature=temperature, top_k=2, top_p=0.9))
    np.testing.assert_array_equal(topped[0], p[0])


def test_ordinary_temperatures_are_unchanged_by_the_stable_form():
    rng = np.random.default_rng(3)
    logits = (4 * rng.normal(size=(4, 50))).astype(np.float32)
    for t in (0.05, 0.7, 1.0, 2.0):
        e = np.exp((logits.astype(np.float64) - logits.max(-1, keepdims=True)) / t)
        np.testing.assert_allclose(warp(logits, SamplingParams(temperature=t)), e / e.sum(-1, keepdims=True),
                                   rtol=2e-6, atol=1e-12)
