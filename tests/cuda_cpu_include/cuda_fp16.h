// __half for tests/cuda_cpu.py: IEEE binary16 storage, converted with GCC's _Float16 (round to
// nearest even), as CUDA's __half2float and __float2half_rn do.
#pragma once
struct __half {
    unsigned short bits;
};
static inline float __half2float(const __half h) {
    _Float16 f;
    __builtin_memcpy(&f, &h.bits, 2);
    return (float)f;
}
static inline __half __float2half_rn(const float v) {
    const _Float16 f = (_Float16)v;
    __half h;
    __builtin_memcpy(&h.bits, &f, 2);
    return h;
}
static inline __half __float2half(const float v) { return __float2half_rn(v); }
