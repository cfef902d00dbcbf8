"""Compiled loops for host arrays (Numba, the optional `fast` extra), with NumPy fallbacks.

    from zmpi.kernels import host as host_kernels
    y = host_kernels.astype(x, np.float32)     # x.astype(...), float16 <-> float32 compiled
    host_kernels.cast_(out, x)                 # out[...] = x, the same
    host_kernels.add_(dst, x)                  # dst += x, float16 compiled
    host_kernels.adam                          # the fused Adam loop, or None (zmpi.optim.adam)
    with host_kernels.disabled(): ...          # NumPy only, as ZMPI_NUMBA=0

Three places where NumPy is far from what the memory allows on the host, measured on one
thread by experiments/bench_adam.py:
- Adam as ufuncs makes about a dozen passes over p, g, m, v and two scratch arrays; the loop
  reads p, g, m, v once and writes p, m, v once (3x NumPy's speed for cached shards).
- NumPy casts float16 <-> float32 one element at a time (0.3-0.5 G elements/s here); the
  loops below read a table (float16 -> float32, 5x) or round with integer arithmetic that
  vectorises (float32 -> float16, 3x).
- NumPy adds float16 arrays at 5.5 ns an element; the loops (each sum in float32, then the
  rounding above) take 1.3-1.5 ns. ZeRO-2/3 add every micro-step's gradient shard into the
  accumulated one this way.
These are what ZeRO-Offload's host side runs (fp16 gradients in, Adam, fp16 parameters out)
and what a mixed-precision CPU run does at every layer.

Every loop gives the bits NumPy gives (NaN payloads aside): Numba without `fastmath` neither
contracts a multiply-add into an FMA nor reorders, the Adam loop does the ufunc path's
operations in its order on the same scalars, and the casts round to nearest even as NumPy
does, with overflow to inf and subnormals (tested against NumPy: every float16 value, and
float32 patterns around every float16 value, at every halfway point and at random).

The loops compile on first use (about a second) and are cached on disk next to this file.
Environment: ZMPI_NUMBA=0 turns them off (NumPy then), 1 (the default) uses them when numba
is installed. CuPy arrays never come here.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np

# every float16 bit pattern -> its float32 value, by NumPy's own cast (so exact, NaN payloads
# included): a 256 KiB table that stays in L2, 5x faster than NumPy's cast loop
ADD_BLOCK = 1 << 14  # elements summed per pass of add_: 64 KiB of float32 scratch
_HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16) \
    .astype(np.float32)


def _adam(param, grads, m, v, scale, l2, beta1, one_minus_beta1, beta2, one_minus_beta2,
          eps_hat, decay, step_size):
    """param, m, v (n,) master dtype, updated in place; grads (n,) master dtype, read; the
    scalars are of the master dtype (zmpi.optim.adam.AdamCoefficients)."""
    for i in range(param.shape[0]):
        g = grads[i] * scale
        if l2 != 0:
            g = g + param[i] * l2
        mi = m[i] * beta1 + g * one_minus_beta1
        vi = v[i] * beta2 + g * g * one_minus_beta2
        m[i] = mi
        v[i] = vi
        param[i] = param[i] * decay - mi / (np.sqrt(vi) + eps_hat) * step_size


def _half_to_float(bits, out, table):
    """bits (n,) uint16, float16 patterns -> out (n,) float32; table: _HALF_TO_FLOAT."""
    for i in range(bits.shape[0]):
        out[i] = table[bits[i]]


def _add_halves(a, b, out, table):
    """a, b (n,) uint16, float16 patterns -> out (n,) float32: their sum in float32, as NumPy
    adds float16 (then rounded by _float_to_half); table: _HALF_TO_FLOAT."""
    for i in range(a.shape[0]):
        out[i] = table[a[i]] + table[b[i]]


def _float_to_half(src, bits, out):
    """src (n,) float32 and bits, the same memory as uint32 -> out (n,) uint16: float16
    patterns rounded to nearest even (F. Giesen's float_to_half_fast3_rtne)."""
    for i in range(src.shape[0]):
        x = np.int64(bits[i])
        sign = (x >> 16) & 0x8000
        a = x & 0x7FFFFFFF
        if a >= 0x7F800000:  # inf or NaN (kept a NaN: a mantissa bit set)
            h = 0x7C00 | (0x200 if a > 0x7F800000 else 0)
        elif a >= 0x47800000:  # 2^16 and above: inf (65520 <= |x| < 2^16 rounds there below)
            h = 0x7C00
        elif a < 0x38800000:  # below 2^-14: a float16 subnormal; |x| 2^24 is exact, rint is RNE
            h = np.int64(np.rint(np.abs(src[i]) * np.float32(2.0**24)))
        else:  # rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even
            h = (a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13
        out[i] = sign | h


def load(setting: str | None):
    """The compiled loops (adam, half_to_float, float_to_half, add_halves), or None if
    `setting` is "0" or numba is not installed. ValueError for a setting other than None,
    "0" or "1"."""
    if setting not in (None, "0", "1"):
        raise ValueError(f"ZMPI_NUMBA must be 0 (NumPy) or 1 (Numba when installed), got "
                         f"{setting!r}")
    if setting == "0":
        return None
    try:
        import numba
    except ImportError:
        return None
    # error_model="numpy": x/0 gives inf as in NumPy, and no zero check blocks vectorising
    jit = numba.njit(nogil=True, cache=True, error_model="numpy")
    return SimpleNamespace(adam=jit(_adam), half_to_float=jit(_half_to_float),
                           float_to_half=jit(_float_to_half), add_halves=jit(_add_halves))


_loops = load(os.environ.get("ZMPI_NUMBA"))
adam = None if _loops is None else _loops.adam


@contextmanager
def disabled():
    """NumPy everywhere inside the block, as with ZMPI_NUMBA=0 (to compare the two paths)."""
    global _loops, adam
    saved = _loops, adam
    _loops = adam = None
    try:
        yield
    finally:
        _loops, adam = saved


def cast_(out, src):
    """out[...] = src, rounded as NumPy rounds; for NumPy arrays of the same shape, float16 <->
    float32 through the compiled loops when they are there (any other pair: `out[...] = src`,
    CuPy arrays included). Returns out."""
    if (_loops is not None and isinstance(out, np.ndarray) and isinstance(src, np.ndarray)
            and out.shape == src.shape and out.flags.c_contiguous and src.flags.c_contiguous):
        if src.dtype == np.float16 and out.dtype == np.float32:
            _loops.half_to_float(src.reshape(-1).view(np.uint16), out.reshape(-1), _HALF_TO_FLOAT)
            return out
        if src.dtype == np.float32 and out.dtype == np.float16:
            flat = src.reshape(-1)
            _loops.float_to_half(flat, flat.view(np.uint32), out.reshape(-1).view(np.uint16))
            return out
    out[...] = src
    return out


def add_(dst, src):
    """dst += src for NumPy arrays, rounded as NumPy rounds (float16: each sum in float32,
    rounded once); float16 arrays of one shape through the compiled loops in blocks of
    ADD_BLOCK elements (a float32 scratch that stays in cache), 5x NumPy's float16 add. An
    overflow to inf is not reported (the loss scaler looks for it). Returns dst."""
    if (_loops is not None and dst.dtype == src.dtype == np.float16 and dst.shape == src.shape
            and dst.flags.c_contiguous and src.flags.c_contiguous):
        a, b = dst.reshape(-1).view(np.uint16), src.reshape(-1).view(np.uint16)
        scratch = np.empty(min(a.shape[0], ADD_BLOCK), np.float32)
        for start in range(0, a.shape[0], ADD_BLOCK):
            block = slice(start, start + ADD_BLOCK)
            sums = scratch[:len(a[block])]
            _loops.add_halves(a[block], b[block], sums, _HALF_TO_FLOAT)
            _loops.float_to_half(sums, sums.view(np.uint32), a[block])
        return dst
    with np.errstate(over="ignore", invalid="ignore"):
        return np.add(dst, src, out=dst)


def astype(a, dtype):
    """a.astype(dtype, copy=False), through `cast_` for a NumPy array; any other array (CuPy)
    as is."""
    dtype = np.dtype(dtype)
    if not isinstance(a, np.ndarray) or a.dtype == dtype:
        return a.astype(dtype, copy=False)
    return cast_(np.empty(a.shape, dtype), a)
