// The last step of the grouped expert op (ops/moe_kernels.py): y[t] = sum over j < K of out2[t*K + j], the
// second GEMM's rows in slot order (each already times its routing weight), summed in fp32 in slot order
// (deterministic) and rounded once to T. A slot whose id is outside [0, E) was dropped by the alignment:
// its out2 row was never written, so it is skipped here (it adds nothing).
//
// Each thread sums 8 columns (16-byte loads and store; H % 8 == 0). Grid (tokens, column chunks).
#include "common/ptx.cuh"

using namespace tf;

__device__ __forceinline__ float2 to_float2(u32 v, __half) { return __half22float2(*reinterpret_cast<__half2*>(&v)); }
__device__ __forceinline__ float2 to_float2(u32 v, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
__device__ __forceinline__ u32 from_float2(float2 v, __half) { return pack_f16x2(v.x, v.y); }
__device__ __forceinline__ u32 from_float2(float2 v, __nv_bfloat16) { return pack_bf16x2(v.x, v.y); }

template <typename T, typename Id>
__global__ void __launch_bounds__(128)
moe_combine(const T* __restrict__ slots, const Id* __restrict__ topk_ids, T* __restrict__ y, int topk, int hidden,
            int experts) {
    const int token = blockIdx.x;
    const int c = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (c >= hidden) return;
    float2 acc[4] = {};
    for (int j = 0; j < topk; ++j) {
        const Id e = topk_ids[(size_t)token * topk + j];
        if (e < 0 || e >= (Id)experts) continue;
        const uint4 v = *reinterpret_cast<const uint4*>(slots + ((size_t)token * topk + j) * hidden + c);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = to_float2(w[i], T());
            acc[i].x += f.x;
            acc[i].y += f.y;
        }
    }
    *reinterpret_cast<uint4*>(y + (size_t)token * hidden + c) =
        make_uint4(from_float2(acc[0], T()), from_float2(acc[1], T()), from_float2(acc[2], T()),
                   from_float2(acc[3], T()));
}
