// W4A16 for skinny x (m <= 32) on Hopper (sm_90a): y[m, n] = x[m, k] @ dequant(W)[n, k]^T (+ bias).
//
// Why a third kernel: at small m the job is streaming the packed weights from DRAM, and the other
// two kernels left a third or more of the bandwidth unused. gemm.cu keeps only two stages of
// weights in flight per block (a register ring) and splits k into equal slices of whole tiles, so
// shapes whose tile count does not divide the SM count run a partial last wave; wgmma.cu has a
// deep ring, but one warpgroup's wgmma chain per tile limits how fast a CTA can consume it.
//
// Stream-K over the whole weight: the work is tiles (NS 64-column strips each) x k stages of 128,
// flattened tile-major into U units, and CTA b of G takes units [b U / G, (b+1) U / G). Every SM
// streams the same number of bytes whatever the shape. A tile whose k range is split between
// CTAs is finished by whichever of them arrives last (fp32 partials, summed in CTA order, so the
// result is bitwise deterministic; the protocol of w4a16/fixup.cuh); no CTA ever waits for another.
//
// Half stage (k % 128 == 64): the last stage of a tile has 64 valid k. Only the producer knows: its
// second x box lies wholly past k, so TMA fills it with zeros (and counts its bytes as usual), and
// the weight rows 4..7 and the second half's scale / zero-point rows are copies of the first half's
// (in bounds, finite), so the consumers' unchanged loop adds exact zeros for k 64..127.
//
// Roles: the NS x WK consumer warps, then the producer warp, then the finisher warp. The
// producer's one thread issues, per stage, two TMA boxes of x (MT x 64, 128-byte swizzle, rows
// past m zero-filled), one 4 KB bulk copy per strip (8 k16 rows x 512 B, contiguous in the
// strip-major packed layout) and the stage's scale / zero-point rows, all counted in by the
// stage's full mbarrier. Consumer warp (strip si, kw) takes k16 rows kw*8/WK .. of strip si,
// dequantizes each 32-bit word with lop3 into the A fragment of mma.m16n8k16 (16 output columns
// x 16 k; gemm.cu's swap path) and multiplies it by x^T (16 k x 8 rows of x, ldmatrix from the
// swizzled box) for each 8-row block of the m tile. The deep ring (STAGES x NS x 4 KB per CTA,
// 2 CTAs per SM) keeps ~100+ KB per SM in flight.
//
// At the end of a tile's segment the WK warps of a strip are summed through shared memory; the
// segment is either the whole tile (epilogue straight to y) or a partial: the consumers store it
// to a workspace slot (b, first or last segment of b) and hand it to the finisher warp, which
// does the fence and the tile counter (the last arriver sums the slots and stores) while the
// consumers go on streaming. Done by the consumers themselves, those round trips stall them
// mid-stream with the ring full, and CTAs whose main loop ends late hold up the whole launch.
//
// Cluster split (launched as clusters of S > 1 CTAs along x; an "/x<S>" plan, ops/w4a16/geometry.py): the
// grid is tiles x S CTAs, so stream-K's ranges give CTA b slice b % S of tile b / S (units split evenly, one
// segment a CTA). The S partials of a tile are summed through distributed shared memory instead: each CTA
// stages its partial in its drained ring, and after a cluster barrier CTA r sums the r-th share of the tile's
// float4s over the ranks in rank (k) order and runs the epilogue. No workspace slot, tile counter or
// finisher, so no L2 round trip between the last main loop and the store (the stream-K tail's cost in a
// decode step, where the next GEMM's first ring is in flight: docs/e2e.md).
//
// Epilogues (w4a16/epilogue.cuh): plain, + residual, or gated (silu(gate) * up of interleaved columns);
// a split tile's fixup pairs a gate float4 with its up float4 (lane ^ 2) through a shuffle.
//
// Programmatic dependent launch: the producer issues its first two stages' weights, scales and zero points
// before grid_dependency_wait (nothing in the stream writes them), x and the rest after it; every other thread waits
// before it touches anything, and the next kernel may be scheduled once every CTA is set up.
#include "common/hopper.cuh"
#include "w4a16/dequant.cuh"
#include "w4a16/epilogue.cuh"
#include "w4a16/fixup.cuh"
#include "w4a16/timeline.cuh"

namespace w4s {
using namespace tf;
constexpr int kBK = 128;  // k per stage (two 64-wide x boxes, 8 k16 rows of packed weights)

template <int MT, int NS, int WK, int GROUP, bool ASYM>
struct Layout {
    static constexpr int BN = 64 * NS;
    static constexpr int X_HALF = MT * 128;  // one 64-wide TMA box: MT rows of 128 B (1024-byte multiple)
    static constexpr int X_BYTES = 2 * X_HALF;
    static constexpr int W_STRIP = 8 * 512;
    static constexpr int W_BYTES = NS * W_STRIP;
    static constexpr int S_ROWS = GROUP == 0 ? 0 : (GROUP >= kBK ? 1 : kBK / GROUP);
    static constexpr int S_BYTES = S_ROWS * BN * 2;
    static constexpr int Z_ROWS = ASYM ? (GROUP == 0 ? 1 : S_ROWS) : 0;
    static constexpr int Z_BYTES = Z_ROWS * BN * 2;
    static constexpr int TX = X_BYTES + W_BYTES + S_BYTES + Z_BYTES;  // bytes landing per stage
    static constexpr int STAGE = (TX + 1023) / 1024 * 1024;          // x boxes stay 1024-aligned
    static constexpr int ACC = MT / 8 * 16;                          // fp32 accumulators a lane
    static constexpr int RED = (WK - 1) * NS * ACC * 32 * 4;          // cross-warp k reduction
};

}  // namespace w4s

