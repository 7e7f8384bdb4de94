// The gated activation between the two expert GEMMs (ops/moe_kernels.py): h [rows, 2I] (gate columns
// 0..I-1, then up columns I..2I-1, the first GEMM's output in sorted-row order) -> a [rows, I], computed in
// fp32 (moe/gated.cuh) and rounded once to T (what the second GEMM reads).
//
// Each thread turns 8 columns (one 16-byte load of gate, one of up, one store; I % 8 == 0). Grid (rows,
// column chunks): a row past *valid_rows (the sorted rows the alignment produced) exits, so dropped slots
// cost nothing and never-written rows are never read.
#include "common/ptx.cuh"
#include "moe/gated.cuh"

using namespace tf;

__device__ __forceinline__ float2 to_float2(u32 v, __half) { return __half22float2(*reinterpret_cast<__half2*>(&v)); }
__device__ __forceinline__ float2 to_float2(u32 v, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
__device__ __forceinline__ u32 from_float2(float a, float b, __half) { return pack_f16x2(a, b); }
__device__ __forceinline__ u32 from_float2(float a, float b, __nv_bfloat16) { return pack_bf16x2(a, b); }

template <typename T, int ACT>
__global__ void __launch_bounds__(128)
moe_act(const T* __restrict__ h, T* __restrict__ out, int inter, const int* __restrict__ valid_rows) {
    const int row = blockIdx.x;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (row >= *valid_rows || c >= inter) return;
    const T* src = h + (size_t)row * 2 * inter + c;
    const uint4 gv = *reinterpret_cast<const uint4*>(src);
    const uint4 uv = *reinterpret_cast<const uint4*>(src + inter);
    const u32 gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w};
    u32 r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 g = to_float2(gw[i], T()), u = to_float2(uw[i], T());
        r[i] = from_float2(gated<ACT>(g.x, u.x), gated<ACT>(g.y, u.y), T());
    }
    *reinterpret_cast<uint4*>(out + (size_t)row * inter + c) = make_uint4(r[0], r[1], r[2], r[3]);
}
