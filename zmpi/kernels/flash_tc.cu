// The CUDA C++ of zmpi.kernels.flash_attention on tensor cores: the same three
// kernels as flash.cu's (forward, backward of queries, backward of keys, with the
// same arguments, CSR layout walk, tile skips and masks) whose products run as warp matrix
// multiply-accumulates (nvcuda::wmma, m16n16k16: 16-bit inputs, float accumulation) for 16-bit
// T (__half, __nv_bfloat16; sm_80 and later: the kernels compile to nothing before). It is
// compiled after flash.cu and what precedes it, in a module of its own, and uses their helpers.
//
// A block of S query (or key) rows, S a multiple of 16 dividing the layout's block
// (flash_attention.tile_rows), runs S / 16 warps, each owning 16 rows. Per tile of S keys (or
// queries) the block loads the tiles it multiplies into shared memory as stored (16-bit, rows
// padded by 8 elements; by cp.async into one of two buffers while it works on the other:
// tc_pipelined_tiles), each warp computes its 16 rows' scores with the MMA into float tiles,
// applies the scale 1 / sqrt(hd), the causal mask and the softmax on them in float (two lanes a
// row), rounds the probabilities (and, backward, ds) to T and multiplies them by the next
// operand with the MMA again. Outputs accumulate in float in shared memory: the forward's o
// rescaled by exp(m_old - m_new) row by row (a fragment's rows are opaque), dq, dk and dv summed.
// What differs from the SIMT kernels' arithmetic: q is not scaled before the product (the
// scores are), and p and ds are rounded to T before their products (FlashAttention's choice):
// results agree with the twin within T's rounding.
//
// Tiles (T elements; float elements), carved in this order, with the leading dimensions of
// TcLeadingDims ld: ld.hd = hd + 8, ld.p = S + 8, ld.s = max(S, hd) + 4, ld.o = hd + 4, every
// tile 32-byte aligned as the MMA's loads and stores require:
//     forward   sQ, k and v twice (S, ld.hd); sP (S, ld.p); sS (S, ld.s); sO (S, ld.o);
//               m, l, alpha (S)
//     dq        sQ sDY, k and v twice (S, ld.hd); sP (S, ld.p); sS sT (S, ld.s); sDQ (S, ld.o);
//               lse, delta (S)
//     dkv       sK sV, q and dy twice (S, ld.hd); sP sDS (S, ld.p); sS sT (S, ld.s); sDK sDV
//               (S, ld.o); lse and delta twice (S)
#include <cuda_pipeline_primitives.h>
#include <mma.h>
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, T, nvcuda::wmma::row_major>
    TcA;
typedef nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> TcC;

// The b operand of a product: b (K, 16 n) row-major, or its transpose read from b (16 n, K)
// row-major (a column-major fragment); `tile` finds the (k, j) tile of 16 x 16.
template <bool Transposed> struct TcOperandB;
template <> struct TcOperandB<false> {
    typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, T,
                                   nvcuda::wmma::row_major> Fragment;
    __device__ static const T* tile(const T* b, const int ldb, const int k, const int j) {
        return b + k * ldb + j * 16;
    }
};
template <> struct TcOperandB<true> {
    typedef nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, T,
                                   nvcuda::wmma::col_major> Fragment;
    __device__ static const T* tile(const T* b, const int ldb, const int k, const int j) {
        return b + j * 16 * ldb + k;
    }
};

// A warp's c (16, 16 n) = a (16, K) b (or b^T), K a multiple of 16, into c (float, leading
// dimension ldc), added to what c holds when `accumulate`
template <bool Transposed>
__device__ void tc_product(const T* a, const int lda, const T* b, const int ldb, const int K,
                           const int n, float* c, const int ldc, const bool accumulate) {
    typedef TcOperandB<Transposed> B;
    for (int j = 0; j < n; ++j) {
        TcC acc;
        if (accumulate)
            nvcuda::wmma::load_matrix_sync(acc, c + j * 16, ldc, nvcuda::wmma::mem_row_major);
        else
            nvcuda::wmma::fill_fragment(acc, 0.0f);
        for (int k = 0; k < K; k += 16) {
            TcA fa;
            typename B::Fragment fb;
            nvcuda::wmma::load_matrix_sync(fa, a + k, lda);
            nvcuda::wmma::load_matrix_sync(fb, B::tile(b, ldb, k, j), ldb);
            nvcuda::wmma::mma_sync(acc, fa, fb, acc);
        }
        nvcuda::wmma::store_matrix_sync(c + j * 16, acc, ldc, nvcuda::wmma::mem_row_major);
    }
}

