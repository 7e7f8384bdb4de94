// The rotary embedding as transformers' eager apply_rotary_pos_emb rounds it (q * cos + rotate_half(q) * sin:
// each product rounded to T, then the sum), on 8-element chunks of a head's two halves: lo = x[i..i+8),
// hi = x[i+D/2..i+D/2+8):
//   out[i] = T(T(x[i] c[i]) + T(-x[i + D/2] s[i])),   out[i + D/2] = T(T(x[i + D/2] c[i + D/2]) + T(x[i] s[i + D/2]))
// Shared by rope_cache.cu and rope_attention.cu, so both write the cache bit for bit alike.
#pragma once
#include "common/ptx.cuh"
#include "w4a16/dequant.cuh"  // Vec2 / Dequant: 16-bit pairs <-> float2 and u32

namespace tf {
namespace rotary {

template <typename T> __device__ __forceinline__ float2 unpack2(u32 v) {
    return Vec2<T>::to_float2(Dequant<T>::as_h2(v));
}
template <typename T> __device__ __forceinline__ u32 pack2(float a, float b) {  // each rounded once to T
    return Dequant<T>::as_u32(Vec2<T>::make(a, b));
}
template <typename T> __device__ __forceinline__ float2 round2(float a, float b) { return unpack2<T>(pack2<T>(a, b)); }

__device__ __forceinline__ u32& word(uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// lo / hi rotated in place by the matching chunks of cos (c_lo, c_hi) and sin (s_lo, s_hi).
template <typename T>
__device__ __forceinline__ void rotate(uint4& lo, uint4& hi, uint4 c_lo, uint4 c_hi, uint4 s_lo, uint4 s_hi) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 x1 = unpack2<T>(word(lo, k)), x2 = unpack2<T>(word(hi, k));
        const float2 c1 = unpack2<T>(word(c_lo, k)), c2 = unpack2<T>(word(c_hi, k));
        const float2 s1 = unpack2<T>(word(s_lo, k)), s2 = unpack2<T>(word(s_hi, k));
        const float2 a = round2<T>(x1.x * c1.x, x1.y * c1.y), b = round2<T>(-x2.x * s1.x, -x2.y * s1.y);
        const float2 e = round2<T>(x2.x * c2.x, x2.y * c2.y), f = round2<T>(x1.x * s2.x, x1.y * s2.y);
        word(lo, k) = pack2<T>(a.x + b.x, a.y + b.y);
        word(hi, k) = pack2<T>(e.x + f.x, e.y + f.y);
    }
}

// Chunk i (8 pairs) of head `src` rotated by the cos / sin rows c, s into lo (dst[i..]) and hi (dst[i + D/2..]).
template <typename T>
__device__ __forceinline__ void rotate_chunk(const T* src, const T* c, const T* s, int i, int dim, uint4& lo, uint4& hi) {
    lo = ld_cg_v4(src + i);  // the q/k/v GEMM's output: through L2 (grid_dependency_wait)
    hi = ld_cg_v4(src + i + dim / 2);
    rotate<T>(lo, hi, ld_nc_v4(c + i), ld_nc_v4(c + i + dim / 2), ld_nc_v4(s + i), ld_nc_v4(s + i + dim / 2));
}

}  // namespace rotary
}  // namespace tf