// CPS: CTAs per SM the launch plans for (the register budget: 2 x 9 warps leave 96 a thread).
// counters: one per tile, left at zero after every launch.
// STAGED: the consumers' end-of-launch fixups bulk-copy the slots into shared memory (a separate
// build, dispatched where the register fixup would take many L2 round trips; see fixup_staged).
template <typename T, int MT, int NS, int WK, int STAGES, int CPS, int GROUP, bool ASYM, bool STAGED>
__global__ void __launch_bounds__((NS * WK + 2) * 32, CPS)
w4a16_skinny(const __grid_constant__ tf::TmaDesc tma_x, const uint4* __restrict__ w, const T* __restrict__ scales,
             const T* __restrict__ zeros, const T* __restrict__ bias, T* __restrict__ out,
             float* __restrict__ workspace, int* __restrict__ counters, int m, int n, int k,
             const T* __restrict__ residual, int gated) {
    using namespace w4s;
    using L = Layout<MT, NS, WK, GROUP, ASYM>;
    using DQ = WeightDecoder<T>;
    static_assert(kDecoderHasZeros || !ASYM, "NF4 codes have no zero points");
    using V2 = Vec2<T>;
    static_assert(MT == 8 || MT == 16 || MT == 32, "MT: 8-row blocks of x^T, up to 32 rows");
    static_assert(NS == 1 || NS == 2 || NS == 4, "strips per tile");
    static_assert(WK == 1 || WK == 2 || WK == 4 || WK == 8, "warps per strip split the 8 k16 rows of a stage");
    constexpr int CW = NS * WK, CT = CW * 32;  // consumer warps / threads
    constexpr int RPW = 8 / WK;                // k16 rows a warp takes from each stage
    constexpr int NB = MT / 8;                 // 8-row blocks of x
    constexpr int BN = L::BN, ACC = L::ACC;
    // Registers a thread gets: one SM sub-partition's 16 K registers over the warps it hosts.
    constexpr int kRegBudget = 16384 / (((CPS * (CW + 2) + 3) / 4) * 32);

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms
    u64* full = reinterpret_cast<u64*>(smem + STAGES * L::STAGE);
    u64* empty = full + STAGES;
    float* red = reinterpret_cast<float*>(empty + STAGES);
    // Consumers -> finisher hand-off of finished partial segments (a ring of 2): (tile or -1, final).
    __shared__ int2 s_seg[2];
    __shared__ __align__(8) u64 seg_full[2], seg_empty[2], fix_ready, fix_bar;
    __shared__ int s_fix_tile;    // finisher -> consumers: the tile whose fixup they run at the end, or -1
    __shared__ int s_defer_tile;  // ... and a tile the finisher left to them (see the finisher), or -1

    const int KS = (k + kBK - 1) / kBK;  // k % 128 == 64: the last stage of a tile is a half stage
    const int tiles = n / BN;
    const int units = tiles * KS, ctas = gridDim.x, b = blockIdx.x;
    const int u0 = unit_begin(b, units, ctas), u1 = unit_begin(b + 1, units, ctas);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    // > 1: the cluster split (see the header); 8-row tiles only (the 16-row builds spill with its code)
    const int csplit = MT == 8 ? (int)cluster_nctarank() : 1;
    // Timeline builds (w4a16/timeline.cuh): per-CTA stamps after the workspace slots (16 a CTA): 0
    // entry, 1 barriers ready, 2 first stage landed, 3 the consumers' final hand-off done, 4 the
    // finisher's exit, 5 the consumers' end; 7 SM id; 8 the final segment's main loop end, 9 the
    // finisher's tile counter returned for the final record, 10 the consumers past fix_ready, 11 the
    // consumers' grid_dependency_wait returned, 12 the producer's; 6 the consumers' final fixup's slots
    // summed (before its epilogue), 13 / 14 a fixup by the finisher begun / ended.
    TF_TIMELINE_AT(reinterpret_cast<long long*>(workspace + (size_t)ctas * 2 * MT * L::BN) + blockIdx.x * 16);
    TF_STAMP_IF(threadIdx.x == 0, 0);
    TF_SMID_IF(threadIdx.x == 0, 7);
#define TF_STAMP(i) TF_STAMP_IF(threadIdx.x == 0, i)

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], CW);  // every consumer warp
        }
        for (int i = 0; i < 2; ++i) {
            mbar_init(&seg_full[i], CW);
            mbar_init(&seg_empty[i], 1);
        }
        mbar_init(&fix_ready, 1);
        if constexpr (STAGED) mbar_init(&fix_bar, 1);
        fence_barrier_init();
    }
    __syncthreads();
    launch_dependent_grids();  // the next kernel's CTAs may take SMs as these leave
    TF_STAMP(1);

    // Workspace slots: CTA c's first segment in slot 2 c, its last in 2 c + 1 (middle tiles are whole).
    // A slot is the tile's valid rows, row-major MT x BN fp32: rows past m are neither written nor
    // read (at m = 1 that is 1/8 of an 8-row tile).
    auto slot_ptr = [&](int c, int which) { return workspace + ((size_t)c * 2 + which) * (MT * BN); };
    const Epilogue<T> epi{residual, gated};
    // A finished float4 of split tile `tile`, valid row `row` of float4 `c4` (every lane of the warp calls
    // this, ok telling whether its float4 is one): per-channel scale, bias, the epilogue, store. The float4s of
    // a warp are 32 consecutive ones, so a gated weight's gate float4 c4 (c4 & 2 == 0) finds its up float4
    // c4 + 2, already scaled, at lane ^ 2.
    auto finish = [&](int tile, int e, bool ok, float4 sum) {
        const int row = e / (BN / 4), c4 = e % (BN / 4), col = tile * BN + 4 * c4;  // col < n even where !ok
        float r[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            if constexpr (GROUP == 0) r[q] *= to_float(scales[col + q]);
            if (bias != nullptr) r[q] += to_float(bias[col + q]);
        }
        if (gated) {
            float u[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) u[q] = __shfl_xor_sync(0xffffffffu, r[q], 2);
            if (ok && !(c4 & 2)) {
                typename V2::type* o = reinterpret_cast<typename V2::type*>(out + (size_t)row * (n / 2) + gated_column(col));
                o[0] = V2::make(epi.silu_mul(r[0], u[0]), epi.silu_mul(r[1], u[1]));
                o[1] = V2::make(epi.silu_mul(r[2], u[2]), epi.silu_mul(r[3], u[3]));
            }
        } else if (ok) {
            const size_t at = (size_t)row * n + col;
            typename V2::type* o = reinterpret_cast<typename V2::type*>(out + at);
            o[0] = V2::make(epi.plain(r[0], at), epi.plain(r[1], at + 1));
            o[1] = V2::make(epi.plain(r[2], at + 2), epi.plain(r[3], at + 3));
        }
    };
    // The fixup of a split tile, by `nthr` threads from `tid`: the last arriver sums the slots of the
    // tile's CTAs in CTA order (bitwise deterministic), a float4 of one valid row a thread, FIX
    // slots' loads in flight at once (a few L2 round trips, not one a slot), then scales / bias / store.
    auto fixup = [&](int tile, int tid, int nthr) {
        constexpr int FIX = CPS == 2 && ASYM ? 4 : 8;  // 8 spilled 8-16 B at the 96-register budget with zero points
        const int first_c = cta_of_unit(tile * KS, units, ctas);
        const int nslots = cta_of_unit((tile + 1) * KS - 1, units, ctas) - first_c + 1;
        // Only the first CTA can have started in the tile before (then this is its last segment).
        const bool first_split = unit_begin(first_c, units, ctas) < tile * KS;
        const int total = min(MT, m) * (BN / 4);  // a multiple of 16: a gate float4's partner is in range too
        // tid % 32 is the lane (nthr is whole warps) and every lane runs every round: finish shuffles.
        for (int base = 0; base < total; base += nthr) {
            const int e = base + tid;
            const bool ok = e < total;
            const int row = e / (BN / 4), c4 = e % (BN / 4);
            float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
            for (int c0 = 0; c0 < (ok ? nslots : 0); c0 += FIX) {
                float4 v[FIX];
#pragma unroll
                for (int i = 0; i < FIX; ++i)
                    if (c0 + i < nslots)
                        v[i] = __ldcg(reinterpret_cast<const float4*>(
                                   slot_ptr(first_c + c0 + i, c0 + i == 0 && first_split) + row * BN) + c4);
#pragma unroll
                for (int i = 0; i < FIX; ++i)
                    if (c0 + i < nslots) {
                        sum.x += v[i].x; sum.y += v[i].y; sum.z += v[i].z; sum.w += v[i].w;
                    }
            }
            TF_STAMP_IF(tid == 0 && nthr == CT && base == 0, 6);
            finish(tile, e, ok, sum);
        }
    };

    // The same fixup by all consumer threads at the end of the launch, staged through shared memory
    // (STAGED builds): thread 0 bulk-copies as many slots as fit (a slot's valid rows are contiguous)
    // into the idle ring and the dynamic bytes past `red`, then every thread sums its float4s from
    // shared memory in the same CTA order. Through registers that tail takes one L2 round trip per
    // element a thread and batch of FIX slots (8 at m = 8 on long k: 4 elements, ~9 slots); this
    // takes one per batch (one where all slots fit). A separate build: with this code in the kernel
    // ptxas schedules the main loop differently, 1.5-3% slower where the fixup is short.
    u32 fix_phase = 0;
    auto fixup_staged = [&](int tile) {
        constexpr int EMAX = (MT * (BN / 4) + CT - 1) / CT;  // float4s a thread
        static_assert(STAGES * L::STAGE >= MT * BN * 4, "the ring holds a whole slot: every batch makes progress");
        const int first_c = cta_of_unit(tile * KS, units, ctas);
        const int nslots = cta_of_unit((tile + 1) * KS - 1, units, ctas) - first_c + 1;
        const bool first_split = unit_begin(first_c, units, ctas) < tile * KS;
        const int total = min(MT, m) * (BN / 4), slot_bytes = total * 16;
        // Two areas: the ring, and the launch's dynamic bytes past the k reduction's (16-aligned).
        unsigned char* const area_b = reinterpret_cast<unsigned char*>(red) + (L::RED + 15) / 16 * 16;
        const int cap_a = STAGES * L::STAGE / slot_bytes;
        const int cap_b = max(0, (int)(smem_raw + dynamic_smem_size() - area_b)) / slot_bytes;
        auto staged_slot = [&](int i) { return i < cap_a ? smem + i * slot_bytes : area_b + (i - cap_a) * slot_bytes; };
        float4 sum[EMAX];
#pragma unroll
        for (int j = 0; j < EMAX; ++j) sum[j] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
        for (int c0 = 0; c0 < nslots; c0 += cap_a + cap_b) {
            const int cnt = min(cap_a + cap_b, nslots - c0);
            if (c0 > 0) {  // every thread's reads of the last batch before the copies overwrite it
                fence_proxy_async_smem();
                named_barrier_sync(1, CT);
            }
            if (threadIdx.x == 0) {
                fence_proxy_async_global();  // the slots' stores, acquired via the tile counter, before the copies read them
                mbar_arrive_expect_tx(&fix_bar, cnt * slot_bytes);
                for (int i = 0; i < cnt; ++i)
                    bulk_load(staged_slot(i), slot_ptr(first_c + c0 + i, c0 + i == 0 && first_split), slot_bytes, &fix_bar);
            }
            mbar_wait(&fix_bar, fix_phase);
            fix_phase ^= 1;
#pragma unroll
            for (int j = 0; j < EMAX; ++j) {
                const int e = threadIdx.x + j * CT;
                if (e < total)
#pragma unroll 1
                    for (int i = 0; i < cnt; ++i) {
                        const float4 v = reinterpret_cast<const float4*>(staged_slot(i))[e];
                        sum[j].x += v.x; sum[j].y += v.y; sum[j].z += v.z; sum[j].w += v.w;
                    }
            }
        }
#pragma unroll
        for (int j = 0; j < EMAX; ++j) {
            const int e = threadIdx.x + j * CT;  // lane bits = the lane's: finish may shuffle
            finish(tile, e, e < total, sum[j]);
        }
        // The next staged fixup (the final tile after a deferred one) overwrites these bytes.
        fence_proxy_async_smem();
        named_barrier_sync(1, CT);
    };

    const size_t strip_uint4 = (size_t)(k / 16) * 32;  // one strip's whole k run
    if (warp == CW + 1) {
        // The finisher: takes each finished partial segment off the consumers' hands (the fence and
        // the tile counter's round trips, which would otherwise stall the consumers while the ring
        // sits full) and, for a tile whose last segment it sees, runs the fixup. For the consumers'
        // final segment it does not: they are idle by then, so they get the tile back and run the
        // fixup with all their threads (the one fixup on the kernel's critical path).
        if (csplit > 1) return;  // the cluster split's partials meet in shared memory, not at counters
        grid_dependency_wait();  // before the counters, which the kernel ahead may still use
        int hs = 0;
        u32 hph = 0;
        int deferred = -1;
        while (true) {
            mbar_wait(&seg_full[hs], hph);
            const int2 rec = s_seg[hs];
            __syncwarp();
            if (lane == 0) mbar_arrive(&seg_empty[hs]);
            if (++hs == 2) { hs = 0; hph ^= 1; }
            bool last = false;
            if (rec.x >= 0) {
                const int tile = rec.x;
                int is_last = 0;
                if (lane == 0) {
                    // The consumers' slot stores reached this lane through seg_full's release /
                    // acquire: the atomic's release publishes them (w4a16/fixup.cuh).
                    const int span = cta_of_unit((tile + 1) * KS - 1, units, ctas) - cta_of_unit(tile * KS, units, ctas);
                    is_last = fixup_arrive(counters + tile, span + 1);
                    TF_STAMP_IF(rec.y, 9);
                }
                last = __shfl_sync(0xffffffffu, is_last, 0) != 0;
                // A first segment that covers most of the CTA's range ends about when the other CTAs
                // of its tile do, so it is often the last arriver, and the consumers are nearly done
                // too: its 32-lane fixup (one L2 round trip per 32 float4, ~10 us at m = 8-16) would
                // then hold up their final reply. Such a tile (less than a quarter of the range left
                // after it) goes to the consumers instead, who run it at the end with all their
                // threads. (k 8192 x n 10240, m = 16: CTA 141's range is 18 units of one tile and 1
                // of the next; in up to 40% of the launches its finisher was last on the first and
                // the launch took 35 us instead of 24.)
                if (last && !rec.y) {
                    if (4 * (u1 - (tile + 1) * KS) < u1 - u0) {
                        deferred = tile;
                    } else {
                        __syncwarp();  // orders the lanes' slot loads after lane 0's acquire
                        TF_STAMP_IF(lane == 0, 13);
                        fixup(tile, lane, 32);
                        TF_STAMP_IF(lane == 0, 14);
                        __syncwarp();
                        if (lane == 0) fixup_reset(counters + tile);
                    }
                }
            }
            if (rec.y) {  // the consumers' final record: tell them whether the fixup is theirs
                if (lane == 0) {
                    s_fix_tile = last ? rec.x : -1;
                    s_defer_tile = deferred;
                    mbar_arrive(&fix_ready);
                }
                break;
            }
        }
        TF_STAMP_IF(lane == 0, 4);
        return;
    }
    if (warp == CW) {  // producer
        if (lane == 0) {
            tma_prefetch_desc(&tma_x);
            const int half_ks = k % kBK ? KS - 1 : -1;  // the half stage of every tile, or none
            constexpr int HALF_ROWS = L::S_ROWS / 2;    // scale rows of a half stage (group 128: none)
            // Unit (tile, ks)'s packed weights, scales and zero points into stage st.
            auto issue_weights = [&](unsigned char* st, u64* bar, int tile, int ks) {
                const bool half = ks == half_ks;
                const uint4* src = w + (size_t)tile * NS * strip_uint4 + (size_t)ks * 8 * 32;
                if (!half) {
#pragma unroll
                    for (int i = 0; i < NS; ++i)
                        bulk_load(st + L::X_BYTES + i * L::W_STRIP, src + i * strip_uint4, L::W_STRIP, bar);
                } else {
#pragma unroll
                    for (int i = 0; i < NS; ++i)
#pragma unroll
                        for (int h = 0; h < 2; ++h)
                            bulk_load(st + L::X_BYTES + i * L::W_STRIP + h * (L::W_STRIP / 2), src + i * strip_uint4,
                                      L::W_STRIP / 2, bar);
                }
                if constexpr (GROUP > 0) {
#pragma unroll
                    for (int r = 0; r < L::S_ROWS; ++r) {
                        const int sr = HALF_ROWS > 0 && half && r >= HALF_ROWS ? r - HALF_ROWS : r;
                        bulk_load(st + L::X_BYTES + L::W_BYTES + r * BN * 2,
                                  scales + (size_t)(ks * kBK / GROUP + sr) * n + tile * BN, BN * 2, bar);
                    }
                }
                if constexpr (ASYM) {
#pragma unroll
                    for (int r = 0; r < L::Z_ROWS; ++r) {
                        const int sr = GROUP > 0 && HALF_ROWS > 0 && half && r >= HALF_ROWS ? r - HALF_ROWS : r;
                        const int zrow = GROUP > 0 ? ks * kBK / GROUP + sr : 0;
                        bulk_load(st + L::X_BYTES + L::W_BYTES + L::S_BYTES + r * BN * 2,
                                  zeros + (size_t)zrow * n + tile * BN, BN * 2, bar);
                    }
                }
            };
            // The first kPreWait stages' weights go out before grid_dependency_wait, each stage's byte
            // count (x included) announced first; x, which the kernel ahead may still be writing, and
            // the rest of the ring after it. Every CTA's early bytes land while the kernel ahead
            // finishes, whose last round trips (its fixup, a norm) queue behind them: two stages of
            // three at m = 1 made a decode step 0.8-1.0 us a layer faster than the whole ring, one
            // stage 0.4-0.7, none 1.5 slower (H200, docs/e2e.md); even at m = 16.
            constexpr int kPreWait = 2;  // every configuration has 2 stages or more
            // A cluster split's narrower tiles: as many stages as make the 32 KB of two 256-column stages.
            const int pre = csplit > 1 ? max(kPreWait, 2 * 8 * 512 * 4 / L::W_BYTES) : kPreWait;
            const int ring = min(min(u1 - u0, pre), STAGES);
            {
                int tile = u0 / KS, ks = u0 - tile * KS;
                for (int i = 0; i < ring; ++i) {
                    mbar_arrive_expect_tx(&full[i], L::TX);  // a half stage lands as many bytes (see the header)
                    issue_weights(smem + i * L::STAGE, &full[i], tile, ks);
                    if (++ks == KS) { ks = 0; ++tile; }
                }
            }
            grid_dependency_wait();
            TF_STAMP_IF(true, 12);
            int s = 0;
            u32 phase = 0;
            int tile = u0 / KS, ks = u0 - tile * KS;
            for (int u = u0; u < u1; ++u) {
                unsigned char* st = smem + s * L::STAGE;
                if (u - u0 >= ring) {
                    if (u - u0 >= STAGES) mbar_wait(&empty[s], phase ^ 1);  // a stage's first use: free
                    mbar_arrive_expect_tx(&full[s], L::TX);
                    issue_weights(st, &full[s], tile, ks);
                }
                tma_load_2d(st, &tma_x, ks * kBK, 0, &full[s]);
                tma_load_2d(st + L::X_HALF, &tma_x, ks * kBK + 64, 0, &full[s]);  // half stage: all zeros
                if (++ks == KS) { ks = 0; ++tile; }
                if (++s == STAGES) { s = 0; phase ^= 1; }
            }
        }
        return;
    }

    // ---- consumers
    grid_dependency_wait();  // before y, the workspace and the counters (they read x only once it lands)
    TF_STAMP(11);
    const int si = warp / WK, kw = warp % WK;
    const int g = lane >> 2, t = lane & 3;
    const typename DQ::Zero zsym = DQ::zero(8.f);
    // ldmatrix row addresses of x: lane l gives row (l & 7) + 8 (l >> 4) of the 16-row pair and
    // 16-byte chunk c0 + ((l >> 3) & 1) (k 0-7 / 8-15 of the k16 step); 128-byte swizzle: chunk c
    // of row r sits at c ^ (r & 7).
    const int x_row = (lane & 7) + ((lane >> 4) << 3), x_hi = (lane >> 3) & 1;

    float acc[NB][4][4];
    int s = 0;
    u32 phase = 0;
    int hs = 0;
    u32 hph = 0;
    bool handed_final = false;
    // Hand a record to the finisher (every consumer warp arrives; warp 0 writes it).
    auto hand_off = [&](int tile, int final) {
        __syncwarp();  // this warp's slot stores come before its arrive (release)
        if (lane == 0) {
            mbar_wait(&seg_empty[hs], hph ^ 1);
            if (warp == 0) s_seg[hs] = make_int2(tile, final);
            mbar_arrive(&seg_full[hs]);
        }
        __syncwarp();
        if (++hs == 2) { hs = 0; hph ^= 1; }
        handed_final = final != 0;
    };
    // One segment (this CTA's units within one tile) per round.
    int u = u0;
    while (u < u1) {
        const int tile = u / KS;
        const int seg_begin = u, seg_end = min(u1, (tile + 1) * KS);
        const bool final = seg_end == u1;
#pragma unroll
        for (int a = 0; a < NB; ++a)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[a][j][c] = 0.f;

        for (; u < seg_end; ++u) {
            mbar_wait(&full[s], phase);
            TF_STAMP_IF(threadIdx.x == 0 && u == u0, 2);
            const unsigned char* st = smem + s * L::STAGE;
            const uint4* wv = reinterpret_cast<const uint4*>(st + L::X_BYTES + si * L::W_STRIP) + lane;
            uint4 words[RPW];
#pragma unroll
            for (int i = 0; i < RPW; ++i) words[i] = wv[(kw * RPW + i) * 32];
            typename V2::type sc2[8];
            typename DQ::Zero zs[8];
            // This lane's scales / zero points of subtiles 0..7 (columns 8 sub + g of the strip sit
            // at 8 g + sub, ops/w4a16/layout.py): one 16-byte load per group row.
            auto load_group = [&](int row) {
                const int offset = (row * BN + si * 64 + g * 8) * 2;
                if constexpr (GROUP > 0) {
                    const uint4 v = *reinterpret_cast<const uint4*>(st + L::X_BYTES + L::W_BYTES + offset);
                    const T* p = reinterpret_cast<const T*>(&v);
#pragma unroll
                    for (int j = 0; j < 8; ++j) sc2[j] = V2::dup(p[j]);
                }
                if constexpr (ASYM) {
                    const uint4 v = *reinterpret_cast<const uint4*>(st + L::X_BYTES + L::W_BYTES + L::S_BYTES + offset);
                    const T* p = reinterpret_cast<const T*>(&v);
#pragma unroll
                    for (int j = 0; j < 8; ++j) zs[j] = DQ::zero(to_float(p[j]));
                }
            };
            constexpr int ROWS_PER_GROUP = GROUP > 0 && GROUP < kBK ? GROUP / 16 : 8;
            // This x fragment pair of k16 row r16: 8-row blocks 0..NB-1 (ldmatrix x2, or x4 for two blocks).
            auto load_x = [&](int r16, u32 (&xb)[NB][2]) {
                const unsigned char* xh = st + (r16 >> 2) * L::X_HALF;
                const int chunk = ((r16 & 3) << 1) + x_hi;
                if constexpr (NB == 1) {
                    ldmatrix_x2(xb[0], xh + x_row * 128 + ((chunk ^ (x_row & 7)) << 4));
                } else {
#pragma unroll
                    for (int p = 0; p < NB / 2; ++p) {
                        const int row = 16 * p + x_row;
                        u32 r[4];
                        ldmatrix_x4(r, xh + row * 128 + ((chunk ^ (row & 7)) << 4));
                        xb[2 * p][0] = r[0]; xb[2 * p][1] = r[1];
                        xb[2 * p + 1][0] = r[2]; xb[2 * p + 1][1] = r[3];
                    }
                }
            };
            // When the warp's RPW k16 rows share one group, the scales multiply fp32 partial sums
            // instead of the fragments. Per subtile pair j the rows accumulate unscaled (q - z) x
            // products (the first mma adds to zero), then one FFMA per accumulator applies the
            // scale: NB x 4 / RPW FFMA a word instead of 4 HMUL2 (m <= 8: 1 instead of 4; m <= 16
            // with two warps a strip: 2), and no fp16 rounding of q x s. j is the outer loop so only
            // NB partials (4 registers each) are live at a time. It needs >= 128 registers a thread
            // and at most two 8-row blocks: at 96 (5 warps on one SM sub-partition's 64 KB register
            // file) the x fragments of all RPW rows spill, and so do four blocks' at 168.
            constexpr bool kAccScale = GROUP > 0 && NB <= 2 && GROUP >= 16 * RPW && kRegBudget >= 128;
            if constexpr (kAccScale) {
                float scf[8];
                {
                    const int offset = (((kw * RPW) / ROWS_PER_GROUP) * BN + si * 64 + g * 8) * 2;
                    const uint4 v = *reinterpret_cast<const uint4*>(st + L::X_BYTES + L::W_BYTES + offset);
                    const T* p = reinterpret_cast<const T*>(&v);
#pragma unroll
                    for (int j = 0; j < 8; ++j) scf[j] = to_float(p[j]);
                }
                if constexpr (ASYM) load_group((kw * RPW) / ROWS_PER_GROUP);
                u32 xb[RPW][NB][2];
#pragma unroll
                for (int i = 0; i < RPW; ++i) load_x(kw * RPW + i, xb[i]);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float part[NB][4];
#pragma unroll
                    for (int i = 0; i < RPW; ++i) {
                        const u32 wj = j == 0 ? words[i].x : j == 1 ? words[i].y : j == 2 ? words[i].z : words[i].w;
                        u32 f[4];
                        DQ::run(wj, ASYM ? zs[2 * j] : zsym, ASYM ? zs[2 * j + 1] : zsym, f);
                        const u32 a[4] = {f[0], f[2], f[1], f[3]};
#pragma unroll
                        for (int nb = 0; nb < NB; ++nb) {
                            if (i == 0) Mma<T>::run_c0(part[nb], a, xb[i][nb][0], xb[i][nb][1]);
                            else Mma<T>::run(part[nb], a, xb[i][nb][0], xb[i][nb][1]);
                        }
                    }
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb)
#pragma unroll
                        for (int c = 0; c < 4; ++c)  // c0, c1: column g of subtile pair j; c2, c3: g + 8
                            acc[nb][j][c] = fmaf(part[nb][c], scf[2 * j + (c >> 1)], acc[nb][j][c]);
                }
            }
