"""Fused kernels: one launch each on a GPU, the same program as NumPy code everywhere else.

    from zmpi import kernels
    layernorm = kernels.fused(_layernorm_numpy, kernels.cuda_layernorm_forward)
    y, cache = layernorm(x, w, b, eps)      # a device array under "fused": one kernel launch
    kernels.set_mode("composed")            # or the config's "kernels": "composed"

A fused op is a pair: its *twin*, a function on arrays of either module (zmpi.nn.functional
writes them; it is also the "composed" implementation: on CuPy each array operation in it is a
kernel launch of its own), and its CUDA launcher here, which does the same arithmetic in one
or two hand-written kernels (`SOURCE`, compiled by CuPy's RawModule on first use, per dtype).
Which runs:

    arrays                 mode "fused" (default)                 mode "composed"
    NumPy (a CPU run)      the twin                               the twin
    CuPy on a GPU          the CUDA launcher                      the twin, op by op
    CuPy without CUDA      the twin on the host, as one launch    the twin, op by op
    (the project's stand-in: it counts launches, tests/standin)

So the CPU and the stand-in run every fused op's twin, tests check the twins against the
composed path and against float64 finite differences, and the GPU-marked tests check each CUDA
launcher against its twin on a GPU. The kernels accumulate in float32 (float64 for float64
arrays), read and write float16/float32/float64, and are compiled without FMA contraction
(--fmad=false) so that their roundings follow the twins' operation by operation.

This module and zmpi.cuda_source (the kernels' C++) are the only ones with CUDA; zmpi.backend
is the only one that knows which array module runs.
"""
from __future__ import annotations

import functools

import numpy as np

from zmpi import backend
from zmpi.cuda_source import SOURCE

MODES = ("fused", "composed")
_mode = ["fused"]


def set_mode(mode: str) -> None:
    """"fused" (one kernel per fused op on a GPU) or "composed" (its twin's array operations,
    one launch each): the config's "kernels". Process-wide; NumPy runs the twins either way."""
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {MODES}, got {mode!r}")
    _mode[0] = mode


def mode() -> str:
    return _mode[0]


def fused(twin, cuda, in_place: bool = False):
    """The op that runs `twin(*args)` or `cuda(*args)` as the table in the module docstring
    says. The first argument decides: a device array under "fused" takes the fused path, with
    every device array argument made C-contiguous first (a copy, and a launch, only when it is
    not: the kernels index rows and columns of contiguous arrays). in_place: the op updates
    its arguments, which must then be C-contiguous already (ValueError: a copy would be
    updated instead)."""

    @functools.wraps(twin)
    def op(*args):
        if _mode[0] == "composed" or not backend.is_device_array(args[0]):
            return twin(*args)
        xp = backend.xp
        if in_place and not all(a.flags.c_contiguous for a in args
                                if backend.is_device_array(a)):
            raise ValueError(f"{twin.__name__}: updates its arguments in place, which must be "
                             "C-contiguous")
        args = tuple(xp.ascontiguousarray(a) if backend.is_device_array(a) else a for a in args)
        launch_twin = getattr(xp, "launch_twin", None)  # a CuPy without CUDA: the stand-in
        if launch_twin is not None:
            return launch_twin(twin, *args)
        return cuda(*args)

    return op


# -- compiling and launching SOURCE (zmpi/cuda_source.py) -------------------------------------

_C_TYPES = {np.dtype(np.float16): "__half", np.dtype(np.float32): "float",
            np.dtype(np.float64): "double"}
THREADS = 256  # per block: a multiple of 32
MAX_BLOCKS = 1024  # of a grid-stride kernel, and the partial sums of sum_of_squares