// The leading dimensions (in elements) of the tensor-core kernels' tiles of S rows: each row
// padded past its width (against shared-memory bank conflicts) to a multiple of 16 bytes, as
// wmma's loads and stores require. hd: T tiles of a head's hd columns (q, k, v, dy); p: T
// tiles of S columns (p, ds); s: float tiles of products of either width (scores, p v); o:
// float sums of hd columns (o, dq, dk, dv). flash_attention._shared_bytes counts the same.
struct TcLeadingDims {
    int hd, p, s, o;
    __device__ TcLeadingDims(const int S, const int head_size)
        : hd(head_size + 8), p(S + 8), s((S > head_size ? S : head_size) + 4),
          o(head_size + 4) {}
};

// The column a softmax lane takes at its step j (j = its half, half + 2, ...: two lanes a row,
// lane l on row l / 2 of the warp's 16): column j, two columns on for rows 8-15 (lanes 16-31),
// wrapping within the S columns (S is 16, 32 or 64). A float row of the scores is ld.s words,
// 4 or 20 modulo 32 banks, so rows i and i + 8 would read the same bank at every step (2-way
// conflicts); shifted by two they take the 32 banks once. The 16-bit stores of p and ds (rows
// of S / 2 + 4 words, two lanes a word) are conflict-free the same way.
__device__ __forceinline__ int tc_column(const int j, const int lane, const int S) {
    return (j + ((lane >> 4) << 1)) & (S - 1);
}

// rows [r0, r0 + S) of one head's q, k, v or dy (`src` at its first column, rows `stride`
// apart) into tile (S, ld) of T as stored; zeros past seq
__device__ void tc_load(const T* src, const long long stride, const int r0, const int seq,
                        const int S, const int hd, const int ld, T* tile) {
    for (int e = threadIdx.x; e < S * hd; e += blockDim.x) {
        const int r = e / hd, d = e % hd;
        if (r0 + r < seq) tile[r * ld + d] = src[(r0 + r) * stride + d];
        else store(tile + r * ld + d, (ACC)0);
    }
}

// tc_load by asynchronous 16-byte copies (cp.async: in flight until __pipeline_wait_prior; the
// rows past seq zero-filled). hd is a multiple of 16, so a row's copies stay 16-byte aligned
// when `src` and the row stride are; where they are not, tc_load copies now.
__device__ void tc_load_async(const T* src, const long long stride, const int r0, const int seq,
                              const int S, const int hd, const int ld, T* tile) {
    if (reinterpret_cast<size_t>(src) % 16 || stride * sizeof(T) % 16) {
        tc_load(src, stride, r0, seq, S, hd, ld, tile);
        return;
    }
    const int chunks = hd * (int)sizeof(T) / 16;  // of a row
    const int per = 16 / (int)sizeof(T);  // elements a chunk
    for (int e = threadIdx.x; e < S * chunks; e += blockDim.x) {
        const int r = e / chunks, d = e % chunks * per;
        const bool inside = r0 + r < seq;  // else 16 bytes of zeros, nothing read
        __pipeline_memcpy_async(tile + r * ld + d, inside ? src + (r0 + r) * stride + d : src,
                                16, inside ? 0 : 16);
    }
}

