// __nv_bfloat16 for tests/cuda_cpu.py: the upper 16 bits of a float32, rounded to nearest even
// (NaN kept quiet), as CUDA's __float2bfloat16_rn and ml_dtypes.bfloat16 round.
#pragma once
struct __nv_bfloat16 {
    unsigned short bits;
};
static inline float __bfloat162float(const __nv_bfloat16 h) {
    const unsigned int u = (unsigned int)h.bits << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
static inline __nv_bfloat16 __float2bfloat16_rn(const float v) {
    unsigned int u;
    __builtin_memcpy(&u, &v, 4);
    __nv_bfloat16 h;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        h.bits = (unsigned short)((u >> 16) | 0x40);  // NaN stays NaN
    else
        h.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
    return h;
}
static inline __nv_bfloat16 __float2bfloat16(const float v) { return __float2bfloat16_rn(v); }
