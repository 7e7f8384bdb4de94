// W4A16 building blocks shared by the kernels (gemm.cu, wgmma.cu, skinny.cu): lop3 int4 ->
// fp16/bf16 conversion of one packed word into four half2 fragment registers, small dtype
// helpers, and the stream-K unit split. The packed word layout is in ops/w4a16/layout.py and docs/w4a16.md.
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

// ---- NF4 (bitsandbytes' 16-entry NormalFloat codebook, symmetric, no zero point): a table lookup
// with byte permutes. A 16-bit table entry is a low byte and a high byte; prmt looks up four bytes
// at once in an 8-entry byte table (two registers), so each byte of the 16 entries is split into
// entries 0-7 (table A) and 8-15 (table B, reversed: byte i holds entry 15 - i, so ~code indexes
// it). Codes 0-7 read A with the code itself as selector; codes 8-15 read B with ~code, whose bit 3
// is then clear (A's lookups of codes 8-15 and B's of 0-7 come out as sign fills and are discarded
// by a per-byte select on bit 3 of the code). The kernel layout stores the nibbles of a word in the
// order 0 4 1 5 2 6 3 7 of the int4 layout (ops/w4a16/layout.py, pack with codebook "nf4"), so one prmt
// interleaves the looked-up low and high bytes straight into the fragment's half2 pairs.
// 22 integer instructions a word (8 weights) against the int4 path's 5 (+ 4 fp16): the NF4 matmul
// runs 1.1-1.4x the int4 time at m <= 64 (docs/nf4.md has the builds tried). The constants are the
// NF4 table rounded to nearest (tests/test_nf4_matmul.py checks them against NF4_TABLE).
template <typename T> struct NF4Bytes;
template <> struct NF4Bytes<__half> {
    static constexpr u32 kLoA0 = 0x52339200, kLoA1 = 0x00d4ea8d, kLoB0 = 0x0d80c900, kLoB1 = 0x1826e068;
    static constexpr u32 kHiA0 = 0xb6b8b9bc, kHiA1 = 0x00adb1b4, kHiB0 = 0x3738393c, kHiB1 = 0x2d313335;
};
template <> struct NF4Bytes<__nv_bfloat16> {
    static constexpr u32 kLoA0 = 0xca063280, kLoA1 = 0x00ba3d92, kLoB0 = 0xe2103980, kLoB1 = 0xa3257cad;
    static constexpr u32 kHiA0 = 0xbebfbfbf, kHiA1 = 0x00bdbebe, kHiB0 = 0x3e3f3f3f, kHiB1 = 0x3d3e3e3e;
};

// ---- MXFP4 (OCP FP4 E2M1 codes: bit 3 the sign, bits 0-2 index 0 0.5 1 1.5 2 3 4 6; scaled by the
// block's power-of-two scale like any group scale): the same lookup with E2M1's bytes, every value exact
// in both dtypes. Entries 8-15 are the negatives of 0-7 (code 8 is -0). tests/test_mxfp4.py checks the
// constants against quant/mxfp4.py's E2M1_VALUES.
template <typename T> struct MXFP4Bytes;
template <> struct MXFP4Bytes<__half> {
    static constexpr u32 kLoA0 = 0x00000000, kLoA1 = 0x00000000, kLoB0 = 0x00000000, kLoB1 = 0x00000000;
    static constexpr u32 kHiA0 = 0x3e3c3800, kHiA1 = 0x46444240, kHiB0 = 0xc0c2c4c6, kHiB1 = 0x80b8bcbe;
};
template <> struct MXFP4Bytes<__nv_bfloat16> {
    static constexpr u32 kLoA0 = 0xc0800000, kLoA1 = 0xc0804000, kLoB0 = 0x004080c0, kLoB1 = 0x000080c0;
    static constexpr u32 kHiA0 = 0x3f3f3f00, kHiA1 = 0x40404040, kHiB0 = 0xc0c0c0c0, kHiB1 = 0x80bfbfbf;
};

// The table decoder of both codebooks: Bytes is NF4Bytes<T> or MXFP4Bytes<T>.
template <typename T, typename Bytes> struct DequantTable {
    struct Zero {};  // the interface of Dequant<T>; a table codebook has no zero point
    static __device__ __forceinline__ Zero zero(float) { return {}; }
    // Word -> 4 pairs: the same (nib0,nib4) (nib1,nib5) (nib2,nib6) (nib3,nib7) of the int4 layout,
    // stored as physical nibbles 0..7 = logical 0 4 1 5 2 6 3 7.
    static __device__ __forceinline__ void run(u32 q, const Zero&, const Zero&, u32 (&r)[4]) {
        // 0xff in byte j where physical nibble j (j + 4 for the high half) has bit 3 set: the sign
        // of the byte whose top bit that is (odd nibbles: q's bytes; even ones: q << 4's).
        const u32 q4 = q << 4;
        half(q, prmt(q, q4, 0x9D8C), r[0], r[1]);
        half(q >> 16, prmt(q, q4, 0xBFAE), r[2], r[3]);
    }
    // Four codes (selector nibbles of s) -> two pairs: (entry of nibble 0, of nibble 1), (2, 3).
    static __device__ __forceinline__ void half(u32 s, u32 mask, u32& r0, u32& r1) {
        using B = Bytes;
        const u32 ns = ~s;
        const u32 lo = lop3<kLopSelect>(prmt(B::kLoA0, B::kLoA1, s), prmt(B::kLoB0, B::kLoB1, ns), mask);
        const u32 hi = lop3<kLopSelect>(prmt(B::kHiA0, B::kHiA1, s), prmt(B::kHiB0, B::kHiB1, ns), mask);
        r0 = prmt(lo, hi, 0x5140);
        r1 = prmt(lo, hi, 0x7362);
    }
};

template <typename T> using DequantNF4 = DequantTable<T, NF4Bytes<T>>;
template <typename T> using DequantMXFP4 = DequantTable<T, MXFP4Bytes<T>>;

// The kernels' decoder: -D TF_W4A16_NF4 builds them for NF4 codes, -D TF_W4A16_MXFP4 for E2M1 codes,
// else for int4 with zero points.
#if defined(TF_W4A16_NF4) && defined(TF_W4A16_MXFP4)
#error "TF_W4A16_NF4 and TF_W4A16_MXFP4 select one codebook each: define one"
#endif
#if defined(TF_W4A16_NF4)
template <typename T> using WeightDecoder = DequantNF4<T>;
constexpr bool kDecoderHasZeros = false;
#elif defined(TF_W4A16_MXFP4)
template <typename T> using WeightDecoder = DequantMXFP4<T>;
constexpr bool kDecoderHasZeros = false;
#else
template <typename T> using WeightDecoder = Dequant<T>;
constexpr bool kDecoderHasZeros = true;
#endif

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
