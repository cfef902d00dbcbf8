// The CUDA C++ of zmpi.kernels.flash_attention: fused flash-style causal attention over a block
// layout (dense causal attention is the lower-triangular layout), forward and backward; the
// twins zmpi.kernels.flash_attention._forward_twin / _backward_twin (zmpi.kernels.OPS).
// It is compiled after common.cuh and the other op families, in the same module, and uses
// common.cuh's helpers (T, ACC, to_acc, store, acc_exp, acc_log, neg_inf, warp_reduce);
// tests/test_kernels_compile.py compiles the module with NVRTC for every dtype.
//
// SIMT kernels (no tensor cores): one block of threads per (tile of S query or key rows, batch x
// head), S a divisor of the layout's block chosen by the launcher so that the tiles fit in 48 KiB
// of dynamic shared memory (flash_attention.tile_rows). Tiles are held in ACC, rows padded
// to hd + 1 elements (no bank conflicts between rows). The layout is CSR on the device: for
// layout head l (l = 0 for every head when layout_heads is 1, else the head), row_ptr[l * (nb +
// 1) + i] .. row_ptr[l * (nb + 1) + i + 1] index `cols`, the key blocks query block i keeps,
// ascending; the backward of keys reads the transpose (col_ptr, rows) the same way. Inside the
// kept blocks the mask is causal by token (key <= query) and keys at or past `seq` are masked
// (a ragged last block of a dense layout). No T x T matrix exists anywhere: scores live only as
// an S x S tile in shared memory.
//
// Grouped-query attention: nkv key/value heads (nkv divides nh; nkv = nh is multi-head
// attention) and query head h reads key/value head h / g, g = nh / nkv, by index: the keys and
// values are never repeated. The keys' backward runs a block per (key tile, batch x key/value
// head) and sums dk and dv over the group's g query heads in shared memory, one head after
// the other (the tiles its own query head would visit, then the next head's): no atomics, no
// per-query-head partials in global memory, the same sums in the same order at g = 1.
//
// Layouts in global memory: qkv (B, seq, (nh + 2 nkv) hd) [q | k | v], query head h's columns
// h hd .. (h + 1) hd of q, key/value head l's l hd .. (l + 1) hd of k and of v; y, dy (B, seq,
// C), C = nh hd; dqkv as qkv; lse, delta (B nh, seq) ACC. q is scaled by `scale` (1 /
// sqrt(hd)) as it is read, in ACC.
// The geometry of a flash kernel's block (SIMT and tensor-core alike), from its launch: grid x
// walks the tiles of S rows, grid y the (batch, query head) pairs b nh + h (the keys'
// backward: the (batch, key/value head) pairs, each block making the FlashHead of each of its
// query heads). Which query head it is, the first row of its tile (queries, or keys in the
// backward of keys), the layout's block count, and where the head and its key/value head start
// in the arrays qkv, dqkv and y, dy.
struct FlashHead {
    int C;             // nh hd: the columns of y and dy, and of qkv's q
    int K;             // nkv hd: the columns of qkv's k and of its v
    int nb;            // the layout's blocks of `block` rows over seq (the last may be ragged)
    int bh, b, h;      // b nh + h: the (batch, query head) pair, its batch, its head
    int r0;            // blockIdx.x S: the tile's first row
    long long stride;  // C + 2 K: from one row of qkv (or dqkv) to the next
    long long at_q;    // the element (b, 0, h hd) of qkv and dqkv: row 0 of the head's q
    long long at_k;    // the element (b, 0, C + (h / g) hd): row 0 of its key/value head's k;
                       // its v is K after
    long long at_y;    // the element (b, 0, h hd) of y and dy: row 0 of the head
    const T* q;        // qkv + at_q: the head's q, row 0
    const T* k;        // qkv + at_k, and K after: its key/value head's k and v, row 0
    const T* v;
    __device__ FlashHead(const T* qkv, const int bh, const int seq, const int nh, const int nkv,
                         const int hd, const int block, const int S)
        : C(nh * hd), K(nkv * hd), nb((seq + block - 1) / block), bh(bh), b(bh / nh),
          h(bh % nh), r0(blockIdx.x * S), stride((long long)C + 2 * K),
          at_q((long long)b * seq * stride + h * hd),
          at_k((long long)b * seq * stride + C + h / (nh / nkv) * hd),
          at_y((long long)b * seq * C + h * hd), q(qkv + at_q), k(qkv + at_k), v(k + K) {}
};

