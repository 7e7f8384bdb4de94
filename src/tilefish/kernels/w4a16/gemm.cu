// W4A16 GEMM: y[m, n] = x[m, k] @ dequant(W)[n, k]^T (+ bias), x fp16/bf16, W 4-bit, fp32 accumulate.
//
// Tiling: a block of 256 threads (8 warps) owns a BM x BN output tile (BM = 16*MB rows, BN = 64*WN
// columns) and walks k in tiles of 128 (the last one half a tile when k % 128 == 64). Its warps form a WN x WK grid: warp (wn, wk) owns the
// 64-column strip wn and the k16 steps wk*KW .. wk*KW+KW-1 of every k tile (KW = 8 / WK), so
// several warps split k and are summed in shared memory at the end (block-level reduction).
//
// Pipeline: STAGES-deep cp.async ring for the x tile, the packed weight tile, the group scales
// and zero points. x is stored XOR-swizzled (16-byte chunk c of row r lands at c ^ (r & 7)), so
// the ldmatrix.x4 that reads a 16x16 A fragment touches 8 different bank groups: conflict-free.
//
// Weights arrive pre-permuted (ops/w4a16/layout.py, docs/w4a16.md), strip-major: each 64-column strip's
// whole k run is contiguous, so a block streams WN sequential runs. For each (strip, k16 row),
// 512 contiguous bytes, 16 per lane, and the 4-byte word j of lane l holds exactly the B fragments
// of n8 subtiles 2j and 2j+1 for that lane, nibbles ordered so that lop3 with an fp16/bf16
// exponent pattern turns pairs of nibbles directly into the half2 registers mma expects. The zero
// point is subtracted exactly in half precision; group scales multiply the fragment (one rounding,
// like a dequantize-then-cast), per-channel scales multiply the fp32 accumulators in the epilogue.
//
// Swap (m <= 8): the dequantized weights become the A operand (16 output columns x 16 k) and x^T
// the B operand (16 k x 8 rows): the A fragment is the same dequantized word with registers 1 and
// 2 exchanged, so the layout is unchanged, while each 32-bit word feeds one MMA instead of two and
// each warp holds half the accumulators.
//
// Half tile (k % 128 == 64): the last k tile has 64 valid k. Its loads stay inside x and W and the
// mma loop runs unchanged: the x chunks of k 64..127 are zero-filled (cp.async with src-size 0, the
// source pointed at valid bytes), and the weight rows and scale / zero-point rows of that half are
// copies of the first half's (finite values), so those products are exactly zero. The only cost is a
// few selects in the loads of each tile, none in the mma loop.
//
// Split-k: when there are too few output tiles to fill the GPU, `slices` blocks share a tile's k
// range. Each writes its fp32 partial tile to a workspace slot; the last one to arrive sums them in
// slice order and resets the tile's counter (the protocol of w4a16/fixup.cuh: bitwise
// deterministic, the workspace clean for the next launch, no block ever waits on another).
//
// Grouped (-D TF_W4A16_GROUPED: the expert GEMMs of mixture-of-experts layers, ops/moe_kernels.py): the
// weights are E experts stacked (expert e's packed / scales / zeros / bias start e * their stride elements
// in), and blockIdx.x indexes a block table (kernels/moe/align.cu) instead of m tiles: entry b holds an
// expert (-1: unused), the first sorted row and the row count (<= BM; <= 8 in swap mode). Tile row r reads
// x row src_rows[first + r] (null: first + r) and writes y row o = dst_rows[first + r] (null: first + r),
// scaled by row_scale[o] (null: 1) after the bias, before the store. An unused entry's blocks, all its k
// slices, exit before anything else, so its tile counter is never touched. The pipeline, the decoding and
// the fixup protocol are the same code; without the define the kernel is exactly the dense one.
//
// Epilogues (w4a16/epilogue.cuh, dense builds only): plain, + residual, or gated (silu(gate) * up of
// interleaved columns); the k-split fixup pairs a gate column pair with its up pair (lane ^ 4).
//
// Programmatic dependent launch: the prologue's weights, scales and zero points go out before
// grid_dependency_wait (nothing in the stream writes them), x after it; everything the kernel writes
// comes later still, and the next kernel may be scheduled once every block is set up.
#include "w4a16/dequant.cuh"
#include "w4a16/epilogue.cuh"
#include "w4a16/fixup.cuh"

