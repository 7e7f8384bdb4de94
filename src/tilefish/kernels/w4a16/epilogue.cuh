// The fused epilogues of the W4A16 kernels (gemm.cu, skinny.cu, wgmma.cu), applied where a tile's final
// value is stored, after the per-channel scale and the bias. They round as the unfused PyTorch forward
// does, so a fused decoder layer stores the bits of the layers it replaces:
//   plain     y[r, c] = T(v)
//   residual  y[r, c] = T(float(T(v)) + float(residual[r, c]))        `residual + linear(x)`: a 16-bit add
//   gated     the weight's columns alternate 8 gate and 8 up columns (ops/w4a16 GATED_BLOCK), and gate
//             column c (c % 16 < 8) with its up column c + 8 gives output column gated_column(c) of a
//             [m, n / 2] y: T(float(T(silu(float(T(g))))) * float(T(u))), silu(g) = g / (1 + exp(-g))
//             in fp32: what `act_fn(gate_proj(x)) * up_proj(x)` rounds (a 16-bit silu, a 16-bit product).
// A thread that holds gate column c holds c + 8 in every kernel's fragment layout (one packed word is
// 16 columns: n8 subtiles 2j and 2j + 1), so the gated epilogue needs no exchange except in the split
// tiles' fixups, which pair float4s through a shuffle or read both from shared memory.
#pragma once
#include "w4a16/dequant.cuh"

namespace tf {

template <typename T>
struct Epilogue {
    const T* residual;  // [m, n] like y, or null
    int gated;          // nonzero: silu(gate) * up, y is [m, n / 2]

    __device__ __forceinline__ static float rounded(float v) { return to_float(Vec2<T>::one(v)); }
    // The residual was written by a kernel that may have been in flight at launch: read through L2
    // (grid_dependency_wait in common/ptx.cuh).
    __device__ __forceinline__ T residual_at(size_t index) const {
        const unsigned short bits = ld_cg_u16(residual + index);
        return *reinterpret_cast<const T*>(&bits);
    }
    // The value to round into y[index] (index = row * n + column): v, or T(v) + residual.
    __device__ __forceinline__ float plain(float v, size_t index) const {
        return residual == nullptr ? v : rounded(v) + to_float(residual_at(index));
    }
    // The value to round into the gated output of gate value g and up value u (both before rounding). The
    // silu is fast fp32, a few ulps from torch's expf and IEEE division (so the 16-bit silu can sit an ulp from
    // torch's): IEEE division's slow-path subroutine made ptxas spill the 16-row skinny kernels. __fdividef
    // returns 0 for a denominator past 2^126 (a gate below -87), where the quotient is a normal float still:
    // both are scaled down by 2^32 there.
    __device__ __forceinline__ static float silu_mul(float g, float u) {
        const float gr = rounded(g), d = 1.f + __expf(-gr);
        const float s = d < 0x1p126f ? __fdividef(gr, d) : __fdividef(gr * 0x1p-32f, d * 0x1p-32f);
        return rounded(s) * rounded(u);
    }
};

// The output column of gate column c of a gated weight (c % 16 < 8).
__device__ __forceinline__ int gated_column(int c) { return ((c >> 4) << 3) | (c & 7); }

// Two 16-byte chunks (8 values each) of T combined value by value in fp32 by f, rounded to T: a staged tile's
// y (already rounded) with its residual (y + r), or 8 gate columns with their 8 up columns (silu_mul).
template <typename T, typename F>
__device__ __forceinline__ uint4 combine_chunks(uint4 a, uint4 b, F f) {
    using V2 = Vec2<T>;
    const auto* pa = reinterpret_cast<const typename V2::type*>(&a);
    const auto* pb = reinterpret_cast<const typename V2::type*>(&b);
    uint4 out;
    auto* o = reinterpret_cast<typename V2::type*>(&out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 fa = V2::to_float2(pa[i]), fb = V2::to_float2(pb[i]);
        o[i] = V2::make(f(fa.x, fb.x), f(fa.y, fb.y));
    }
    return out;
}

}  // namespace tf