// A bump allocator over a kernel's dynamic shared memory: the tile of the next n elements of
// E at `at`, which moves past it, so that a kernel's tiles lie one after another in the order
// it carves them, as flash_attention._shared_bytes counts them (no padding between).
// `at` must be aligned for E (and 32 bytes for a wmma tile): the tile sizes before keep it so.
template <typename E> __device__ __forceinline__ E* flash_carve(unsigned char*& at, const int n) {
    E* tile = reinterpret_cast<E*>(at);
    at += (size_t)n * sizeof(E);
    return tile;
}

// rows [r0, r0 + S) of one head's q, k or v (`src` at its first column, rows `stride` apart)
// into tile (S, ld) in ACC, times `mul`; zeros past seq
__device__ void flash_load(const T* src, const long long stride, const int r0, const int seq,
                           const int S, const int hd, const int ld, ACC* tile, const ACC mul) {
    for (int e = threadIdx.x; e < S * hd; e += blockDim.x) {
        const int r = e / hd, d = e % hd;
        tile[r * ld + d] = r0 + r < seq ? to_acc(src[(r0 + r) * stride + d]) * mul : (ACC)0;
    }
}

// dot product of tile rows a[r] and b[c] over hd
__device__ __forceinline__ ACC flash_dot(const ACC* a, const ACC* b, const int hd) {
    ACC s = 0;
    for (int d = 0; d < hd; ++d) s += a[d] * b[d];
    return s;
}

// the key (or query) block lists of the layout row (or column) `i` for head h: [*begin, *end)
__device__ __forceinline__ void flash_list(const int* ptr, const int h, const int layout_heads,
                                           const int nb, const int i, int* begin, int* end) {
    const int* p = ptr + (layout_heads == 1 ? 0 : h) * (nb + 1);
    *begin = p[i];
    *end = p[i + 1];
}

// Whether query q and key k of kept blocks score in the backward: causal (k <= q) and the
// query before seq (so is the key, then); the forward masks keys only (k <= q, k < seq).
__device__ __forceinline__ bool flash_kept(const int q, const int k, const int seq) {
    return k <= q && q < seq;
}

// Whether the tile of S keys at k0 holds a key that one of the queries q0 .. q0 + S - 1
// attends to (a key before seq, at or before the last query), and the same question from
// the keys' side: whether the tile of S queries at q0 holds one that attends to a key of
// k0 .. k0 + S - 1. The kernels visit only such tiles.
__device__ __forceinline__ bool flash_keys_seen(const int k0, const int q0, const int S,
                                                const int seq) {
    return k0 <= q0 + S - 1 && k0 < seq;
}
__device__ __forceinline__ bool flash_queries_seen(const int q0, const int k0, const int S,
                                                   const int seq) {
    return q0 + S - 1 >= k0 && q0 < seq && k0 < seq;
}

// Advance (n, r0) to the next tile of S rows that a block visits: the tiles of the layout
// blocks list[n], n < end, in order, those where keep(r0) holds; false when none is left.
// r0 = -1 starts at block n's first tile.
template <typename Keep>
__device__ bool flash_next_tile(const int* list, const int end, const int block, const int S,
                                Keep keep, int& n, int& r0) {
    for (; n < end; ++n, r0 = -1)
        for (r0 = r0 < 0 ? list[n] * block : r0 + S; r0 < (list[n] + 1) * block; r0 += S)
            if (keep(r0)) return true;
    return false;
}

