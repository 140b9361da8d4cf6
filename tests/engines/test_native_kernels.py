"""The native block-quantized kernels alone, for every weight format (int4, int4 with minimums, int8, int8 with
a scale per half block: GGUF's Q4_0, Q4_1 / Q4_K, Q8_0 and Q6_K blocks): every kernel branch against the scalar reference, bitwise, at every row count
1..32 and in mixed batches, and against the float product within the int8 activations' rounding."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.engines.native import calls, library, weights

KERNELS = list(library.KERNELS)
FORMATS = list(weights.FORMATS)
# the formats whose factors can be halves exactly (GGUF's Q4_0, Q4_1, Q8_0, Q5_1 carry d and m as halves): their
# weights with every scale and minimum a half, which the library keeps as halves
HALVES = [f"{fmt}/half" for fmt in ("q4", "q4_min", "q8", "q8_min")]


def needs(kernel: str):
    if not library.supported(kernel):
        pytest.skip(f"this CPU cannot execute the {kernel} kernel (it needs {library.NEEDS[kernel]})")


def as_halves(a: np.ndarray) -> np.ndarray:
    """Float32 values that are each a half exactly."""
    return a.astype(np.float16).astype(np.float32)


class Linear:
    """A random projection of weight format `fmt` in the library's input layout, loaded into the library;
    `dense` is the weights it stands for, [N, K] in float64. "FMT/half": its scales and minimums are halves."""

    def __init__(self, k: int, n: int, seed: int = 0, bias: bool = False, fmt: str = "q4"):
        fmt, _, storage = fmt.partition("/")
        factor = as_halves if storage == "half" else (lambda a: a)
        rng = np.random.default_rng(seed)
        blocks = -(-k // 32)
        self.scales = factor((rng.random((n, blocks)) * 0.02 + 0.001).astype(np.float32))
        self.mins = None
        if fmt in ("q8", "q8x16", "q8_min", "q8x16_min"):
            q = rng.integers(-128, 128, (n, blocks, 32)).astype(np.int8)
            if k % 32:
                q[:, -1, k % 32:] = 0
            self.packed = np.ascontiguousarray(q)
            values = q.astype(np.float64)
            if fmt == "q8_min":  # a GGUF Q5_1 / Q5_K block's d·q + m (its codes 0..31; any int8 computes)
                self.mins = factor((-rng.random((n, blocks)) * 0.15).astype(np.float32))
                values = values + (self.mins / self.scales)[..., None]
            if fmt in ("q8x16", "q8x16_min"):  # the upper half's scale: its own, so mixing the halves is off
                upper = (rng.random((n, blocks)) * 0.05 + 0.001).astype(np.float32)
                values[..., 16:] *= (upper / self.scales)[..., None]
                self.scales = np.ascontiguousarray(np.stack([self.scales, upper], axis=-1))
            if fmt == "q8x16_min":  # and each half its own minimum (in units of the lower scale, as `values`)
                self.mins = (-rng.random((n, blocks, 2)) * 0.15).astype(np.float32)
                values[..., :16] += (self.mins[..., 0] / self.scales[..., 0])[..., None]
                values[..., 16:] += (self.mins[..., 1] / self.scales[..., 0])[..., None]
        else:
            q = rng.integers(0, 16, (n, blocks, 32)).astype(np.uint8)
            values = q.astype(np.float64) - 8
            if fmt == "q4_min":
                self.mins = factor((-rng.random((n, blocks)) * 0.15).astype(np.float32))
                values = q.astype(np.float64) + (self.mins / self.scales)[..., None]
            if k % 32:
                q[:, -1, k % 32:] = 8  # padding inputs: never read against a nonzero activation
            self.packed = np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4))
        lower = self.scales[..., 0] if fmt in ("q8x16", "q8x16_min") else self.scales
        self.dense = (values * lower[..., None]).reshape(n, -1)[:, :k]  # [N, K]
        self.bias = (rng.standard_normal(n) * 0.1).astype(np.float32) if bias else None
        self.k, self.n = k, n
        self.lib = library.load()
        self.h = calls.linear_new(self.lib, weights.Linear(k, n, self.packed, self.scales, self.bias, fmt, self.mins))
        assert self.h, library.last_error()

    def __call__(self, kernel: str, x: np.ndarray, threads: int = 2) -> np.ndarray:
        x = np.ascontiguousarray(x, np.float32)
        y = np.full((x.shape[0], self.n), np.nan, np.float32)
        assert calls.linear_run(self.lib, self.h, library.KERNELS[kernel], threads, x, y) == 0, library.last_error()
        return y

    def __del__(self):
        self.lib.spn_linear_free(self.h)


@pytest.fixture(scope="module", params=FORMATS + HALVES)
def qkv(request):
    return Linear(576, 960, seed=1, fmt=request.param)


@pytest.fixture(scope="module")
def rows():
    x = np.random.default_rng(2).standard_normal((32, 576)).astype(np.float32)
    x[3] *= 40.0  # an outlier row: per-row scales keep it from touching its neighbours
    x[5, :7] = 0.0  # a block partly zero and one wholly zero
    x[6, :32] = 0.0
    x[7, 32:64] = np.arange(32) - 15.5  # with absmax 127, values that fall halfway: round to nearest even
    x[7, 32] = 127.0
    x[8, 64:96] *= 1e-30  # a block of subnormal products
    return x


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_row_count_gives_each_row_bitwise_the_scalar_reference(kernel, qkv, rows):
    needs(kernel)
    reference = qkv("scalar", rows)
    for m in range(1, 33):
        got = qkv(kernel, rows[:m])
        assert np.array_equal(got, reference[:m]), (kernel, m, np.abs(got - reference[:m]).max())


@pytest.mark.parametrize("fmt", FORMATS + HALVES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_any_block_count_and_tile_height_gives_the_reference(kernel, fmt):
    """One block, an odd number of blocks (the AMX kernel takes blocks in pairs) and row counts around its
    16-row tiles, each row bitwise the scalar reference."""
    needs(kernel)
    x = np.random.default_rng(8).standard_normal((40, 160)).astype(np.float32)
    for k in (32, 96, 160):
        lin = Linear(k, 48, seed=k, bias=True, fmt=fmt)
        reference = lin("scalar", x[:, :k])
        for m in (1, 2, 5, 15, 16, 17, 31, 32, 33, 40):
            assert np.array_equal(lin(kernel, x[:m, :k]), reference[:m]), (kernel, fmt, k, m)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_row_does_not_depend_on_the_rows_beside_it(kernel, qkv, rows):
    needs(kernel)
    alone = np.concatenate([qkv(kernel, rows[i:i + 1]) for i in range(12)])
    order = np.random.default_rng(3).permutation(12)
    mixed = qkv(kernel, np.concatenate([rows[order], rows[20:32]]))  # other company, other positions
    assert np.array_equal(mixed[:12], alone[order])
    assert np.array_equal(qkv(kernel, rows[:12], threads=1), alone)  # and not on the thread split


@pytest.mark.parametrize("fmt", FORMATS + HALVES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_product_is_the_float_product_within_int8_rounding(kernel, fmt, rows):
    needs(kernel)
    lin = Linear(40, 20, seed=4, bias=True, fmt=fmt)  # K not a whole block, N not a whole tile
    x = rows[:9, :40]
    exact = x.astype(np.float64) @ lin.dense.T + lin.bias
    got = lin(kernel, x)
    # int8 activations per block of 32: each input off by at most half a step of absmax/127
    step = np.abs(x.astype(np.float64)).max(axis=1, keepdims=True) / 127
    bound = 0.5 * step * np.abs(lin.dense).sum(axis=1)[None, :] + 1e-5 * (1 + np.abs(exact))
    assert np.all(np.abs(got - exact) <= bound), np.abs(got - exact).max()
    assert np.array_equal(got, lin("scalar", x))


SOME_ROWS = (1, 2, 3, 4, 8, 9, 16, 17, 32)


def default_and_off(monkeypatch, variable: str, fmt: str, seed: int) -> tuple[Linear, Linear]:
    """The same random weights loaded with the library's default and with `variable`=0."""
    default = Linear(576, 200, seed=seed, bias=True, fmt=fmt)
    monkeypatch.setenv(variable, "0")
    off = Linear(576, 200, seed=seed, bias=True, fmt=fmt)
    monkeypatch.delenv(variable)
    return default, off


