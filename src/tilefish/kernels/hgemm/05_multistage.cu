// HGEMM step 5: cp.async multistage pipeline + register double buffering of fragments.
// C = A @ B, A [M, K] row-major, B [K, N] row-major (B_NK = false) or B [N, K] row-major
// (B_NK = true, nn.Linear weights), T = __half or __nv_bfloat16, fp32 accumulation, C in T.
//
// Tiling (template parameters, dispatch defaults in ops/hgemm.py): a block of (BM/WM) x (BN/WN)
// warps owns a BM x BN tile of C (e.g. 128 x 256, warps 2 x 4 of 64 x 64) and walks K in
// BK-deep chunks (32 or 64) through a ring of STAGES (2..4) shared-memory buffers, dynamic
// shared memory, STAGES * (BM + BN) * BK * 2 bytes, XOR-swizzled as in step 4.
//
// What changed vs step 4:
//   * cp.async.cg (16 bytes, L2 only) copies global -> shared directly: no registers hold data
//     in flight and no LDG -> STS dependency stalls the warp. Out-of-range chunks use the
//     zero-fill form (src-size 0). Per-chunk pointers and predicates are computed once per block.
//   * Pipeline: the prologue fills all STAGES buffers (one commit group each). The last k16 step
//     of stage kt waits for stage kt+1 (cp.async.wait_group STAGES-2); one __syncthreads
//     publishes it to the block and proves every warp has read all of stage kt, whose buffer is
//     refilled at once with stage kt+STAGES -- so STAGES-1 chunks of copy are always in flight
//     under the mmas, and there is one barrier per chunk. STAGES = 2 is classic double buffering.
//   * Fragments are double-buffered in registers: the ldmatrix of k step kk+1 is issued before
//     the mmas of k step kk, across stage boundaries too (stage kt+1's first fragments load
//     before stage kt's last mmas), so shared-memory latency and the barrier's skew between
//     warps hide behind tensor-core work.
//   * ldmatrix addresses are a per-lane base plus compile-time offsets (the swizzle's XOR is
//     split out once per thread), not a swizzle computed per fragment.
//   * B fragments come two n8 tiles per ldmatrix.x4(.trans) (half the ldmatrix issues of x2).
//
// Limits: the grid walks tiles in launch order (all N tiles of one M row, then the next), so
// consecutive blocks share A but each sweeps all of B: at large N, B falls out of L2 between
// uses (step 6). The epilogue stores fragments straight from registers (16 bytes per row quad;
// no smem-staged 16-byte stores). mma.sync on Hopper issues at well under the wgmma rate (~65 %
// of peak at best), and a 64 x 64 warp tile reads 128 bytes of shared memory per mma.
// Edges: any M, N (predicated); K % 8 == 0 and, for B [K, N], N % 8 == 0; 16-byte aligned rows.
#include "common/ptx.cuh"
#include "hgemm/epilogue.cuh"