// body(r0) for every tile r0 that flash_next_tile(list from begin, keep) gives, after
// load(r0) has put what the tile needs in shared memory: the SIMT kernels' walk of a layout
// row (or column). Every thread of the block calls it; load and body run between barriers
// (the previous tile's readers are done before load, the loads before body).
template <typename Keep, typename Load, typename Body>
__device__ void flash_tiles(const int* list, const int begin, const int end, const int block,
                            const int S, Keep keep, Load load, Body body) {
    int n = begin, r0 = -1;
    while (flash_next_tile(list, end, block, S, keep, n, r0)) {
        __syncthreads();
        load(r0);
        __syncthreads();
        body(r0);
    }
}

// The online softmax's step for row r after a tile of keys whose largest score is mx: the
// running max m_new, and what the tile's scores are shifted by (m_use: 0 while every score so
// far is masked, so that exp never sees inf - inf)
__device__ __forceinline__ void flash_new_max(const ACC* sM, const int r, const ACC mx,
                                              ACC* m_old, ACC* m_new, ACC* m_use) {
    *m_old = sM[r];
    *m_new = mx > *m_old ? mx : *m_old;
    *m_use = *m_new == neg_inf(*m_new) ? (ACC)0 : *m_new;
}

// ... and, with the tile's sum of exp(s - m_use), the row's running sum l = l alpha + sum and
// max, alpha = exp(m_old - m_use) (kept in sA for rescaling o): by one thread of the row
__device__ __forceinline__ void flash_rescale(ACC* sM, ACC* sL, ACC* sA, const int r,
                                              const ACC m_old, const ACC m_new, const ACC m_use,
                                              const ACC sum) {
    const ACC alpha = acc_exp(m_old - m_use);
    sA[r] = alpha;
    sL[r] = sL[r] * alpha + sum;
    sM[r] = m_new;
}

// rows r0 .. r0 + S of tile (S, ld), those before seq, times mul into the rows of `dst`
// (`stride` apart, hd elements each), rounded once to T
__device__ void flash_store_rows(T* dst, const long long stride, const int r0, const int seq,
                                 const int S, const int hd, const ACC* tile, const int ld,
                                 const ACC mul) {
    for (int e = threadIdx.x; e < S * hd; e += blockDim.x) {
        const int r = e / hd, d = e % hd;
        if (r0 + r < seq) store(dst + (r0 + r) * stride + d, tile[r * ld + d] * mul);
    }
}

// y (rows r0 .. r0 + S of head bh, `y` at the head's row 0, C apart) = o / l, and lse = m +
// log l: the end of a forward; o (S, ld) is divided in place
__device__ void flash_store_output(T* y, ACC* lse, ACC* o, const int ld, const ACC* m,
                                   const ACC* l, const long long bh, const int r0,
                                   const int seq, const int S, const int hd, const int C) {
    for (int e = threadIdx.x; e < S * hd; e += blockDim.x) o[e / hd * ld + e % hd] /= l[e / hd];
    __syncthreads();
    flash_store_rows(y, C, r0, seq, S, hd, o, ld, (ACC)1);
    for (int r = threadIdx.x; r < S; r += blockDim.x)
        if (r0 + r < seq) lse[bh * seq + r0 + r] = m[r] + acc_log(l[r]);
}

// The backward's row statistics of rows q0 .. q0 + S of head bh (`y`, `dy` at its row 0, C
// apart): delta = rowsum(dy y) into `delta` (global) and sD, and each row's lse into sLse (0
// past seq); a warp a row
__device__ void flash_row_stats(const T* y, const T* dy, const ACC* lse, ACC* delta,
                                ACC* sD, ACC* sLse, const long long bh, const int q0,
                                const int seq, const int S, const int hd, const int C) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int r = warp; r < S; r += warps) {
        ACC dot = 0;
        if (q0 + r < seq)
            for (int d = lane; d < hd; d += 32)
                dot += to_acc(dy[(long long)(q0 + r) * C + d])
                       * to_acc(y[(long long)(q0 + r) * C + d]);
        dot = warp_reduce(dot, false);
        if (lane == 0) {
            sD[r] = dot;
            sLse[r] = q0 + r < seq ? lse[bh * seq + q0 + r] : (ACC)0;
            if (q0 + r < seq) delta[bh * seq + q0 + r] = dot;
        }
    }
}

