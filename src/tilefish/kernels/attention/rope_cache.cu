// The rotary embedding and KV-cache write of a Llama-family attention step (ops/rope_cache.py), straight from
// the fused q/k/v projection's output, in one launch. For every token (b, j) of qkv [B, T, (H + 2 KV) * D]:
//   q_out[b, j, h]       = rope(q_h)   (h < H; q_out is [B, T, H, D], the layout transformers' query has)
//   keys[b, g, L + j]    = rope(k_g),   values[b, g, L + j] = v_g   (g < KV; the caches are [B, KV, S, D])
// with L = *length as the launch found it, and *length = L + T once every CTA has read it: transformers'
// StaticLayer.update (index_copy_ at arange(T) + cumulative_length, then cumulative_length += T).
// rope(x) pairs element i < D/2 with i + D/2, rounded as transformers' eager apply_rotary_pos_emb rounds
// (q * cos + rotate_half(q) * sin: each product rounded to T, then the sum):
//   out[i] = T(T(x[i] c[i]) + T(-x[i + D/2] s[i])),   out[i + D/2] = T(T(x[i + D/2] c[i + D/2]) + T(x[i] s[i + D/2]))
// cos / sin: [B or 1, T, D] rows (strides in elements; the batch stride 0 for a shared row).
//
// Work units: 8 pairs of one rotated head (16 bytes of each half), or 8 elements of one v head; thread t of
// the grid takes units t, t + stride, ... Positions L + j >= S are not written (the op's documented rule).
// The length: thread 0 of each CTA reads L before it arrives on `arrivals` (atom.acq_rel, the W4A16 counter
// protocol of w4a16/fixup.cuh); the last CTA to arrive writes L + T and puts `arrivals` back to zero, so no CTA
// can read a length another has moved. Under programmatic dependent launch everything comes after
// grid_dependency_wait: the launch only gets its CTAs resident while the q/k/v GEMM ahead finishes.
// Limits (the op checks them): D % 16 == 0, 16-byte aligned rows.
#include "common/ptx.cuh"
#include "w4a16/dequant.cuh"  // Vec2 / Dequant: 16-bit pairs <-> float2 and u32

using namespace tf;

namespace {

template <typename T> __device__ __forceinline__ float2 unpack2(u32 v) {
    return Vec2<T>::to_float2(Dequant<T>::as_h2(v));
}
template <typename T> __device__ __forceinline__ u32 pack2(float a, float b) {  // each rounded once to T
    return Dequant<T>::as_u32(Vec2<T>::make(a, b));
}
template <typename T> __device__ __forceinline__ float2 round2(float a, float b) { return unpack2<T>(pack2<T>(a, b)); }

__device__ __forceinline__ u32& word(uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// The two halves' 8-element chunks of a rotated head: lo = x[i..i+8), hi = x[i+D/2..), in place.
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

}  // namespace

template <typename T>
__global__ void __launch_bounds__(256)
rope_cache(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ sin, T* __restrict__ q_out,
           T* __restrict__ keys, T* __restrict__ values, long long* __restrict__ length, int* __restrict__ arrivals,
           int batch, int tokens, int heads, int kv_heads, int dim, int slots, long long cs_batch, long long cs_token) {
    __shared__ long long base_shared;
    launch_dependent_grids();
    grid_dependency_wait();
    if (threadIdx.x == 0) base_shared = *length;
    __syncthreads();
    const long long base = base_shared;
    const int half_chunks = dim >> 4, chunks = dim >> 3, width = (heads + 2 * kv_heads) * dim;
    const int rotated = (heads + kv_heads) * half_chunks, per_token = rotated + kv_heads * chunks;
    const long long units = (long long)batch * tokens * per_token;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < units;
         u += (long long)gridDim.x * blockDim.x) {
        const long long token = u / per_token;
        const int r = (int)(u - token * per_token);
        const int b = (int)(token / tokens), j = (int)(token - (long long)b * tokens);
        const T* row = qkv + token * width;
        const long long slot = base + j;
        if (r < rotated) {
            const int head = r / half_chunks, i = (r - head * half_chunks) * 8;
            T* dst;
            if (head < heads) {
                dst = q_out + (token * heads + head) * dim;
            } else {
                if (slot >= slots) continue;
                dst = keys + (((long long)b * kv_heads + head - heads) * slots + slot) * dim;
            }
            const T* src = row + head * dim;
            const T* c = cos + b * cs_batch + j * cs_token;
            const T* s = sin + b * cs_batch + j * cs_token;
            uint4 lo = ld_nc_v4(src + i), hi = ld_nc_v4(src + i + dim / 2);
            rotate<T>(lo, hi, ld_nc_v4(c + i), ld_nc_v4(c + i + dim / 2), ld_nc_v4(s + i), ld_nc_v4(s + i + dim / 2));
            st_v4(dst + i, lo);
            st_v4(dst + i + dim / 2, hi);
        } else {
            if (slot >= slots) continue;
            const int rv = r - rotated, g = rv / chunks, i = (rv - g * chunks) * 8;
            st_v4(values + (((long long)b * kv_heads + g) * slots + slot) * dim + i,
                  ld_nc_v4(row + (heads + kv_heads + g) * dim + i));
        }
    }
    if (threadIdx.x == 0 && atomic_add_acq_rel(arrivals, 1) == (int)gridDim.x - 1) {
        *length = base + tokens;
        store_relaxed(arrivals, 0);
    }
}