namespace hg {
using tf::u32;

// XOR-swizzled tiles, as step 4: dense pitch COLS, 16-byte chunk index XOR-ed with row bits so
// the 8 rows of every ldmatrix matrix (and every cp.async store phase) hit 8 distinct bank groups.
template <int COLS> __device__ __forceinline__ int soff(int r, int c) {
    constexpr int CPR = COLS / 8;
    constexpr int RPL = CPR >= 8 ? 1 : 8 / CPR;  // rows per 128-byte bank line
    constexpr int SW = CPR >= 8 ? 8 : CPR;       // swizzle span in chunks
    static_assert((CPR & (CPR - 1)) == 0, "power-of-two chunks per row");
    return r * COLS + ((((c >> 3) ^ ((r / RPL) % SW))) << 3) + (c & 7);
}
// The XOR pattern of row r: it repeats every 8 rows, so rows that differ by a multiple of 8 (the
// i / j / kk offsets of a warp's fragments) share it, and it can be computed once from the lane.
template <int COLS> __device__ __forceinline__ int swz_phase(int r) {
    constexpr int CPR = COLS / 8;
    constexpr int RPL = CPR >= 8 ? 1 : 8 / CPR;
    constexpr int SW = CPR >= 8 ? 8 : CPR;
    return (r / RPL) % SW;
}

// One operand's share of a pipeline stage for this thread: ITERS 16-byte chunks of a ROWS x COLS
// tile of a row-major matrix. NT is a multiple of the chunks per row, so a thread's chunks all sit
// in one column c, on rows r0, r0 + RSTEP, ...: one base pointer and one row stride describe them
// all (few registers: the 64 x 64 warp tiles need every one for accumulators and fragments).
//   KROWS = true:  the tile's rows run along K (B [K, N]): stage kt starts kt*ROWS rows further.
//   KROWS = false: the tile's columns run along K (A, B [N, K]): kt*COLS columns further.
template <typename T, int ROWS, int COLS, int NT, bool KROWS>
struct TileCopy {
    static constexpr int CPR = COLS / 8;
    static constexpr int ITERS = ROWS * CPR / NT;
    static constexpr int RSTEP = NT / CPR;
    static_assert((ROWS * CPR) % NT == 0 && NT % CPR == 0, "tile must split evenly into 16-byte chunks per thread");
    const T* base;     // chunk 0 of this thread at k stage 0 (only dereferenced when in range)
    size_t stride;     // RSTEP rows, in elements
    int r0, c;         // the thread's first tile row and its column
    int bound;         // KROWS: 1 if the column is inside N, else 0; !KROWS: rows left inside M/N

    // g: matrix base; ldg: row pitch; row0/col0: the block's first row/col; row_end/col_end:
    // the bound of the non-K dimension (the K bound is tested per stage in copy()).
    __device__ __forceinline__ TileCopy(const T* g, int ldg, int row0, int row_end, int col0, int col_end, int tid) {
        r0 = tid / CPR;
        c = (tid % CPR) * 8;
        base = g + (size_t)(row0 + r0) * ldg + col0 + c;
        stride = (size_t)RSTEP * ldg;
        bound = KROWS ? (col0 + c < col_end ? 1 : 0) : row_end - row0 - r0;
    }
    // Issue the cp.async copies of k-stage kt into the smem tile s (zero-fill outside the matrix:
    // src-size 0 reads nothing, and the source pointer is then the matrix base, never out of bounds).
    __device__ __forceinline__ void copy(T* s, const T* g, int ldg, int kt, int K) const {
        const int k0 = kt * (KROWS ? ROWS : COLS);
        const T* p = KROWS ? base + (size_t)k0 * ldg : base + k0;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            const int r = r0 + i * RSTEP;
            const bool v = KROWS ? (bound != 0 && k0 + r < K) : (i * RSTEP < bound && k0 + c < K);
            // Rows r0 + i RSTEP share r0's swizzle when RSTEP is a multiple of its 8-row period:
            // one offset for all chunks instead of a swizzle per chunk (registers, instructions).
            const int off = RSTEP % 8 == 0 ? soff<COLS>(r0, c) + i * RSTEP * COLS : soff<COLS>(r, c);
            tf::cp_async16(&s[off], v ? p + i * stride : g, v);
        }
    }
};