// body(k0) for every tile of S keys k0 of the layout row of the block's query tile (head.r0)
// that its queries see, after sK and sV (S, ld) hold the tile's keys and values: the walk of
// flash_forward and flash_backward_dq
template <typename Body>
__device__ void flash_key_tiles(const FlashHead& head, const int* row_ptr, const int* cols,
                                const int seq, const int hd, const int block,
                                const int layout_heads, const int S, const int ld, ACC* sK,
                                ACC* sV, Body body) {
    int begin, end;
    flash_list(row_ptr, head.h, layout_heads, head.nb, head.r0 / block, &begin, &end);
    flash_tiles(
        cols, begin, end, block, S,
        [&](const int k0) { return flash_keys_seen(k0, head.r0, S, seq); },
        [&](const int k0) {
            flash_load(head.k, head.stride, k0, seq, S, hd, ld, sK, (ACC)1);
            flash_load(head.v, head.stride, k0, seq, S, hd, ld, sV, (ACC)1);
        },
        body);
}

// y (B, seq, C) and lse (B nh, seq): for query rows q0 .. q0 + S of head h (grid (nb block / S,
// B nh)), the online softmax (running max m, sum l) over the key blocks the layout keeps, S
// keys at a time: o = o alpha + p v with p = exp(s - m_new), alpha = exp(m_old - m_new).
extern "C" __global__ void flash_forward(const T* qkv, const int* row_ptr, const int* cols,
                                         T* y, ACC* lse, const int seq, const int nh,
                                         const int nkv, const int hd, const int block,
                                         const int layout_heads, const int S, const ACC scale) {
    extern __shared__ __align__(16) unsigned char flash_smem[];
    const FlashHead head(qkv, blockIdx.y, seq, nh, nkv, hd, block, S);
    const int q0 = head.r0, ld = hd + 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    unsigned char* at = flash_smem;
    ACC* sQ = flash_carve<ACC>(at, S * ld);
    ACC* sO = flash_carve<ACC>(at, S * ld);
    ACC* sK = flash_carve<ACC>(at, S * ld);
    ACC* sV = flash_carve<ACC>(at, S * ld);
    ACC* sP = flash_carve<ACC>(at, S * S);
    ACC* sM = flash_carve<ACC>(at, S);
    ACC* sL = flash_carve<ACC>(at, S);
    ACC* sA = flash_carve<ACC>(at, S);
    flash_load(head.q, head.stride, q0, seq, S, hd, ld, sQ, scale);
    for (int e = threadIdx.x; e < S * ld; e += blockDim.x) sO[e] = 0;
    for (int r = threadIdx.x; r < S; r += blockDim.x) {
        sM[r] = neg_inf((ACC)0);
        sL[r] = 0;
    }
    flash_key_tiles(head, row_ptr, cols, seq, hd, block, layout_heads, S, ld, sK, sV,
                    [&](const int k0) {
        for (int e = threadIdx.x; e < S * S; e += blockDim.x) {
            const int r = e / S, c = e % S;
            const ACC s = flash_dot(sQ + r * ld, sK + c * ld, hd);
            sP[e] = k0 + c <= q0 + r && k0 + c < seq ? s : neg_inf(s);
        }
        __syncthreads();
        for (int r = warp; r < S; r += warps) {  // a warp a row
            ACC mx = neg_inf((ACC)0);
            for (int c = lane; c < S; c += 32) mx = sP[r * S + c] > mx ? sP[r * S + c] : mx;
            mx = warp_reduce(mx, true);
            ACC m_old, m_new, m_use, sum = 0;
            flash_new_max(sM, r, mx, &m_old, &m_new, &m_use);
            for (int c = lane; c < S; c += 32) {
                const ACC p = acc_exp(sP[r * S + c] - m_use);
                sP[r * S + c] = p;
                sum += p;
            }
            sum = warp_reduce(sum, false);
            if (lane == 0) flash_rescale(sM, sL, sA, r, m_old, m_new, m_use, sum);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < S * hd; e += blockDim.x) {
            const int r = e / hd, d = e % hd;
            ACC o = 0;
            for (int c = 0; c < S; ++c) o += sP[r * S + c] * sV[c * ld + d];
            sO[r * ld + d] = sO[r * ld + d] * sA[r] + o;
        }
    });
    __syncthreads();
    flash_store_output(y + head.at_y, lse, sO, ld, sM, sL, head.bh, q0, seq, S, hd, head.C);
}