#pragma unroll
            for (int i = 0; i < (kAccScale ? 0 : RPW); ++i) {
                const int r16 = kw * RPW + i;  // k16 row within the stage
                if constexpr (GROUP > 0 || ASYM) {
                    if (i == 0 || r16 % ROWS_PER_GROUP == 0) load_group(GROUP > 0 && GROUP < kBK ? r16 / ROWS_PER_GROUP : 0);
                }
                u32 xb[NB][2];
                load_x(r16, xb);
                const u32 wd[4] = {words[i].x, words[i].y, words[i].z, words[i].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 f[4];
                    DQ::run(wd[j], ASYM ? zs[2 * j] : zsym, ASYM ? zs[2 * j + 1] : zsym, f);
                    if constexpr (GROUP > 0) {
#pragma unroll
                        for (int p = 0; p < 4; ++p) {
                            typename V2::type v = *reinterpret_cast<typename V2::type*>(&f[p]);
                            v = __hmul2(v, sc2[2 * j + (p >> 1)]);
                            f[p] = *reinterpret_cast<u32*>(&v);
                        }
                    }
                    const u32 a[4] = {f[0], f[2], f[1], f[3]};  // rows g, g+8 x k lo, hi
#pragma unroll
                    for (int nb = 0; nb < NB; ++nb) Mma<T>::run(acc[nb][j], a, xb[nb][0], xb[nb][1]);
                }
            }
            // The refill is an async-proxy write (TMA / bulk copy) after these generic-proxy reads
            // (LDS, ldmatrix): the mbarrier's release alone does not order the two proxies, and
            // ptxas issues the arrive while the last ldmatrix is still in flight (a measured race:
            // one warp's strip picked up the next round's data). The proxy fence waits for them.
            fence_proxy_async_smem();
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[s]);
            if (++s == STAGES) { s = 0; phase ^= 1; }
        }
        if (final) TF_STAMP(8);

        // ---- end of this CTA's segment of `tile`: sum the WK warps of each strip (warp kw = 0 keeps it)
        if constexpr (WK > 1) {
            named_barrier_sync(1, CT);  // the previous segment's readers are done with `red`
            if (kw > 0) {
                float* dst = red + ((kw - 1) * NS + si) * (ACC * 32);
#pragma unroll
                for (int a = 0; a < NB; ++a)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) dst[((a * 4 + j) * 4 + c) * 32 + lane] = acc[a][j][c];
            }
            named_barrier_sync(1, CT);
            if (kw == 0) {
#pragma unroll 1
                for (int w2 = 1; w2 < WK; ++w2) {
                    const float* src = red + ((w2 - 1) * NS + si) * (ACC * 32);
#pragma unroll
                    for (int a = 0; a < NB; ++a)
#pragma unroll
                        for (int j = 0; j < 4; ++j)
#pragma unroll
                            for (int c = 0; c < 4; ++c) acc[a][j][c] += src[((a * 4 + j) * 4 + c) * 32 + lane];
                }
            }
        }

        const bool whole = seg_begin == tile * KS && seg_end == (tile + 1) * KS;
        if (csplit > 1) {  // the cluster split: this CTA's one segment is slice `rank` of `tile` (the header)
            constexpr int FROW = BN + 4;  // floats a staged row: rows 2 t apart land 8 banks apart
            static_assert(STAGES * L::STAGE >= MT * FROW * 4, "the partial tile fits in the drained ring");
            float* part = reinterpret_cast<float*>(smem);
            named_barrier_sync(1, CT);  // every consumer warp is done reading the ring
            if (kw == 0) {
#pragma unroll
                for (int a = 0; a < NB; ++a)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            const int row = 8 * a + 2 * t + (c & 1);
                            if (row < m) part[row * FROW + si * 64 + 16 * j + g + 8 * (c >> 1)] = acc[a][j][c];
                        }
            }
            cluster_sync();  // every rank's partial staged (the producer and finisher warps have exited: arrived)
            TF_STAMP(6);
            // Rank r's share: whole quads of float4s (a gate float4 and its up float4 two on stay in one
            // warp, lane ^ 2, as finish needs), each summed over the ranks in order, FIX loads in flight.
            constexpr int FIX = 8;
            const int rank = (int)cluster_ctarank(), total = min(MT, m) * (BN / 4), quads = total / 4;
            const int begin = rank * quads / csplit * 4, end = (rank + 1) * quads / csplit * 4;
            const u32 local = smem_addr(part);
            for (int base = begin; base < end; base += CT) {  // every lane runs every round: finish shuffles
                const int e = base + (int)threadIdx.x;
                const bool ok = e < end;
                const u32 off = (u32)(((ok ? e : begin) / (BN / 4)) * FROW + ((ok ? e : begin) % (BN / 4)) * 4) * 4;
                float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 1
                for (int r0 = 0; r0 < (ok ? csplit : 0); r0 += FIX) {
                    float4 v[FIX];
#pragma unroll
                    for (int i = 0; i < FIX; ++i)
                        if (r0 + i < csplit) v[i] = ld_shared_cluster_f4(mapa_shared(local + off, r0 + i));
#pragma unroll
                    for (int i = 0; i < FIX; ++i)
                        if (r0 + i < csplit) {
                            sum.x += v[i].x; sum.y += v[i].y; sum.z += v[i].z; sum.w += v[i].w;
                        }
                }
                finish(tile, e, ok, sum);
            }
            TF_STAMP(5);
            cluster_sync();  // no CTA leaves while a peer may still read its shared memory
            return;
        }
        if (!whole) {
            if (kw == 0) {
                float* dst = slot_ptr(b, seg_begin == u0 ? 0 : 1) + si * 64;
#pragma unroll
                for (int a = 0; a < NB; ++a)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            const int row = 8 * a + 2 * t + (c & 1);
                            if (row < m) __stcg(dst + row * BN + 16 * j + g + 8 * (c >> 1), acc[a][j][c]);
                        }
            }
            hand_off(tile, final);
            continue;
        }
        // Epilogue: acc[a][j][c] is y[8 a + 2 t + (c & 1), column 16 j + g + 8 (c >> 1) of the strip]:
        // columns col and col + 8 of a row (a gate column and its up column, gated).
        if (kw == 0) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int col = tile * BN + si * 64 + 16 * j + g;
                float sc[2] = {1.f, 1.f}, bi[2] = {0.f, 0.f};
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if constexpr (GROUP == 0) sc[h] = to_float(scales[col + 8 * h]);
                    if (bias != nullptr) bi[h] = to_float(bias[col + 8 * h]);
                }
