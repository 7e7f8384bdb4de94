// HGEMM step 4: step 2 with XOR-swizzled shared-memory tiles instead of padding.
// C = A @ B, A [M, K] row-major, B [K, N] row-major (B_NK = false) or B [N, K] row-major
// (B_NK = true, nn.Linear weights), T = __half or __nv_bfloat16, fp32 accumulation, C in T.
//
// Tiling: as steps 2-3 (BM x BN block tile [128 x 128], BK [32], (BM/WM) x (BN/WN) warps
// [2 x 4], ldmatrix.x4 for A, ldmatrix.x2(.trans) for B, synchronous 16-byte loads).
//
// What changed vs step 3: the tiles keep their dense power-of-two pitch (no wasted bytes, shift
// addressing) and instead the 16-byte chunk index inside a row is XOR-ed with a few row bits:
//     phys_chunk = chunk ^ ((row / RPL) % SW)      RPL = max(1, 8 / CPR), SW = min(CPR, 8)
// where CPR = COLS / 8 chunks per row. A 128-byte bank line holds RPL rows; the 8 row addresses
// of one ldmatrix matrix (8 consecutive rows, same logical chunk) are spread over the 8 chunk
// positions of a bank line:
//     CPR >= 8 (BN = 128, BK = 64): chunk ^ (row % 8)    -> 8 distinct positions
//     CPR == 4 (BK = 32, 64 B rows): chunk ^ ((row/2)%4) -> (row%2)*4 + distinct -> 8 positions
//     CPR == 2 (BK = 16): chunk ^ ((row/4)%2)
// so every ldmatrix is one wavefront, like padding, with no padding. The copy side stays
// conflict-free because the XOR only permutes chunks inside a row (or a pair of rows) and a
// store phase writes whole rows. The SASS has LDSM (ldmatrix) with no bank-conflict replays.
//
// Limits: loads are still synchronous (registers -> st.shared -> barrier -> math), so copy and
// math never overlap; that is step 5. K % 8 == 0 and, for B [K, N], N % 8 == 0.
#include "common/ptx.cuh"
#include "hgemm/epilogue.cuh"

namespace hg {
using tf::u32;

// XOR-swizzled tiles (see the header): dense pitch COLS, chunk index XOR-ed with row bits.
template <int COLS> __host__ __device__ constexpr int tile_ld() { return COLS; }
template <int COLS> __device__ __forceinline__ int soff(int r, int c) {
    constexpr int CPR = COLS / 8;
    constexpr int RPL = CPR >= 8 ? 1 : 8 / CPR;  // rows per 128-byte bank line
    constexpr int SW = CPR >= 8 ? 8 : CPR;       // swizzle span in chunks
    static_assert((CPR & (CPR - 1)) == 0, "power-of-two chunks per row");
    return r * COLS + ((((c >> 3) ^ ((r / RPL) % SW))) << 3) + (c & 7);
}

// Copy a ROWS x COLS tile of a row-major matrix (row pitch LDG elements) into shared memory,
// synchronously: 16-byte global loads into registers, then 16-byte shared stores. Rows past
// row_end and chunks past col_end are zero-filled (col_end % 8 == 0, so a chunk is all in or out).
template <typename T, int ROWS, int COLS, int NT>
__device__ __forceinline__ void load_tile(T* s, const T* g, int ldg, int row0, int row_end, int col0,
                                          int col_end, int tid) {
    constexpr int CPR = COLS / 8;                 // 16-byte chunks per row
    static_assert((ROWS * CPR) % NT == 0, "tile must split evenly into 16-byte chunks per thread");
#pragma unroll
    for (int i = 0; i < ROWS * CPR / NT; ++i) {
        const int idx = tid + i * NT;
        const int r = idx / CPR, c = (idx % CPR) * 8;  // CPR is a power of two: shifts
        const int gr = row0 + r, gc = col0 + c;
        const bool ok = gr < row_end && gc < col_end;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (ok) v = *reinterpret_cast<const uint4*>(g + (size_t)gr * ldg + gc);
        *reinterpret_cast<uint4*>(&s[soff<COLS>(r, c)]) = v;
    }
}

}  // namespace hg

template <typename T, bool B_NK, int BM, int BN, int BK, int WM, int WN>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32)
hgemm_swizzled(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
    using namespace hg;
    constexpr int WARPS_N = BN / WN;
    constexpr int NT = (BM / WM) * WARPS_N * 32;
    constexpr int MI = WM / 16, NI = WN / 8;      // mma tiles per warp
    constexpr int B_ROWS = B_NK ? BN : BK, B_COLS = B_NK ? BK : BN;
    static_assert(BM % WM == 0 && BN % WN == 0, "warp tile must divide the block tile");
    static_assert(WM % 16 == 0 && WN % 8 == 0 && BK % 16 == 0, "mma.m16n8k16 granularity");
    static_assert(NT <= 1024, "at most 1024 threads");
    __shared__ __align__(128) T sA[BM * tile_ld<BK>()];
    __shared__ __align__(128) T sB[B_ROWS * tile_ld<B_COLS>()];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;

    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    for (int k0 = 0; k0 < K; k0 += BK) {
        load_tile<T, BM, BK, NT>(sA, A, K, m0, M, k0, K, tid);
        if constexpr (B_NK) load_tile<T, BN, BK, NT>(sB, B, K, n0, N, k0, K, tid);
        else load_tile<T, BK, BN, NT>(sB, B, N, k0, K, n0, N, tid);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            u32 af[MI][4], bf[NI][2];
#pragma unroll
            for (int i = 0; i < MI; ++i)  // lanes 0-15: rows 0-15 at k, lanes 16-31: rows 0-15 at k+8
                tf::ldmatrix_x4(af[i], &sA[soff<BK>(wm + i * 16 + (lane & 15), kk + (lane >> 4) * 8)]);
#pragma unroll
            for (int j = 0; j < NI; ++j) {
                if constexpr (B_NK)  // lanes 0-7: n rows at k, lanes 8-15: n rows at k+8
                    tf::ldmatrix_x2(bf[j], &sB[soff<BK>(wn + j * 8 + (lane & 7), kk + ((lane >> 3) & 1) * 8)]);
                else                 // lanes 0-15: k rows kk..kk+15 at n
                    tf::ldmatrix_x2_trans(bf[j], &sB[soff<BN>(kk + (lane & 15), wn + j * 8)]);
            }
#pragma unroll
            for (int i = 0; i < MI; ++i)
#pragma unroll
                for (int j = 0; j < NI; ++j) tf::Mma<T>::run(acc[i][j], af[i], bf[j][0], bf[j][1]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < NI; ++j) store_frag<T>(C, M, N, m0 + wm + i * 16, n0 + wn + j * 8, acc[i][j]);
}
