// CUDA C++ on a CPU, for tests (tests/cuda_cpu.py): the builtins zmpi's kernels use, and a
// scheduler that runs one block's threads as fibers (ucontext) on one OS thread, the blocks of
// a grid one after another. A __syncthreads() releases when every live thread of the block
// waits at one; a warp shuffle when every lane of the warp waits at one. Threads that wait at
// different barriers when nothing can run, or a shuffle a warp's lanes do not all reach, is
// an error the launch returns (a real GPU would hang or give undefined results). Included
// before the kernel source (g++ -include); the source's <cuda_fp16.h> and <cuda_bf16.h> are
// the ones beside this file.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static  // one block runs at a time: a static is that block's shared memory
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
static dim3 threadIdx, blockIdx, blockDim, gridDim;  // the running fiber's
static unsigned char* zmpi_dynamic_shared;  // `extern __shared__` arrays point here
static const int warpSize = 32;

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
static inline double __longlong_as_double(long long i) {
    double d;
    std::memcpy(&d, &i, 8);
    return d;
}
static inline void __threadfence() {}  // blocks run one after another: memory is coherent
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    const unsigned int old = *p;
    *p = old + v;
    return old;
}
static inline float atomicAdd(float* p, float v) {
    const float old = *p;
    *p = old + v;
    return old;
}

namespace zmpi_cpu {
enum State { RUNNABLE, AT_SYNCTHREADS, AT_SHUFFLE, DONE };
struct Fiber {
    ucontext_t context;
    State state;
};
static std::vector<Fiber> fibers;
static std::vector<std::vector<char>> stacks;
static ucontext_t scheduler;
static int current;
static std::function<void()> kernel;
static std::string error;
static uint64_t shuffle_slots[1024];
static size_t dynamic_shared_bytes;  // the launch's

static void wait_at(State state) {
    fibers[current].state = state;
    swapcontext(&fibers[current].context, &scheduler);
}

static void fiber_main() {
    kernel();
    fibers[current].state = DONE;  // uc_link returns to the scheduler
}

static void fail(const std::string& what) {
    if (error.empty()) error = what;
}

static std::string block_name() {
    return "block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) + ", " +
           std::to_string(blockIdx.z) + ")";
}

// Run the current block's blockDim threads to the end; false on a barrier error.
static bool run_block() {
    const int n = (int)(blockDim.x * blockDim.y * blockDim.z);
    for (int t = 0; t < n; ++t) {
        Fiber& f = fibers[t];
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = stacks[t].data();
        f.context.uc_stack.ss_size = stacks[t].size();
        f.context.uc_link = &scheduler;
        makecontext(&f.context, fiber_main, 0);
        f.state = RUNNABLE;
    }
    for (;;) {
        for (int t = 0; t < n; ++t) {
            if (fibers[t].state != RUNNABLE) continue;
            current = t;
            threadIdx.x = t % blockDim.x;
            threadIdx.y = t / blockDim.x % blockDim.y;
            threadIdx.z = t / (blockDim.x * blockDim.y);
            swapcontext(&scheduler, &fibers[t].context);
        }
        int live = 0, at_sync = 0;
        bool released = false;
        for (int w = 0; w < n; w += 32) {  // a warp whose lanes all wait at a shuffle goes on
            int shuffling = 0, done = 0;
            for (int t = w; t < w + 32 && t < n; ++t) {
                shuffling += fibers[t].state == AT_SHUFFLE;
                done += fibers[t].state == DONE;
            }
            if (shuffling && shuffling + done == min(32, n - w)) {
                if (done) {
                    fail(block_name() + ": a warp shuffle that lanes which have returned "
                         "cannot reach");
                    return false;
                }
                for (int t = w; t < w + 32; ++t) fibers[t].state = RUNNABLE;
                released = true;
            }
        }
        if (released) continue;
        for (int t = 0; t < n; ++t) {
            live += fibers[t].state != DONE;
            at_sync += fibers[t].state == AT_SYNCTHREADS;
        }
        if (live == 0) return true;
        if (at_sync == live) {
            for (int t = 0; t < n; ++t)
                if (fibers[t].state == AT_SYNCTHREADS) fibers[t].state = RUNNABLE;
            continue;
        }
        fail(block_name() + ": " + std::to_string(at_sync) + " of its " + std::to_string(live) +
             " live threads wait at __syncthreads() and the others at a warp shuffle: "
             "divergent barriers");
        return false;
    }
}

// Run `body` (the kernel called with its arguments) over the grid; 0, or 1 with `error` set.
static int launch(const unsigned int* grid, const unsigned int* block, size_t shared_bytes,
                  std::function<void()> body) {
    error.clear();
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {block[0], block[1], block[2]};
    const unsigned int n = block[0] * block[1] * block[2];
    if (n == 0 || n > 1024 || n % 32 || block[2] > 64) {  // CUDA's: z at most 64
        fail("blockDim of " + std::to_string(n) + " threads (z " + std::to_string(block[2]) +
             "): these kernels need a multiple of 32, at most 1024, z at most 64");
        return 1;
    }
    if (grid[0] > 2147483647u || grid[1] > 65535u || grid[2] > 65535u) {
        fail("a grid of (" + std::to_string(grid[0]) + ", " + std::to_string(grid[1]) + ", " +
             std::to_string(grid[2]) + ") blocks: CUDA's limits are 2^31 - 1, 65535, 65535");
        return 1;
    }
    if (shared_bytes > 48 * 1024) {  // beyond it a kernel must opt in first, which zmpi's do not
        fail(std::to_string(shared_bytes) + " bytes of dynamic shared memory: a launch gets 48 "
             "KiB unless the kernel opts in (cudaFuncAttributeMaxDynamicSharedMemorySize)");
        return 1;
    }
    fibers.assign(n, Fiber());
    stacks.assign(n, std::vector<char>(64 * 1024));
    std::vector<unsigned char> dynamic(shared_bytes + 16);
    dynamic_shared_bytes = shared_bytes;
    kernel = body;
    for (unsigned int z = 0; z < grid[2]; ++z)
        for (unsigned int y = 0; y < grid[1]; ++y)
            for (unsigned int x = 0; x < grid[0]; ++x) {
                blockIdx = {x, y, z};
                // shared memory starts as NaN bytes: a read before a write shows
                std::memset(dynamic.data(), 0xff, dynamic.size());
                zmpi_dynamic_shared = dynamic.data();
                if (!run_block() || !error.empty()) return 1;  // a barrier's, or fail()'s
            }
    return 0;
}
}  // namespace zmpi_cpu

