// HGEMM step 3: step 2 with padded shared-memory rows.
// C = A @ B, A [M, K] row-major, B [K, N] row-major (B_NK = false) or B [N, K] row-major
// (B_NK = true, nn.Linear weights), T = __half or __nv_bfloat16, fp32 accumulation, C in T.
//
// Tiling: as step 2 (BM x BN block tile [128 x 128], BK [32], (BM/WM) x (BN/WN) warps [2 x 4],
// ldmatrix.x4 for A, ldmatrix.x2(.trans) for B, synchronous 16-byte loads, zero-filled edges).
//
// What changed vs step 2: every shared-memory row is 8 elements (16 bytes) longer than the
// data. One ldmatrix 8x8 matrix is 8 row addresses of 16 bytes each, serviced in one shared
// memory wavefront only if the 8 rows cover 8 different 16-byte bank groups (32 banks x 4 B =
// 8 groups). With a pitch of COLS + 8 elements, row r starts (r * (COLS/8 + 1)) mod 8 groups
// after row 0; COLS/8 is a multiple of 8 for BN = 128 and for BK = 64, so the 8 rows land on 8
// distinct groups (pitch 272 B for B [32 x 128]: r * 68 words -> 4r mod 32). For BK = 32 the A
// pitch is 80 B (20 words): rows at 0, 20, 8, 28, 16, 4, 24, 12 -> also conflict-free. The
// 16-byte stores of the copy stay conflict-free too (8 consecutive chunks of one row per phase).
//
// Limits: the padding wastes 8/COLS of the shared memory (BK = 32: 20 % of the A tile) and
// the pitch is no longer a power of two, so addresses need a multiply; the copy is still
// synchronous. K % 8 == 0 and, for B [K, N], N % 8 == 0.
#include "common/ptx.cuh"
#include "hgemm/epilogue.cuh"

namespace hg {
using tf::u32;

// Padded tiles: pitch COLS + 8 elements, so consecutive rows start 16 bytes (one bank group)
// further along the 32 banks, and ldmatrix row addresses stay 16-byte aligned.
constexpr int PAD = 8;
template <int COLS> __host__ __device__ constexpr int tile_ld() { return COLS + PAD; }
template <int COLS> __device__ __forceinline__ int soff(int r, int c) { return r * (COLS + PAD) + c; }

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
hgemm_padded(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
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