def same_at_every_row_count(kernel: str, rows, a: Linear, b: Linear, fmt: str) -> None:
    for m in SOME_ROWS:
        assert np.array_equal(a(kernel, rows[:m]), b(kernel, rows[:m])), (kernel, fmt, m)


@pytest.mark.parametrize("kernel", KERNELS)
def test_factors_kept_as_halves_give_bitwise_what_floats_give(kernel, rows, monkeypatch):
    """Weights whose scales and minimums are all halves keep them as halves (half the factor bytes a pass
    streams); each kernel's outputs equal, bitwise, those of the same weights kept as floats
    (SPECRT_NATIVE_HALF_FACTORS=0) at every row count."""
    needs(kernel)
    for fmt in HALVES:
        kept, floats = default_and_off(monkeypatch, "SPECRT_NATIVE_HALF_FACTORS", fmt, seed=6)
        mins = "half" if kept.mins is not None else "float"
        assert calls.linear_factors(kept.lib, kept.h) == {"scales": "half", "mins": mins}, fmt
        assert calls.linear_factors(floats.lib, floats.h) == {"scales": "float", "mins": "float"}, fmt
        same_at_every_row_count(kernel, rows, kept, floats, fmt)


@pytest.mark.parametrize("kernel", KERNELS)
def test_weights_prefetched_non_temporal_give_bitwise_what_cached_ones_give(kernel, rows, monkeypatch):
    """A decoder's weights stream once a pass, prefetched non-temporal (the default); SPECRT_NATIVE_STREAM=0
    prefetches them into every cache level. A hint: each kernel's outputs are bitwise the same either way."""
    needs(kernel)
    for fmt in FORMATS:
        streamed, cached = default_and_off(monkeypatch, "SPECRT_NATIVE_STREAM", fmt, seed=8)
        assert calls.linear_streams(streamed.lib, streamed.h) and not calls.linear_streams(cached.lib, cached.h)
        same_at_every_row_count(kernel, rows, streamed, cached, fmt)


