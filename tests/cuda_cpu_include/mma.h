// nvcuda::wmma (CUDA's warp matrix multiply-accumulate, <mma.h>) for tests/cuda_cpu.py, the
// m16n16k16 shapes with 16-bit inputs and float accumulators. A fragment's layout across the
// lanes of a warp is opaque in CUDA, so code may only fill, load, store and multiply it (and
// touch x[i] alike for every i): here every lane holds the whole 16 x 16 tile, and the product
// is computed once a warp, the same values the warp's tensor cores would give (each product
// exact, the float sums in k order). Each operation is collective: every lane of the warp must reach it
// (a warp barrier, as __syncwarp), as CUDA requires.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

static inline float to_float(const __half v) { return __half2float(v); }
static inline float to_float(const __nv_bfloat16 v) { return __bfloat162float(v); }
static inline float to_float(const float v) { return v; }

template <typename Use, int M, int N, int K, typename E, typename Layout = void>
struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "only m16n16k16 here");
    static const int num_elements = 256;  // the whole tile, in every lane
    E x[256];
};

static inline void collective() { __syncwarp(); }

template <typename Use, typename E, typename Layout, typename V>
inline void fill_fragment(fragment<Use, 16, 16, 16, E, Layout>& f, const V v) {
    collective();
    for (int i = 0; i < 256; ++i) f.x[i] = v;
}

// Element (i, j) of a tile is f.x[i * 16 + j]: a (16 rows, 16 k), b (16 k, 16 columns) or an
// accumulator. In memory it is at p[i * ldm + j] when the tile is row-major, p[j * ldm + i]
// when column-major.
static inline unsigned int at(const bool row, const int i, const int j, const unsigned int ldm) {
    return row ? i * ldm + j : j * ldm + i;
}

// CUDA's rule for load_matrix_sync and store_matrix_sync: the tile's first element 256-bit
// aligned (in shared memory: from the dynamic shared memory's start, which the kernels
// declare __align__(32); in global memory the address, as cudaMalloc's arrays are here) and
// ldm a multiple of 16 bytes. A GPU gives undefined results otherwise; here it is an error.
template <typename E>
inline void check_tile(const E* p, const unsigned int ldm, const char* what) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    const uintptr_t shared = reinterpret_cast<uintptr_t>(zmpi_dynamic_shared);
    const bool in_shared = at >= shared && at < shared + zmpi_cpu::dynamic_shared_bytes;
    const uintptr_t offset = in_shared ? at - shared : at;
    if (offset % 32 || (ldm * sizeof(E)) % 16)
        zmpi_cpu::fail(std::string(what) + ": a tile at " + (in_shared ? "shared" : "global") +
                       " offset " + std::to_string(offset) + " with ldm " + std::to_string(ldm) +
                       " (CUDA needs a 32-byte aligned tile and ldm a multiple of 16 bytes)");
}

template <typename F, typename E>
inline void load(F& f, const E* p, const unsigned int ldm, const bool row) {
    check_tile(p, ldm, "wmma::load_matrix_sync");
    collective();
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) f.x[i * 16 + j] = p[at(row, i, j, ldm)];
}

template <typename Use, typename E>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, E, row_major>& f, const E* p,
                             unsigned int ldm) {
    load(f, p, ldm, true);
}

template <typename Use, typename E>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, E, col_major>& f, const E* p,
                             unsigned int ldm) {
    load(f, p, ldm, false);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned int ldm, layout_t layout) {
    load(f, p, ldm, layout == mem_row_major);
}

inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned int ldm, layout_t layout) {
    check_tile(p, ldm, "wmma::store_matrix_sync");
    collective();
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) p[at(layout == mem_row_major, i, j, ldm)] = f.x[i * 16 + j];
}

// one lane of the warp multiplies (the others hold the same tiles), every lane takes the result
static float mma_result[32][256];  // per warp of the block

template <typename E, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, E, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, E, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
    collective();
    float* out = mma_result[zmpi_cpu::current >> 5];
    if ((zmpi_cpu::current & 31) == 0)
        for (int i = 0; i < 16; ++i)
            for (int j = 0; j < 16; ++j) {
                float s = c.x[i * 16 + j];
                for (int k = 0; k < 16; ++k)
                    s += to_float(a.x[i * 16 + k]) * to_float(b.x[k * 16 + j]);
                out[i * 16 + j] = s;
            }
    collective();
    for (int i = 0; i < 256; ++i) d.x[i] = out[i];
    collective();  // every lane has its copy before the next product
}
}  // namespace wmma
}  // namespace nvcuda
