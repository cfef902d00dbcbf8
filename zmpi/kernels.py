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

This is the only module with CUDA source; zmpi.backend is the only one that knows which array
module runs.
"""
from __future__ import annotations

import functools

import numpy as np

from zmpi import backend

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

    op.twin = twin
    return op


# -- the CUDA source -------------------------------------------------------------------------
# T: the arrays' dtype (__half, float, double); ACC: what the kernel accumulates in (float,
# or double for double). One module per (T, ACC), compiled on first use (CuPy caches it on disk).
# Row kernels run one block per row, blockDim.x a multiple of 32; elementwise ones grid-stride.

SOURCE = r"""
#include <cuda_fp16.h>

// The options define ZMPI_T and ZMPI_ACC, not T and ACC: NVRTC's builtin header, read before
// this source, names template parameters T, which a macro T would break.
typedef ZMPI_T T;
typedef ZMPI_ACC ACC;

__device__ __forceinline__ float to_acc(const __half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(const float x) { return x; }
__device__ __forceinline__ double to_acc(const double x) { return x; }
__device__ __forceinline__ void store(__half* p, const float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(float* p, const float v) { *p = v; }
__device__ __forceinline__ void store(double* p, const double v) { *p = v; }
__device__ __forceinline__ float acc_exp(const float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(const double x) { return exp(x); }
__device__ __forceinline__ float acc_log(const float x) { return logf(x); }
__device__ __forceinline__ double acc_log(const double x) { return log(x); }
__device__ __forceinline__ float acc_sqrt(const float x) { return sqrtf(x); }
__device__ __forceinline__ double acc_sqrt(const double x) { return sqrt(x); }
__device__ __forceinline__ float acc_tanh(const float x) { return tanhf(x); }
__device__ __forceinline__ double acc_tanh(const double x) { return tanh(x); }
__device__ __forceinline__ float neg_inf(const float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double neg_inf(const double) {
    return __longlong_as_double(0xfff0000000000000ULL);
}

template <typename A> __device__ __forceinline__ A warp_reduce(A v, const bool is_max) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        const A other = __shfl_xor_sync(0xffffffffu, v, offset);
        v = is_max ? (other > v ? other : v) : v + other;
    }
    return v;
}

// The sum (or max) over the block, in every thread. `shared`: 32 slots of A.
template <typename A> __device__ A block_reduce(A v, A* shared, const bool is_max) {
    v = warp_reduce(v, is_max);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // the previous reduction's readers are done with `shared`
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? shared[lane] : (is_max ? neg_inf(v) : (A)0);
    return warp_reduce(v, is_max);
}

#define GRID_STRIDE(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)

// x, y (rows, C) T; w, b (C,) T; xhat (rows, C), rstd (rows,) ACC
extern "C" __global__ void layernorm_forward(const T* x, const T* w, const T* b, T* y,
                                             ACC* xhat, ACC* rstd, const int C, const ACC eps) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)C;
    ACC s = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += to_acc(x[o + c]);
    const ACC mean = block_reduce(s, shared, false) / C;
    ACC s2 = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC d = to_acc(x[o + c]) - mean;
        s2 += d * d;
    }
    const ACC r = (ACC)1 / acc_sqrt(block_reduce(s2, shared, false) / C + eps);
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC h = (to_acc(x[o + c]) - mean) * r;
        xhat[o + c] = h;
        store(y + o + c, h * to_acc(w[c]) + to_acc(b[c]));
    }
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy w. dy, dx (rows, C) T
extern "C" __global__ void layernorm_backward(const T* dy, const ACC* xhat, const ACC* rstd,
                                              const T* w, T* dx, const int C) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)C;
    ACC sg = 0, sgx = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC g = to_acc(dy[o + c]) * to_acc(w[c]);
        sg += g;
        sgx += g * xhat[o + c];
    }
    const ACC mg = block_reduce(sg, shared, false) / C;
    const ACC mgx = block_reduce(sgx, shared, false) / C;
    const ACC r = rstd[blockIdx.x];
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        const ACC g = to_acc(dy[o + c]) * to_acc(w[c]);
        store(dx + o + c, (g - mg - xhat[o + c] * mgx) * r);
    }
}

// partial (2, gridDim.y, C): column sums of dy xhat and of dy over rows y, y + gridDim.y, ...
extern "C" __global__ void column_sums(const T* dy, const ACC* xhat, ACC* partial,
                                       const long long rows, const int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    ACC sw = 0, sb = 0;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        const ACC d = to_acc(dy[r * C + c]);
        sw += d * xhat[r * C + c];
        sb += d;
    }
    partial[(long long)blockIdx.y * C + c] = sw;
    partial[((long long)gridDim.y + blockIdx.y) * C + c] = sb;
}

#define GELU_S 0.7978845608028654  // sqrt(2 / pi)

// y = 0.5 x (1 + t), t = tanh(sqrt(2/pi) x (1 + 0.044715 x^2)). Both kernels take the
// products in the twins' order (x x first, then times the constant), so each rounds as theirs.
extern "C" __global__ void gelu_forward(const T* x, T* y, ACC* t, const long long n) {
    GRID_STRIDE(i, n) {
        const ACC v = to_acc(x[i]);
        const ACC th = acc_tanh(v * (v * v * (ACC)0.044715 + (ACC)1) * (ACC)GELU_S);
        t[i] = th;
        store(y + i, (th + (ACC)1) * v * (ACC)0.5);
    }
}

