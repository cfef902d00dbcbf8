"""Fused kernels: one launch each on a GPU, the same program as NumPy code everywhere else.

    from zmpi import kernels
    layernorm = kernels.fused(_layernorm_numpy, kernels.cuda_layernorm_forward)
    y, cache = layernorm(x, w, b, eps)      # a device array under "fused": one kernel launch
    kernels.set_mode("composed")            # or the config's "kernels": "composed"

A fused op is a pair: its *twin*, a function on arrays of either module (zmpi.nn.functional
writes them; it is also the "composed" implementation: on CuPy each array operation in it is a
kernel launch of its own), and its CUDA launcher here, which does the same arithmetic in one
or two hand-written kernels (this package's .cu files, one per op family, compiled by CuPy's
RawModule on first use, per dtype: zmpi.kernels.source). `OPS` names every pair. Which runs:

    arrays                 mode "fused" (default)                 mode "composed"
    NumPy (a CPU run)      the twin                               the twin
    CuPy on a GPU          the CUDA launcher                      the twin, op by op
    CuPy without CUDA      the twin on the host, as one launch    the twin, op by op
    (the project's stand-in: it counts launches, tests/standin)

So the CPU and the stand-in run every fused op's twin, tests check the twins against the
composed path and against float64 finite differences, and the GPU-marked tests check each CUDA
launcher against its twin on a GPU. The kernels accumulate in float32 (float64 for float64
arrays), read and write float16/bfloat16/float32/float64, and are compiled as NVRTC compiles
by default, multiply-adds contracted into FMAs: their results agree with the twins' within
rounding (a test compiles with --fmad=false where bit-matching them is the point).
Activations keep their dtype through them: float16 (or bfloat16) in, the same out, float32
only in registers (and in what a backward reuses at full precision: LayerNorm's and RMSNorm's
x-hat and 1/std or 1/rms, GELU's tanh, the loss's log-sum-exp).

`matmul` is the batched matrix product (attention's): cuBLAS on the operands as they are,
float16 and bfloat16 on tensor cores with float32 accumulation, where CuPy's own matmul casts
float16 to float32 and the product back, has no batched bfloat16 product at all (CuPy 14.2:
cupy/cupy#10317), and copies operands that are not contiguous.

The package (zmpi.kernels: this module, .source, .llama (the Llama family's launchers),
.flash_attention, .host and the .cu files) is
the only place with CUDA or compiled loops; zmpi.backend is the only module that knows which
array module runs.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from zmpi import backend
from zmpi.kernels.source import FAMILIES, compile_options, module_source


class Op(NamedTuple):
    """A fused op: the .cu files (zmpi/kernels/) holding its kernels, those kernels, and its
    CUDA launcher and NumPy twin as "module:function"."""
    files: tuple[str, ...]
    kernels: tuple[str, ...]
    launcher: str
    twin: str


_NN, _LAUNCH, _FLASH = "zmpi.nn.functional:", "zmpi.kernels:", "zmpi.kernels.flash_attention:"
_LL, _LLAMA = "zmpi.nn.llama_functional:", "zmpi.kernels.llama:"
# Every fused op with CUDA of its own, in one place (tests/test_kernels_compile.py holds it to
# the .cu files' kernels and to the kernels.fused pairs the modules make); `matmul` is cuBLAS's.
OPS = {
    "layernorm_forward": Op(("layernorm.cu",), ("layernorm_forward",),
                            _LAUNCH + "cuda_layernorm_forward",
                            _NN + "_layernorm_forward_twin"),
    "layernorm_backward": Op(("layernorm.cu",),
                             ("layernorm_backward", "column_sums", "column_sums_total"),
                             _LAUNCH + "cuda_layernorm_backward",
                             _NN + "_layernorm_backward_twin"),
    "gelu_forward": Op(("gelu.cu",), ("gelu_forward",), _LAUNCH + "cuda_gelu_forward",
                       _NN + "_gelu_forward_twin"),
    "gelu_backward": Op(("gelu.cu",), ("gelu_backward",), _LAUNCH + "cuda_gelu_backward",
                        _NN + "_gelu_backward_twin"),
    "causal_softmax": Op(("softmax_loss.cu",), ("causal_softmax",),
                         _LAUNCH + "cuda_causal_softmax",
                         "zmpi.nn.attention:_causal_softmax_twin"),
    "softmax_backward": Op(("softmax_loss.cu",), ("softmax_backward",),
                           _LAUNCH + "cuda_softmax_backward",
                           "zmpi.nn.attention:_softmax_backward_twin"),
    "cross_entropy_rows": Op(("softmax_loss.cu",), ("cross_entropy_forward",),
                             _LAUNCH + "cuda_cross_entropy_rows",
                             _NN + "_cross_entropy_rows_twin"),
    "cross_entropy_grad": Op(("softmax_loss.cu",), ("cross_entropy_backward",),
                             _LAUNCH + "cuda_cross_entropy_grad",
                             _NN + "_cross_entropy_grad_twin"),
    "adam": Op(("adam.cu",), ("adam",), _LAUNCH + "cuda_adam", "zmpi.optim.adam:_adam_twin"),
    "sum_of_squares": Op(("adam.cu",), ("sum_of_squares",), _LAUNCH + "cuda_sum_of_squares",
                         "zmpi.optim.adam:_sum_of_squares_twin"),
    "bias_grad": Op(("bias_grad.cu",), ("bias_grad",), _LAUNCH + "cuda_bias_grad",
                    _NN + "_bias_grad_twin"),
    "rmsnorm_forward": Op(("rmsnorm.cu",), ("rmsnorm_forward",),
                          _LLAMA + "cuda_rmsnorm_forward", _LL + "_rmsnorm_forward_twin"),
    "rmsnorm_backward": Op(("rmsnorm.cu",),
                           ("rmsnorm_backward", "rmsnorm_dw_partials", "rmsnorm_dw_total"),
                           _LLAMA + "cuda_rmsnorm_backward", _LL + "_rmsnorm_backward_twin"),
    "rope_forward": Op(("rope.cu",), ("rope_forward",), _LLAMA + "cuda_rope_forward",
                       _LL + "_rope_forward_twin"),
    "rope_backward": Op(("rope.cu",), ("rope_backward",), _LLAMA + "cuda_rope_backward",
                        _LL + "_rope_backward_twin"),
    "swiglu_forward": Op(("swiglu.cu",), ("swiglu_forward",), _LLAMA + "cuda_swiglu_forward",
                         _LL + "_swiglu_forward_twin"),
    "swiglu_backward": Op(("swiglu.cu",), ("swiglu_backward",),
                          _LLAMA + "cuda_swiglu_backward", _LL + "_swiglu_backward_twin"),
    "flash_forward": Op(("flash.cu", "flash_tc.cu"), ("flash_forward", "flash_tc_forward"),
                        _FLASH + "cuda_flash_forward", _FLASH + "_forward_twin"),
    "flash_backward": Op(("flash.cu", "flash_tc.cu"),
                         ("flash_backward_dq", "flash_backward_dkv", "flash_tc_backward_dq",
                          "flash_tc_backward_dkv"),
                         _FLASH + "cuda_flash_backward", _FLASH + "_backward_twin"),
}

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


def fused(twin, cuda, in_place: bool = False, launches: int = 1, strided: bool = False):
    """The op that runs `twin(*args)` or `cuda(*args)` as the table in the module docstring
    says. The first argument decides: a device array under "fused" takes the fused path, with
    every device array argument made C-contiguous first (a copy, and a launch, only when it is
    not: the kernels index rows and columns of contiguous arrays). in_place: the op updates
    its arguments, which must then be C-contiguous already (ValueError: a copy would be
    updated instead). launches: the GPU operations `cuda` runs (what the stand-in counts for
    the twin). strided: `cuda` reads and writes arrays through their strides (its docstring
    says which layouts), so they reach it as given, views included (an `out` view is written
    where it lies). The op keeps its pair as `op.__wrapped__` (the twin) and `op.launcher`."""

    @functools.wraps(twin)
    def op(*args):
        if _mode[0] == "composed" or not backend.is_device_array(args[0]):
            return twin(*args)
        xp = backend.xp
        if in_place and not all(a.flags.c_contiguous for a in args
                                if backend.is_device_array(a)):
            raise ValueError(f"{twin.__name__}: updates its arguments in place, which must be "
                             "C-contiguous")
        if not strided:
            args = tuple(xp.ascontiguousarray(a) if backend.is_device_array(a) else a
                         for a in args)
        launch_twin = getattr(xp, "launch_twin", None)  # a CuPy without CUDA: the stand-in
        if launch_twin is not None:
            return launch_twin(twin, *args, launches=launches)
        return cuda(*args)

    op.launcher = cuda
    return op


def matmul(a, b, out=None):
    """a @ b (into `out` if given) for arrays of more than two dimensions. On a GPU under
    "fused", float16, bfloat16 or float32 operands of one dtype and one batch shape run as one
    cuBLAS strided batched GEMM read through their strides (a transposed or sliced operand is
    not copied when its matrices have a unit stride and its batches one stride), float32
    accumulation, 16-bit on tensor cores (float32 on TensorFloat-32 ones under CUPY_TF32, as
    CuPy's), written in their dtype: CuPy 14's matmul instead casts float16 operands to
    float32, multiplies without tensor cores and casts the product back (three cast kernels a
    product), and copies any operand that is not C-contiguous. bfloat16 takes the GEMM under
    "composed" too: CuPy 14.2 has no batched bfloat16 matmul (cupy/cupy#10317). Anything else
    (NumPy, float64, 2-D, "composed") is the array module's matmul. The stand-in runs
    `_matmul_twin` as the GEMM's one launch."""
    if (_mode[0] == "composed" and a.dtype != backend.BFLOAT16
            or not backend.is_device_array(a) or a.ndim < 3
            or a.dtype not in _GEMM_TYPES or b.dtype != a.dtype or a.shape[:-2] != b.shape[:-2]
            or a.shape[-1] != b.shape[-2] or out is not None
            and (out.dtype != a.dtype or out.shape != (*a.shape[:-1], b.shape[-1]))):
        return backend.array_module(a, b).matmul(a, b, out=out)
    xp = backend.xp
    a, b = (x if _gemm_layout(x) else xp.ascontiguousarray(x) for x in (a, b))
    into = out if out is not None and (_gemm_layout(out) or (1,))[0] == 0 else None
    launch_twin = getattr(xp, "launch_twin", None)  # a CuPy without CUDA: the stand-in
    c = launch_twin(_matmul_twin, a, b, into) if launch_twin else cuda_matmul(a, b, into)
    if out is None or c is out:
        return c
    out[...] = c  # a copy: cuBLAS writes only row-major matrices one batch stride apart
    return out


# cuBLAS's data types, as cupy.cuda.runtime names them (CUDA_R_16BF = 14 from CuPy 14 on)
_GEMM_TYPES = {np.dtype(np.float16): "CUDA_R_16F", backend.BFLOAT16: "CUDA_R_16BF",
               np.dtype(np.float32): "CUDA_R_32F"}


def _matmul_twin(a, b, out):
    """The product as cuBLAS makes it: float32 accumulation, rounded once to a's dtype."""
    product = np.matmul(a, b, dtype=np.float32)
    if out is None:
        return product.astype(a.dtype)
    out[...] = product
    return out


# -- compiling and launching the op families' .cu files (zmpi.kernels.source) ----------------

_C_TYPES = {np.dtype(np.float16): "__half", backend.BFLOAT16: "__nv_bfloat16",
            np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
THREADS = 256  # per block: a multiple of 32
MAX_BLOCKS = 1024  # of a grid-stride kernel, and the partial sums of sum_of_squares


def acc_dtype(dtype) -> np.dtype:
    """What a kernel on `dtype` arrays accumulates in: float32 (float16, bfloat16 and float32
    arrays), or float64 for float64."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


@functools.cache
def _function(name: str, dtype: np.dtype, acc: np.dtype):
    """Kernel `name` of the module compiled for (T, ACC) = (dtype, acc)."""
    if dtype not in _C_TYPES or acc not in _C_TYPES:
        raise TypeError(f"no {name} kernel for {dtype} arrays accumulated in {acc}")
    module = _modules(_C_TYPES[dtype], _C_TYPES[acc])
    return module.get_function(name)


@functools.cache
def _modules(t: str, acc: str, families: tuple[str, ...] = FAMILIES):
    """The module of `families` (.cu files after common.cuh) for C types (t, acc), compiled by
    CuPy's RawModule with `compile_options`: one per (t, acc, families), on first use."""
    return backend.xp.RawModule(code=module_source(families), options=compile_options(t, acc))


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

def _gemm_layout(x):
    """(cuBLAS's op, leading dimension, batch stride) of the matrices on x's last two axes, in
    elements: op 0 when they are row-major, 1 when column-major (a transposed view); None
    when they are neither or the batch axes are not one stride apart."""
    *batch, rows, cols = x.shape
    strides = [s // x.itemsize for s in x.strides]
    kept = [(n, s) for n, s in zip(batch, strides[:-2], strict=True) if n != 1]
    if not all(s0 == n1 * s1 for (_, s0), (n1, s1) in zip(kept, kept[1:], strict=False)):
        return None
    batch_stride = kept[-1][1] if kept else 0
    if strides[-1] == 1 and strides[-2] >= max(cols, 1):
        return 0, strides[-2], batch_stride
    if strides[-2] == 1 and strides[-1] >= max(rows, 1):
        return 1, strides[-1], batch_stride
    return None


def cuda_matmul(a, b, out):
    """`matmul` of a (..., M, K) and b (..., K, N) of one dtype (`_GEMM_TYPES`) and one batch
    shape, both with a `_gemm_layout`: cuBLAS gemmStridedBatchedEx in their dtype,
    CUBLAS_COMPUTE_32F (CUBLAS_COMPUTE_32F_FAST_TF32 for float32 when CUPY_TF32 is set, as
    CuPy does); into `out` (None, or row-major matrices one batch stride apart). Row-major
    C = A B is column-major C^T = B^T A^T: cuBLAS multiplies b's matrices by a's."""
    import os

    from cupy_backends.cuda.libs import cublas

    xp = backend.xp
    *batch, M, K = a.shape
    N = b.shape[-1]
    c = xp.empty((*batch, M, N), a.dtype) if out is None else out
    if c.size and K == 0:
        c.fill(0)
    elif c.size:
        (op_a, lda, stride_a), (op_b, ldb, stride_b) = _gemm_layout(a), _gemm_layout(b)
        _, ldc, stride_c = _gemm_layout(c)
        kind = getattr(xp.cuda.runtime, _GEMM_TYPES[a.dtype])
        tf32 = a.dtype == np.float32 and int(os.environ.get("CUPY_TF32", "0")) > 0
        compute = cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if tf32 else cublas.CUBLAS_COMPUTE_32F
        one, zero = np.ones((), np.float32), np.zeros((), np.float32)  # host scalars
        cublas.gemmStridedBatchedEx(
            xp.cuda.device.get_cublas_handle(), op_b, op_a, N, M, K, one.ctypes.data,
            b.data.ptr, kind, ldb, stride_b, a.data.ptr, kind, lda, stride_a, zero.ctypes.data,
            c.data.ptr, kind, ldc, stride_c, c.size // (M * N), compute,
            cublas.CUBLAS_GEMM_DEFAULT)
    return c


def _row_norm_outputs(x):
    """A row norm's outputs for x (..., C): y like x, and in x's accumulation dtype `acc`
    xhat (..., C) and rstd (..., 1) (the backward's cache). Returns (acc, y, xhat, rstd)."""
    xp, acc = backend.xp, acc_dtype(x.dtype)
    return acc, xp.empty_like(x), xp.empty(x.shape, acc), xp.empty((*x.shape[:-1], 1), acc)


def cuda_layernorm_forward(x, w, b, eps):
    C = x.shape[-1]
    acc, y, xhat, rstd = _row_norm_outputs(x)
    _launch("layernorm_forward", x.dtype, x.size // C,
            (x, w.astype(x.dtype, copy=False), b.astype(x.dtype, copy=False), y, xhat, rstd,
             np.int32(C), _scalar(acc, eps)))
    return y, (xhat, rstd, w)


def cuda_layernorm_backward(dy, cache, dw=None, db=None):
    xhat, rstd, w = cache
    xp, C = backend.xp, dy.shape[-1]
    rows = dy.size // C
    dx = xp.empty_like(dy)
    _launch("layernorm_backward", dy.dtype, rows,
            (dy, xhat, rstd, w.astype(dy.dtype, copy=False), dx, np.int32(C)))
    dw, db = _column_sums("column_sums", "column_sums_total", dy, xhat, (dw, db))
    return dx, dw, db


def _column_sums(partials, total, dy, xhat, outs):
    """The column sums of dy * xhat (dy (..., C) T, xhat of its shape in ACC) and, given two
    `outs`, of dy: kernel `partials` sums min(64, rows) row parts of THREADS columns a block
    into (len(outs), parts, C) ACC, then `total` sums those into `outs` (arrays (C,) of dy's
    dtype, or None for new ones), rounding once. The `outs` written, as a tuple. (LayerNorm's
    dw and db, RMSNorm's dw: common.cuh's column_partials and column_totals.)"""
    xp, C = backend.xp, dy.shape[-1]
    rows = dy.size // C
    parts = min(64, rows)
    partial = xp.empty((len(outs), parts, C), xhat.dtype)
    _launch(partials, dy.dtype, (-(-C // THREADS), parts),
            (dy, xhat, partial, np.int64(rows), np.int32(C)))
    outs = tuple(xp.empty(C, dy.dtype) if a is None else a for a in outs)
    _launch(total, dy.dtype, -(-C // THREADS), (partial, *outs, np.int32(parts), np.int32(C)))
    return outs


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
    probs = backend.xp.empty_like(scores)
    _launch("causal_softmax", scores.dtype, scores.size // S,
            (scores, probs, np.int32(R), np.int32(S), np.int32(start)))
    return probs


def cuda_softmax_backward(dprobs, probs):
    """(probs of another dtype than dprobs', e.g. a float32 softmax's, are cast to it first:
    one cast kernel)"""
    S = probs.shape[-1]
    dscores = backend.xp.empty_like(dprobs)
    _launch("softmax_backward", dprobs.dtype, probs.size // S,
            (dprobs, probs.astype(dprobs.dtype, copy=False), dscores, np.int32(S)))
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


BIAS_GRAD_PARTS = 64  # row parts (blocks per column tile) of bias_grad, at most
_arrived = [None]  # bias_grad's counters, one per column tile: zero between launches


def cuda_bias_grad(dy, out):
    """db (C,) in dy's dtype, the column sums of dy (rows, C) accumulated in ACC (the twin's
    contract: zmpi.nn.functional's linear_backward), into `out` when given: one launch of
    `bias_grad`, as CuPy's sum over axis 0 is, but reading dy's rows coalesced over every SM
    where CuPy's reduction walks each column down its stride (`cupy_sum`, 8 ms of a GPT-2
    small step on the H200, 48 bias gradients; this kernel's time is not measured yet). Its
    counters live in one buffer, zeroed when made (a launch, the first time and when it must
    grow) and left zero by every launch: launches on one stream at a time, as zmpi's compute
    runs."""
    xp, (rows, C) = backend.xp, dy.shape
    db = xp.empty(C, dy.dtype) if out is None else out
    if rows == 0:
        db.fill(0)
        return db
    tiles = -(-C // 32)
    parts = min(BIAS_GRAD_PARTS, -(-rows // (THREADS // 32)))
    if not isinstance(_arrived[0], xp.ndarray) or _arrived[0].size < tiles:
        _arrived[0] = xp.zeros(max(tiles, 1024), np.uint32)
    partial = xp.empty((parts, C), acc_dtype(dy.dtype))
    _launch("bias_grad", dy.dtype, (tiles, parts),
            (dy, partial, _arrived[0], db, np.int64(rows), np.int32(C)))
    return db
