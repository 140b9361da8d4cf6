"""Int4 blocks fitted to float weights (export/int4_fit.py): a scale and minimum per block of 32 that beat both
symmetric round-to-nearest and the block's plain range on the weights' squared error, give a block already on
such a grid back, and are what an int4 export of float weights carries."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.export.int4_fit import fit_q4_min


def _symmetric(w: np.ndarray) -> np.ndarray:
    """Round-to-nearest symmetric int4 (ONNX Runtime's default): d = absmax / 8, codes -8..7."""
    x = w.reshape(w.shape[0], -1, 32)
    d = np.abs(x).max(-1, keepdims=True) / 8
    return (np.clip(np.rint(x / np.where(d > 0, d, 1)), -8, 7) * d).reshape(w.shape)


def _range(w: np.ndarray) -> np.ndarray:
    x = w.reshape(w.shape[0], -1, 32)
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    d = (hi - lo) / 15
    return (np.clip(np.rint((x - lo) / np.where(d > 0, d, 1)), 0, 15) * d + lo).reshape(w.shape)


@pytest.mark.parametrize("dist", ["normal", "laplace", "skewed"])
def test_the_fit_beats_symmetric_and_range_rounding(dist):
    rng = np.random.default_rng(0)
    w = {"normal": rng.standard_normal((256, 512)), "laplace": rng.laplace(size=(256, 512)),
         "skewed": rng.gamma(2.0, size=(256, 512)) - 1.0}[dist].astype(np.float32) * 0.05
    b = fit_q4_min(w)
    assert b.format == "q4_min" and b.q.shape == (256, 16, 16) and b.scales.dtype == np.float32
    err = lambda approx: float(np.square(approx.astype(np.float64) - w).mean())  # noqa: E731
    fit, sym, rng_only = err(b.dense()), err(_symmetric(w)), err(_range(w))
    assert fit < 0.75 * sym and fit < 0.95 * rng_only, (fit, sym, rng_only)


def test_a_block_on_a_grid_comes_back_and_flat_blocks_are_kept():
    rng = np.random.default_rng(1)
    d = rng.random((8, 4, 1)).astype(np.float32) * 0.01 + 0.001
    m = -rng.random((8, 4, 1)).astype(np.float32) * 0.05
    codes = rng.integers(0, 16, (8, 4, 32))
    codes[..., 0], codes[..., 1] = 0, 15  # the grid's ends are used
    w = (codes * d + m).reshape(8, 128).astype(np.float32)
    w[3, 32:64] = 0.125  # a flat block
    got = fit_q4_min(w).dense()
    assert np.allclose(got, w, rtol=0, atol=1e-6) and np.array_equal(got[3, 32:64], w[3, 32:64])
    with pytest.raises(ValueError, match="rows of 40 inputs are not whole blocks of 32"):
        fit_q4_min(np.zeros((2, 40), np.float32))


def test_an_int4_export_of_float_weights_carries_fitted_blocks(tmp_path):
    from specrt.engines.native.weights import read
    from specrt.schema.manifest import Manifest
    from tests.helpers import export_tiny

    bundle = export_tiny(tmp_path, "llama")
    m = Manifest.load(bundle)
    w = read(m.onnx_path(bundle, "target"), m.graphs["target"].config)
    assert {lin.format for layer in w.layers for lin in layer.values()} == {"q4_min"}
    assert w.head.format == "q4_min" and "from_model_file" not in m.artifacts["quantization"]