using namespace tf;

#ifdef TF_W4A16_GROUPED
constexpr bool kGrouped = true;
#define TF_W4A16_GROUPED_PARAMS                                                                          \
    , const int* __restrict__ block_expert, const int* __restrict__ block_start,                        \
        const int* __restrict__ block_rows, const int* __restrict__ src_rows, const int* __restrict__ dst_rows, \
        const float* __restrict__ row_scale, long long w_stride, long long scale_stride, long long zero_stride, \
        long long bias_stride
#else
constexpr bool kGrouped = false;
#define TF_W4A16_GROUPED_PARAMS
#endif

// A grouped block's rows (the header's "Grouped"): which x row tile row r reads, which y row it writes,
// and that row's scale. Dense builds declare one and never read it.
struct GroupRows {
    int first;
    const int* src;
    const int* dst;
    const float* scale;
    __device__ __forceinline__ int x_row(int r) const { return src != nullptr ? src[first + r] : first + r; }
    __device__ __forceinline__ int out_row(int r) const { return dst != nullptr ? dst[first + r] : first + r; }
    __device__ __forceinline__ float factor(int row) const { return scale != nullptr ? scale[row] : 1.f; }
};

constexpr int kThreads = 256;
constexpr int kBK = 128;  // k per pipeline tile (k % 128 == 64: the last tile is half of one)

// Shared-memory bytes of one pipeline stage (the host computes the same numbers).
template <int MB, int WN, int GROUP, bool ASYM, bool BREG>
struct StageLayout {
    static constexpr int BM = 16 * MB, BN = 64 * WN;
    static constexpr int kA = BM * kBK * 2;
    static constexpr int kB = BREG ? 0 : kBK * BN / 2;  // BREG: weights bypass shared memory
    static constexpr int kScaleRows = GROUP ? kBK / GROUP : 0;
    static constexpr int kZeroRows = ASYM ? (GROUP ? kBK / GROUP : 1) : 0;
    static constexpr int kS = kScaleRows * BN * 2;
    static constexpr int kZ = kZeroRows * BN * 2;
    static constexpr int kBytes = kA + kB + kS + kZ;
};

