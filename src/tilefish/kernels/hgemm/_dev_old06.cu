// HGEMM step 6: step 5 + threadblock rasterization (grouped tile order for L2 reuse).
// C = A @ B, A [M, K] row-major, B [K, N] row-major (B_NK = false) or B [N, K] row-major
// (B_NK = true, nn.Linear weights), T = __half or __nv_bfloat16, fp32 accumulation, C in T.
//
// Tiling and pipeline: as step 5 (BM x BN block tile, (BM/WM) x (BN/WN) warps, BK-deep chunks
// through a STAGES-deep cp.async ring of XOR-swizzled tiles, register double-buffered
// fragments, ldmatrix.x4(.trans)).
//
// What changed vs step 5: the order in which output tiles are assigned to blocks. The grid is
// 1-D; block id pid is mapped to (tile_m, tile_n) in groups of GROUP_M tile rows:
//     group = pid / (GROUP_M * tiles_n);  first_m = group * GROUP_M
//     rows  = min(tiles_m - first_m, GROUP_M)
//     tile_m = first_m + (pid % (GROUP_M * tiles_n)) % rows
//     tile_n = (pid % (GROUP_M * tiles_n)) / rows
// so consecutive blocks walk DOWN a column of GROUP_M tiles before moving right. The ~132
// co-resident blocks then cover a roughly square patch of C (e.g. 8 x 16 tiles) instead of one
// long row: they read GROUP_M A panels and ~16 B panels instead of 1 A panel and all of B,
// which keeps the working set in the 50-60 MB L2 and cuts DRAM traffic at large N.
// The divisions run once per block, not in the loop.
//
// Limits: as step 5 -- mma.sync issue rate (Hopper's wgmma + TMA path is the next step), no
// smem-staged epilogue, a k-boundary bubble in the fragment double buffer. Edges: any M, N;
// K % 8 == 0 and, for B [K, N], N % 8 == 0; 16-byte aligned rows.
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
            tf::cp_async16(&s[soff<COLS>(r, c)], v ? p + i * stride : g, v);
        }
    }
};

}  // namespace hg

template <typename T, bool B_NK, int BM, int BN, int BK, int WM, int WN, int STAGES, int GROUP_M>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, 1)
hgemm_rasterized_old(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
    using namespace hg;
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
    int m0, n0;
    {   // grouped rasterization (see the header): GROUP_M tile rows per group, column-major inside
        const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
        const int pid = blockIdx.x, per_group = GROUP_M * tiles_n;
        const int group = pid / per_group, first_m = group * GROUP_M;
        const int rows = min(tiles_m - first_m, GROUP_M);
        const int in_group = pid - group * per_group;
        m0 = (first_m + in_group % rows) * BM;
        n0 = (in_group / rows) * BN;
    }
    const int KT = (K + BK - 1) / BK;  // once per block

    const TileCopy<T, BM, BK, NT, false> ca(A, K, m0, M, 0, K, tid);
    typedef TileCopy<T, (B_NK ? BN : BK), (B_NK ? BK : BN), NT, !B_NK> BCopy;
    const BCopy cb = B_NK ? BCopy(B, K, n0, N, 0, K, tid) : BCopy(B, N, 0, K, n0, N, tid);
    const int ldb = B_NK ? K : N;

    // Prologue: stages 0 .. STAGES-2 in flight, one commit group each (empty groups past KT
    // keep the group count uniform, so wait_group<STAGES-2> always means "stage kt landed").
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) {
            ca.copy(sA + s * A_STAGE, A, K, s, K);
            cb.copy(sB + s * B_STAGE, B, ldb, s, K);
        }
        tf::cp_async_commit();
    }

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    u32 af[2][MI][4], bf[2][NI][2];  // register double buffer: k step kk+1 loads under kk's mmas
    int rs = 0, ws = STAGES - 1;     // read / write stage of the ring (no modulo in the loop)
    for (int kt = 0; kt < KT; ++kt) {
        tf::cp_async_wait<STAGES - 2>();  // this thread's copies of stage kt have landed
        __syncthreads();                  // ... everyone's have, and stage kt-1 is free to refill
        if (kt + STAGES - 1 < KT) {
            ca.copy(sA + ws * A_STAGE, A, K, kt + STAGES - 1, K);
            cb.copy(sB + ws * B_STAGE, B, ldb, kt + STAGES - 1, K);
        }
        tf::cp_async_commit();
        ws = ws + 1 == STAGES ? 0 : ws + 1;

        const T* a_s = sA + rs * A_STAGE;
        const T* b_s = sB + rs * B_STAGE;
#pragma unroll
        for (int kk = 0; kk <= KSTEPS; ++kk) {
            if (kk < KSTEPS) {  // fragments of k step kk into buffer kk & 1
                const int buf = kk & 1;
#pragma unroll
                for (int i = 0; i < MI; ++i)  // lanes 0-15: rows at k, lanes 16-31: rows at k+8
                    tf::ldmatrix_x4(af[buf][i], &a_s[soff<BK>(wm + i * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8)]);
#pragma unroll
                for (int j = 0; j < NI; j += 2) {  // one x4 = b0,b1 of two adjacent n8 tiles
                    u32 r[4];
                    if constexpr (B_NK)  // matrices: (n0-7,k0-7) (n0-7,k8-15) (n8-15,k0-7) (n8-15,k8-15)
                        tf::ldmatrix_x4(r, &b_s[soff<BK>(wn + j * 8 + (lane & 7) + (lane >> 4) * 8,
                                                         kk * 16 + ((lane >> 3) & 1) * 8)]);
                    else                 // k rows; .trans: (k0-7,n0-7) (k8-15,n0-7) (k0-7,n8-15) (k8-15,n8-15)
                        tf::ldmatrix_x4_trans(r, &b_s[soff<BN>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                               wn + j * 8 + (lane >> 4) * 8)]);
                    bf[buf][j][0] = r[0]; bf[buf][j][1] = r[1];
                    bf[buf][j + 1][0] = r[2]; bf[buf][j + 1][1] = r[3];
                }
            }
            if (kk > 0) {  // mmas of k step kk-1
                const int buf = (kk - 1) & 1;
#pragma unroll
                for (int i = 0; i < MI; ++i)
#pragma unroll
                    for (int j = 0; j < NI; ++j)
                        tf::Mma<T>::run(acc[i][j], af[buf][i], bf[buf][j][0], bf[buf][j][1]);
            }
        }
        rs = rs + 1 == STAGES ? 0 : rs + 1;
    }
    tf::cp_async_wait<0>();  // only empty groups can remain; drain before the block retires

#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) store_frag<T>(C, M, N, m0 + wm + i * 16, n0 + wn + j * 8, acc[i][j]);
}