// body(r0, buf) for every tile r0 that flash_next_tile (flash.cu) gives from list, begin and keep,
// after load(r0, buf) has put what the tile needs in shared memory buffer buf (0 or 1) by
// asynchronous copies: the next tile's copies are in flight (into the other buffer) while
// body works on this one (cp.async, double-buffered). Every thread of the block calls it;
// body must not use __syncthreads (it runs between two).
template <typename Keep, typename Load, typename Body>
__device__ void tc_pipelined_tiles(const int* list, const int begin, const int end,
                                   const int block, const int S, Keep keep, Load load,
                                   Body body) {
    int n = begin, r0 = -1, buf = 0;
    bool have = flash_next_tile(list, end, block, S, keep, n, r0);
    if (have) load(r0, 0);
    __pipeline_commit();
    while (have) {
        int n_next = n, r_next = r0;
        const bool more = flash_next_tile(list, end, block, S, keep, n_next, r_next);
        if (more) load(r_next, buf ^ 1);  // the buffer the previous tile's readers are done with
        __pipeline_commit();
        __pipeline_wait_prior(1);  // this thread's copies of this tile have landed
        __syncthreads();  // and every thread's
        body(r0, buf);
        __syncthreads();  // every reader of this buffer is done before it is loaded again
        buf ^= 1;
        n = n_next;
        r0 = r_next;
        have = more;
    }
}

// body(k0, sK, sV) for every tile of S keys k0 of the layout row of the block's query tile
// (head.r0) that its queries see, sK and sV (S, ld_hd) holding its keys and values (buffers
// kBuf and vBuf, loaded as tc_pipelined_tiles loads): the walk of flash_tc_forward and
// flash_tc_backward_dq
template <typename Body>
__device__ void tc_key_tiles(const FlashHead& head, const int* row_ptr, const int* cols,
                             const int seq, const int hd, const int block,
                             const int layout_heads, const int S, const int ld_hd,
                             T* const kBuf[2], T* const vBuf[2], Body body) {
    int begin, end;
    flash_list(row_ptr, head.h, layout_heads, head.nb, head.r0 / block, &begin, &end);
    tc_pipelined_tiles(
        cols, begin, end, block, S,
        [&](const int k0) { return flash_keys_seen(k0, head.r0, S, seq); },
        [&](const int k0, const int buf) {
            tc_load_async(head.k, head.stride, k0, seq, S, hd, ld_hd, kBuf[buf]);
            tc_load_async(head.v, head.stride, k0, seq, S, hd, ld_hd, vBuf[buf]);
        },
        [&](const int k0, const int buf) { body(k0, kBuf[buf], vBuf[buf]); });
}