// 16-row tiles get an explicit 128-register budget (2 blocks per SM): without it ptxas 13.0
// squeezed one sm_80 variant to 64 registers and spilled; 32-row tiles need up to 255.
template <typename T, int MB, int WN, int WK, int STAGES, int GROUP, bool ASYM, bool SWAP = false, bool BREG = false>
__global__ void __launch_bounds__(kThreads, MB == 1 ? 2 : 1)
w4a16_gemm(const T* __restrict__ x, const uint4* __restrict__ w, const T* __restrict__ scales,
           const T* __restrict__ zeros, const T* __restrict__ bias, T* __restrict__ out,
           float* __restrict__ workspace, int* __restrict__ counters, int m, int n, int k,
           int slices, const T* __restrict__ residual, int gated TF_W4A16_GROUPED_PARAMS) {
    static_assert(WN * WK == 8, "8 warps");
    static_assert(!SWAP || MB == 1, "swap handles up to 8 rows: one 16-row block");
    constexpr int NJ = SWAP ? 4 : 8;  // accumulator tiles per 16-row block: 16x8 each
    using L = StageLayout<MB, WN, GROUP, ASYM, BREG>;
    using DQ = WeightDecoder<T>;
    static_assert(kDecoderHasZeros || !ASYM, "NF4 codes have no zero points");
    using V2 = Vec2<T>;
    constexpr int BM = L::BM, BN = L::BN, KW = 8 / WK;
    constexpr int kAccPerThread = MB * NJ * 4;

    extern __shared__ __align__(16) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wn = warp % WN, wk = warp / WN;
    const int g = lane >> 2, t = lane & 3;
    GroupRows grp{};
#ifdef TF_W4A16_GROUPED
    // Block table entry blockIdx.x: its expert's weights, and m becomes its row count (m0 = 0 below).
    {
        const int expert = block_expert[blockIdx.x];
        if (expert < 0) return;
        grp = GroupRows{block_start[blockIdx.x], src_rows, dst_rows, row_scale};
        m = block_rows[blockIdx.x];
        w = reinterpret_cast<const uint4*>(reinterpret_cast<const int*>(w) + expert * w_stride);
        scales += expert * scale_stride;
        if (zeros != nullptr) zeros += expert * zero_stride;
        if (bias != nullptr) bias += expert * bias_stride;
    }
#endif
    // The fused epilogues: dense builds only (a grouped build's rows are scattered and weighted).
    const bool gated_on = !kGrouped && gated;
    const Epilogue<T> epi{kGrouped ? nullptr : residual, gated_on};
    // Output coordinates (row within the block tile, column within the strip) of acc[a][j][c].
    auto acc_row = [&](int a, int j, int c) { return SWAP ? 2 * t + (c & 1) : a * 16 + g + 8 * (c >> 1); };
    auto acc_col = [&](int j, int c) { return SWAP ? 16 * j + g + 8 * (c >> 1) : j * 8 + 2 * t + (c & 1); };

    // m tiles vary fastest, so the blocks that share a weight tile run at the same time and the
    // weights come from DRAM once (then L2) however many 16-row blocks m has.
    const int m_tiles = gridDim.x;
    const int tile = blockIdx.y * m_tiles + blockIdx.x;
    const int n0 = blockIdx.y * BN, m0 = kGrouped ? 0 : blockIdx.x * BM;
    const int k_tiles = (k + kBK - 1) / kBK;
    const int half_kt = k % kBK ? k_tiles - 1 : -1;  // the half tile (host-checked: k % 64 == 0), or none
    const int slice = blockIdx.z;
    const int kt_begin = (int)((long long)slice * k_tiles / slices);
    const int kt_end = (int)((long long)(slice + 1) * k_tiles / slices);
    // Strip-major weights: strip S's k16 row r is at w[(S * k/16 + r) * 32 + lane].
    const size_t strip_stride = (size_t)(k / 16) * 32;
    const uint4* w_strip = w + (size_t)(n0 / 64) * strip_stride + warp * 32 + lane;

    auto stage_ptr = [&](int s) { return smem + s * L::kBytes; };

    // Per-thread x-copy addresses, computed once: source row pointers (row 0 for rows past m,
    // which are zero-filled, never read) and swizzled shared-memory offsets.
    constexpr int kACopies = (BM * 16 + kThreads - 1) / kThreads;
    const T* a_src[kACopies];
    int a_dst[kACopies];
    unsigned a_valid = 0;
    const bool a_hi = (tid & 8) != 0;  // this thread copies x chunks 8..15 (k 64..127 of a tile)
    static_assert(kThreads % 16 == 0, "a thread's x chunk column is the same in every copy");
#pragma unroll
    for (int i = 0; i < kACopies; ++i) {
        const int c = tid + i * kThreads, row = c >> 4, col = c & 15;
        const bool valid = c < BM * 16 && m0 + row < m;
        int src = valid ? m0 + row : 0;
        if constexpr (kGrouped) src = valid ? grp.x_row(row) : 0;
        a_src[i] = x + (size_t)src * k + col * 8;
        a_dst[i] = row * kBK + ((col ^ (row & 7)) << 3);
        a_valid |= (valid ? 1u : 0u) << i;
    }

    auto load_x = [&](int s, int kt) {
        T* a_s = reinterpret_cast<T*>(stage_ptr(s));
        const int k0 = kt * kBK;
        // x tile: BM rows x 16 chunks of 16 B, swizzled; rows past m are zero-filled, and so are
        // chunks 8..15 of the half tile (their source moved 64 k back, inside the row; nothing is read).
        const bool a_zero = kt == half_kt && a_hi;
        const int a_k0 = a_zero ? k0 - kBK / 2 : k0;
#pragma unroll
        for (int i = 0; i < kACopies; ++i)
            if (BM * 16 % kThreads == 0 || tid + i * kThreads < BM * 16)
                cp_async16(a_s + a_dst[i], a_src[i] + a_k0, ((a_valid >> i) & 1) && !a_zero);
    };
    auto load_weights = [&](int s, int kt) {
        unsigned char* base = stage_ptr(s);
        uint4* b_s = reinterpret_cast<uint4*>(base + L::kA);
        const int k0 = kt * kBK;
        const bool half = kt == half_kt;
        // weight tile: strip i of the block's WN strips is 8 k16 rows x 512 B = 4 KB contiguous in
        // global memory (strip-major layout); warp `warp` copies row `warp` of every strip (half tile:
        // rows 4..7 copy rows 0..3).
        if constexpr (!BREG) {
            const size_t w_off = (size_t)kt * 256 - (half && warp >= 4 ? 4 * 32 : 0);
#pragma unroll
            for (int i = 0; i < WN; ++i)
                cp_async16(b_s + (warp * WN + i) * 32 + lane, w_strip + (size_t)i * strip_stride + w_off);
        }
        // Scale / zero-point rows: the half tile's second half repeats the first half's rows (group
        // 128 never has a half tile: the host checks k % group).
        constexpr int kHalfRows = L::kScaleRows / 2;
        if constexpr (GROUP > 0) {
            T* s_s = reinterpret_cast<T*>(base + L::kA + L::kB);
            constexpr int chunks = L::kScaleRows * BN / 8;
            if (tid < chunks) {
                int row = tid / (BN / 8), col = tid % (BN / 8);
                const int srow = kHalfRows > 0 && half && row >= kHalfRows ? row - kHalfRows : row;
                cp_async16(s_s + row * BN + col * 8, scales + (size_t)(k0 / GROUP + srow) * n + n0 + col * 8);
            }
        }
        if constexpr (ASYM) {
            T* z_s = reinterpret_cast<T*>(base + L::kA + L::kB + L::kS);
            constexpr int chunks = L::kZeroRows * BN / 8;
            if (tid < chunks) {
                int row = tid / (BN / 8), col = tid % (BN / 8);
                const int srow = GROUP && kHalfRows > 0 && half && row >= kHalfRows ? row - kHalfRows : row;
                int zrow = GROUP ? k0 / GROUP + srow : 0;
                cp_async16(z_s + row * BN + col * 8, zeros + (size_t)zrow * n + n0 + col * 8);
            }
        }
    };

    float acc[MB][NJ][4];
#pragma unroll
    for (int a = 0; a < MB; ++a)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[a][j][c] = 0.f;

    // Symmetric weights: the zero point is the constant 8.
    typename DQ::Zero zsym = DQ::zero(8.f);

    // BREG: each warp loads its own weight words (its strip, its k16 steps) straight into a
    // register ring of STAGES slots, issued at the same distance ahead as the cp.async stages. In the
    // half tile, k16 rows 4..7 load rows 0..3 (their x is zero).
    uint4 breg[BREG ? STAGES : 1][KW];
    const uint4* w_warp = w + ((size_t)(n0 / 64 + wn) * (k / 16) + wk * KW) * 32 + lane;
    auto breg_off = [&](int kt, int kk) {
        return (size_t)kt * 256 + kk * 32 - (kt == half_kt && wk * KW + kk >= 4 ? 4 * 32 : 0);
    };
    (void)w_warp;
    (void)breg;
    (void)breg_off;

    launch_dependent_grids();  // the next kernel's blocks may take SMs as these leave

    // Prologue: fill STAGES-1 stages, their weights before grid_dependency_wait and x after it. The first
    // commit group holds every prologue weight copy and stage 0's x, group s stage s's x: each stage's
    // data is in a group no later than its own, so the main loop's waits still cover it.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (kt_begin + s < kt_end) {
            load_weights(s, kt_begin + s);
            if constexpr (BREG) {
#pragma unroll
                for (int kk = 0; kk < KW; ++kk) breg[s][kk] = ld_nc_v4(w_warp + breg_off(kt_begin + s, kk));
            }
        }
    }
    grid_dependency_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (kt_begin + s < kt_end) load_x(s, kt_begin + s);
        cp_async_commit();
    }

    // The k loop is unrolled by STAGES so the ring slot `u` is a compile-time index (register
    // arrays must never be indexed at run time).
    for (int kt0 = kt_begin; kt0 < kt_end; kt0 += STAGES) {
#pragma unroll
    for (int u = 0; u < STAGES; ++u) {
        const int kt = kt0 + u;
        if (kt >= kt_end) break;
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt is visible to all; everyone is done with tile kt-1's stage
        {
            const int nxt = kt + STAGES - 1;
            const int nslot = (u + STAGES - 1) % STAGES;  // a constant once the loop is unrolled
            if (nxt < kt_end) {
                load_x(nslot, nxt);
                load_weights(nslot, nxt);
                if constexpr (BREG) {
#pragma unroll
                    for (int kk = 0; kk < KW; ++kk) breg[nslot][kk] = ld_nc_v4(w_warp + breg_off(nxt, kk));
                }
            }
            cp_async_commit();
        }
        unsigned char* base = stage_ptr(u);
        const T* a_s = reinterpret_cast<const T*>(base);
        const uint4* b_s = reinterpret_cast<const uint4*>(base + L::kA);
        // This lane's scales / zero points of subtiles 0..7 (column 8*sub + g of the strip), 16 B
        // each. With one group per k tile (group >= 128, or per-channel zeros) they are loaded once
        // per tile; smaller groups reload them per k16 step.
        typename V2::type sc2[8];
        typename DQ::Zero zs[8];
        auto load_scales = [&](int s16) {
            if constexpr (GROUP > 0) {
                const int grp = (s16 * 16) / GROUP;
                const T* s_s = reinterpret_cast<const T*>(base + L::kA + L::kB);
                uint4 sv = *reinterpret_cast<const uint4*>(s_s + grp * BN + wn * 64 + g * 8);
                const T* sp = reinterpret_cast<const T*>(&sv);
#pragma unroll
                for (int j = 0; j < 8; ++j) sc2[j] = V2::dup(sp[j]);
            }
            if constexpr (ASYM) {
                const int zrow = GROUP ? (s16 * 16) / GROUP : 0;
                const T* z_s = reinterpret_cast<const T*>(base + L::kA + L::kB + L::kS);
                uint4 zv = *reinterpret_cast<const uint4*>(z_s + zrow * BN + wn * 64 + g * 8);
                const T* zp = reinterpret_cast<const T*>(&zv);
#pragma unroll
                for (int j = 0; j < 8; ++j) zs[j] = DQ::zero(to_float(zp[j]));
            }
        };
        constexpr bool kOneGroupPerTile = GROUP == 0 || GROUP >= kBK;
        if constexpr (kOneGroupPerTile) load_scales(0);
#pragma unroll
        for (int kk = 0; kk < KW; ++kk) {
            const int s16 = wk * KW + kk;  // k16 step within the tile
            u32 af[MB][4];
            u32 xb[2];  // SWAP: x^T as the B operand (rows 0-7 of the tile)
            if constexpr (SWAP) {
                int row = lane & 7, chunk = 2 * s16 + ((lane >> 3) & 1);
                ldmatrix_x2(xb, a_s + row * kBK + ((chunk ^ (row & 7)) << 3));
            } else {
#pragma unroll
                for (int a = 0; a < MB; ++a) {
                    int row = a * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
                    int chunk = 2 * s16 + (lane >> 4);
                    ldmatrix_x4(af[a], a_s + row * kBK + ((chunk ^ (row & 7)) << 3));
                }
            }
            uint4 bw;
            if constexpr (BREG) bw = breg[u][kk];
            else bw = b_s[(s16 * WN + wn) * 32 + lane];
            u32 words[4] = {bw.x, bw.y, bw.z, bw.w};
            if constexpr (!kOneGroupPerTile) load_scales(s16);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 frag[4];
                DQ::run(words[j], ASYM ? zs[2 * j] : zsym, ASYM ? zs[2 * j + 1] : zsym, frag);
                if constexpr (GROUP > 0) {
#pragma unroll
                    for (int p = 0; p < 4; ++p) {
                        typename V2::type v = *reinterpret_cast<typename V2::type*>(&frag[p]);
                        v = __hmul2(v, sc2[2 * j + (p >> 1)]);
                        frag[p] = *reinterpret_cast<u32*>(&v);
                    }
                }
                if constexpr (SWAP) {
                    const u32 wa[4] = {frag[0], frag[2], frag[1], frag[3]};  // rows g, g+8 x k lo, hi
                    Mma<T>::run(acc[0][j], wa, xb[0], xb[1]);
                } else {
#pragma unroll
                    for (int a = 0; a < MB; ++a) {
                        Mma<T>::run(acc[a][2 * j], af[a], frag[0], frag[1]);
                        Mma<T>::run(acc[a][2 * j + 1], af[a], frag[2], frag[3]);
                    }
                }
            }
        }
    }
    }
    cp_async_wait<0>();
    __syncthreads();

    // Block-level k reduction: warps wk > 0 hand their partial sums to warp wk == 0 of the strip,
    // which adds them in wk order. Layout [warp][value][lane] keeps the accesses conflict-free.
    float* red = reinterpret_cast<float*>(smem);
    if constexpr (WK > 1) {
        if (wk > 0) {
            float* dst = red + ((wk - 1) * WN + wn) * (kAccPerThread * 32);
#pragma unroll
            for (int a = 0; a < MB; ++a)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int c = 0; c < 4; ++c) dst[((a * NJ + j) * 4 + c) * 32 + lane] = acc[a][j][c];
        }
        __syncthreads();
        if (wk == 0) {
#pragma unroll 1
            for (int w2 = 1; w2 < WK; ++w2) {
                const float* src = red + ((w2 - 1) * WN + wn) * (kAccPerThread * 32);
#pragma unroll
                for (int a = 0; a < MB; ++a)
#pragma unroll
                    for (int j = 0; j < NJ; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[a][j][c] += src[((a * NJ + j) * 4 + c) * 32 + lane];
            }
        }
    }

    // Split-k fixup across blocks (w4a16/fixup.cuh). The workspace holds, per tile, one row-major
    // BM x BN fp32 partial per slice (rows past m are never written nor read).
    if (slices > 1) {
        __shared__ int s_is_last;
        float* tile_ws = workspace + (size_t)tile * slices * (BM * BN);
        if (wk == 0) {
            float* dst = tile_ws + (size_t)slice * (BM * BN);
#pragma unroll
            for (int a = 0; a < MB; ++a)
#pragma unroll
                for (int j = 0; j < NJ; ++j)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int row = acc_row(a, j, c);
                        if (m0 + row < m) __stcg(dst + row * BN + wn * 64 + acc_col(j, c), acc[a][j][c]);
                    }
        }
        if (!fixup_arrive_cta(counters + tile, slices, tid == 0, s_is_last, [] { __syncthreads(); })) return;
        // The last block reduces with all 256 threads: each owns column pairs of valid rows and
        // sums the slices in slice order (deterministic); the loads of different slices are
        // independent, so they are in flight together.
        const int rows = min(BM, m - m0);
        // rows x BN / 2 is a multiple of 32, so every lane of a warp runs every round (the gated shuffle).
        for (int e = tid; e < rows * (BN / 2); e += kThreads) {
            const int row = e / (BN / 2), col = 2 * (e % (BN / 2));
            const float* src = tile_ws + row * BN + col;
            float2 sum = __ldcg(reinterpret_cast<const float2*>(src));
#pragma unroll 4
            for (int s = 1; s < slices; ++s) {
                float2 v = __ldcg(reinterpret_cast<const float2*>(src + (size_t)s * (BM * BN)));
                sum.x += v.x;
                sum.y += v.y;
            }
            const int gcol = n0 + col;
            float2 sc = make_float2(1.f, 1.f), bi = make_float2(0.f, 0.f);
            if constexpr (GROUP == 0) sc = V2::to_float2(*reinterpret_cast<const typename V2::type*>(scales + gcol));
            if (bias != nullptr) bi = V2::to_float2(*reinterpret_cast<const typename V2::type*>(bias + gcol));
            float v0 = sum.x * sc.x + bi.x, v1 = sum.y * sc.y + bi.y;
            int orow = m0 + row;
            if constexpr (kGrouped) {
                orow = grp.out_row(row);
                const float f = grp.factor(orow);
                v0 *= f;
                v1 *= f;
            }
            if (gated_on) {  // gate pair col (col % 16 < 8) and its up pair col + 8, four pairs (lanes) on
                const float u0 = __shfl_xor_sync(0xffffffffu, v0, 4), u1 = __shfl_xor_sync(0xffffffffu, v1, 4);
                if (!(col & 8))
                    *reinterpret_cast<typename V2::type*>(out + (size_t)orow * (n / 2) + gated_column(gcol)) =
                        V2::make(epi.silu_mul(v0, u0), epi.silu_mul(v1, u1));
                continue;
            }
            const size_t at = (size_t)orow * n + gcol;
            *reinterpret_cast<typename V2::type*>(out + at) = V2::make(epi.plain(v0, at), epi.plain(v1, at + 1));
        }
        if (tid == 0) fixup_reset(counters + tile);
        return;
    }

    if (wk != 0) return;
    // Epilogue: per-channel scale, bias, convert, store (rows past m are skipped).
    if constexpr (SWAP) {
        // acc[0][j][c] and acc[0][j][c + 2] (c < 2): columns col and col + 8 of one row (gate and up).
        auto value = [&](int j, int c, int col) {
            float v = acc[0][j][c];
            if constexpr (GROUP == 0) v *= to_float(scales[col]);
            if (bias != nullptr) v += to_float(bias[col]);
            return v;
        };
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int row = m0 + acc_row(0, j, c), col = n0 + wn * 64 + acc_col(j, c);
                if (row >= m) continue;
                if (gated_on) {
                    if (c < 2)
                        out[(size_t)row * (n / 2) + gated_column(col)] =
                            V2::one(epi.silu_mul(value(j, c, col), value(j, c + 2, col + 8)));
                    continue;
                }
                float v = value(j, c, col);
                int orow = row;
                if constexpr (kGrouped) {
                    orow = grp.out_row(row);
                    v *= grp.factor(orow);
                }
                const size_t at = (size_t)orow * n + col;
                out[at] = V2::one(epi.plain(v, at));
            }
    } else {
    // acc[a][j] is n8 subtile j of the strip: gated, subtile 2 p holds gate columns and 2 p + 1 their up
    // columns, both in this thread.
    auto scale_bias = [&](int j, int a, int h) {
        const int col = n0 + wn * 64 + j * 8 + 2 * t;
        float2 sc = make_float2(1.f, 1.f), bi = make_float2(0.f, 0.f);
        if constexpr (GROUP == 0) sc = V2::to_float2(*reinterpret_cast<const typename V2::type*>(scales + col));
        if (bias != nullptr) bi = V2::to_float2(*reinterpret_cast<const typename V2::type*>(bias + col));
        return make_float2(acc[a][j][2 * h] * sc.x + bi.x, acc[a][j][2 * h + 1] * sc.y + bi.y);
    };
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int col = n0 + wn * 64 + j * 8 + 2 * t;
#pragma unroll
        for (int a = 0; a < MB; ++a) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + a * 16 + g + 8 * h;
                if (row < m) {
                    const float2 v = scale_bias(j, a, h);
                    float v0 = v.x, v1 = v.y;
                    if (gated_on) {
                        if (j % 2 == 0) {
                            const float2 u = scale_bias(j + 1, a, h);
                            *reinterpret_cast<typename V2::type*>(out + (size_t)row * (n / 2) + gated_column(col)) =
                                V2::make(epi.silu_mul(v0, u.x), epi.silu_mul(v1, u.y));
                        }
                        continue;
                    }
                    int orow = row;
                    if constexpr (kGrouped) {
                        orow = grp.out_row(row);
                        const float f = grp.factor(orow);
                        v0 *= f;
                        v1 *= f;
                    }
                    const size_t at = (size_t)orow * n + col;
                    *reinterpret_cast<typename V2::type*>(out + at) = V2::make(epi.plain(v0, at), epi.plain(v1, at + 1));
                }
            }
        }
    }
    }
}
