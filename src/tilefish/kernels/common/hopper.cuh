// Hopper (sm_90a) building blocks: mbarriers, TMA tensor loads, wgmma shared-memory descriptors
// and fences, register reallocation. Each wrapper says why it exists. Only kernels compiled for
// sm_90a include this (KernelSpec.arch_specific); the wgmma shapes are in common/wgmma.cuh.
#pragma once
#include "common/cluster.cuh"
#include "common/ptx.cuh"

namespace tf {

// A CUtensorMap as a kernel parameter: 128 opaque bytes, 64-byte aligned, filled on the host by
// cuTensorMapEncodeTiled (runtime/tma.py). Passed as `const __grid_constant__ TmaDesc`, so its
// generic address points into the parameter space, which is where TMA wants to read it from.
struct alignas(64) TmaDesc {
    u64 opaque[16];
};

// ---- mbarrier: a shared-memory barrier that also counts bytes (transactions). TMA completes
// its bytes on one, so a consumer waits for "stage s has landed" without any thread polling data.
__device__ __forceinline__ void mbar_init(u64* bar, u32 arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// Make the inits visible to the async proxy (TMA) before any copy signals the barrier.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival plus "expect this many more bytes in the current phase" (the producer, per stage).
__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_addr(bar)) : "memory");
}
// Block until the phase with parity `parity` has completed. try_wait suspends the thread for a
// hardware-chosen time instead of spinning hot, so waiting warps leave issue slots to the others.
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    const u32 addr = smem_addr(bar);
    u32 done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(addr), "r"(parity) : "memory");
    } while (!done);
}

// Order this thread's generic-proxy shared-memory accesses (ld.shared, ldmatrix) before later
// async-proxy ones (TMA / bulk copies into the same bytes). A consumer that read a stage with
// ordinary loads needs it before releasing the stage: the mbarrier arrive orders only its own proxy.
__device__ __forceinline__ void fence_proxy_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Order global-memory data this thread has acquired (generic proxy: another CTA's stores, seen
// through an acquire) before its later async-proxy reads of it (bulk copies global -> shared).
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Bytes of dynamic shared memory this launch was given.
__device__ __forceinline__ u32 dynamic_smem_size() {
    u32 r;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// ---- TMA: one instruction moves a whole 2-D box global -> shared, in the tensor map's swizzle,
// zero-filling what lies outside the tensor (so M/N/K edges need no predication on loads), and
// signals `bar` with the byte count. c0 is the inner (contiguous) coordinate, c1 the row.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const TmaDesc* map, int c0, int c1, u64* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_addr(smem_dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1),
                    "r"(smem_addr(bar)) : "memory");
}
// The same box delivered to every CTA of the cluster named in cta_mask, at the same smem offset,
// completing on each CTA's barrier at `bar`'s offset: one L2 read feeds several SMs.
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const TmaDesc* map, int c0, int c1, u64* bar,
                                                      unsigned short cta_mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;"
                 :: "r"(smem_addr(smem_dst)), "l"(reinterpret_cast<u64>(map)), "r"(c0), "r"(c1),
                    "r"(smem_addr(bar)), "h"(cta_mask) : "memory");
}
// Non-tensor bulk copy: `bytes` contiguous bytes (multiple of 16, both addresses 16-byte aligned)
// global -> shared, completing on `bar`. For operands that are already in the kernel's layout in
// global memory (packed W4A16 weights, their scales), where a tensor map would only add a descriptor.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_addr(smem_dst)), "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// TMA store: a whole 2-D box shared -> global in the map's swizzle; the parts of the box past the
// tensor's edges are not written (so M/N edges need no predication). The copy reads shared memory
// asynchronously: the source may be overwritten only after bulk_wait_group_read says so, and the
// writes must first be made visible to the async proxy (fence_proxy_async_smem).
__device__ __forceinline__ void tma_store_2d(const TmaDesc* map, const void* smem_src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 :: "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(smem_src)), "r"(c0), "r"(c1) : "memory");
}
// This thread's bulk stores issued since the last commit form one group.
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until at most N of this thread's committed groups still read their shared-memory source.
template <int N> __device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
// Wait until at most N of this thread's committed groups are still incomplete (writes done).
template <int N> __device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}
// Pull the descriptor into the constant cache before the first copy needs it.
__device__ __forceinline__ void tma_prefetch_desc(const TmaDesc* map) {
    asm volatile("prefetch.tensormap [%0];" :: "l"(reinterpret_cast<u64>(map)) : "memory");
}

// Arrive on the barrier at `bar`'s offset in CTA `rank` of the cluster. Default (CTA-scope)
// semantics on purpose: the .release.cluster form costs a MEMBAR.ALL.GPU per arrival (and an
// acquire.cluster wait an L1 invalidate per wait), which serialized the whole pipeline (~1 us per
// stage). Nothing needs that fence here: what the arrival announces is that this warp's wgmmas
// (async-proxy reads, finished by wgmma.wait_group) are done with the stage, and the only writer
// that waits for it is the peer's TMA (async proxy as well).
__device__ __forceinline__ void mbar_arrive_cluster(u64* bar, u32 rank) {
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}"
                 :: "r"(smem_addr(bar)), "r"(rank) : "memory");
}

// ---- wgmma shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"), 128-byte
// swizzle: start address, leading / stride byte offsets (all >> 4), swizzle mode 1 in bits 62-63.
// The 1024-byte swizzle atoms must start on 1024-byte boundaries (base offset 0).
//   K-major (A, and B [N, K]): rows of 64 elements (128 B); SBO = 1024 (next 8 rows); LBO unused.
//     A k16 step inside the 64-wide row just moves the start address by 32 bytes: the hardware
//     applies the XOR to the final address bits, exactly as TMA wrote them.
//   N-major (B [K, N]): 64-wide n blocks of 128-byte k rows; SBO = 1024 (next 8 k rows),
//     LBO = distance between 64-wide n blocks.
__device__ __forceinline__ u64 wgmma_desc_sw128(const void* smem, u32 lbo_bytes, u32 sbo_bytes) {
    const u64 addr = smem_addr(smem);
    return ((addr & 0x3FFFF) >> 4) | ((u64)((lbo_bytes & 0x3FFFF) >> 4) << 16) |
           ((u64)((sbo_bytes & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// Order this warpgroup's register writes (accumulators) before the following wgmmas read them.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Wait until at most N committed wgmma groups are still running (their smem may then be reused).
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Barrier over a subset of the block (e.g. the consumer warpgroups only, while the producer runs
// ahead): `threads` (a multiple of 32) arrive at barrier `id` (1..15; 0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads) {
    asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}

// Warp specialization: the producer warpgroup gives registers back, the math warpgroups take
// them, so the accumulators fit without spills. All threads of a warpgroup execute it.
template <int REGS> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS));
}
template <int REGS> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS));
}

}  // namespace tf