def test_one_factor_that_is_not_a_half_keeps_that_array_as_floats():
    """A single scale off the halves' grid (or out of their range) keeps the scales as floats; the minimums,
    all halves, are still kept as halves. The half-block formats keep floats."""
    lin = Linear(64, 40, seed=7, fmt="q4_min/half")
    assert calls.linear_factors(lin.lib, lin.h) == {"scales": "half", "mins": "half"}
    for odd in (0.1, 1e-9, 7e4):
        scales = lin.scales.copy()
        scales[5, 1] = odd
        h = calls.linear_new(lin.lib, weights.Linear(64, 40, lin.packed, scales, None, "q4_min", lin.mins))
        assert h, library.last_error()
        try:
            assert calls.linear_factors(lin.lib, h) == {"scales": "float", "mins": "half"}, odd
        finally:
            lin.lib.spn_linear_free(h)
    halves = Linear(64, 40, seed=7, fmt="q8x16")
    rounded = as_halves(halves.scales)
    h = calls.linear_new(halves.lib, weights.Linear(64, 40, halves.packed, rounded, None, "q8x16", None))
    assert h, library.last_error()
    try:
        assert calls.linear_factors(halves.lib, h) == {"scales": "float", "mins": "float"}
    finally:
        halves.lib.spn_linear_free(h)


def test_the_formats_differ_and_a_bad_layout_is_refused():
    """The same blocks read as another format give another product (each format's arithmetic is its own),
    and sizes that do not fit the format are an error from C, not a read past an end."""
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    q4, q4m = Linear(64, 16, seed=6), Linear(64, 16, seed=6, fmt="q4_min")
    assert not np.allclose(q4("scalar", x), q4m("scalar", x))
    lib = library.load()
    blocks = np.zeros((16, 2, 16), np.uint8)
    scales = np.ones((16, 2), np.float32)
    assert not calls.linear_new(lib, weights.Linear(64, 16, blocks, scales, format="q8"))  # int4-sized blocks
    assert "packed weights of 512 bytes" in library.last_error()
    assert not calls.linear_new(lib, weights.Linear(64, 16, blocks, scales, format="q4_min"))  # no minimums
    assert "0 minimums" in library.last_error()
    assert not calls.linear_new(lib, weights.Linear(64, 16, blocks, scales, format="q4", mins=scales))
    assert "32 minimums" in library.last_error()
    int8 = np.zeros((16, 2, 32), np.int8)
    assert not calls.linear_new(lib, weights.Linear(64, 16, int8, scales, format="q8x16"))  # one scale a block
    assert "32 scales" in library.last_error()
    q8, halves = Linear(64, 16, seed=7, fmt="q8"), Linear(64, 16, seed=7, fmt="q8x16")
    assert not np.allclose(q8("scalar", x), halves("scalar", x))
    assert not np.allclose(q8("scalar", x), Linear(64, 16, seed=7, fmt="q8_min")("scalar", x))
    assert not calls.linear_new(lib, weights.Linear(64, 16, int8, scales, format="q8_min"))  # no minimums
    assert "0 minimums" in library.last_error()
    with pytest.raises(ValueError, match="weight format 'q5'"):
        calls.linear_new(lib, weights.Linear(64, 16, blocks, scales, format="q5"))


