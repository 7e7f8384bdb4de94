// HGEMM step 2: block tiling with several warps, fragments read with ldmatrix.
// C = A @ B, A [M, K] row-major, B [K, N] row-major (B_NK = false) or B [N, K] row-major
// (B_NK = true, nn.Linear weights), T = __half or __nv_bfloat16, fp32 accumulation, C in T.
//
// Tiling (template parameters, defaults in brackets): a block of (BM/WM) x (BN/WN) warps [2 x 4]
// owns a BM x BN [128 x 128] tile of C and walks K in BK-deep [32] chunks. Per chunk the block
// copies A [BM x BK] and B ([BK x BN] or [BN x BK]) into shared memory (16-byte loads, zero-filled
// at the M/N/K edges), then each warp computes its WM x WN [64 x 32] warp tile as
// (WM/16) x (WN/8) mma.m16n8k16 per 16-deep k step: A fragments with ldmatrix.x4, B fragments
// with ldmatrix.x2.trans ([K, N] B: the k rows are the smem rows, .trans hands out the k-pairs
// mma wants) or ldmatrix.x2 ([N, K] B: already k-contiguous, no transpose).
//
// What changed vs step 1: reuse. A block loads each A element once per BN columns and each B
// element once per BM rows (step 1: once per 8 / 16), and a warp reuses each A fragment for
// WN/8 mmas and each B fragment for WM/16 mmas, so global traffic drops ~10x and the tensor
// cores see (WM/16)*(WN/8) [16] mmas per (WM/16 + WN/8) [8] ldmatrix.
//
// Limits: the smem tiles are unpadded. A rows are BK*2 = 64 bytes, so the 8 row addresses of
// one ldmatrix 8x8 matrix fall on only 2 distinct 16-byte bank groups: a 4-way bank conflict;
// B [K, N] rows are 256 bytes, so all 8 rows of a .trans matrix hit the same banks: 8-way.
// Loads are synchronous (global -> registers -> shared, then a barrier), so the tensor cores
// idle during every copy. Edges: K % 8 == 0 and, for B [K, N], N % 8 == 0 (16-byte chunks).
#include "common/ptx.cuh"
#include "hgemm/epilogue.cuh"

namespace hg {
using tf::u32;

// Shared-memory tiles are plain row-major ROWS x COLS arrays (this step's bank conflicts).
template <int COLS> __host__ __device__ constexpr int tile_ld() { return COLS; }
template <int COLS> __device__ __forceinline__ int soff(int r, int c) { return r * COLS + c; }

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
hgemm_block_ldmatrix(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
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
