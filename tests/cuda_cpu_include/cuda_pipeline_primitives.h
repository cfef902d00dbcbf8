// CUDA's pipeline primitives (<cuda_pipeline_primitives.h>: cp.async on sm_80 and later) for
// tests/cuda_cpu.py. A thread's __pipeline_memcpy_async copies are held back, batched by its
// __pipeline_commit, and made only when __pipeline_wait_prior(n) waits for them (every batch
// but the n most recent), the latest moment CUDA allows: a kernel that reads a copy's shared
// memory before it waits reads what was there before, and fails its test. Copies of 4, 8 or 16
// bytes, each end aligned to its size, as cp.async requires (else the launch fails).
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

namespace zmpi_cpu_pipeline {
struct Copy {
    void* dst;
    const void* src;
    size_t size, zfill;  // the last zfill of size bytes are zeros, not read from src
};
struct Pipeline {
    std::vector<std::vector<Copy>> batches{1};  // committed ones, then the open one (last)
};
static std::vector<Pipeline> threads;  // the running block's, by linear thread index
static dim3 owner{0, 0, 0};  // the block they belong to (a new block starts them afresh,
static unsigned char* owner_shared = nullptr;  // dropping what a faulty one left unwaited)

static inline Pipeline& mine() {
    const bool same = owner_shared == zmpi_dynamic_shared && owner.x == blockIdx.x &&
                      owner.y == blockIdx.y && owner.z == blockIdx.z;
    if (!same) {
        threads.assign(blockDim.x * blockDim.y * blockDim.z, Pipeline());
        owner = blockIdx;
        owner_shared = zmpi_dynamic_shared;
    }
    return threads[threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)];
}
}  // namespace zmpi_cpu_pipeline

static inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size,
                                           size_t zfill = 0) {
    const bool sized = size == 4 || size == 8 || size == 16;
    if (!sized || zfill > size || reinterpret_cast<uintptr_t>(dst) % size ||
        (zfill < size && reinterpret_cast<uintptr_t>(src) % size))
        zmpi_cpu::fail("__pipeline_memcpy_async of " + std::to_string(size) + " bytes (" +
                       std::to_string(zfill) + " zero-filled): 4, 8 or 16, both ends aligned");
    zmpi_cpu_pipeline::mine().batches.back().push_back({dst, src, size, zfill});
}

static inline void __pipeline_commit() { zmpi_cpu_pipeline::mine().batches.emplace_back(); }

static inline void __pipeline_wait_prior(size_t n) {
    auto& batches = zmpi_cpu_pipeline::mine().batches;
    const size_t committed = batches.size() - 1;
    const size_t done = committed > n ? committed - n : 0;
    for (size_t b = 0; b < done; ++b)
        for (const auto& c : batches[b]) {
            std::memcpy(c.dst, c.src, c.size - c.zfill);
            std::memset(static_cast<char*>(c.dst) + (c.size - c.zfill), 0, c.zfill);
        }
    batches.erase(batches.begin(), batches.begin() + done);
}
