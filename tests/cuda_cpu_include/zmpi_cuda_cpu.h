// CUDA C++ on a CPU, for tests (tests/cuda_cpu.py): the builtins zmpi's kernels use, and a
// scheduler that runs one block's threads as fibers (ucontext) on one OS thread, the blocks of
// a grid one after another (a fiber is made once a launch with makecontext, and switched to and
// from with _setjmp/_longjmp, which leave the signal mask alone: no system call a switch). A
// __syncthreads() releases when every live thread of the block
// waits at one; a warp shuffle when every lane of the warp waits at one. Threads that wait at
// different barriers when nothing can run, or a shuffle a warp's lanes do not all reach, is
// an error the launch returns (a real GPU would hang or give undefined results). Ordered (the
// default), the blocks run in grid order and the runnable threads in ascending index between
// barriers; shuffled (zmpi_schedule), both in an order drawn from the launch's seed, so a
// result that depends on which block or thread runs first (a race) shows. Flush-to-zero (as
// NVRTC's -ftz=true) sets the x86 MXCSR's FTZ and DAZ bits for the launch: denormal inputs and
// results of float32 and, unlike CUDA's, float64 operations become zero. Included before the
// kernel source (g++ -include); the source's <cuda_fp16.h> and <cuda_bf16.h> are the ones
// beside this file.
#pragma once
#undef _FORTIFY_SOURCE  // its longjmp check refuses a jump to another fiber's stack
#include <setjmp.h>
#include <ucontext.h>
#include <xmmintrin.h>

#include <algorithm>

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
    jmp_buf resume;  // where it goes on: a barrier it waits at, or the start of its kernel
    State state;
};
static std::vector<Fiber> fibers;
static std::vector<std::vector<char>> stacks;  // kept from launch to launch
static jmp_buf scheduler;
static int current;
static std::function<void()> kernel;
static std::string error;
static uint64_t shuffle_slots[1024];
static size_t dynamic_shared_bytes;  // the launch's
static bool shuffled = false, flush_to_zero = false;  // the next launch's (zmpi_schedule)
static uint64_t random_state;

static uint64_t next_random() {  // splitmix64
    uint64_t z = (random_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// 0, 1, ..., n - 1, in a random order (Fisher-Yates) when shuffled
static void order(std::vector<unsigned int>& indices, size_t n) {
    indices.resize(n);
    for (size_t i = 0; i < n; ++i) indices[i] = (unsigned int)i;
    if (shuffled)
        for (size_t i = n; i > 1; --i) std::swap(indices[i - 1], indices[next_random() % i]);
}

// The running fiber waits (a barrier, or its kernel's end): back to the scheduler.
__attribute__((noinline)) static void wait_at(State state) {
    fibers[current].state = state;
    if (!_setjmp(fibers[current].resume)) _longjmp(scheduler, 1);
}

// A fiber's life: made, it goes back at once; then each time the scheduler resumes it at its
// start, it runs the kernel as thread `current` of a block to the end.
static void fiber_main() {
    wait_at(RUNNABLE);
    for (;;) {
        kernel();
        wait_at(DONE);
    }
}

// Run fiber t until it waits.
__attribute__((noinline)) static void resume(int t) {
    current = t;
    if (!_setjmp(scheduler)) _longjmp(fibers[t].resume, 1);
}

// Start a fiber at `start` and come back when it first waits.
__attribute__((noinline)) static void start_fiber(int t, ucontext_t* start) {
    current = t;
    if (!_setjmp(scheduler)) setcontext(start);
}

// Make n fibers on stacks of their own, each waiting at its kernel's start.
static void make_fibers(int n) {
    if ((int)stacks.size() < n) stacks.resize(n, std::vector<char>(64 * 1024));
    fibers.assign(n, Fiber());
    for (int t = 0; t < n; ++t) {
        ucontext_t start;
        getcontext(&start);
        start.uc_stack.ss_sp = stacks[t].data();
        start.uc_stack.ss_size = stacks[t].size();
        start.uc_link = nullptr;  // fiber_main never returns
        makecontext(&start, fiber_main, 0);
        start_fiber(t, &start);
    }
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
    for (int t = 0; t < n; ++t) fibers[t].state = RUNNABLE;  // each at its kernel's start
    std::vector<unsigned int> turns;
    for (;;) {
        order(turns, n);  // a new order for each round between barriers
        for (const unsigned int t : turns) {
            if (fibers[t].state != RUNNABLE) continue;
            threadIdx.x = t % blockDim.x;
            threadIdx.y = t / blockDim.x % blockDim.y;
            threadIdx.z = t / (blockDim.x * blockDim.y);
            resume(t);
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
    const uint64_t total = (uint64_t)grid[0] * grid[1] * grid[2];
    if (total > (1u << 22)) {  // legal CUDA, and hours here
        fail("a grid of " + std::to_string(total) + " blocks: the CPU executor runs at most "
             "2^22");
        return 1;
    }
    std::vector<unsigned char> dynamic(shared_bytes + 16);
    dynamic_shared_bytes = shared_bytes;
    kernel = body;
    std::vector<unsigned int> blocks;
    order(blocks, (size_t)total);
    const unsigned int csr = _mm_getcsr();
    if (flush_to_zero) _mm_setcsr(csr | 0x8040);  // FTZ and DAZ
    make_fibers((int)n);  // after: their contexts take the MXCSR from here
    int status = 0;
    for (const unsigned int b : blocks) {
        blockIdx = {b % grid[0], b / grid[0] % grid[1], b / (grid[0] * grid[1])};
        // shared memory starts as NaN bytes: a read before a write shows
        std::memset(dynamic.data(), 0xff, dynamic.size());
        zmpi_dynamic_shared = dynamic.data();
        if (!run_block() || !error.empty()) {  // a barrier's, or fail()'s
            status = 1;
            break;
        }
    }
    _mm_setcsr(csr);
    return status;
}
}  // namespace zmpi_cpu

// The next launch's schedule: blocks and threads in order (shuffled 0) or in an order drawn
// from seed; denormals flushed to zero or not.
extern "C" void zmpi_schedule(int shuffled, unsigned long long seed, int flush_to_zero) {
    zmpi_cpu::shuffled = shuffled != 0;
    zmpi_cpu::random_state = seed;
    zmpi_cpu::flush_to_zero = flush_to_zero != 0;
}

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
