// The split-tile fixup protocol of the W4A16 kernels: gemm.cu (k split), wgmma.cu (k split through
// the workspace, stream-K) and skinny.cu (stream-K) finish a tile whose k range is cut between CTAs
// (its `count` contributors) the same way; the helpers below are that shared part.
//
// The rule:
// 1. Each contributor stores its fp32 partial into a workspace slot of its own (st.cg, to L2).
// 2. Something that orders all of the CTA's slot stores before one thread (a CTA or named barrier;
//    skinny.cu: the mbarrier hand-off to its finisher warp), then that thread arrives with
//    fixup_arrive: one atom.add.acq_rel.gpu on the tile's counter. Its release publishes the CTA's
//    slot stores (cumulatively, through the barrier); when it returns "last" (the old value was
//    count - 1), its acquire makes every other contributor's slot stores visible. A second barrier
//    (or a shuffle / mbarrier) passes that acquire on to the threads that read the slots. So no
//    fence.sc (MEMBAR.SC.GPU) is needed on either side: the atomic's acq_rel is the whole ordering.
// 3. Only the last contributor reads the slots (ld.cg), adding them in a fixed slot order (k order),
//    so the result is bitwise the same whatever order the contributors arrived in; then it stores y
//    and resets the counter with fixup_reset (a relaxed store of 0). Every contributor has already
//    incremented it, so nothing else touches the counter in this launch, and the kernel boundary
//    orders the store before the next launch: the next launch finds zeros. (Counters are per
//    (device, stream), ops/w4a16/launch.py: concurrent launches never share them.)
// 4. It cannot hang: no CTA ever waits for another. The only waits are barriers inside one CTA; a
//    contributor that is not last leaves (or goes on with its next segment).
// A contributor may also peek (fixup_others_in: a load.acquire of the counter) before storing its
// own slot: if all the others are in, it is the last without storing its partial or taking the
// atomic, and its partial, still in registers, stands in for its slot at the same place of the sum.
#pragma once
#include "common/ptx.cuh"

namespace tf {

// One thread of a contributor, after the barrier that ordered the CTA's slot stores: true if this
// contributor is the last of `count` to arrive (then every slot is visible to this thread).
__device__ __forceinline__ bool fixup_arrive(int* counter, int count) {
    return atomic_add_acq_rel(counter, 1) == count - 1;
}

// fixup_arrive by `leader` between two barriers (`sync`: __syncthreads or a named barrier of the
// threads involved), the answer broadcast through `flag` (shared memory) to every thread.
template <typename Sync>
__device__ __forceinline__ bool fixup_arrive_cta(int* counter, int count, bool leader, int& flag, Sync sync) {
    sync();  // every thread's slot stores come before the leader's release
    if (leader) flag = fixup_arrive(counter, count);
    sync();  // ... and the leader's acquire (and flag) before any thread's slot loads
    return flag;
}

// The peek: true if the other count - 1 contributors have all arrived (their slots are visible).
__device__ __forceinline__ bool fixup_others_in(const int* counter, int count) {
    return load_acquire(counter) == count - 1;
}

// The last contributor, once the tile is summed: the counter back to zero for the next launch.
__device__ __forceinline__ void fixup_reset(int* counter) { store_relaxed(counter, 0); }

}  // namespace tf