// FlashAttention-2's backward, queries: delta = rowsum(dy y) (B nh, seq) for the rows q0 .. q0
// + S, and dq = scale sum over kept keys of ds k, ds = p (dp - delta), p = exp(s - lse), dp =
// dy v^T, into dqkv's q. Runs before flash_backward_dkv, which reads delta.
extern "C" __global__ void flash_backward_dq(const T* qkv, const T* y, const T* dy,
                                             const ACC* lse, const int* row_ptr,
                                             const int* cols, T* dqkv, ACC* delta,
                                             const int seq, const int nh, const int nkv,
                                             const int hd, const int block,
                                             const int layout_heads, const int S,
                                             const ACC scale) {
    extern __shared__ __align__(16) unsigned char flash_smem[];
    const FlashHead head(qkv, blockIdx.y, seq, nh, nkv, hd, block, S);
    const int q0 = head.r0, ld = hd + 1;
    unsigned char* at = flash_smem;
    ACC* sQ = flash_carve<ACC>(at, S * ld);
    ACC* sDY = flash_carve<ACC>(at, S * ld);
    ACC* sDQ = flash_carve<ACC>(at, S * ld);
    ACC* sK = flash_carve<ACC>(at, S * ld);
    ACC* sV = flash_carve<ACC>(at, S * ld);
    ACC* sP = flash_carve<ACC>(at, S * S);  // ds
    ACC* sLse = flash_carve<ACC>(at, S);
    ACC* sD = flash_carve<ACC>(at, S);
    flash_load(head.q, head.stride, q0, seq, S, hd, ld, sQ, scale);
    flash_load(dy + head.at_y, head.C, q0, seq, S, hd, ld, sDY, (ACC)1);
    for (int e = threadIdx.x; e < S * ld; e += blockDim.x) sDQ[e] = 0;
    flash_row_stats(y + head.at_y, dy + head.at_y, lse, delta, sD, sLse, head.bh, q0, seq, S, hd,
                    head.C);
    flash_key_tiles(head, row_ptr, cols, seq, hd, block, layout_heads, S, ld, sK, sV,
                    [&](const int k0) {
        for (int e = threadIdx.x; e < S * S; e += blockDim.x) {
            const int r = e / S, c = e % S;
            const ACC p = flash_kept(q0 + r, k0 + c, seq)
                              ? acc_exp(flash_dot(sQ + r * ld, sK + c * ld, hd) - sLse[r])
                              : (ACC)0;
            sP[e] = p * (flash_dot(sDY + r * ld, sV + c * ld, hd) - sD[r]);
        }
        __syncthreads();
        for (int e = threadIdx.x; e < S * hd; e += blockDim.x) {
            const int r = e / hd, d = e % hd;
            ACC g = 0;
            for (int c = 0; c < S; ++c) g += sP[r * S + c] * sK[c * ld + d];
            sDQ[r * ld + d] += g;
        }
    });
    __syncthreads();
    flash_store_rows(dqkv + head.at_q, head.stride, q0, seq, S, hd, sDQ, ld, scale);
}