def acc_dtype(dtype) -> np.dtype:
    """What a kernel on `dtype` arrays accumulates in: float32, or float64 for float64."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@functools.cache
def _function(name: str, dtype: np.dtype, acc: np.dtype):
    """Kernel `name` of the module compiled for (T, ACC) = (dtype, acc)."""
    if dtype not in _C_TYPES or acc not in _C_TYPES:
        raise TypeError(f"no {name} kernel for {dtype} arrays accumulated in {acc}")
    module = _modules(_C_TYPES[dtype], _C_TYPES[acc])
    return module.get_function(name)


@functools.cache
def _modules(t: str, acc: str):
    return backend.xp.RawModule(code=SOURCE, options=compile_options(t, acc))


def compile_options(t: str, acc: str) -> tuple[str, ...]:
    """NVRTC options of the module for C types t and acc (tests compile SOURCE with them)."""
    return ("--std=c++14", "--fmad=false", f"-DZMPI_T={t}", f"-DZMPI_ACC={acc}")


def _launch(name, dtype, grid, args, acc=None):
    """Run kernel `name` for `dtype` arrays on `grid` blocks of THREADS; nothing for an empty
    grid (no rows: nothing to compute, and no block may touch an empty buffer)."""
    grid = grid if isinstance(grid, tuple) else (grid,)
    if 0 in grid:
        return
    dtype = np.dtype(dtype)
    acc = acc_dtype(dtype) if acc is None else np.dtype(acc)
    _function(name, dtype, acc)(grid, (THREADS,), args)


def _blocks(n: int) -> int:
    """Blocks of a grid-stride kernel over n elements."""
    return max(1, min(MAX_BLOCKS, -(-n // THREADS)))


def _scalar(dtype, value):
    return np.dtype(dtype).type(value)


# -- CUDA launchers: the twins' contracts (zmpi.nn.functional, .attention, zmpi.optim.adam) ----

def cuda_layernorm_forward(x, w, b, eps):
    xp, C = backend.xp, x.shape[-1]
    acc = acc_dtype(x.dtype)
    y = xp.empty_like(x)
    xhat = xp.empty(x.shape, acc)
    rstd = xp.empty((*x.shape[:-1], 1), acc)
    _launch("layernorm_forward", x.dtype, x.size // C,
            (x, w.astype(x.dtype, copy=False), b.astype(x.dtype, copy=False), y, xhat, rstd,
             np.int32(C), _scalar(acc, eps)))
    return y, (xhat, rstd, w)


def cuda_layernorm_backward(dy, cache):
    xhat, rstd, w = cache
    xp, C = backend.xp, dy.shape[-1]
    rows = dy.size // C
    dx = xp.empty_like(dy)
    _launch("layernorm_backward", dy.dtype, rows,
            (dy, xhat, rstd, w.astype(dy.dtype, copy=False), dx, np.int32(C)))
    parts = min(64, rows)
    partial = xp.empty((2, parts, C), xhat.dtype)
    _launch("column_sums", dy.dtype, (-(-C // THREADS), parts),
            (dy, xhat, partial, np.int64(rows), np.int32(C)))
    dw_db = partial.sum(axis=1)  # (2, C)
    return dx, dw_db[0], dw_db[1]


def cuda_gelu_forward(x):
    xp = backend.xp
    y, t = xp.empty_like(x), xp.empty(x.shape, acc_dtype(x.dtype))
    _launch("gelu_forward", x.dtype, _blocks(x.size), (x, y, t, np.int64(x.size)))
    return y, (x, t)


def cuda_gelu_backward(dy, cache):
    x, t = cache
    dx = backend.xp.empty_like(dy)
    _launch("gelu_backward", dy.dtype, _blocks(dy.size),
            (dy, x.astype(dy.dtype, copy=False), t, dx, np.int64(dy.size)))
    return dx


def cuda_causal_softmax(scores, start):
    R, S = scores.shape[-2], scores.shape[-1]
    probs = backend.xp.empty(scores.shape, acc_dtype(scores.dtype))
    _launch("causal_softmax", scores.dtype, scores.size // S,
            (scores, probs, np.int32(R), np.int32(S), np.int32(start)))
    return probs


def cuda_softmax_backward(dprobs, probs):
    S = probs.shape[-1]
    dscores = backend.xp.empty_like(dprobs)
    _launch("softmax_backward", dprobs.dtype, probs.size // S,
            (dprobs, probs, dscores, np.int32(S)))
    return dscores


def _ignore_args(ignore):
    return (np.int32(ignore is not None), np.int64(0 if ignore is None else ignore))


def cuda_cross_entropy_rows(z, targets, ignore, inv_normalizer):
    xp, (N, V) = backend.xp, z.shape
    acc = acc_dtype(z.dtype)
    loss, lse = xp.empty(N, acc), xp.empty(N, acc)
    _launch("cross_entropy_forward", z.dtype, N,
            (z, targets, loss, lse, np.int32(V), *_ignore_args(ignore),
             _scalar(acc, inv_normalizer)))
    return loss, lse


def cuda_cross_entropy_grad(z, lse, targets, ignore, scale):
    dz = backend.xp.empty_like(z)
    _launch("cross_entropy_backward", z.dtype, z.shape[0],
            (z, lse, targets, dz, np.int32(z.shape[1]), *_ignore_args(ignore),
             _scalar(lse.dtype, scale)))
    return dz


def cuda_adam(param, grads, m, v, coefficients):
    _launch("adam", grads.dtype, _blocks(param.size),
            (param, grads, m, v, np.int64(param.size), *coefficients), acc=param.dtype)


def cuda_sum_of_squares(x, scale, dtype):
    blocks = _blocks(x.size)
    partial = backend.xp.empty(blocks, dtype)
    _launch("sum_of_squares", x.dtype, blocks, (x, partial, np.int64(x.size),
                                                _scalar(dtype, scale)), acc=dtype)
    return partial.sum()