#pragma unroll
                for (int a = 0; a < NB; ++a)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int row = 8 * a + 2 * t + e;
                        if (row >= m) continue;
                        const float v0 = acc[a][j][e] * sc[0] + bi[0], v1 = acc[a][j][2 + e] * sc[1] + bi[1];
                        if (gated) {
                            out[(size_t)row * (n / 2) + gated_column(col)] = V2::one(epi.silu_mul(v0, v1));
                        } else {
                            const size_t at = (size_t)row * n + col;
                            out[at] = V2::one(epi.plain(v0, at));
                            out[at + 8] = V2::one(epi.plain(v1, at + 8));
                        }
                    }
            }
        }
        if (final) hand_off(-1, 1);  // the final segment was whole: the finisher still needs the end
    }
    if (!handed_final) hand_off(-1, 1);  // no units at all (the launcher never makes such a CTA)
    TF_STAMP(3);
    // The fixup of the tile the CTA's final segment completed, with every consumer thread.
    mbar_wait(&fix_ready, 0);
    TF_STAMP(10);
    // The tile the finisher left to them, if any, then the final segment's. (One shared copy of the
    // fixup code in a two-pass loop measured 1-3% slower on the main loop than these two.)
    const int fix_tile = s_fix_tile, defer_tile = s_defer_tile;
    // fix_ready's acquire follows the finisher's acquire of the tile counter: the slots are visible.
    if (defer_tile >= 0) {
        if constexpr (STAGED) fixup_staged(defer_tile);
        else fixup(defer_tile, threadIdx.x, CT);
        if (threadIdx.x == 0) fixup_reset(counters + defer_tile);
    }
    if (fix_tile >= 0) {
        if constexpr (STAGED) fixup_staged(fix_tile);
        else fixup(fix_tile, threadIdx.x, CT);
        if (threadIdx.x == 0) fixup_reset(counters + fix_tile);
    }
    TF_STAMP(5);
#undef TF_STAMP
}