static inline void __syncthreads() { zmpi_cpu::wait_at(zmpi_cpu::AT_SYNCTHREADS); }

// every lane of the warp waits here (the warp's lanes then see each other's shared-memory writes)
static inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    if (mask != 0xffffffffu)  // legal CUDA, which this executor does not model
        zmpi_cpu::fail("__syncwarp with a partial mask (not modelled here)");
    zmpi_cpu::wait_at(zmpi_cpu::AT_SHUFFLE);
}

template <typename A> static A __shfl_xor_sync(unsigned int mask, A v, int lane_mask) {
    static_assert(sizeof(A) <= 8, "a shuffle moves at most 8 bytes");
    if (mask != 0xffffffffu)  // legal CUDA, which this executor does not model
        zmpi_cpu::fail("__shfl_xor_sync with a partial mask (not modelled here)");
    const unsigned int t = zmpi_cpu::current, lane = t & 31;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(A));
    zmpi_cpu::shuffle_slots[t] = bits;
    zmpi_cpu::wait_at(zmpi_cpu::AT_SHUFFLE);  // every lane has written
    bits = zmpi_cpu::shuffle_slots[(t & ~31u) | ((lane ^ lane_mask) & 31)];
    zmpi_cpu::wait_at(zmpi_cpu::AT_SHUFFLE);  // every lane has read
    A out;
    std::memcpy(&out, &bits, sizeof(A));
    return out;
}
