// PTX wrappers shared by every kernel family. Each says why it exists.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace tf {

typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// 16-byte load through the read-only (non-coherent) path: the data is never written by
// the kernel, so it may bypass L1 coherence and be issued as one LDG.E.128.
__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// Same, with the L2::256B prefetch-size hint: a streaming reader asks DRAM for whole 256 B
// spans, so fewer, larger requests keep the memory pipeline full.
__device__ __forceinline__ uint4 ld_nc_v4_l2_256(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// 16-byte store with the evict-first (streaming) hint: output that is written once and
// not re-read should not push reusable lines out of L2.
__device__ __forceinline__ void st_cs_v4(void* p, uint4 v) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ void st_v4(void* p, uint4 v) {
    *reinterpret_cast<uint4*>(p) = v;
}

// Bit-cast helpers (no conversions): pack two 16-bit values into one 32-bit register.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // .x = lo = lower address
    return *reinterpret_cast<u32*>(&h);
}
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

}  // namespace tf
