// The rotary embedding as transformers' eager apply_rotary_pos_emb rounds it (q * cos + rotate_half(q) * sin:
// each product rounded to T, then the sum), on 8-element chunks of a head's two halves: lo = x[i..i+8),
// hi = x[i+D/2..i+D/2+8):
//   out[i] = T(T(x[i] c[i]) + T(-x[i + D/2] s[i])),   out[i + D/2] = T(T(x[i + D/2] c[i + D/2]) + T(x[i] s[i + D/2]))
// Shared by rope_cache.cu and rope_attention.cu, so both write the cache bit for bit alike; so is the optional
// per-head RMSNorm ahead of the rotary (Qwen3), below.
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
__device__ __forceinline__ u32 word(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

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

// Chunk i (8 pairs) of head `src`: lo = src[i..i+8), hi = src[i + D/2..); the q/k/v GEMM's output, read through L2
// (after grid_dependency_wait).
template <typename T>
__device__ __forceinline__ void load_chunk(const T* src, int i, int dim, uint4& lo, uint4& hi) {
    lo = ld_cg_v4(src + i);
    hi = ld_cg_v4(src + i + dim / 2);
}

// lo / hi (chunk i of a head) rotated by the cos / sin rows c, s.
template <typename T>
__device__ __forceinline__ void rotate_at(uint4& lo, uint4& hi, const T* c, const T* s, int i, int dim) {
    rotate<T>(lo, hi, ld_nc_v4(c + i), ld_nc_v4(c + i + dim / 2), ld_nc_v4(s + i), ld_nc_v4(s + i + dim / 2));
}

// A head's RMSNorm before its rotary (Qwen3's q_norm / k_norm), rounded as transformers' Qwen3RMSNorm rounds it:
//   inv = rsqrt(ss / D + eps),   x_n = T(x * inv),   out = T(w * x_n)
// ss, the head's fp32 sum of squares, has one summation order in every kernel, so rope_cache and rope_attention
// write the same cache bits: each chunk's 16 squares (lo's 8, then hi's, fma from 0), then the chunks' sums in
// chunk order (from 0).
template <typename T> __device__ __forceinline__ float chunk_sumsq(const uint4& lo, const uint4& hi) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float2 f = unpack2<T>(word(k < 4 ? lo : hi, k & 3));
        ss = fmaf(f.x, f.x, ss);
        ss = fmaf(f.y, f.y, ss);
    }
    return ss;
}

__device__ __forceinline__ float inv_rms(float ss, int dim, float eps) { return rsqrtf(ss / (float)dim + eps); }

// lo / hi (chunk i of a head) normalized by inv and scaled by the norm weight w [D].
template <typename T>
__device__ __forceinline__ void norm_chunk(uint4& lo, uint4& hi, const T* w, int i, int dim, float inv) {
    const uint4 w_lo = ld_nc_v4(w + i), w_hi = ld_nc_v4(w + i + dim / 2);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        uint4& v = k < 4 ? lo : hi;
        const float2 f = unpack2<T>(word(v, k & 3));
        const float2 g = unpack2<T>(word(k < 4 ? w_lo : w_hi, k & 3));
        const float2 y = round2<T>(f.x * inv, f.y * inv);  // x_n.to(T)
        word(v, k & 3) = pack2<T>(g.x * y.x, g.y * y.y);
    }
}

// The head norm of chunk i when the thread sees only its own chunk: the sum over the head's D / 16 chunks held by
// `chunks` consecutive lanes (a power of two, aligned; every lane in `mask` takes part), in chunk order.
template <typename T>
__device__ __forceinline__ void norm_chunk_in_lanes(uint4& lo, uint4& hi, const T* w, int i, int dim, float eps,
                                                    unsigned mask, int chunks) {
    const float own = chunk_sumsq<T>(lo, hi);
    float ss = 0.f;
    for (int j = 0; j < chunks; ++j) ss += __shfl_sync(mask, own, j, chunks);
    norm_chunk<T>(lo, hi, w, i, dim, inv_rms(ss, dim, eps));
}

// The head norm of chunk i when the thread reads the head's other chunks itself (from L2).
template <typename T>
__device__ __forceinline__ void norm_chunk_reading_head(uint4& lo, uint4& hi, const T* src, const T* w, int i,
                                                        int dim, float eps) {
    float ss = 0.f;
    for (int j = 0; j < dim / 2; j += 8) {
        uint4 a, b;
        load_chunk<T>(src, j, dim, a, b);
        ss += chunk_sumsq<T>(a, b);
    }
    norm_chunk<T>(lo, hi, w, i, dim, inv_rms(ss, dim, eps));
}

}  // namespace rotary
}  // namespace tf
