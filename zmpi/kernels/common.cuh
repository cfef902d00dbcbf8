// What every zmpi kernel module starts with (zmpi.kernels.source.module_source puts it first,
// then the op families' .cu files, as one source: CuPy's RawModule keys its cache on the code,
// so an #include of a file of ours would let an edit go unseen).
//
// T: the arrays' dtype (__half, __nv_bfloat16, float, double); ACC: what the kernel accumulates
// in (float, or double for double). A 16-bit T is read through `to_acc` and written through
// `store`, rounded to nearest even once (cuda_fp16.h's and cuda_bf16.h's conversions, the only
// intrinsics of those headers the kernels use). One module per (T, ACC), compiled on first use
// (CuPy caches it on disk). Row kernels run one block per row, blockDim.x a multiple of 32;
// elementwise ones grid-stride.
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

// Column sums of the weight (and bias) gradients of a row normalisation, in two kernels that
// share these bodies (LayerNorm's column_sums / column_sums_total, RMSNorm's
// rmsnorm_dw_partials / rmsnorm_dw_total): the first sums rows y, y + gridDim.y, ... of column
// c = blockIdx.x * blockDim.x + threadIdx.x of dy xhat (and, BIAS, of dy) into partial
// (1 + BIAS, gridDim.y, C); the second sums a column's `parts` partials and rounds once as it
// writes dw[c] (and db[c]). Without BIAS, db is not read and may be null.
template <bool BIAS> __device__ void column_partials(const T* dy, const ACC* xhat, ACC* partial,
                                                     const long long rows, const int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    ACC sw = 0, sb = 0;
    for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
        const ACC d = to_acc(dy[r * C + c]);
        sw += d * xhat[r * C + c];
        if (BIAS) sb += d;
    }
    partial[(long long)blockIdx.y * C + c] = sw;
    if (BIAS) partial[((long long)gridDim.y + blockIdx.y) * C + c] = sb;
}

template <bool BIAS> __device__ void column_totals(const ACC* partial, T* dw, T* db,
                                                   const int parts, const int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    ACC sw = 0, sb = 0;
    for (int p = 0; p < parts; ++p) {
        sw += partial[(long long)p * C + c];
        if (BIAS) sb += partial[((long long)parts + p) * C + c];
    }
    store(dw + c, sw);
    if (BIAS) store(db + c, sb);
}

#define GRID_STRIDE(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)
