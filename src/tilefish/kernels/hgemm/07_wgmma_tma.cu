// HGEMM step 7 (Hopper, sm_90a): TMA + mbarrier pipeline, wgmma from shared memory, warp
// specialization, persistent grid.
// C = A @ B, A [M, K] row-major, B [K, N] row-major (B_NK = false) or B [N, K] row-major
// (B_NK = true, nn.Linear weights), T = __half or __nv_bfloat16, fp32 accumulation, C in T.
//
// Why a new kernel: steps 1-6 issue mma.sync (16 x 8 x 16 per warp instruction) and feed it with
// ldmatrix; on Hopper that path tops out near 65% of the tensor cores. wgmma is issued by a whole
// warpgroup (4 warps) for a 64 x BN x 16 product and reads both operands straight from shared
// memory through descriptors, so operand traffic never touches registers.
//
// Roles (BM/64 + 1 warpgroups per block, one block per SM):
//   warpgroup 0   the producer. It gives registers back (setmaxnreg.dec) and one thread issues
//                 TMA copies: per k stage one box of A (BM x 64) and B (BN x 64 K-major, or
//                 BN/64 boxes of 64 x 64 N-major), landing 128-byte-swizzled in a STAGES-deep
//                 ring; each stage's full barrier counts the bytes in.
//   warpgroups 1+ the consumers. They take the registers (setmaxnreg.inc); consumer c owns rows
//                 64c .. 64c+63 of the block tile and keeps a 64 x BN fp32 accumulator (BN/2
//                 registers per thread). Per stage: wait full[s], 4 wgmma k16 steps, wait for
//                 them, arrive on empty[s] so the producer may refill it.
// Pipelining inside a consumer: the wgmmas of stage s are left running (wait_group 1) while the
// consumer waits for stage s+1 and issues its wgmmas; stage s is handed back only once they finish.
// Persistent: one block per SM; blocks walk the output tiles in the grouped (GROUP_M) order of
// step 6, striding by the grid. The producer runs ahead into the next tile while the consumers
// store the previous one, so the loads of tile i+1 hide under the epilogue of tile i.
// Clusters (CLUSTER = 2): two CTAs on neighbouring SMs take vertically adjacent tiles (same n0),
// so they need the same B box: each loads half of it and TMA multicasts that half into both
// CTAs' smem. L2 -> SM traffic per tile drops from (BM + BN) x 64 to (BM + BN/2) x 64 elements per
// stage, which matters because at ~700 TFLOP/s the operand stream is ~8 TB/s out of L2. A stage
// may then be refilled only when the consumers of *both* CTAs are done with it, so consumers
// arrive on the empty barrier of every CTA in the cluster.
// Edges: TMA zero-fills boxes past M, N or K, so only the stores are predicated (a cluster's
// second tile may lie wholly below M: it loads zeros, multicasts its half of B, stores nothing).
// Schedules (PINGPONG):
//   0 cooperative: both consumers share each BM x BN tile (64 rows each); their tensor work pauses
//     while they store it.
//   1 ping-pong: each consumer owns whole tiles (BM rows: BM / 64 m64 wgmmas per k16 step), the
//     two taking alternate tiles of the CTA's sequence. The ring holds the tiles' stages in that
//     sequence, so one consumer's epilogue runs while the other's tile streams through the tensor
//     cores. Tile j of the CTA owns ring positions j KT .. j KT + KT - 1.
// Epilogues (TMA_STORE):
//   0 each thread stores its fragments straight to global memory (4-byte stores, 16 bytes a row
//     per warp instruction: half-sector writes, 64 store instructions a thread for 64 x 256).
//   1 the fragments go through shared memory: per 64 x 64 box, stmatrix into a 128-byte-swizzled
//     staging buffer (4 instructions a thread), then one thread hands the box to the TMA unit and
//     the consumer moves on. Two 8 KB buffers a consumer, so writing box i overlaps the TMA's read
//     of box i - 1; the TMA clips rows and columns past M and N. Needs N % 8 == 0 (16-byte rows of
//     C for the tensor map); the launcher falls back to TMA_STORE = 0 otherwise. Cooperative
//     consumers pack the tile to 16 bits and store it during the next tile's first stage of
//     wgmmas (a deferred epilogue), so their tensor-core idle time per tile is the pack only.
#include "common/wgmma.cuh"
#include "hgemm/epilogue.cuh"

template <typename T, bool B_NK, int BM, int BN, int STAGES, int GROUP_M, int CLUSTER, int PINGPONG, int TMA_STORE>
__global__ void __launch_bounds__(((PINGPONG ? 2 : BM / 64) + 1) * 128, 1)
hgemm_wgmma(const __grid_constant__ tf::TmaDesc tma_a, const __grid_constant__ tf::TmaDesc tma_b,
            const __grid_constant__ tf::TmaDesc tma_c, T* __restrict__ C, int M, int N, int K) {
    using tf::u32;
    using tf::u64;
    constexpr int BK = 64;                        // one 128-byte swizzle row of 16-bit elements
    constexpr int CONSUMERS = PINGPONG ? 2 : BM / 64;
    constexpr int MI = PINGPONG ? BM / 64 : 1;          // m64 wgmmas per k16 step of one consumer
    constexpr int READERS = PINGPONG ? 1 : CONSUMERS;   // consumer warpgroups reading each stage
    constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2;
    static_assert(BM % 64 == 0 && (BM / 64 == 1 || BM / 64 == 2), "BM = 64 or 128");
    static_assert(PINGPONG == 0 || PINGPONG == 1, "PINGPONG: 0 cooperative, 1 ping-pong");
    static_assert(MI * BN / 2 <= 128, "ping-pong: a consumer holds the whole tile (<= 128 accumulators a thread)");
    static_assert(BN == 64 || BN == 128 || BN == 256, "BN = 64, 128 or 256 (wgmma n, TMA box <= 256)");
    static_assert(STAGES >= 2, "at least double buffering");
    static_assert(CLUSTER == 1 || CLUSTER == 2, "clusters of 1 or 2 CTAs along M");
    static_assert(B_NK || (BN / 64) % CLUSTER == 0, "B [K, N]: whole 64-wide boxes per CTA");
    static_assert(TMA_STORE == 0 || TMA_STORE == 1, "TMA_STORE: 0 direct stores, 1 smem + TMA store");
    constexpr int STAGING = 2 * 64 * 64 * 2;  // per consumer: two 64 x 64 boxes of C
    // Register split: 128 * PRODUCER_REGS + CONSUMERS * 128 * CONSUMER_REGS <= 64K.
    constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = CONSUMERS == 1 ? 256 : 232;

    extern __shared__ unsigned char smem_raw[];
    // The swizzle atoms (8 rows x 128 B) must sit on 1024-byte boundaries: align the shared-window
    // address by hand (the launcher reserves 1 KB of slack). Every CTA gets the same offset, so
    // multicast destinations line up.
    unsigned char* smem = smem_raw + ((1024 - (tf::smem_addr(smem_raw) & 1023)) & 1023);
    unsigned char* sA = smem;
    unsigned char* sB = smem + STAGES * A_BYTES;
    unsigned char* staging = sB + STAGES * B_BYTES;  // TMA_STORE: CONSUMERS x STAGING bytes
    u64* full = reinterpret_cast<u64*>(staging + (TMA_STORE ? CONSUMERS * STAGING : 0));
    u64* empty = full + STAGES;
    u64* order = empty + STAGES;  // ping-pong: order[c] completes when consumer c's tile has all its stages

    const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const int cl_tiles_m = (tiles_m + CLUSTER - 1) / CLUSTER;  // tile rows in units of clusters
    const int cl_tiles = cl_tiles_m * tiles_n;
    const int KT = (K + BK - 1) / BK;
    const int wg = threadIdx.x / 128;
    const u32 rank = CLUSTER > 1 ? tf::cluster_ctarank() : 0;
    const int cluster_id = blockIdx.x / CLUSTER, clusters = gridDim.x / CLUSTER;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            tf::mbar_init(&full[s], 1);                         // the producer's arrive.expect_tx
            tf::mbar_init(&empty[s], READERS * 4 * CLUSTER);  // every reading consumer warp of the cluster
        }
        tf::mbar_init(&order[0], 1);
        tf::mbar_init(&order[1], 1);
        tf::fence_barrier_init();
    }
    if constexpr (CLUSTER > 1) tf::cluster_sync(); else __syncthreads();

    // Grouped order over cluster tiles (CLUSTER x 1 tiles): GROUP_M cluster rows per group,
    // column-major inside a group; this CTA takes row `rank` of its cluster tile.
    auto tile_origin = [&](int t, int& m0, int& n0) {
        const int per_group = GROUP_M * tiles_n;
        const int group = t / per_group, first_m = group * GROUP_M;
        const int rows = min(cl_tiles_m - first_m, GROUP_M);
        const int in_group = t - group * per_group;
        m0 = ((first_m + in_group % rows) * CLUSTER + (int)rank) * BM;
        n0 = (in_group / rows) * BN;
    };

    if (wg == 0) {
        tf::setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            tf::tma_prefetch_desc(&tma_a);
            tf::tma_prefetch_desc(&tma_b);
            int s = 0;
            u32 phase = 0;
            for (int t = cluster_id; t < cl_tiles; t += clusters) {
                int m0, n0;
                tile_origin(t, m0, n0);
                for (int kt = 0; kt < KT; ++kt) {
                    // Parity trick: in round 0 the wait is for the phase "before" the first one,
                    // which counts as complete, so the ring starts out free.
                    tf::mbar_wait(&empty[s], phase ^ 1);
                    tf::mbar_arrive_expect_tx(&full[s], A_BYTES + B_BYTES);  // all of B lands here
                    unsigned char* a_dst = sA + s * A_BYTES;
                    unsigned char* b_dst = sB + s * B_BYTES;
                    tf::tma_load_2d(a_dst, &tma_a, kt * BK, m0, &full[s]);
                    if constexpr (CLUSTER == 1) {
                        if constexpr (B_NK) {
                            tf::tma_load_2d(b_dst, &tma_b, kt * BK, n0, &full[s]);
                        } else {
#pragma unroll
                            for (int j = 0; j < BN / 64; ++j)  // 64 n x 64 k boxes, N-major
                                tf::tma_load_2d(b_dst + j * 64 * BK * 2, &tma_b, n0 + 64 * j, kt * BK, &full[s]);
                        }
                    } else {
                        constexpr unsigned short ALL = (1u << CLUSTER) - 1;
                        if constexpr (B_NK) {  // rows [rank * BN/CLUSTER, ...) of the K-major box
                            constexpr int PART = BN / CLUSTER;
                            tf::tma_load_2d_multicast(b_dst + rank * PART * BK * 2, &tma_b, kt * BK,
                                                      n0 + (int)rank * PART, &full[s], ALL);
                        } else {
                            constexpr int BOXES = BN / 64 / CLUSTER;
#pragma unroll
                            for (int i = 0; i < BOXES; ++i) {
                                const int j = (int)rank * BOXES + i;
                                tf::tma_load_2d_multicast(b_dst + j * 64 * BK * 2, &tma_b, n0 + 64 * j, kt * BK,
                                                          &full[s], ALL);
                            }
                        }
                    }
                    if (++s == STAGES) { s = 0; phase ^= 1; }
                }
            }
        }
    } else {
        tf::setmaxnreg_inc<CONSUMER_REGS>();
        const int c = wg - 1;
        const int lane = threadIdx.x & 31, warp_in_wg = (threadIdx.x / 32) & 3;
        float acc[MI][BN / 2];
        // The TMA-store epilogue works from the accumulators packed to 16 bits. Cooperative
        // consumers (DEFER) keep them packed and store them while the next tile's first stage of
        // wgmmas runs: both consumers stop issuing wgmma for their epilogue in this schedule, and
        // storing takes ~2% of a 4096^3 tile's time (128 + 64 registers fit in the 232 a consumer has).
        constexpr bool DEFER = TMA_STORE && !PINGPONG;
        const u64 desc_a0 = tf::wgmma_desc_sw128(sA + (PINGPONG ? 0 : c * 64 * BK * 2), 16, 1024);
        const u64 desc_b0 = B_NK ? tf::wgmma_desc_sw128(sB, 16, 1024) : tf::wgmma_desc_sw128(sB, 64 * BK * 2, 1024);
        u32 packed[MI][BN / 4];
        int pend_m0 = -1, pend_n0 = 0;
        auto store_packed = [&](int m0, int n0) {
            // Box i (64 rows of row block mi x 64 columns) goes to buffer i % 2. Before writing a
            // buffer, its previous box (the one before last, possibly of the previous tile) must
            // have been read by the TMA unit: at most one group may still be reading.
            unsigned char* stage_c = staging + c * STAGING;
            const bool issuer = (threadIdx.x & 127) == 0;
            const u32 bar_id = 2 + c;  // named barrier of this consumer's 128 threads (0: __syncthreads)
            // stmatrix x4 lane roles: matrix q = lane / 8 (rows +8 (q & 1), column block +(q >> 1)),
            // row lane % 8 of it; 128-byte swizzle: 16-byte chunk j of row r sits at j ^ (r % 8).
            const int q = lane >> 3, r = warp_in_wg * 16 + (lane & 7) + 8 * (q & 1);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
                for (int cb = 0; cb < BN / 64; ++cb) {
                    unsigned char* buf = stage_c + ((mi * (BN / 64) + cb) & 1) * (64 * 64 * 2);
                    if (issuer) tf::bulk_wait_group_read<1>();
                    tf::named_barrier_sync(bar_id, 128);
#pragma unroll
                    for (int jp = 0; jp < 4; ++jp) {  // column blocks 2 jp, 2 jp + 1 of the box
                        const u32* p = &packed[mi][2 * (8 * cb + 2 * jp)];
                        const u32 regs[4] = {p[0], p[1], p[2], p[3]};
                        tf::stmatrix_x4(buf + r * 128 + (((2 * jp + (q >> 1)) ^ (r & 7)) << 4), regs);
                    }
                    tf::fence_proxy_async_smem();  // generic-proxy writes -> visible to the TMA read
                    tf::named_barrier_sync(bar_id, 128);
                    if (issuer) {
                        const int row = m0 + (PINGPONG ? mi * 64 : c * 64);
                        tf::tma_store_2d(&tma_c, buf, n0 + 64 * cb, row);
                        tf::bulk_commit_group();
                    }
                }
            }
        };
        auto release = [&](int stage) {  // this warp no longer reads `stage`: tell every producer
            if (lane == 0) {
                if constexpr (CLUSTER == 1) {
                    tf::mbar_arrive(&empty[stage]);
                } else {
#pragma unroll
                    for (int r = 0; r < CLUSTER; ++r) tf::mbar_arrive_cluster(&empty[stage], r);
                }
            }
        };
        // Tile j of this CTA (j = 0, 1, ...): the cooperative consumers take every tile, ping-pong
        // consumer c the tiles j = c, c + 2, ...; its stages sit at ring positions j KT + kt.
        // Ping-pong order: consumer c starts tile j only once the other consumer has seen every
        // stage of tile j - 1 arrive (order[1 - c], one phase per tile). Without it, a consumer
        // waiting for ring round r of a stage whose round r - 1 (the other's) has not landed yet
        // would see the parity it waits for already "complete" and read the stage early.
        constexpr int J_STEP = PINGPONG ? 2 : 1;
        const int j0 = PINGPONG ? c : 0;
        for (int t = cluster_id + j0 * clusters, j = j0; t < cl_tiles; t += J_STEP * clusters, j += J_STEP) {
            int m0, n0;
            tile_origin(t, m0, n0);
            if constexpr (PINGPONG) {
                if (j > 0) tf::mbar_wait(&order[1 - c], ((j - 1) / 2) & 1);
            }
            const u32 pos = (u32)j * (u32)KT;
            int s = (int)(pos % STAGES);
            u32 phase = (pos / STAGES) & 1;
            int prev = -1;
            for (int kt = 0; kt < KT; ++kt) {
                tf::mbar_wait(&full[s], phase);
                if constexpr (PINGPONG) {
                    if (kt == KT - 1 && (threadIdx.x & 127) == 0) tf::mbar_arrive(&order[c]);
                }
                tf::wgmma_fence();
                // Descriptors advance by constants: a stage, a 64-row block or a k16 step moves only
                // the 14-bit start-address field (bytes / 16), which never carries (smem < 256 KB).
                const u64 sa = desc_a0 + (u64)(s * (A_BYTES >> 4)), sb = desc_b0 + (u64)(s * (B_BYTES >> 4));
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    const u64 db = sb + (u64)(B_NK ? kk * (32 >> 4) : kk * (16 * 128 >> 4));
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi) {
                        const u64 da = sa + (u64)(mi * (64 * BK * 2 >> 4) + kk * (32 >> 4));
                        tf::Wgmma<BN, T>::template run<B_NK ? 0 : 1>(acc[mi], da, db, (kt | kk) != 0);
                    }
                }
                tf::wgmma_commit();
                if constexpr (DEFER) {
                    if (kt == 0 && pend_m0 >= 0) {  // the previous tile's stores, under this stage's wgmmas
                        store_packed(pend_m0, pend_n0);
                        pend_m0 = -1;
                    }
                }
                tf::wgmma_wait<1>();          // stage kt-1's wgmmas are done (kt's may still run) ...
                if (prev >= 0) release(prev);  // ... so its smem goes back to the producer(s)
                prev = s;
                if (++s == STAGES) { s = 0; phase ^= 1; }
            }
            tf::wgmma_wait<0>();
            if (prev >= 0) release(prev);
            if constexpr (TMA_STORE) {
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int p = 0; p < BN / 4; ++p) packed[mi][p] = hg::Conv<T>::pack(acc[mi][2 * p], acc[mi][2 * p + 1]);
                if constexpr (DEFER) {
                    pend_m0 = m0;
                    pend_n0 = n0;
                } else {
                    store_packed(m0, n0);
                }
            } else {
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    const int row0 = m0 + (PINGPONG ? mi * 64 : c * 64) + warp_in_wg * 16;
#pragma unroll
                    for (int jn = 0; jn < BN / 8; ++jn)
                        hg::store_frag<T>(C, M, N, row0, n0 + 8 * jn, *reinterpret_cast<const float(*)[4]>(&acc[mi][4 * jn]));
                }
            }
        }
        if constexpr (DEFER) {
            if (pend_m0 >= 0) store_packed(pend_m0, pend_n0);  // the last tile's
        }
        // The staging buffers must outlive the TMA unit's reads of them.
        if constexpr (TMA_STORE) {
            if ((threadIdx.x & 127) == 0) tf::bulk_wait_group<0>();
        }
    }
    // A CTA must outlive its peers' multicasts into its smem and their arrivals on its barriers.
    if constexpr (CLUSTER > 1) tf::cluster_sync();
}
