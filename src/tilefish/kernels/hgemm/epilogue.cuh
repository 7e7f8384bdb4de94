// Shared epilogue pieces of the HGEMM ladder (steps 1-6): fp32 -> fp16/bf16 packing and the
// predicated store of one m16n8 accumulator fragment.
#pragma once
#include "common/ptx.cuh"

namespace hg {
using tf::u32;

template <typename T> struct Conv;
template <> struct Conv<__half> {
    static __device__ __forceinline__ u32 pack(float a, float b) { return tf::pack_f16x2(a, b); }
    static __device__ __forceinline__ __half one(float a) { return __float2half_rn(a); }
};
template <> struct Conv<__nv_bfloat16> {
    static __device__ __forceinline__ u32 pack(float a, float b) { return tf::pack_bf16x2(a, b); }
    static __device__ __forceinline__ __nv_bfloat16 one(float a) { return __float2bfloat16_rn(a); }
};

// Store one m16n8 accumulator fragment (c0,c1 at row g, cols 2t..2t+1; c2,c3 at row g+8) to C
// at (row0, col0), predicated on M and N. An even N keeps every pair 4-byte aligned (one 32-bit
// store); an odd N stores element by element.
template <typename T>
__device__ __forceinline__ void store_frag(T* C, int M, int N, int row0, int col0, const float (&c)[4]) {
    const int lane = threadIdx.x & 31;
    const int col = col0 + 2 * (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = row0 + (lane >> 2) + 8 * h;
        if (row >= M) continue;
        T* p = C + (size_t)row * N + col;
        if ((N & 1) == 0) {
            if (col < N) *reinterpret_cast<u32*>(p) = Conv<T>::pack(c[2 * h], c[2 * h + 1]);
        } else {
            if (col < N) p[0] = Conv<T>::one(c[2 * h]);
            if (col + 1 < N) p[1] = Conv<T>::one(c[2 * h + 1]);
        }
    }
}

}  // namespace hg
