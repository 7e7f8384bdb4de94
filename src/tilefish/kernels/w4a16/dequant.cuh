// W4A16 building blocks shared by the kernels (gemm.cu, wgmma.cu, skinny.cu): lop3 int4 ->
// fp16/bf16 conversion of one packed word into four half2 fragment registers, small dtype
// helpers, and the stream-K unit split. The packed word layout is in ops/w4a16.py and docs/w4a16.md.
#pragma once
#include "common/ptx.cuh"

namespace tf {

template <typename T> struct Dequant;

// fp16: 0x6400 is 1024.0; OR-ing a nibble into bits 0-3 gives 1024 + q, into bits 4-7 1024 + 16q.
template <> struct Dequant<__half> {
    struct Zero { __half2 lo, hi; };  // 1024 + z and 64 + z, per column
    static __device__ __forceinline__ Zero zero(float z) {
        return {__float2half2_rn(1024.f + z), __float2half2_rn(64.f + z)};
    }
    static __device__ __forceinline__ __half2 as_h2(u32 v) { return *reinterpret_cast<__half2*>(&v); }
    static __device__ __forceinline__ u32 as_u32(__half2 v) { return *reinterpret_cast<u32*>(&v); }
    // Word -> 4 half2: (nib0,nib4) (nib1,nib5) (nib2,nib6) (nib3,nib7), minus the zero point.
    static __device__ __forceinline__ void run(u32 q, const Zero& z0, const Zero& z1, u32 (&r)[4]) {
        const u32 kLo = 0x000f000f, kHi = 0x00f000f0, kExp = 0x64006400;
        const __half2 kSixteenth = __float2half2_rn(1.f / 16.f);
        u32 lo0 = lop3<kLopAndOr>(q, kLo, kExp), hi0 = lop3<kLopAndOr>(q, kHi, kExp);
        q >>= 8;
        u32 lo1 = lop3<kLopAndOr>(q, kLo, kExp), hi1 = lop3<kLopAndOr>(q, kHi, kExp);
        r[0] = as_u32(__hsub2(as_h2(lo0), z0.lo));
        r[1] = as_u32(__hfma2(as_h2(hi0), kSixteenth, __hneg2(z0.hi)));
        r[2] = as_u32(__hsub2(as_h2(lo1), z1.lo));
        r[3] = as_u32(__hfma2(as_h2(hi1), kSixteenth, __hneg2(z1.hi)));
    }
};

// bf16 has 7 mantissa bits: 16q does not fit, so every nibble is shifted down to bits 0-3 and
// OR-ed into 0x4300 (128.0), giving 128 + q.
template <> struct Dequant<__nv_bfloat16> {
    struct Zero { __nv_bfloat162 lo; };
    static __device__ __forceinline__ Zero zero(float z) { return {__float2bfloat162_rn(128.f + z)}; }
    static __device__ __forceinline__ __nv_bfloat162 as_h2(u32 v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }
    static __device__ __forceinline__ u32 as_u32(__nv_bfloat162 v) { return *reinterpret_cast<u32*>(&v); }
    static __device__ __forceinline__ void run(u32 q, const Zero& z0, const Zero& z1, u32 (&r)[4]) {
        const u32 kLo = 0x000f000f, kExp = 0x43004300;
        r[0] = as_u32(__hsub2(as_h2(lop3<kLopAndOr>(q, kLo, kExp)), z0.lo));
        r[1] = as_u32(__hsub2(as_h2(lop3<kLopAndOr>(q >> 4, kLo, kExp)), z0.lo));
        r[2] = as_u32(__hsub2(as_h2(lop3<kLopAndOr>(q >> 8, kLo, kExp)), z1.lo));
        r[3] = as_u32(__hsub2(as_h2(lop3<kLopAndOr>(q >> 12, kLo, kExp)), z1.lo));
    }
};

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> struct Vec2;
template <> struct Vec2<__half> {
    using type = __half2;
    static __device__ __forceinline__ type make(float a, float b) { return __floats2half2_rn(a, b); }
    static __device__ __forceinline__ type dup(__half v) { return __half2half2(v); }
    static __device__ __forceinline__ float2 to_float2(type v) { return __half22float2(v); }
    static __device__ __forceinline__ __half one(float v) { return __float2half_rn(v); }
};
template <> struct Vec2<__nv_bfloat16> {
    using type = __nv_bfloat162;
    static __device__ __forceinline__ type make(float a, float b) { return __floats2bfloat162_rn(a, b); }
    static __device__ __forceinline__ type dup(__nv_bfloat16 v) { return __bfloat162bfloat162(v); }
    static __device__ __forceinline__ float2 to_float2(type v) { return __bfloat1622float2(v); }
    static __device__ __forceinline__ __nv_bfloat16 one(float v) { return __float2bfloat16_rn(v); }
};

// Stream-K: G CTAs split U units evenly, CTA b taking [unit_begin(b), unit_begin(b + 1)).
// 64-bit products: U x G may pass 2^31 on huge weights.
__device__ __forceinline__ int unit_begin(int b, int units, int ctas) {
    return (int)((long long)b * units / ctas);
}
// The CTA whose range holds unit u: the largest b with unit_begin(b) <= u.
__device__ __forceinline__ int cta_of_unit(int u, int units, int ctas) {
    return (int)(((long long)(u + 1) * ctas - 1) / units);
}

}  // namespace tf
