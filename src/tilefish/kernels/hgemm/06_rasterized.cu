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
// smem-staged epilogue. Edges: any M, N; K % 8 == 0 and, for B [K, N], N % 8 == 0; 16-byte
// aligned rows.
//
// The tile's main loop is step 5's (`hg::multistage_mainloop`, included from 05_multistage.cu):
// the two steps differ only in which tile a block computes.
#include "hgemm/05_multistage.cu"

template <typename T, bool B_NK, int BM, int BN, int BK, int WM, int WN, int STAGES, int GROUP_M>
__global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, 1)
hgemm_rasterized(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
    using namespace hg;
    // Grouped rasterization (see the header): GROUP_M tile rows per group, column-major inside.
    // Run again for the epilogue rather than kept live across the main loop: the 64 x 64 warp
    // tiles need every register there (NVRTC 13.5 spilled 4 bytes with m0 / n0 held). The block
    // index is read with asm volatile so the two evaluations are not merged back into one.
    auto tile_origin = [&](int& m0, int& n0) {
        int pid;
        asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(pid));
        const int tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
        const int per_group = GROUP_M * tiles_n;
        const int group = pid / per_group, first_m = group * GROUP_M;
        const int rows = min(tiles_m - first_m, GROUP_M);
        const int in_group = pid - group * per_group;
        m0 = (first_m + in_group % rows) * BM;
        n0 = (in_group / rows) * BN;
    };
    int m0, n0;
    tile_origin(m0, n0);
    float acc[WM / 16][WN / 8][4];
    multistage_mainloop<T, B_NK, BM, BN, BK, WM, WN, STAGES>(A, B, M, N, K, m0, n0, acc);
    tile_origin(m0, n0);
    const int warp = threadIdx.x >> 5;
    const int wm = (warp / (BN / WN)) * WM, wn = (warp % (BN / WN)) * WN;
#pragma unroll
    for (int i = 0; i < WM / 16; ++i)
#pragma unroll
        for (int j = 0; j < WN / 8; ++j) store_frag<T>(C, M, N, m0 + wm + i * 16, n0 + wn + j * 8, acc[i][j]);
}
