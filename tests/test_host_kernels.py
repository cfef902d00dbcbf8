"""The compiled host loops (zmpi.kernels.host, the `fast` extra) give NumPy's bits.

The dev extra installs numba, so `make test` runs these; without numba they skip, and every
caller uses the NumPy path they are compared against here.
"""
import subprocess
import sys

import numpy as np
import pytest

from zmpi.backend import BFLOAT16
from zmpi.kernels import host as host_kernels
from zmpi.optim.adam import AdamCoefficients, _adam_ufuncs_, adam_chunk_

needs_loops = pytest.mark.skipif(host_kernels.adam is None, reason="numba not installed")


def _bits_equal(a, b) -> bool:
    """Same bit patterns, except that a NaN only has to meet a NaN."""
    nan = np.isnan(a)
    view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return (np.array_equal(nan, np.isnan(b))
            and np.array_equal(a[~nan].view(view), b[~nan].view(view)))


@needs_loops
def test_half_to_float_every_pattern():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    assert _bits_equal(halves.astype(np.float32), host_kernels.astype(halves, np.float32))


@needs_loops
def test_float_to_half_rounds_as_numpy():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)]
    near = halves.astype(np.float32).view(np.uint32).astype(np.int64)
    near = (near[:, None] + np.arange(-2, 3)).ravel() % (1 << 32)  # every value +- 2 ulp
    sorted_ = np.sort(halves.astype(np.float64))
    halfway = (sorted_[:-1] + sorted_[1:]) / 2  # ties: round to even
    random_bits = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64)
    x = np.concatenate([near.astype(np.uint32).view(np.float32), halfway.astype(np.float32),
                        random_bits.astype(np.uint32).view(np.float32),
                        np.float32([65504, 65519.996, 65520, 65536, 1e30, 2.0**-25,
                                    1.5 * 2.0**-24, 2.0**-14, -0.0, np.inf, -np.inf, np.nan])])
    with np.errstate(over="ignore", invalid="ignore"):
        expected = x.astype(np.float16)
    assert _bits_equal(expected, host_kernels.astype(x, np.float16))


@needs_loops
def test_float16_add_rounds_as_numpy():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    rng = np.random.default_rng(2)
    dst = np.concatenate([halves, halves, rng.permutation(halves)])  # 3 x 2^16: 12 blocks
    src = np.concatenate([halves[::-1], rng.permutation(halves), rng.permutation(halves)])
    dst, src = dst[:-5], src[:-5]  # a last block shorter than the others
    with np.errstate(over="ignore", invalid="ignore"):
        expected = dst + src
    out = dst.copy()
    assert host_kernels.add_(out, src) is out
    assert _bits_equal(expected, out)
    assert np.isinf(out).sum() > 0 and np.isnan(out).sum() > 0  # overflow and NaN met, quietly


def test_add_falls_back_for_other_dtypes_and_layouts():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for dst in (np.ones((4, 3), np.float16).T, np.ones((3, 4), BFLOAT16),
                np.ones((3, 4), np.float32)):  # non-contiguous, and dtypes without a loop
        host_kernels.add_(dst, x.astype(dst.dtype))
        assert np.array_equal(dst.astype(np.float32), x + 1)


@needs_loops
@pytest.mark.parametrize("master", [np.float32, np.float64])
@pytest.mark.parametrize("grad_dtype", ["master", np.float16, BFLOAT16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_adam_equals_ufuncs_bit_for_bit(master, grad_dtype, decoupled):
    rng = np.random.default_rng(1)
    n = 10_007
    grad_dtype = master if grad_dtype == "master" else grad_dtype
    fused = [rng.standard_normal(n).astype(master), np.zeros(n, master), np.zeros(n, master)]
    ufunc = [a.copy() for a in fused]
    initial = fused[0].copy()
    scratch = [np.empty(n, master), np.empty(n, master)]
    for step in range(1, 4):
        grads = (3 * rng.standard_normal(n)).astype(grad_dtype)
        hyper = (step, 1e-3, (0.9, 0.999), 1e-8, 0.1, decoupled)
        adam_chunk_(fused[0], grads, fused[1], fused[2], scratch, *hyper, 0.5, 0.7)
        _adam_ufuncs_(ufunc[0], grads, ufunc[1], ufunc[2], np.empty(n, master),
                      np.empty(n, master), AdamCoefficients.of(master, *hyper, 0.5 * 0.7))
    for a, b in zip(fused, ufunc, strict=True):
        assert np.array_equal(a, b)
    assert np.abs(fused[0] - initial).min() > 0  # every parameter moved


def test_cast_falls_back_for_other_pairs_and_layouts():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for out in (np.empty((4, 3), np.float16).T, np.empty((3, 4), BFLOAT16),
                np.empty((3, 4), np.float64)):  # non-contiguous, and pairs without a loop
        host_kernels.cast_(out, x)
        assert np.array_equal(out.astype(np.float32), x)
    assert host_kernels.astype(x, np.float32) is x


def test_setting_is_checked():
    assert host_kernels.load("0") is None
    with pytest.raises(ValueError, match="ZMPI_NUMBA must be 0"):
        host_kernels.load("yes")
    out = subprocess.run([sys.executable, "-c", "import zmpi.kernels.host as k; "
                          "print(k.adam is None)"], env={"ZMPI_NUMBA": "0", "PATH": ""},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr
