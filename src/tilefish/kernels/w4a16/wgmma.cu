// W4A16 on Hopper (sm_90a): y[m, n] = x[m, k] @ dequant(W)[n, k]^T (+ bias) with wgmma.
//
// Why: mma.sync tops out near 65% of Hopper's tensor rate, and from m = 64 up the mma.sync kernel
// (gemm.cu) is compute-bound. wgmma issues a whole 64 x N x 16 product per warpgroup.
//
// Operand roles are swapped: the dequantized weights are wgmma's A operand (64 output columns
// of W per instruction, from registers) and x is its B operand (N = the m tile, from shared
// memory), so the accumulator is y^T. This is what lets int4 weights feed wgmma at all: A is the
// only operand that may come from registers, where the lop3 dequantization produces it, and the
// m tile can be any multiple of 8 (16 .. 256), so small batches waste no tensor work on padding.
// x [m, k] row-major is exactly a K-major B; TMA loads it 128-byte swizzled (zero-filling rows
// past m), the layout the wgmma descriptor reads.
//
// The wgmma A fragment of warp w of a warpgroup is the mma.m16n8k16 A fragment of rows
// 16w .. 16w+15, which is what one packed word dequantizes to (gemm.cu's swap path uses the same
// fact). A lane's 16 packed bytes of a (strip, k16) row hold four words, for the 16-row blocks
// j = 0..3 of the strip; NT words per warp means NT accumulator tiles per warpgroup:
//   tile jj (0 .. NT-1) of a warpgroup, warp w: W rows 64 * strip + 16 * (word0 + jj) + {g, g+8}
//   with strip = c * NT + (w * NT) / 4 and word0 = (w * NT) % 4.
// NT = 4: each warp owns one strip (16-byte loads), NT = 2: two warps per strip, NT = 1: a strip
// per warpgroup. A warpgroup covers NT strips, so a CTA covers CONS * NT strips (BN = 64 CONS NT
// columns of y) and MT rows; each consumer thread keeps NT * MT / 2 fp32 accumulators.
//
// Roles (warp specialization as in hgemm step 7): warpgroup 0 is the producer (setmaxnreg.dec,
// one thread): per 64-wide k stage one TMA box of x (MT x 64) and one bulk copy per strip of the
// packed weights (4 k16 rows x 512 B, contiguous in the strip-major layout), plus the stage's
// scale / zero-point rows, all counted in by the stage's full mbarrier. Warpgroups 1..CONS are the
// consumers: per stage they load their words from shared memory, dequantize two k16 steps at a
// time into A register sets, issue 2 NT wgmmas as one group, and wait until only that group is
// in flight (see the main loop). A stage goes back to the producer when the first wait of the
// next stage shows its last group finished.
//
// Two schedules (template SK):
// - Tiles (SK = false): grid (m tiles, n tiles, slices), one CTA per (tile, k slice). Split k
//   (few output tiles): `slices` CTAs share a tile.
// - Stream-K (SK = true): a 1-D grid of G CTAs (one wave) over U = tiles x KT units of (tile,
//   64-k stage), tile-major with m tiles fastest; CTA b takes units [b U / G, (b+1) U / G), so
//   every SM gets the same work whatever the tile count (no partly empty last wave, no
//   over-split k). The producer streams across tile boundaries without draining the ring, so the
//   epilogue stages y in a shared-memory area of its own.
// A k split of 2-8 slices in tile mode whose clusters all fit at once runs as one cluster of the
// slices (cluster_split): they add their partials through distributed shared memory (the fixup
// below). Otherwise, a tile cut between CTAs is finished the same way in both: each contributor writes its fp32
// accumulators to a workspace slot in fragment order (each thread 16-byte chunks, coalesced),
// bumps the tile's counter; the last to arrive adds the slots in k order, runs the epilogue and
// resets the counter (the protocol of w4a16/fixup.cuh: bitwise deterministic, no CTA waits for another).
//
// Any k % 64 == 0 works as it is: a stage is 64 wide, so k / 64 stages cover k exactly.
//
// Epilogues (w4a16/epilogue.cuh): plain, + residual, or gated (silu(gate) * up of interleaved columns),
// applied where y leaves shared memory (a gate chunk of 8 columns and its up chunk are both staged).
//
// Programmatic dependent launch: the producer issues its first ring's weights, scales and zero points
// before grid_dependency_wait (nothing in the stream writes them), x after it; the consumers wait
// before they touch anything, and the next kernel may be scheduled once every CTA is set up.
#include "common/wgmma.cuh"
#include "w4a16/dequant.cuh"
#include "w4a16/epilogue.cuh"
#include "w4a16/fixup.cuh"
#include "w4a16/timeline.cuh"

namespace w4h {
using namespace tf;
constexpr int kBK = 64;  // one 128-byte swizzle row of x per stage

template <int MT, int NT, int CONS, int GROUP, bool ASYM>
struct Layout {
    static constexpr int STRIPS = CONS * NT;               // 64-column strips of W per CTA
    static constexpr int BN = 64 * STRIPS;
    static constexpr int X_BYTES = MT * kBK * 2;             // 1024-byte multiple (MT % 8 == 0)
    static constexpr int W_STRIP_BYTES = (kBK / 16) * 512;   // 4 k16 rows x 32 lanes x 16 B
    static constexpr int W_BYTES = STRIPS * W_STRIP_BYTES;
    static constexpr int S_ROWS = GROUP == 0 ? 0 : (GROUP >= kBK ? 1 : kBK / GROUP);
    static constexpr int S_BYTES = S_ROWS * BN * 2;
    static constexpr int Z_ROWS = ASYM ? (GROUP == 0 ? 1 : S_ROWS) : 0;
    static constexpr int Z_BYTES = Z_ROWS * BN * 2;
    static constexpr int TX_BYTES = X_BYTES + W_BYTES + S_BYTES + Z_BYTES;  // per stage
};

template <int NT> struct Words;
template <> struct Words<4> { static __device__ __forceinline__ void load(const unsigned char* p, u32 (&w)[4]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p); w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w; } };
template <> struct Words<2> { static __device__ __forceinline__ void load(const unsigned char* p, u32 (&w)[2]) {
    const uint2 v = *reinterpret_cast<const uint2*>(p); w[0] = v.x; w[1] = v.y; } };
template <> struct Words<1> { static __device__ __forceinline__ void load(const unsigned char* p, u32 (&w)[1]) {
    w[0] = *reinterpret_cast<const u32*>(p); } };

}  // namespace w4h

template <typename T, int MT, int NT, int CONS, int STAGES, int GROUP, bool ASYM, bool SK>
__global__ void __launch_bounds__((CONS + 1) * 128, CONS == 1 ? 2 : 1)
w4a16_wgmma(const __grid_constant__ tf::TmaDesc tma_x, const uint4* __restrict__ w, const T* __restrict__ scales,
            const T* __restrict__ zeros, const T* __restrict__ bias, T* __restrict__ out,
            float* __restrict__ workspace, int* __restrict__ counters, int m, int n, int k, int slices,
            int cluster_split, int tile_base, const T* __restrict__ residual, int gated) {
    using namespace w4h;
    using L = Layout<MT, NT, CONS, GROUP, ASYM>;
    using DQ = WeightDecoder<T>;
    static_assert(kDecoderHasZeros || !ASYM, "NF4 codes have no zero points");
    using V2 = Vec2<T>;
    using epilogue_t = Epilogue<T>;
    static_assert(MT == 16 || MT == 32 || MT == 64 || MT == 128 || MT == 256, "MT: a generated wgmma n");
    static_assert(NT == 1 || NT == 2 || NT == 4, "NT words per lane: 4, 8 or 16 bytes");
    static_assert(CONS == 1 || CONS == 2, "one or two consumer warpgroups");
    static_assert(NT * MT / 2 <= 128, "accumulators per thread");
    static_assert(CONS == 2 || MT <= 128, "CONS = 1 launches at 128 registers: one m64n256 wgmma needs more");
    // CONS = 1 fits two CTAs per SM (launch at 128 registers a thread): 128 x 24 + 128 x 232 = 32K
    // (the producer thread's loop needs few; 216 for the consumers spilled the asymmetric m64 tile).
    constexpr int PRODUCER_REGS = CONS == 1 ? 24 : 40, CONSUMER_REGS = 232;
    constexpr int BN = L::BN, CT = CONS * 128;
    constexpr int ACC = MT / 2;  // per tile per thread

    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms
    unsigned char* sX = smem;
    unsigned char* sW = sX + STAGES * L::X_BYTES;
    unsigned char* sS = sW + STAGES * L::W_BYTES;
    unsigned char* sZ = sS + STAGES * L::S_BYTES;
    u64* full = reinterpret_cast<u64*>(sZ + STAGES * L::Z_BYTES);
    u64* empty = full + STAGES;
    __shared__ int s_is_last, s_peek;

    // This CTA's units [u0, u1) of (tile, k stage), unit = tile * KT + stage; tile = n tile x m
    // tiles + m tile.
    const int KT = k / kBK;
    // Tile mode with cluster_split: the k slices of a tile are one cluster (consecutive blockIdx.x)
    // and sum their partials through distributed shared memory (below); else blockIdx.z is the slice.
    // tile_base: the first tile of this launch (the host runs a partial last wave as a launch of
    // its own, so its CTAs spread one an SM; see ops/w4a16/launch.py, _hopper_launches).
    const bool dsmem_fixup = !SK && cluster_split && slices > 1;
    const int m_tiles = (m + MT - 1) / MT;
    // n % BN may be 64 * j (n % 64 == 0 always): the last column tile is ragged (ragged_strips below).
    const int n_tiles = (n + BN - 1) / BN;
    const int units = SK ? m_tiles * n_tiles * KT : 0;
    int cta_index = blockIdx.x;  // this CTA's number among the whole problem's (timeline stamps)
    (void)cta_index;
    int u0, u1;
    if constexpr (SK) {
        u0 = unit_begin(blockIdx.x, units, gridDim.x);
        u1 = unit_begin(blockIdx.x + 1, units, gridDim.x);
    } else {
        const int slice = dsmem_fixup ? (int)(blockIdx.x % slices) : (int)blockIdx.z;
        const int tile = tile_base + blockIdx.y * (int)(dsmem_fixup ? gridDim.x / slices : gridDim.x) +
                         (dsmem_fixup ? (int)(blockIdx.x / slices) : (int)blockIdx.x);
        cta_index = tile * slices + slice;
        u0 = tile * KT + (int)((long long)slice * KT / slices);
        u1 = tile * KT + (int)((long long)(slice + 1) * KT / slices);
    }
    const int wg = threadIdx.x / 128;
    // Timeline builds (w4a16/timeline.cuh): per-CTA stamps after the workspace slots (8 a CTA): 0
    // entry, 1 first stage landed, 2 main loop done, 5 partial staged / written (split k), 3 fixup
    // done (or handed on), 4 exit. Stream-K: 2, 5 and 4 are the last segment's, 6 / 7 the loop end /
    // partial written of a first segment that is not the last; no 3 (with it, ptxas 13.0 built a
    // stream-K kernel that hung).
    TF_TIMELINE_AT(reinterpret_cast<long long*>(
        workspace + (size_t)(SK ? 2 * (int)gridDim.x : m_tiles * n_tiles * slices) * MT * BN) +
        (size_t)cta_index * 8);
    TF_STAMP_IF(threadIdx.x == 0, 0);
#define TF_STAMP(i) TF_STAMP_IF(threadIdx.x == 128 && !(SK && (i) == 3), i)

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(&full[s], 1);
            mbar_init(&empty[s], CONS * 4);  // every consumer warp
        }
        fence_barrier_init();
    }
    __syncthreads();
    launch_dependent_grids();  // the next kernel's CTAs may take SMs as these leave

    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            tma_prefetch_desc(&tma_x);
            const size_t strip_uint4 = (size_t)(k / 16) * 32;  // one strip's whole k run
            // A ragged last column tile (n - n0 < BN) holds `valid` strips. Its missing strips load
            // copies of its last valid one (weights, scales, zero points): every copy stays in bounds,
            // the stage's byte count and the consumers stay as they are, and the columns the copies
            // feed are never stored (epilogue). Other tiles take the one-copy-per-row path.
            auto issue_weights = [&](int s, u64* bar, int kt, int n0) {
                const int valid = min(L::STRIPS, (n - n0) / 64);
                const uint4* w_cta = w + (size_t)(n0 / 64) * strip_uint4;
#pragma unroll
                for (int i = 0; i < L::STRIPS; ++i)
                    bulk_load(sW + s * L::W_BYTES + i * L::W_STRIP_BYTES,
                              w_cta + min(i, valid - 1) * strip_uint4 + (size_t)kt * (kBK / 16) * 32,
                              L::W_STRIP_BYTES, bar);
                if constexpr (GROUP > 0) {
#pragma unroll
                    for (int r = 0; r < L::S_ROWS; ++r) {
                        const T* row = scales + (size_t)(kt * kBK / GROUP + r) * n + n0;
                        if (valid == L::STRIPS) {
                            bulk_load(sS + s * L::S_BYTES + r * BN * 2, row, BN * 2, bar);
                        } else {
                            for (int i = 0; i < L::STRIPS; ++i)
                                bulk_load(sS + s * L::S_BYTES + r * BN * 2 + i * 128, row + min(i, valid - 1) * 64,
                                          128, bar);
                        }
                    }
                }
                if constexpr (ASYM) {
#pragma unroll
                    for (int r = 0; r < L::Z_ROWS; ++r) {
                        const int zrow = GROUP > 0 ? kt * kBK / GROUP + r : 0;
                        const T* row = zeros + (size_t)zrow * n + n0;
                        if (valid == L::STRIPS) {
                            bulk_load(sZ + s * L::Z_BYTES + r * BN * 2, row, BN * 2, bar);
                        } else {
                            for (int i = 0; i < L::STRIPS; ++i)
                                bulk_load(sZ + s * L::Z_BYTES + r * BN * 2 + i * 128, row + min(i, valid - 1) * 64,
                                          128, bar);
                        }
                    }
                }
            };
            // The first ring's weights go out before grid_dependency_wait, each stage's byte count (x
            // included) announced first; x, which the kernel ahead may still be writing, after it.
            const int ring = min(u1 - u0, STAGES);
            {
                int tile = u0 / KT, kt = u0 - tile * KT;
                for (int i = 0; i < ring; ++i) {
                    mbar_arrive_expect_tx(&full[i], L::TX_BYTES);
                    issue_weights(i, &full[i], kt, (tile / m_tiles) * BN);
                    if (++kt == KT) { kt = 0; ++tile; }
                }
            }
            grid_dependency_wait();
            int s = 0;
            u32 phase = 0;
            int tile = u0 / KT, kt = u0 - tile * KT;
            int m0 = (tile % m_tiles) * MT, n0 = (tile / m_tiles) * BN;
            for (int u = u0; u < u1; ++u) {
                if (u - u0 >= ring) {
                    mbar_wait(&empty[s], phase ^ 1);
                    mbar_arrive_expect_tx(&full[s], L::TX_BYTES);
                    issue_weights(s, &full[s], kt, n0);
                }
                tma_load_2d(sX + s * L::X_BYTES, &tma_x, kt * kBK, m0, &full[s]);
                if (++s == STAGES) { s = 0; phase ^= 1; }
                if (++kt == KT) {
                    kt = 0;
                    ++tile;
                    m0 = (tile % m_tiles) * MT;
                    n0 = (tile / m_tiles) * BN;
                }
            }
        }
        return;  // exited threads count as arrived at the consumers' cluster barriers (PTX `exit`)
    }

    setmaxnreg_inc<CONSUMER_REGS>();
    grid_dependency_wait();  // before y, the workspace and the counters (they read x only once it lands)
    const int c = wg - 1, ctid = threadIdx.x - 128;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const int g = lane >> 2, t = lane & 3;
    const int strip = c * NT + (warp * NT) / 4, word0 = (warp * NT) % 4;

    float acc[NT][ACC];
    u32 afrag[kBK / 16][NT][4];
    typename V2::type sc2[NT][2];
    typename DQ::Zero zs[NT][2];
    const typename DQ::Zero zsym = DQ::zero(8.f);

    // This lane's scales / zero points: columns 8 s + g of the strip sit at 8 g + s (ops/w4a16/layout.py),
    // and the lane needs subtiles s = 2 (word0 + jj) + h: 2 NT contiguous values (one load, and
    // no run-time index into a register array, which would go to local memory).
    auto load_group = [&](int stage, int row) {
        const int offset = (row * BN + strip * 64 + g * 8 + 2 * word0) * 2;
        if constexpr (GROUP > 0) {
            u32 v[NT];
            Words<NT>::load(sS + stage * L::S_BYTES + offset, v);
#pragma unroll
            for (int jj = 0; jj < NT; ++jj) {
                const T* p = reinterpret_cast<const T*>(&v[jj]);
                sc2[jj][0] = V2::dup(p[0]);
                sc2[jj][1] = V2::dup(p[1]);
            }
        }
        if constexpr (ASYM) {
            u32 v[NT];
            Words<NT>::load(sZ + stage * L::Z_BYTES + offset, v);  // GROUP 0: row is 0
#pragma unroll
            for (int jj = 0; jj < NT; ++jj) {
                const T* p = reinterpret_cast<const T*>(&v[jj]);
                zs[jj][0] = DQ::zero(to_float(p[0]));
                zs[jj][1] = DQ::zero(to_float(p[1]));
            }
        }
    };
    auto release = [&](int stage) {
        if (lane == 0) mbar_arrive(&empty[stage]);
    };

    // Two k16 steps per wgmma group, four A register sets: a group is issued, then the previous
    // one is waited for, so while this warpgroup dequantizes the next two steps the tensor cores
    // still hold up to two groups (four steps) of its work. Sets 0-1 serve steps 0-1 of a stage,
    // sets 2-3 steps 2-3, so a set is rewritten only after the wait that retired its last reader.
    constexpr int STEPS = kBK / 16, STEPS_PER_MMA_GROUP = 2;
    constexpr int CHUNKS = NT * ACC / 4;  // float4 per thread in a partial tile
    constexpr int ROW = BN * 2 + 16;      // bytes per staged row of y (epilogue)
    // Stream-K keeps the ring running through the epilogue, so y is staged in an area of its own;
    // one tile per CTA stages it in the drained pipeline buffers.
    static_assert(SK || MT * ROW <= STAGES * (L::X_BYTES + L::W_BYTES + L::S_BYTES + L::Z_BYTES),
                  "the staged tile fits in the (drained) pipeline buffers");
    unsigned char* const staging = SK ? reinterpret_cast<unsigned char*>(empty + STAGES) : smem;
    int s = 0, prev = -1;
    u32 phase = 0;
    int u = u0;
    while (u < u1) {
        const int tile = u / KT;
        const int seg_begin = u, seg_end = min(u1, (tile + 1) * KT);
        const int m0 = (tile % m_tiles) * MT, n0 = (tile / m_tiles) * BN;
        for (; u < seg_end; ++u) {
            mbar_wait(&full[s], phase);
            if (u == u0) TF_STAMP(1);
            const unsigned char* w_s = sW + s * L::W_BYTES + strip * L::W_STRIP_BYTES + lane * 16 + word0 * 4;
            const unsigned char* x_s = sX + s * L::X_BYTES;
            u32 words[STEPS][NT];  // the whole stage's words up front: one shared-memory latency per stage
#pragma unroll
            for (int kk = 0; kk < STEPS; ++kk) Words<NT>::load(w_s + kk * 512, words[kk]);
#pragma unroll
            for (int k0 = 0; k0 < STEPS; k0 += STEPS_PER_MMA_GROUP) {
#pragma unroll
                for (int kk = k0; kk < k0 + STEPS_PER_MMA_GROUP; ++kk) {
                    if constexpr (GROUP > 0 || ASYM) {
                        constexpr int STEPS_PER_SCALE = GROUP > 0 && GROUP < kBK ? GROUP / 16 : STEPS;
                        if (kk % STEPS_PER_SCALE == 0) load_group(s, kk / STEPS_PER_SCALE);
                    }
#pragma unroll
                    for (int jj = 0; jj < NT; ++jj) {
                        u32 f[4];
                        DQ::run(words[kk][jj], ASYM ? zs[jj][0] : zsym, ASYM ? zs[jj][1] : zsym, f);
                        if constexpr (GROUP > 0) {
#pragma unroll
                            for (int p = 0; p < 4; ++p) {
                                typename V2::type v = *reinterpret_cast<typename V2::type*>(&f[p]);
                                v = __hmul2(v, sc2[jj][p >> 1]);
                                f[p] = *reinterpret_cast<u32*>(&v);
                            }
                        }
                        // f = (row g, k lo) (row g, k hi) (row g+8, k lo) (row g+8, k hi); A wants rows inner.
                        afrag[kk][jj][0] = f[0]; afrag[kk][jj][1] = f[2]; afrag[kk][jj][2] = f[1]; afrag[kk][jj][3] = f[3];
                    }
                }
                wgmma_fence();
#pragma unroll
                for (int kk = k0; kk < k0 + STEPS_PER_MMA_GROUP; ++kk) {
                    const u64 db = wgmma_desc_sw128(x_s + kk * 32, 16, 1024);
#pragma unroll
                    for (int jj = 0; jj < NT; ++jj)
                        WgmmaRS<MT, T>::run(acc[jj], afrag[kk][jj], db, (u != seg_begin) | kk);
                }
                wgmma_commit();
                wgmma_wait<1>();  // the previous group is done: its A registers (and smem) are free
                if (k0 == 0 && prev >= 0) release(prev);  // ... which was the previous stage's last
            }
            prev = s;
            if (++s == STAGES) { s = 0; phase ^= 1; }
        }
        wgmma_wait<0>();
        TF_STAMP(SK && seg_begin == u0 && seg_end != u1 ? 6 : 2);  // 6: an early segment's
        if constexpr (SK) {  // the producer may be waiting for it to start the next segment
            release(prev);
            prev = -1;
        }

        if (dsmem_fixup) {
            // The slices of this tile are this cluster's CTAs (rank = slice). Each stages its fp32
            // partial tile row-major in its drained pipeline buffers; after a cluster barrier, CTA r
            // sums the r-th share of the valid rows' float4s over all ranks in rank order (k order:
            // deterministic) straight from their shared memory, applies scale and bias and stores
            // them. All slices finish the tile together; no workspace, no counter, no L2 round trip.
            constexpr int FROW = BN + 4;  // floats a staged row: rows 2t apart land 8 banks apart
            static_assert(SK || MT * FROW * 4 <= STAGES * (L::X_BYTES + L::W_BYTES + L::S_BYTES + L::Z_BYTES),
                          "the fp32 partial tile fits in the drained pipeline buffers");
            float* part = reinterpret_cast<float*>(smem);
            named_barrier_sync(1, CT);  // every consumer warpgroup's wgmmas are done with the buffers
#pragma unroll
            for (int jj = 0; jj < NT; ++jj)
#pragma unroll
                for (int cc = 0; cc < MT / 8; ++cc)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int e = 0; e < 2; ++e)
                            part[(8 * cc + 2 * t + e) * FROW + strip * 64 + 16 * (word0 + jj) + 8 * h + g] =
                                acc[jj][4 * cc + 2 * h + e];
            cluster_sync();
            TF_STAMP(5);
            const u32 local = smem_addr(part);
            // Items: the valid rows' float4s (ragged: valid strips); gated, only the gate float4s (c4 % 4
            // < 2), each summed with its up float4 c4 + 2.
            const int rows = min(MT, m - m0), per_row = min(BN, n - n0) / 4;
            const int per_item = gated ? per_row / 2 : per_row, total = rows * per_item;
            auto c4_of = [&](int q) { return gated ? (q >> 1) * 4 + (q & 1) : q; };  // q: item within its row
            const int rank = (int)cluster_ctarank();  // = the slice (recomputed: nothing extra lives through the loop)
            const int begin = (int)((long long)rank * total / slices), end = (int)((long long)(rank + 1) * total / slices);
            const epilogue_t epi{residual, gated};
            // RB items a thread in flight per rank: one DSMEM round trip per (batch, rank), not one per
            // float4 (each add would wait on its own load).
            constexpr int RB = 8;
            for (int base = begin; base < end; base += RB * CT) {
                u32 off[RB];
                float4 sum[RB], up[RB];
#pragma unroll
                for (int b = 0; b < RB; ++b) {
                    const int i = min(base + b * CT + ctid, end - 1);  // clamped: loads stay in bounds
                    off[b] = (u32)((i / per_item) * FROW + c4_of(i % per_item) * 4) * 4;
                }
                const u32 rank0 = mapa_shared(local, 0);
#pragma unroll
                for (int b = 0; b < RB; ++b) {
                    sum[b] = ld_shared_cluster_f4(rank0 + off[b]);
                    if (gated) up[b] = ld_shared_cluster_f4(rank0 + off[b] + 32);  // 8 floats on
                }
#pragma unroll 1
                for (int r = 1; r < slices; ++r) {
                    const u32 peer = mapa_shared(local, r);
                    float4 v[RB], vu[RB];
#pragma unroll
                    for (int b = 0; b < RB; ++b) {
                        v[b] = ld_shared_cluster_f4(peer + off[b]);
                        if (gated) vu[b] = ld_shared_cluster_f4(peer + off[b] + 32);
                    }
#pragma unroll
                    for (int b = 0; b < RB; ++b) {
                        sum[b].x += v[b].x; sum[b].y += v[b].y; sum[b].z += v[b].z; sum[b].w += v[b].w;
                        if (gated) {
                            up[b].x += vu[b].x; up[b].y += vu[b].y; up[b].z += vu[b].z; up[b].w += vu[b].w;
                        }
                    }
                }
#pragma unroll
                for (int b = 0; b < RB; ++b) {
                    const int i = base + b * CT + ctid;
                    if (i >= end) break;
                    const int row = i / per_item, col = n0 + c4_of(i % per_item) * 4;
                    float o[4] = {sum[b].x, sum[b].y, sum[b].z, sum[b].w};
                    float ou[4] = {up[b].x, up[b].y, up[b].z, up[b].w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if constexpr (GROUP == 0) o[e] *= to_float(scales[col + e]);
                        if (bias != nullptr) o[e] += to_float(bias[col + e]);
                        if (gated) {
                            if constexpr (GROUP == 0) ou[e] *= to_float(scales[col + 8 + e]);
                            if (bias != nullptr) ou[e] += to_float(bias[col + 8 + e]);
                            o[e] = epi.silu_mul(o[e], ou[e]);
                        } else {
                            o[e] = epi.plain(o[e], (size_t)(m0 + row) * n + col + e);
                        }
                    }
                    const typename V2::type lo = V2::make(o[0], o[1]), hi = V2::make(o[2], o[3]);
                    uint2 packed;
                    packed.x = *reinterpret_cast<const u32*>(&lo);
                    packed.y = *reinterpret_cast<const u32*>(&hi);
                    T* dst = gated ? out + (size_t)(m0 + row) * (n / 2) + gated_column(col)
                                   : out + (size_t)(m0 + row) * n + col;
                    *reinterpret_cast<uint2*>(dst) = packed;
                }
            }
            TF_STAMP(3);
            cluster_sync();  // no CTA leaves while a peer may still read its shared memory
            TF_STAMP(4);
            break;
        }

        // A tile cut between CTAs: fp32 partials in fragment order, the last contributor to
        // arrive sums them in k order. Slots: tiles mode, tile x slices + slice; stream-K, 2 per
        // CTA (0: the segment its range starts in, 1: the one it ends in; middle tiles are whole).
        if (seg_begin != tile * KT || seg_end != (tile + 1) * KT) {
            // Slot of contributor i (0 = the first in k order): stream-K contributors after the
            // first start inside the tile, so only the first can be in its slot 1.
            int first, count, mine;
            if constexpr (SK) {
                const int first_cta = cta_of_unit(tile * KT, units, gridDim.x);
                first = 2 * first_cta + (unit_begin(first_cta, units, gridDim.x) >= tile * KT ? 0 : 1);
                count = cta_of_unit((tile + 1) * KT - 1, units, gridDim.x) - first_cta + 1;
                mine = 2 * blockIdx.x + (u0 >= tile * KT ? 0 : 1);
            } else {
                first = tile * slices;
                count = slices;
                mine = first + blockIdx.z;
            }
            auto slot = [&](int i) {  // this thread's first chunk in contributor i's slot
                const int sl = SK ? (i == 0 ? first : 2 * (first / 2 + i)) : first + i;
                return reinterpret_cast<float4*>(workspace) + (size_t)sl * CHUNKS * CT + ctid;
            };
            // Stream-K, a CTA's last segment that starts its tile (contributor 0): the other
            // contributors' segments are their first ones, long done as a rule. If the counter
            // already shows them all in, this CTA is the last without storing its own partial and
            // waiting for the atomic (~2.1 us a CTA on the launch's tail); its partial, still in
            // registers, is the sum's first term, so the k order (and every bit) is the same.
            bool own_in_registers = false;
            if constexpr (SK) {
                if (seg_end == u1 && seg_begin == tile * KT) {
                    if (ctid == 0) s_peek = fixup_others_in(counters + tile, count);  // written once a launch
                    named_barrier_sync(1, CT);
                    own_in_registers = s_peek;
                }
            }
            if (!own_in_registers) {
                float4* dst = reinterpret_cast<float4*>(workspace) + (size_t)mine * CHUNKS * CT + ctid;
#pragma unroll
                for (int jj = 0; jj < NT; ++jj)
#pragma unroll
                    for (int q = 0; q < ACC / 4; ++q)
                        __stcg(dst + (jj * (ACC / 4) + q) * CT,
                               make_float4(acc[jj][4 * q], acc[jj][4 * q + 1], acc[jj][4 * q + 2], acc[jj][4 * q + 3]));
                const bool last = fixup_arrive_cta(counters + tile, count, ctid == 0, s_is_last,
                                                   [] { named_barrier_sync(1, CT); });
                TF_STAMP(SK && seg_begin == u0 && seg_end != u1 ? 7 : 5);  // 7: an early segment's
                if (!last) {
                    if constexpr (SK) continue;
                    TF_STAMP(3);
                    TF_STAMP(4);
                    return;
                }
            }
            // Loads in batches of BATCH independent float4 per contributor: one L2 round trip per
            // (batch, contributor). One chunk at a time (each waiting on its own loads) made a 4-way
            // split of a k 4096 tile cost ~14 us; batches of 16 beat 8 by 2-7% on split plans, and
            // all 32 chunks of a 128-accumulator tile at once spilled.
            constexpr int BATCH = CHUNKS < 16 ? CHUNKS : 16;
            static_assert(CHUNKS % BATCH == 0, "whole batches");
#pragma unroll
            for (int c0 = 0; c0 < CHUNKS; c0 += BATCH) {
                // The sum's first term: contributor 0's slot, or this CTA's own partial, still in acc.
                if (!own_in_registers) {
                    const float4* src0 = slot(0) + c0 * CT;
                    float4 v[BATCH];
#pragma unroll
                    for (int b = 0; b < BATCH; ++b) v[b] = __ldcg(src0 + b * CT);
#pragma unroll
                    for (int b = 0; b < BATCH; ++b) {
                        const int c = c0 + b, jj = c / (ACC / 4), q = c % (ACC / 4);
                        acc[jj][4 * q] = v[b].x; acc[jj][4 * q + 1] = v[b].y;
                        acc[jj][4 * q + 2] = v[b].z; acc[jj][4 * q + 3] = v[b].w;
                    }
                }
#pragma unroll 1
                for (int i = 1; i < count; ++i) {
                    const float4* src = slot(i) + c0 * CT;
                    float4 v[BATCH];
#pragma unroll
                    for (int b = 0; b < BATCH; ++b) v[b] = __ldcg(src + b * CT);
#pragma unroll
                    for (int b = 0; b < BATCH; ++b) {
                        const int c = c0 + b, jj = c / (ACC / 4), q = c % (ACC / 4);
                        acc[jj][4 * q] += v[b].x; acc[jj][4 * q + 1] += v[b].y;
                        acc[jj][4 * q + 2] += v[b].z; acc[jj][4 * q + 3] += v[b].w;
                    }
                }
            }
            if (ctid == 0) fixup_reset(counters + tile);
        }
        TF_STAMP(3);

        // Epilogue: acc[jj][4 cc + 2 h + e] is y[m0 + 8 cc + 2 t + e, col(jj, h)] (the accumulator
        // is y^T: its rows are W rows = columns of y). Per-channel scale and bias in fp32, then the
        // tile goes through shared memory: stmatrix.trans turns each 8 (n) x 8 (m) fragment block
        // into 8 rows of y (16 contiguous bytes each; rows padded by 16 bytes, so the 8 rows of a
        // block hit 8 different bank groups), and the consumers copy whole rows out with 16-byte
        // coalesced stores. Storing 2-byte values straight from the fragments cost ~10% at k = 4096.
        named_barrier_sync(1, CT);  // every consumer warp is done with the staging area (pipeline / last tile)
        {
            float sc[NT][2], bi[NT][2];
            // a ragged tile's missing strips read the last valid strip's columns (never stored)
            const int strip_col = min(n0 + strip * 64, n - 64);
#pragma unroll
            for (int jj = 0; jj < NT; ++jj)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int col = strip_col + 16 * (word0 + jj) + 8 * h + g;
                    sc[jj][h] = 1.f;
                    bi[jj][h] = 0.f;
                    if constexpr (GROUP == 0) sc[jj][h] = to_float(scales[col]);
                    if (bias != nullptr) bi[jj][h] = to_float(bias[col]);
                }
            // Matrix f = (2 jj + h) * MT/8 + cc covers n block strip * 64 + 16 (word0 + jj) + 8 h and
            // m block 8 cc; one x4 stores matrices f0 .. f0+3. Lane 8i + j addresses row j (m = 8 cc
            // + j) of matrix f0 + i.
            constexpr int CB = MT / 8, MATRICES = NT * 2 * CB;
            static_assert(MATRICES % 4 == 0, "whole stmatrix.x4 groups");
            const int mi = lane >> 3, mj = lane & 7;
#pragma unroll
            for (int f0 = 0; f0 < MATRICES; f0 += 4) {
                u32 r[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int f = f0 + i, jj = f / (2 * CB), h = (f / CB) % 2, cc = f % CB;
                    typename V2::type v = V2::make(acc[jj][4 * cc + 2 * h] * sc[jj][h] + bi[jj][h],
                                                   acc[jj][4 * cc + 2 * h + 1] * sc[jj][h] + bi[jj][h]);
                    r[i] = *reinterpret_cast<u32*>(&v);
                }
                const int f = f0 + mi, jj = f / (2 * CB), h = (f / CB) % 2, cc = f % CB;
                const int n_local = strip * 64 + 16 * (word0 + jj) + 8 * h;
                stmatrix_x4_trans(staging + (8 * cc + mj) * ROW + n_local * 2, r);
            }
        }
        named_barrier_sync(1, CT);
        constexpr int CHUNKS_PER_ROW = BN / 8;
        const int rows = min(MT, m - m0), cols8 = min(BN, n - n0) / 8;  // a ragged tile stores its valid strips
        // Gated: chunk 2 p (8 gate columns) and 2 p + 1 (their up columns) -> 8 columns of y.
        const int per_row = gated ? CHUNKS_PER_ROW / 2 : CHUNKS_PER_ROW;
        for (int c16 = ctid; c16 < rows * per_row; c16 += CT) {
            const int row = c16 / per_row, col8 = (c16 % per_row) << (gated ? 1 : 0);
            if (col8 >= cols8) continue;
            const unsigned char* st = staging + row * ROW + col8 * 16;
            uint4 v = *reinterpret_cast<const uint4*>(st);
            size_t at;
            if (gated) {
                v = combine_chunks<T>(v, *reinterpret_cast<const uint4*>(st + 16),
                                      [](float g, float u) { return epilogue_t::silu_mul(g, u); });
                at = (size_t)(m0 + row) * (n / 2) + (n0 + col8 * 8) / 2;
            } else {
                at = (size_t)(m0 + row) * n + n0 + col8 * 8;
                if (residual != nullptr)
                    v = combine_chunks<T>(v, ld_cg_v4(residual + at),  // through L2 (epilogue.cuh)
                                          [](float y, float r) { return y + r; });
            }
            *reinterpret_cast<uint4*>(out + at) = v;
        }
        TF_STAMP(4);
        if constexpr (!SK) break;  // one segment: tell the compiler
    }
}
#undef TF_STAMP