// FlashAttention-2's backward, keys: for key rows k0 .. k0 + S of key/value head l (grid
// (nb block / S, B nkv)), over each query head h of its group (h / g = l, in order) and the
// query blocks of h that keep their block (the transposed layout col_ptr, rows): dv = sum p^T
// dy, dk = sum ds^T q (q scaled), into dqkv's k and v. A key no query keeps gets zeros.
extern "C" __global__ void flash_backward_dkv(const T* qkv, const T* dy, const ACC* lse,
                                              const ACC* delta, const int* col_ptr,
                                              const int* rows, T* dqkv, const int seq,
                                              const int nh, const int nkv, const int hd,
                                              const int block, const int layout_heads,
                                              const int S, const ACC scale) {
    extern __shared__ __align__(16) unsigned char flash_smem[];
    const int g = nh / nkv;  // blockIdx.y = b nkv + l: query heads (b nkv + l) g .. + g - 1
    const FlashHead first(qkv, blockIdx.y * g, seq, nh, nkv, hd, block, S);
    const int k0 = first.r0, ld = hd + 1;
    unsigned char* at = flash_smem;
    ACC* sK = flash_carve<ACC>(at, S * ld);
    ACC* sV = flash_carve<ACC>(at, S * ld);
    ACC* sDK = flash_carve<ACC>(at, S * ld);
    ACC* sDV = flash_carve<ACC>(at, S * ld);
    ACC* sQ = flash_carve<ACC>(at, S * ld);
    ACC* sDY = flash_carve<ACC>(at, S * ld);
    ACC* sP = flash_carve<ACC>(at, S * S);  // (S queries, S keys): p
    ACC* sS = flash_carve<ACC>(at, S * S);  // ds
    ACC* sLse = flash_carve<ACC>(at, S);
    ACC* sD = flash_carve<ACC>(at, S);
    flash_load(first.k, first.stride, k0, seq, S, hd, ld, sK, (ACC)1);
    flash_load(first.v, first.stride, k0, seq, S, hd, ld, sV, (ACC)1);
    for (int e = threadIdx.x; e < S * ld; e += blockDim.x) {
        sDK[e] = 0;
        sDV[e] = 0;
    }
    for (int member = 0; member < g; ++member) {  // the group's query heads, in order
        const FlashHead head(qkv, first.bh + member, seq, nh, nkv, hd, block, S);
        int begin, end;
        flash_list(col_ptr, head.h, layout_heads, head.nb, k0 / block, &begin, &end);
        flash_tiles(
            rows, begin, end, block, S,
            [&](const int q0) { return flash_queries_seen(q0, k0, S, seq); },
            [&](const int q0) {
                flash_load(head.q, head.stride, q0, seq, S, hd, ld, sQ, scale);
                flash_load(dy + head.at_y, head.C, q0, seq, S, hd, ld, sDY, (ACC)1);
                for (int r = threadIdx.x; r < S; r += blockDim.x) {
                    sLse[r] = q0 + r < seq ? lse[(long long)head.bh * seq + q0 + r] : (ACC)0;
                    sD[r] = q0 + r < seq ? delta[(long long)head.bh * seq + q0 + r] : (ACC)0;
                }
            },
            [&](const int q0) {
                for (int e = threadIdx.x; e < S * S; e += blockDim.x) {
                    const int r = e / S, c = e % S;
                    const ACC p = flash_kept(q0 + r, k0 + c, seq)
                                      ? acc_exp(flash_dot(sQ + r * ld, sK + c * ld, hd) - sLse[r])
                                      : (ACC)0;
                    sP[e] = p;
                    sS[e] = p * (flash_dot(sDY + r * ld, sV + c * ld, hd) - sD[r]);
                }
                __syncthreads();
                for (int e = threadIdx.x; e < S * hd; e += blockDim.x) {
                    const int c = e / hd, d = e % hd;
                    ACC gv = 0, gk = 0;
                    for (int r = 0; r < S; ++r) {
                        gv += sP[r * S + c] * sDY[r * ld + d];
                        gk += sS[r * S + c] * sQ[r * ld + d];
                    }
                    sDV[c * ld + d] += gv;
                    sDK[c * ld + d] += gk;
                }
            });
    }
    __syncthreads();
    T* dk = dqkv + first.at_k;  // the key/value head in dqkv: its dk, and its dv K after
    flash_store_rows(dk, first.stride, k0, seq, S, hd, sDK, ld, (ACC)1);
    flash_store_rows(dk + first.K, first.stride, k0, seq, S, hd, sDV, ld, (ACC)1);
}