extern "C" __global__ void gelu_backward(const T* dy, const T* x, const ACC* t, T* dx,
                                         const long long n) {
    GRID_STRIDE(i, n) {
        const ACC v = to_acc(x[i]), th = t[i];
        const ACC g = (v * v * (ACC)(3 * 0.044715) + (ACC)1) * (ACC)(0.5 * GELU_S) * v
                      * ((ACC)1 - th * th) + (ACC)0.5 + th * (ACC)0.5;
        store(dx + i, g * to_acc(dy[i]));
    }
}

// m = max of row[0, n), z = sum of exp(row[c] - m) over it, in every thread of the block
__device__ void row_max_sum_exp(const T* row, const int n, ACC* shared, ACC& m, ACC& z) {
    m = neg_inf((ACC)0);
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        const ACC v = to_acc(row[c]);
        m = v > m ? v : m;
    }
    m = block_reduce(m, shared, true);
    z = 0;
    for (int c = threadIdx.x; c < n; c += blockDim.x) z += acc_exp(to_acc(row[c]) - m);
    z = block_reduce(z, shared, false);
}

// probs (rows, S) of scores (rows, S): softmax over the keys a query may see. Row r is query
// start + r % R; its keys 0 .. start + r % R; the later ones get probability 0.
extern "C" __global__ void causal_softmax(const T* scores, ACC* probs, const int R, const int S,
                                          const int start) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)S;
    const int seen = min(start + (int)(blockIdx.x % R) + 1, S);
    ACC m, z;
    row_max_sum_exp(scores + o, seen, shared, m, z);
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        probs[o + c] = c < seen ? acc_exp(to_acc(scores[o + c]) - m) / z : (ACC)0;
}

// dscores = probs (dprobs - sum(dprobs probs)), per row
extern "C" __global__ void softmax_backward(const T* dprobs, const ACC* probs, T* dscores,
                                            const int S) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)S;
    ACC dot = 0;
    for (int c = threadIdx.x; c < S; c += blockDim.x) dot += to_acc(dprobs[o + c]) * probs[o + c];
    dot = block_reduce(dot, shared, false);
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        store(dscores + o + c, (to_acc(dprobs[o + c]) - dot) * probs[o + c]);
}

// loss[r] = (lse - logits[r, t]) inv_normalizer (0 where t == ignore), lse[r] = log sum exp
extern "C" __global__ void cross_entropy_forward(const T* logits, const long long* targets,
                                                 ACC* loss, ACC* lse, const int V,
                                                 const int has_ignore, const long long ignore,
                                                 const ACC inv_normalizer) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)V;
    ACC m, s;
    row_max_sum_exp(logits + o, V, shared, m, s);
    if (threadIdx.x == 0) {
        const long long t = targets[blockIdx.x];
        const bool ignored = has_ignore && t == ignore;
        const ACC l = acc_log(s);
        lse[blockIdx.x] = l + m;
        loss[blockIdx.x] = ignored ? (ACC)0 : (l - (to_acc(logits[o + t]) - m)) * inv_normalizer;
    }
}

// dlogits = (exp(logits - lse) - onehot(t)) scale, 0 on ignored rows
extern "C" __global__ void cross_entropy_backward(const T* logits, const ACC* lse,
                                                  const long long* targets, T* dlogits,
                                                  const int V, const int has_ignore,
                                                  const long long ignore, const ACC scale) {
    const long long o = blockIdx.x * (long long)V, t = targets[blockIdx.x];
    const bool ignored = has_ignore && t == ignore;
    const ACC l = lse[blockIdx.x];
    for (int c = threadIdx.x; c < V; c += blockDim.x) {
        const ACC p = acc_exp(to_acc(logits[o + c]) - l) - (c == t ? (ACC)1 : (ACC)0);
        store(dlogits + o + c, ignored ? (ACC)0 : p * scale);
    }
}

// Adam(W) in place: param, m, v ACC (the master dtype); grads T. The operations and their
// order are host_kernels._adam's (zmpi.optim.adam.AdamCoefficients names the scalars).
extern "C" __global__ void adam(ACC* param, const T* grads, ACC* m, ACC* v, const long long n,
                                const ACC scale, const ACC l2, const ACC beta1,
                                const ACC one_minus_beta1, const ACC beta2,
                                const ACC one_minus_beta2, const ACC eps_hat, const ACC decay,
                                const ACC step_size) {
    GRID_STRIDE(i, n) {
        ACC g = (ACC)to_acc(grads[i]) * scale;
        if (l2 != (ACC)0) g = g + param[i] * l2;
        const ACC mi = m[i] * beta1 + g * one_minus_beta1;
        const ACC vi = v[i] * beta2 + g * g * one_minus_beta2;
        m[i] = mi;
        v[i] = vi;
        param[i] = param[i] * decay - mi / (acc_sqrt(vi) + eps_hat) * step_size;
    }
}

// partial[block] = sum of (x scale)^2 over the block's grid-stride share of x
extern "C" __global__ void sum_of_squares(const T* x, ACC* partial, const long long n,
                                          const ACC scale) {
    __shared__ ACC shared[32];
    ACC s = 0;
    GRID_STRIDE(i, n) {
        const ACC g = (ACC)to_acc(x[i]) * scale;
        s += g * g;
    }
    s = block_reduce(s, shared, false);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
"""

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


# -- CUDA launchers: the twins' contracts (zmpi.nn.functional, zmpi.optim.adam) ---------------

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