// The block's main loop, shared with step 6 (which only changes the order of the tiles): the
// BM x BN tile of C at (m0, n0), K swept through the STAGES-deep cp.async ring, accumulated
// into acc (fp32 fragments of the warp's WM x WN tile). Needs STAGES * (BM + BN) * BK * 2 bytes
// of dynamic shared memory.
template <typename T, bool B_NK, int BM, int BN, int BK, int WM, int WN, int STAGES>
__device__ __forceinline__ void multistage_mainloop(const T* __restrict__ A, const T* __restrict__ B, int M, int N,
                                                    int K, int m0, int n0, float (&acc)[WM / 16][WN / 8][4]) {
    constexpr int WARPS_N = BN / WN;
    constexpr int NT = (BM / WM) * WARPS_N * 32;
    constexpr int MI = WM / 16, NI = WN / 8;      // mma tiles per warp
    constexpr int KSTEPS = BK / 16;
    constexpr int A_STAGE = BM * BK, B_STAGE = BN * BK;  // elements per stage
    static_assert(STAGES >= 2, "at least double buffering");
    static_assert(BM % WM == 0 && BN % WN == 0, "warp tile must divide the block tile");
    static_assert(WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0, "m16 x n16 (two n8 per ldmatrix.x4) x k16");
    static_assert(NT <= 1024, "at most 1024 threads");
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sA = reinterpret_cast<T*>(smem_raw);
    T* sB = sA + STAGES * A_STAGE;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
    const int KT = (K + BK - 1) / BK;  // once per block

    const TileCopy<T, BM, BK, NT, false> ca(A, K, m0, M, 0, K, tid);
    typedef TileCopy<T, (B_NK ? BN : BK), (B_NK ? BK : BN), NT, !B_NK> BCopy;
    const BCopy cb = B_NK ? BCopy(B, K, n0, N, 0, K, tid) : BCopy(B, N, 0, K, n0, N, tid);
    const int ldb = B_NK ? K : N;

    // Prologue: all STAGES stages in flight, one commit group each (empty groups past KT keep the
    // group count uniform, so the wait_group counts below always mean "stage kt+1 landed").
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
        if (s < KT) {
            ca.copy(sA + s * A_STAGE, A, K, s, K);
            cb.copy(sB + s * B_STAGE, B, ldb, s, K);
        }
        tf::cp_async_commit();
    }