def test_a_forced_kernel_is_named_in_the_record_and_a_bad_one_refused(monkeypatch):
    from specrt.errors import SpecrtError

    monkeypatch.setenv("SPECRT_NATIVE_KERNEL", "scalar")
    name, rec = library.kernel()
    assert name == "scalar" and rec == {"value": "scalar", "forced": True, "chosen_by": "SPECRT_NATIVE_KERNEL"}
    monkeypatch.setenv("SPECRT_NATIVE_KERNEL", "sse9")
    with pytest.raises(SpecrtError, match="SPECRT_NATIVE_KERNEL='sse9'"):
        library.kernel()
    monkeypatch.delenv("SPECRT_NATIVE_KERNEL")
    monkeypatch.setattr(library, "supported", lambda k: k == "scalar")
    with pytest.raises(SpecrtError, match="needs AVX2, FMA and F16C, which this CPU lacks"):
        library.kernel("avx2")


def test_without_a_compiler_the_native_backend_says_what_to_do(monkeypatch, tmp_path):
    from specrt.errors import SpecrtError

    monkeypatch.setattr(library, "compiler", lambda: None)
    with pytest.raises(SpecrtError, match="no C\\+\\+ compiler was found.*--backend ort"):
        library.build()


def test_a_failed_compile_leaves_no_library_behind(monkeypatch, tmp_path):
    from specrt.errors import SpecrtError

    monkeypatch.setenv("SPECRT_HOME", str(tmp_path))
    monkeypatch.setattr(library, "FLAGS", (*library.FLAGS, "-DSPECRT_NO_SUCH_FLAG", "-fno-such-option"))
    with pytest.raises(SpecrtError, match="compiling the native kernels failed"):
        library.build()
    assert not any(p.is_file() for p in (tmp_path / "cache").rglob("*"))


def _half_inputs() -> np.ndarray:
    """Floats over the whole range (random bit patterns: normals, subnormals, infinities, NaNs), the half
    range's edges and ties, and small normal values (keys and values as they are)."""
    rng = np.random.default_rng(4)
    edges = np.array([0.0, 65504, 65519.996, 65520, 65536, 2**-24, 2**-25, 2**-25 * 1.0000001, 3 * 2**-26, 2**-14,
                      2**-14 * (1 - 2**-11), np.inf, 1e-45, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-11 + 2**-20],
                     np.float32)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([edges, -edges, bits, rng.standard_normal(50_000).astype(np.float32)])


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_float_rounds_to_the_nearest_half_on_every_kernel(kernel):
    """The KV cache's fp16 rounding (ties to even, overflow to infinity, subnormals kept) is numpy's for every
    value but NaN, and every kernel's conversion is bitwise the scalar one, NaN payloads included."""
    needs(kernel)
    lib = library.load()
    x = _half_inputs()

    def halves(k: str) -> np.ndarray:
        out = np.zeros(x.size, np.uint16)
        assert lib.spn_to_half(library.KERNELS[k], calls.ptr(x), x.size, calls.ptr(out)) == 0, library.last_error()
        return out

    got = halves(kernel)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    numbers = ~np.isnan(x)
    assert np.array_equal(got[numbers], want[numbers])
    assert np.array_equal(got, halves("scalar"))


def test_amx_tiles_of_fewer_than_16_rows_give_the_reference(tmp_path):
    """SPECRT_AMX_MIN_ROWS=2 (read once, when the library loads: so in a process of its own) runs every call of
    2-15 rows on tiles of exactly that many rows; this file's AMX checks, every row count and block count, then
    hold those tiles to the scalar reference bitwise."""
    import os
    import subprocess
    import sys

    needs("amx")
    env = {**os.environ, "SPECRT_AMX_MIN_ROWS": "2"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "amx and not fewer_than_16", "--basetemp", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1], done.stdout[-500:]
