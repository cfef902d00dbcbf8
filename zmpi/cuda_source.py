"""The CUDA C++ of zmpi.kernels' fused ops, one string: `SOURCE`. Each kernel keeps the contract
of a NumPy twin (zmpi.nn.functional, zmpi.nn.attention, zmpi.optim.adam); zmpi.kernels compiles
and launches it, and tests/test_kernels_compile.py compiles it with NVRTC for every dtype pair
the launchers use.

T: the arrays' dtype (__half, __nv_bfloat16, float, double); ACC: what the kernel accumulates
in (float, or double for double). A 16-bit T is read through `to_acc` and written through
`store`, rounded to nearest even once (cuda_fp16.h's and cuda_bf16.h's conversions, the only
intrinsics of those headers the source uses). One module per (T, ACC), compiled on first use
(CuPy caches it on disk). Row kernels run one block per row, blockDim.x a multiple of 32;
elementwise ones grid-stride.
"""

SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// The options define ZMPI_T and ZMPI_ACC, not T and ACC: NVRTC's builtin header, read before
// this source, names template parameters T, which a macro T would break.
typedef ZMPI_T T;
typedef ZMPI_ACC ACC;

__device__ __forceinline__ float to_acc(const __half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(const __nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(const float x) { return x; }
__device__ __forceinline__ double to_acc(const double x) { return x; }
__device__ __forceinline__ void store(__half* p, const float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, const float v) {
    *p = __float2bfloat16_rn(v);
}
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

// dw[c], db[c]: the sums of column_sums' partials (2, parts, C), rounded once as written
extern "C" __global__ void column_sums_total(const ACC* partial, T* dw, T* db, const int parts,
                                             const int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    ACC sw = 0, sb = 0;
    for (int p = 0; p < parts; ++p) {
        sw += partial[(long long)p * C + c];
        sb += partial[((long long)parts + p) * C + c];
    }
    store(dw + c, sw);
    store(db + c, sb);
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

// probs (rows, S) of scores (rows, S), both T (computed in ACC): softmax over the keys a query
// may see. Row r is query start + r % R; its keys 0 .. start + r % R; the later ones get
// probability 0.
extern "C" __global__ void causal_softmax(const T* scores, T* probs, const int R, const int S,
                                          const int start) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)S;
    const int seen = min(start + (int)(blockIdx.x % R) + 1, S);
    ACC m, z;
    row_max_sum_exp(scores + o, seen, shared, m, z);
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        store(probs + o + c, c < seen ? acc_exp(to_acc(scores[o + c]) - m) / z : (ACC)0);
}

// dscores = probs (dprobs - sum(dprobs probs)), per row; all T, computed in ACC
extern "C" __global__ void softmax_backward(const T* dprobs, const T* probs, T* dscores,
                                            const int S) {
    __shared__ ACC shared[32];
    const long long o = blockIdx.x * (long long)S;
    ACC dot = 0;
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        dot += to_acc(dprobs[o + c]) * to_acc(probs[o + c]);
    dot = block_reduce(dot, shared, false);
    for (int c = threadIdx.x; c < S; c += blockDim.x)
        store(dscores + o + c, (to_acc(dprobs[o + c]) - dot) * to_acc(probs[o + c]));
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

// db (C,) = the column sums of dy (rows, C), a bias's gradient, in one launch. Block (x, y)
// takes the 32 columns from 32 x and its warps the rows y w', y w' + W', ... (w' its warp's
// index among all W' = gridDim.y warps per column tile): coalesced reads, every SM busy. Each
// block sums its warps in warp order into partial[y] (gridDim.y, C); the block of a tile that
// arrives last (arrived[x], reset to 0 by it) sums the partials in y order and writes db: the
// same bits whichever block is last. blockDim.x <= 256 (8 warps).
extern "C" __global__ void bias_grad(const T* dy, ACC* partial, unsigned int* arrived, T* db,
                                     const long long rows, const int C) {
    __shared__ ACC warp_sums[8][32];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int c = blockIdx.x * 32 + lane;
    ACC s = 0;
    if (c < C)
        for (long long r = (long long)blockIdx.y * warps + warp; r < rows;
             r += (long long)gridDim.y * warps)
            s += to_acc(dy[r * C + c]);
    warp_sums[warp][lane] = s;
    __syncthreads();
    if (warp == 0 && c < C) {
        ACC t = 0;
        for (int w = 0; w < warps; ++w) t += warp_sums[w][lane];
        partial[(long long)blockIdx.y * C + c] = t;
        __threadfence();  // the partial is visible to every block before this one is counted
    }
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(arrived + blockIdx.x, 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    if (warp == 0 && c < C) {
        __threadfence();
        ACC t = 0;
        for (int y = 0; y < (int)gridDim.y; ++y)
            t += ((volatile ACC*)partial)[(long long)y * C + c];
        store(db + c, t);
    }
    if (threadIdx.x == 0) arrived[blockIdx.x] = 0;  // ready for the next launch
}
"""