#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    // Register double buffer: the fragments of the next k16 step are ldmatrix'ed into one half while
    // the mmas of this step read the other. It runs across stage boundaries: the last k16 step of
    // a stage waits for the next stage (wait_group + the one barrier per stage) and loads that
    // stage's first fragments *before* issuing its own mmas, so the barrier skew between warps and
    // the ldmatrix latency hide under that step's tensor work instead of stalling every warp at
    // the top of each stage.
    static_assert(KSTEPS % 2 == 0, "BK a multiple of 32: k16 step 0 of every stage uses fragment buffer 0");
    u32 af[2][MI][4], bf[2][NI][2];
    // ldmatrix addresses: a lane-dependent part computed once here, plus compile-time offsets per
    // (i / j, kk). Recomputing soff() for every fragment made the compiler redo the swizzle per
    // address (~200 integer instructions per 128 HMMAs) and, with the stage-crossing buffer,
    // pushed the 64 x 64 warp tiles past 255 registers.
    //   A rows wm + 16 i + (lane & 15), 16-byte chunk 2 kk + (lane >> 4) (k 0-7 / 8-15);
    //   B [N, K]: rows wn + 8 j + (lane & 7) + 8 (lane >> 4), chunk 2 kk + ((lane >> 3) & 1);
    //   B [K, N]: rows 16 kk + (lane & 7) + 8 ((lane >> 3) & 1), chunk wn / 8 + j + (lane >> 4).
    // For A and B [N, K] the chunk's XOR splits: (2 kk + h) ^ p = 2 kk ^ (h ^ p) for h in {0, 1}.
    const u32 sA_u = tf::smem_addr(sA), sB_u = tf::smem_addr(sB);
    const int a_row = (wm + (lane & 15)) * BK;
    const int a_x = (lane >> 4) ^ swz_phase<BK>(lane & 15);
    int b_row, b_x;
    if constexpr (B_NK) {
        b_row = (wn + (lane & 7) + ((lane >> 4) << 3)) * BK;
        b_x = ((lane >> 3) & 1) ^ swz_phase<BK>(lane & 7);
    } else {
        b_row = ((lane & 7) + (((lane >> 3) & 1) << 3)) * BN + (WN == 64 ? wn : 0);  // b_col below
        b_x = swz_phase<BN>(lane & 7);
    }
    // B [K, N] columns of tile pair j: chunk (wn / 8 + j + (lane >> 4)) ^ b_x. With 64-wide warp
    // tiles wn / 8 is a multiple of 8 and j + (lane >> 4) < 8, so the XOR stays in the low 3 bits
    // and splits like A's: one base register instead of one per j (NVRTC 13.5 spilled otherwise).
    const int b_xh = (lane >> 4) ^ b_x;
    auto b_col = [&](int j) {
        if constexpr (WN == 64) return (j ^ b_xh) << 3;  // + wn, folded into b_row
        else return (((wn >> 3) + j + (lane >> 4)) ^ b_x) << 3;
    };
    auto load_frags = [&](u32 a_s, u32 b_s, int kk, int buf) {  // a_s / b_s: the stage's smem addresses
#pragma unroll
        for (int i = 0; i < MI; ++i)  // lanes 0-15: rows at k, lanes 16-31: rows at k+8
            tf::ldmatrix_x4(af[buf][i], a_s + 2 * (a_row + i * 16 * BK + (((2 * kk) ^ a_x) << 3)));
#pragma unroll
        for (int j = 0; j < NI; j += 2) {  // one x4 = b0,b1 of two adjacent n8 tiles
            u32 r[4];
            if constexpr (B_NK)  // matrices: (n0-7,k0-7) (n0-7,k8-15) (n8-15,k0-7) (n8-15,k8-15)
                tf::ldmatrix_x4(r, b_s + 2 * (b_row + j * 8 * BK + (((2 * kk) ^ b_x) << 3)));
            else                 // k rows; .trans: (k0-7,n0-7) (k8-15,n0-7) (k0-7,n8-15) (k8-15,n8-15)
                tf::ldmatrix_x4_trans(r, b_s + 2 * (b_row + kk * 16 * BN + b_col(j)));
            bf[buf][j][0] = r[0]; bf[buf][j][1] = r[1];
            bf[buf][j + 1][0] = r[2]; bf[buf][j + 1][1] = r[3];
        }
    };
    int rs = 0;                       // the ring buffer being read (no modulo in the loop)
    tf::cp_async_wait<STAGES - 1>();  // this thread's copies of stage 0 have landed ...
    __syncthreads();                  // ... and everyone's
    load_frags(sA_u, sB_u, 0, 0);
    for (int kt = 0; kt < KT; ++kt) {
        const u32 a_s = sA_u + rs * (A_STAGE * 2), b_s = sB_u + rs * (B_STAGE * 2);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            if (kk == KSTEPS - 1) {
                // Stage kt+1: this thread's copies have landed (wait_group); the barrier says
                // everyone's have, and that every warp has read all of stage kt (its last
                // fragments were loaded one step ago), so its buffer takes stage kt+STAGES now.
                tf::cp_async_wait<STAGES - 2>();
                __syncthreads();
                if (kt + STAGES < KT) {
                    ca.copy(sA + rs * A_STAGE, A, K, kt + STAGES, K);
                    cb.copy(sB + rs * B_STAGE, B, ldb, kt + STAGES, K);
                }
                tf::cp_async_commit();
                rs = rs + 1 == STAGES ? 0 : rs + 1;
                if (kt + 1 < KT) load_frags(sA_u + rs * (A_STAGE * 2), sB_u + rs * (B_STAGE * 2), 0, 0);
            } else {
                load_frags(a_s, b_s, kk + 1, (kk + 1) & 1);
            }
            const int buf = kk & 1;  // mmas of k step kk
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NI; ++j)
                    tf::Mma<T>::run(acc[i][j], af[buf][i], bf[buf][j][0], bf[buf][j][1]);
        }
    }
    tf::cp_async_wait<0>();  // only empty groups can remain; drain before the block retires
}

}  // namespace hg

template <typename T, bool B_NK, int BM, int BN, int BK, int WM, int WN, int STAGES>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, 1)
hgemm_multistage(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
    using namespace hg;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;  // launch order: N tiles fastest
    float acc[WM / 16][WN / 8][4];
    multistage_mainloop<T, B_NK, BM, BN, BK, WM, WN, STAGES>(A, B, M, N, K, m0, n0, acc);
    const int warp = threadIdx.x >> 5;
    const int wm = (warp / (BN / WN)) * WM, wn = (warp % (BN / WN)) * WN;
#pragma unroll
    for (int i = 0; i < WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WN / 8; ++j) store_frag<T>(C, M, N, m0 + wm + i * 16, n0 + wn + j * 8, acc[i][j]);
}