// y (B, seq, C) and lse (B nh, seq) for query rows q0 .. q0 + S of head h (grid (nb block / S,
// B nh), S / 16 warps): flash.cu's flash_forward, its products on tensor cores
extern "C" __global__ void flash_tc_forward(const T* qkv, const int* row_ptr, const int* cols,
                                            T* y, ACC* lse, const int seq, const int nh,
                                            const int nkv, const int hd, const int block,
                                            const int layout_heads, const int S,
                                            const ACC scale) {
    extern __shared__ __align__(32) unsigned char flash_smem[];
    const FlashHead head(qkv, blockIdx.y, seq, nh, nkv, hd, block, S);
    const TcLeadingDims ld(S, hd);
    const int q0 = head.r0, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char* at = flash_smem;
    T* sQ = flash_carve<T>(at, S * ld.hd);
    T* const kBuf[2] = {flash_carve<T>(at, S * ld.hd), flash_carve<T>(at, S * ld.hd)};
    T* const vBuf[2] = {flash_carve<T>(at, S * ld.hd), flash_carve<T>(at, S * ld.hd)};
    T* sP = flash_carve<T>(at, S * ld.p);
    float* sS = flash_carve<float>(at, S * ld.s);
    float* sO = flash_carve<float>(at, S * ld.o);
    float* sM = flash_carve<float>(at, S);
    float* sL = flash_carve<float>(at, S);
    float* sA = flash_carve<float>(at, S);
    tc_load(head.q, head.stride, q0, seq, S, hd, ld.hd, sQ);
    for (int e = threadIdx.x; e < S * ld.o; e += blockDim.x) sO[e] = 0;
    for (int r = threadIdx.x; r < S; r += blockDim.x) {
        sM[r] = neg_inf(0.0f);
        sL[r] = 0;
    }
    // the warp's 16 rows; two lanes a row in the softmax, each every other column
    const int w0 = warp * 16, r = w0 + (lane >> 1), half = lane & 1;
    float* s = sS + w0 * ld.s;
    __syncthreads();  // sQ, sO, sM, sL written
    tc_key_tiles(
        head, row_ptr, cols, seq, hd, block, layout_heads, S, ld.hd, kBuf, vBuf,
        [&](const int k0, const T* sK, const T* sV) {
            tc_product<true>(sQ + w0 * ld.hd, ld.hd, sK, ld.hd, hd, S / 16, s, ld.s, false);
            __syncwarp();
            float mx = neg_inf(0.0f);
            for (int j = half; j < S; j += 2) {
                const int c = tc_column(j, lane, S);
                const bool kept = k0 + c <= q0 + r && k0 + c < seq;
                const float v = kept ? s[(r - w0) * ld.s + c] * scale : neg_inf(0.0f);
                s[(r - w0) * ld.s + c] = v;
                mx = v > mx ? v : mx;
            }
            const float other = __shfl_xor_sync(0xffffffffu, mx, 1);
            mx = other > mx ? other : mx;
            float m_old, m_new, m_use, sum = 0;
            flash_new_max(sM, r, mx, &m_old, &m_new, &m_use);
            for (int j = half; j < S; j += 2) {
                const int c = tc_column(j, lane, S);
                const float p = acc_exp(s[(r - w0) * ld.s + c] - m_use);
                store(sP + r * ld.p + c, p);
                sum += p;
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            __syncwarp();  // every lane has read m_old before it changes
            if (half == 0) flash_rescale(sM, sL, sA, r, m_old, m_new, m_use, sum);
            __syncwarp();
            tc_product<false>(sP + w0 * ld.p, ld.p, sV, ld.hd, S, hd / 16, s, ld.s, false);
            __syncwarp();
            for (int e = lane; e < 16 * hd; e += 32) {  // o = o alpha + p v, row by row
                const int i = e / hd, d = e % hd;
                sO[(w0 + i) * ld.o + d] = sO[(w0 + i) * ld.o + d] * sA[w0 + i] + s[i * ld.s + d];
            }
        });
    flash_store_output(y + head.at_y, lse, sO, ld.o, sM, sL, head.bh, q0, seq, S, hd, head.C);
}

// flash.cu's flash_backward_dq on tensor cores: delta = rowsum(dy y) for rows q0 .. q0 + S
// and dq = scale sum ds k, ds = p (dy v^T - delta) rounded to T, p = exp(s - lse)
extern "C" __global__ void flash_tc_backward_dq(const T* qkv, const T* y, const T* dy,
                                                const ACC* lse, const int* row_ptr,
                                                const int* cols, T* dqkv, ACC* delta,
                                                const int seq, const int nh, const int nkv,
                                                const int hd, const int block,
                                                const int layout_heads, const int S,
                                                const ACC scale) {
    extern __shared__ __align__(32) unsigned char flash_smem[];
    const FlashHead head(qkv, blockIdx.y, seq, nh, nkv, hd, block, S);
    const TcLeadingDims ld(S, hd);
    const int q0 = head.r0, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char* at = flash_smem;
    T* sQ = flash_carve<T>(at, S * ld.hd);
    T* sDY = flash_carve<T>(at, S * ld.hd);
    T* const kBuf[2] = {flash_carve<T>(at, S * ld.hd), flash_carve<T>(at, S * ld.hd)};
    T* const vBuf[2] = {flash_carve<T>(at, S * ld.hd), flash_carve<T>(at, S * ld.hd)};
    T* sP = flash_carve<T>(at, S * ld.p);  // ds
    float* sS = flash_carve<float>(at, S * ld.s);  // scores
    float* sT = flash_carve<float>(at, S * ld.s);  // dy v^T
    float* sDQ = flash_carve<float>(at, S * ld.o);
    float* sLse = flash_carve<float>(at, S);
    float* sD = flash_carve<float>(at, S);
    tc_load(head.q, head.stride, q0, seq, S, hd, ld.hd, sQ);
    tc_load(dy + head.at_y, head.C, q0, seq, S, hd, ld.hd, sDY);
    for (int e = threadIdx.x; e < S * ld.o; e += blockDim.x) sDQ[e] = 0;
    flash_row_stats(y + head.at_y, dy + head.at_y, lse, delta, sD, sLse, head.bh, q0, seq, S, hd,
                    head.C);
    const int w0 = warp * 16, r = w0 + (lane >> 1), half = lane & 1;
    float* s = sS + w0 * ld.s;
    float* t = sT + w0 * ld.s;
    __syncthreads();  // sQ, sDY, sDQ, sLse, sD written
    tc_key_tiles(
        head, row_ptr, cols, seq, hd, block, layout_heads, S, ld.hd, kBuf, vBuf,
        [&](const int k0, const T* sK, const T* sV) {
            tc_product<true>(sQ + w0 * ld.hd, ld.hd, sK, ld.hd, hd, S / 16, s, ld.s, false);
            tc_product<true>(sDY + w0 * ld.hd, ld.hd, sV, ld.hd, hd, S / 16, t, ld.s, false);
            __syncwarp();
            for (int j = half; j < S; j += 2) {
                const int c = tc_column(j, lane, S);
                const float p = flash_kept(q0 + r, k0 + c, seq)
                                    ? acc_exp(s[(r - w0) * ld.s + c] * scale - sLse[r])
                                    : 0.0f;
                store(sP + r * ld.p + c, p * (t[(r - w0) * ld.s + c] - sD[r]));
            }
            __syncwarp();
            tc_product<false>(sP + w0 * ld.p, ld.p, sK, ld.hd, S, hd / 16, sDQ + w0 * ld.o, ld.o,
                              true);
        });
    flash_store_rows(dqkv + head.at_q, head.stride, q0, seq, S, hd, sDQ, ld.o, scale);
}

// flash.cu's flash_backward_dkv on tensor cores: for key rows k0 .. k0 + S of key/value head
// l, over each query head of its group in order and the query blocks that keep their block,
// dv = sum p^T dy and dk = scale sum ds^T q, p and ds rounded to T; each warp's 16 keys
// against S queries at a time
extern "C" __global__ void flash_tc_backward_dkv(const T* qkv, const T* dy, const ACC* lse,
                                                 const ACC* delta, const int* col_ptr,
                                                 const int* rows, T* dqkv, const int seq,
                                                 const int nh, const int nkv, const int hd,
                                                 const int block, const int layout_heads,
                                                 const int S, const ACC scale) {
    extern __shared__ __align__(32) unsigned char flash_smem[];
    const int g = nh / nkv;  // blockIdx.y = b nkv + l: query heads (b nkv + l) g .. + g - 1
    const FlashHead first(qkv, blockIdx.y * g, seq, nh, nkv, hd, block, S);
    const TcLeadingDims ld(S, hd);
    const int k0 = first.r0, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned char* at = flash_smem;
    T* sK = flash_carve<T>(at, S * ld.hd);
    T* sV = flash_carve<T>(at, S * ld.hd);
    T* const qBuf[2] = {flash_carve<T>(at, S * ld.hd), flash_carve<T>(at, S * ld.hd)};
    T* const dyBuf[2] = {flash_carve<T>(at, S * ld.hd), flash_carve<T>(at, S * ld.hd)};
    T* sP = flash_carve<T>(at, S * ld.p);  // p^T (keys, queries)
    T* sDS = flash_carve<T>(at, S * ld.p);  // ds^T
    float* sS = flash_carve<float>(at, S * ld.s);  // k q^T
    float* sT = flash_carve<float>(at, S * ld.s);  // v dy^T
    float* sDK = flash_carve<float>(at, S * ld.o);
    float* sDV = flash_carve<float>(at, S * ld.o);
    float* const lseBuf[2] = {flash_carve<float>(at, S), flash_carve<float>(at, S)};
    float* const deltaBuf[2] = {flash_carve<float>(at, S), flash_carve<float>(at, S)};
    tc_load(first.k, first.stride, k0, seq, S, hd, ld.hd, sK);
    tc_load(first.v, first.stride, k0, seq, S, hd, ld.hd, sV);
    for (int e = threadIdx.x; e < S * ld.o; e += blockDim.x) {
        sDK[e] = 0;
        sDV[e] = 0;
    }
    const int w0 = warp * 16, r = w0 + (lane >> 1), half = lane & 1;  // r: a key row
    float* s = sS + w0 * ld.s;
    float* t = sT + w0 * ld.s;
    __syncthreads();  // sK, sV, sDK, sDV written
    for (int member = 0; member < g; ++member) {  // the group's query heads, in order
        const FlashHead head(qkv, first.bh + member, seq, nh, nkv, hd, block, S);
        int begin, end;
        flash_list(col_ptr, head.h, layout_heads, head.nb, k0 / block, &begin, &end);
        const ACC* lse_h = lse + (long long)head.bh * seq;
        const ACC* delta_h = delta + (long long)head.bh * seq;
        tc_pipelined_tiles(
            rows, begin, end, block, S,
            [&](const int q0) { return flash_queries_seen(q0, k0, S, seq); },
            [&](const int q0, const int buf) {
                tc_load_async(head.q, head.stride, q0, seq, S, hd, ld.hd, qBuf[buf]);
                tc_load_async(dy + head.at_y, head.C, q0, seq, S, hd, ld.hd, dyBuf[buf]);
                for (int i = threadIdx.x; i < S; i += blockDim.x) {  // 0 past seq
                    const bool inside = q0 + i < seq;
                    __pipeline_memcpy_async(lseBuf[buf] + i, inside ? lse_h + q0 + i : lse_h, 4,
                                            inside ? 0 : 4);
                    __pipeline_memcpy_async(deltaBuf[buf] + i, inside ? delta_h + q0 + i : delta_h,
                                            4, inside ? 0 : 4);
                }
            },
            [&](const int q0, const int buf) {
                const T* sQ = qBuf[buf];
                const T* sDY = dyBuf[buf];
                const float* sLse = lseBuf[buf];
                const float* sD = deltaBuf[buf];
                tc_product<true>(sK + w0 * ld.hd, ld.hd, sQ, ld.hd, hd, S / 16, s, ld.s, false);
                tc_product<true>(sV + w0 * ld.hd, ld.hd, sDY, ld.hd, hd, S / 16, t, ld.s, false);
                __syncwarp();
                for (int j = half; j < S; j += 2) {
                    const int c = tc_column(j, lane, S);  // a query column
                    const float p = flash_kept(q0 + c, k0 + r, seq)
                                        ? acc_exp(s[(r - w0) * ld.s + c] * scale - sLse[c])
                                        : 0.0f;
                    store(sP + r * ld.p + c, p);
                    store(sDS + r * ld.p + c, p * (t[(r - w0) * ld.s + c] - sD[c]));
                }
                __syncwarp();
                tc_product<false>(sP + w0 * ld.p, ld.p, sDY, ld.hd, S, hd / 16, sDV + w0 * ld.o,
                                  ld.o, true);
                tc_product<false>(sDS + w0 * ld.p, ld.p, sQ, ld.hd, S, hd / 16, sDK + w0 * ld.o,
                                  ld.o, true);
            });
    }
    T* dk = dqkv + first.at_k;  // the key/value head in dqkv: its dk, and its dv K after
    flash_store_rows(dk, first.stride, k0, seq, S, hd, sDK, ld.o, scale);
    flash_store_rows(dk + first.K, first.stride, k0, seq, S, hd, sDV, ld.o, 1.0f);
}
#endif
