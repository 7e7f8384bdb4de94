// Expert alignment for the grouped expert GEMMs (ops/moe_kernels.py; the idea of vLLM's
// moe_align_block_size): from the router's top-k ids [S = T*K slots] it sorts the slots by expert and cuts
// each expert's rows into blocks of at most BM rows, the grid of the grouped GEMM (w4a16/gemm.cu with
// -D TF_W4A16_GROUPED: blockIdx.x indexes the block table).
//
// Outputs (every buffer is sized from S, E and BM only, so the launches never depend on the routing):
//   sorted_slot[i]   slot t*K + j of sorted row i (expert-major; the order of one expert's slots is not
//                    specified: every output row is computed on its own, so no result depends on it)
//   sorted_token[i]  its token t = sorted_slot[i] / K (the first GEMM's x row)
//   block_expert[b]  the expert of block b, or -1 for an unused entry (b >= the blocks used)
//   block_start[b]   its first sorted row; block_rows[b] its row count (1..BM; 0 when unused)
//   meta[0], meta[1] the sorted rows (valid slots) and the blocks used
// Rows past meta[0] of the sorted lists are left unwritten; no consumer reads them.
// max_blocks >= ceil(S / BM) + min(E, S) holds every expert's last, partial block.
//
// Ids outside [0, E) (negative: an expert-parallel "not mine" marker; >= E: garbage) are dropped: the
// slot is in no block, so no GEMM reads or writes for it, and the combine kernel adds nothing for it.
// Nothing is read or written out of bounds for any id value.
//
// One CTA (S is a few thousand slots at most in decode / small batches; a prefill's GEMMs dwarf this
// pass): count with warp-aggregated shared atomics, a block-wide scan of the row and block counts, the
// block table (each entry finds its expert by binary search in the block offsets), then placement with the
// same aggregated atomics on per-expert cursors. Shared memory: 3E + 1 ints (dynamic).
#include "common/ptx.cuh"

using namespace tf;

constexpr int kMaxWarps = 32;

// The expert of an id, or -1 when it is outside [0, experts): the 64-bit compare comes first, so a huge
// int64 id never wraps into range.
template <typename Id>
__device__ __forceinline__ int valid_expert(Id id, int experts) {
    return id >= 0 && id < (Id)experts ? (int)id : -1;
}

// Warp-aggregated atomicAdd of 1 per lane to counter[e] (lanes with e < 0 take no part): one atomic per
// distinct expert in the warp instead of one per lane (decode batches route many slots to a few experts).
// Returns each participating lane's old value plus its rank among the warp's lanes of the same expert.
__device__ __forceinline__ int aggregated_add(int* counter, int e) {
    const int lane = threadIdx.x & 31;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int leader = __ffs(peers) - 1;
    int base = 0;
    if (e >= 0 && lane == leader) base = atomicAdd(counter + e, __popc(peers));
    base = __shfl_sync(0xffffffffu, base, leader);
    return base + __popc(peers & ((1u << lane) - 1));
}

// Block-wide exclusive scan of a pair of ints (rows, blocks); `total` gets the sums. Every thread calls it.
__device__ __forceinline__ int2 block_exclusive_scan(int2 v, int2* warp_sums, int2& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int2 inc = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int a = __shfl_up_sync(0xffffffffu, inc.x, off), b = __shfl_up_sync(0xffffffffu, inc.y, off);
        if (lane >= off) {
            inc.x += a;
            inc.y += b;
        }
    }
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int2 s = lane < warps ? warp_sums[lane] : make_int2(0, 0);
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, s.x, off), b = __shfl_up_sync(0xffffffffu, s.y, off);
            if (lane >= off) {
                s.x += a;
                s.y += b;
            }
        }
        if (lane < warps) warp_sums[lane] = s;  // inclusive sums of the warps
    }
    __syncthreads();
    const int2 before = warp > 0 ? warp_sums[warp - 1] : make_int2(0, 0);
    total = warp_sums[warps - 1];
    return make_int2(before.x + inc.x - v.x, before.y + inc.y - v.y);
}

// blockDim.x: a multiple of 32, at most 1024. Dynamic shared memory: (3 * experts + 1) ints.
template <typename Id>
__global__ void __launch_bounds__(1024)
moe_align(const Id* __restrict__ topk_ids, int slots, int topk, int experts, int block_m, int max_blocks,
          int* __restrict__ sorted_slot, int* __restrict__ sorted_token, int* __restrict__ block_expert,
          int* __restrict__ block_start, int* __restrict__ block_rows, int* __restrict__ meta) {
    extern __shared__ int smem[];
    int* count = smem;                    // [experts] valid slots of each expert
    int* cursor = smem + experts;         // [experts] first sorted row of each expert, then the placement cursor
    int* block_off = smem + 2 * experts;  // [experts + 1] first block of each expert; [experts] = blocks used
    __shared__ int2 warp_sums[kMaxWarps];
    const int tid = threadIdx.x;

    for (int e = tid; e < experts; e += blockDim.x) count[e] = 0;
    __syncthreads();
    // The trip count is the same for every lane of a warp (the aggregated atomics need whole warps).
    for (int i0 = 0; i0 < slots; i0 += blockDim.x) {
        const int i = i0 + tid;
        aggregated_add(count, i < slots ? valid_expert(topk_ids[i], experts) : -1);
    }
    __syncthreads();

    // Each thread scans a contiguous run of experts: its local sums, the block-wide scan, then its prefixes.
    const int per_thread = (experts + blockDim.x - 1) / blockDim.x;
    const int e_begin = min(tid * per_thread, experts), e_end = min(e_begin + per_thread, experts);
    int2 local = make_int2(0, 0);
    for (int e = e_begin; e < e_end; ++e) {
        local.x += count[e];
        local.y += (count[e] + block_m - 1) / block_m;
    }
    int2 total;
    int2 run = block_exclusive_scan(local, warp_sums, total);
    for (int e = e_begin; e < e_end; ++e) {
        cursor[e] = run.x;
        block_off[e] = run.y;
        run.x += count[e];
        run.y += (count[e] + block_m - 1) / block_m;
    }
    const int used = min(total.y, max_blocks);  // total.y <= max_blocks by the host's bound
    if (tid == 0) {
        block_off[experts] = total.y;
        meta[0] = total.x;
        meta[1] = used;
    }
    __syncthreads();

    // The block table: entry b of the used ones belongs to the last expert whose first block is <= b
    // (experts without rows own no block, so that expert has rows).
    for (int b = tid; b < max_blocks; b += blockDim.x) {
        if (b >= used) {
            block_expert[b] = -1;
            block_start[b] = 0;
            block_rows[b] = 0;
            continue;
        }
        int lo = 0, hi = experts - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (block_off[mid] <= b) lo = mid;
            else hi = mid - 1;
        }
        const int first = (b - block_off[lo]) * block_m;
        block_expert[b] = lo;
        block_start[b] = cursor[lo] + first;
        block_rows[b] = min(block_m, count[lo] - first);
    }
    __syncthreads();  // the block table has read the cursors' starting values

    for (int i0 = 0; i0 < slots; i0 += blockDim.x) {
        const int i = i0 + tid;
        const int e = i < slots ? valid_expert(topk_ids[i], experts) : -1;
        const int pos = aggregated_add(cursor, e);
        if (e >= 0) {
            sorted_slot[pos] = i;
            sorted_token[pos] = i / topk;
        }
    }
}
