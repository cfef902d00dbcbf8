"""CUDA launchers of the Llama family's fused ops (rmsnorm.cu, rope.cu, swiglu.cu): the
contracts of their NumPy twins in zmpi.nn.llama_functional, as zmpi.kernels' launchers are
those of zmpi.nn.functional's twins (zmpi.kernels.OPS names each pair).

    y, cache = cuda_rmsnorm_forward(x, w, eps)       # one row kernel
    dx, dw = cuda_rmsnorm_backward(dy, cache, dw)    # a row kernel, dw's two column kernels
    y = cuda_rope_forward(x, cos, sin, out)          # one kernel, x and out read through strides
    dx = cuda_rope_backward(dy, cos, sin, out)       # the inverse rotation, the same way
    y, cache = cuda_swiglu_forward(g, u)             # one elementwise kernel
    dg, du = cuda_swiglu_backward(dy, cache)         # one elementwise kernel

Arrays are the array module's device arrays (backend.xp); each kernel reads float16, bfloat16,
float32 or float64, computes in float32 (float64 for float64) and rounds once as it writes.
"""
from __future__ import annotations

import numpy as np

from zmpi import backend
from zmpi.kernels import _blocks, _column_sums, _launch, _row_norm_outputs, _scalar


def cuda_rmsnorm_forward(x, w, eps):
    """x (..., C) T, w (C,) -> y (..., C) T, cache (xhat (..., C), rstd (..., 1) in ACC, w)."""
    C = x.shape[-1]
    acc, y, xhat, rstd = _row_norm_outputs(x)
    _launch("rmsnorm_forward", x.dtype, x.size // C,
            (x, w.astype(x.dtype, copy=False), y, xhat, rstd, np.int32(C), _scalar(acc, eps)))
    return y, (xhat, rstd, w)


def cuda_rmsnorm_backward(dy, cache, dw=None):
    """dy (..., C) T and the forward's cache -> dx (..., C) T, dw (C,) T (into `dw` if given):
    dx in one row kernel, dw's column sums in two (zmpi.kernels' LayerNorm's, without db)."""
    xhat, rstd, w = cache
    xp, C = backend.xp, dy.shape[-1]
    dx = xp.empty_like(dy)
    _launch("rmsnorm_backward", dy.dtype, dy.size // C,
            (dy, xhat, rstd, w.astype(dy.dtype, copy=False), dx, np.int32(C)))
    (dw,) = _column_sums("rmsnorm_dw_partials", "rmsnorm_dw_total", dy, xhat, (dw,))
    return dx, dw


def cuda_swiglu_forward(g, u):
    """g, u (...) of one shape -> y = silu(g) u in g's dtype, cache (g, u)."""
    y = backend.xp.empty_like(g)
    _launch("swiglu_forward", g.dtype, _blocks(g.size),
            (g, u.astype(g.dtype, copy=False), y, np.int64(g.size)))
    return y, (g, u)


def cuda_swiglu_backward(dy, cache):
    """dy (...) and the forward's cache (g, u) -> (dg, du) in dy's dtype."""
    g, u = (a.astype(dy.dtype, copy=False) for a in cache)
    xp = backend.xp
    dg, du = xp.empty_like(dy), xp.empty_like(dy)
    _launch("swiglu_backward", dy.dtype, _blocks(dy.size), (dy, g, u, dg, du, np.int64(dy.size)))
    return dg, du


def cuda_rope_forward(x, cos, sin, out=None):
    """x (..., T, hd) rotated by the angles of the tables cos, sin (T, hd/2), in x's dtype, into
    `out` (x's shape) if given, else into a new C-contiguous array: `_rope`."""
    return _rope("rope_forward", x, cos, sin, out)


def cuda_rope_backward(dy, cos, sin, out=None):
    """dy rotated by the opposite angles (rope_forward's gradient), as cuda_rope_forward."""
    return _rope("rope_backward", dy, cos, sin, out)


def _rope(name, x, cos, sin, out):
    """One launch of `name` over x's (hd/2) pairs. x and `out` are read and written where they
    lie, through their strides (a head layout (B, n, T, hd) taken as a transposed view of (B, T,
    n, hd), in either direction), when `_strided` finds a layout; otherwise x is copied to a
    C-contiguous array first, and `out` written through a C-contiguous one (a copy each)."""
    xp = backend.xp
    y = xp.empty(x.shape, x.dtype) if out is None else out
    if x.size == 0:
        return y
    source = _strided(x)
    if source is None:
        x = xp.ascontiguousarray(x)
        source = _strided(x)
    target = _strided(y)
    into = y if target is not None else xp.empty(x.shape, x.dtype)
    target = target or _strided(into)
    (a, b, T, hd), (x_base, x_strides), (y_base, y_strides) = _axes4(x).shape, source, target
    tables = (xp.ascontiguousarray(t.astype(x.dtype, copy=False)) for t in (cos, sin))
    _launch(name, x.dtype, _blocks(x.size // 2),
            (x_base, *tables, y_base, *map(np.int32, (a, b, T, hd // 2)),
             *map(np.int64, x_strides), *map(np.int64, y_strides)))
    if into is not y:
        y[...] = into
    return y


def _axes4(a):
    """a as 4 axes (A, B, T, hd), a view: size-1 axes added in front, or the leading axes
    merged (None where they cannot merge without a copy: more than 4 axes, not C-contiguous)."""
    if a.ndim <= 4:
        return a[(None,) * (4 - a.ndim)]
    return a.reshape(-1, *a.shape[-3:]) if a.flags.c_contiguous else None


def _strided(a):
    """(base, strides): base a C-contiguous array over exactly a's elements (a's axes in memory
    order: a transposed view of it), strides the element strides of a's (A, B, T) axes
    (`_axes4`); None where a's last axis is not unit-stride or its elements are not one
    C-contiguous block."""
    a4 = _axes4(a)
    if a4 is None or a4.strides[-1] != a4.itemsize:
        return None
    # axes of more than one element by stride, largest first: each stride must be the product
    # of the sizes after it (checked here, not by the array module's flags, whose treatment
    # of size-1 axes' strides may differ)
    order = sorted(range(4), key=lambda i: (a4.shape[i] > 1, -a4.strides[i]))
    step = a4.itemsize
    for i in reversed(order):
        if a4.shape[i] > 1:
            if a4.strides[i] != step:
                return None
            step *= a4.shape[i]
    return a4.transpose(order), [s // a4.itemsize for s in a4.strides[:3]]
