// Thread-block clusters (sm_90+): CTAs on neighbouring SMs that can touch each other's shared memory. Kernels
// built for older GPUs as well (rope_attention) include this too: there the bodies compile to nothing, and the
// host never launches such a kernel as a cluster.
#pragma once
#include "common/ptx.cuh"

namespace tf {

__device__ __forceinline__ u32 cluster_ctarank() {
    u32 r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
// CTAs in this CTA's cluster (1: not launched as a cluster).
__device__ __forceinline__ u32 cluster_nctarank() {
    u32 r = 1;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
#endif
    return r;
}
// Every thread of every CTA in the cluster: publishes barrier inits before peers signal them, and
// keeps a CTA's smem alive until its peers have stopped writing / arriving into it.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// The shared::cluster address of local shared address `addr` in CTA `rank` of the cluster.
__device__ __forceinline__ u32 mapa_shared(u32 addr, u32 rank) {
    u32 r = addr;
#if __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
#endif
    return r;
}
// 16 bytes / 4 bytes from a shared::cluster address (distributed shared memory, after a cluster barrier).
__device__ __forceinline__ float4 ld_shared_cluster_f4(u32 addr) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
#endif
    return v;
}
__device__ __forceinline__ float ld_shared_cluster_f32(u32 addr) {
    float v = 0.f;
#if __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
#endif
    return v;
}

}  // namespace tf
