// SGEMM step 3: shared-memory cache blocking.  C = alpha * A @ B + beta * C, fp32, row-major.
//
// Tiling: a block of BS*BS threads owns a BS x BS tile of C (one element per thread, as in
// step 2).  The k dimension is walked in chunks of BS: the block cooperatively copies the
// BS x BS tile of A and the BS x BS tile of B into shared memory (one coalesced element per
// thread each), synchronizes, and every thread does BS FFMAs out of shared memory.
//
// What changed: each element brought on chip is now used BS times (by the BS threads of a row
// or a column of the tile) instead of once, so global/L2 traffic drops by a factor of BS
// (32 by default).  In the inner loop As[ty][k] is a broadcast within a warp (a warp lies in
// one or two rows of the tile) and Bs[k][tx] is 32 consecutive words: conflict-free.
//
// Limits: each FFMA still needs two shared-memory loads (LDS), so the LSU/shared-memory pipe,
// not the FMA pipe, sets the pace (at most ~1/2 of FFMA peak, in practice much less), plus two
// __syncthreads per BS-deep chunk with no overlap of loads and math.
//
// Bounds: any M, N, K >= 1: out-of-range elements of the A/B tiles are loaded as zeros, so
// partial tiles in k contribute nothing; threads outside C skip the store.  beta == 0 never
// reads C.

template <int BS>
__global__ void __launch_bounds__(BS * BS)
sgemm_smem(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
           int M, int N, int K, float alpha, float beta) {
    __shared__ float As[BS][BS];
    __shared__ float Bs[BS][BS];

    const int tiles_n = (N + BS - 1) / BS;
    const int tile_m = blockIdx.x / tiles_n;
    const int tile_n = blockIdx.x - tile_m * tiles_n;
    const int ty = threadIdx.x / BS;
    const int tx = threadIdx.x % BS;
    const int row = tile_m * BS + ty;
    const int col = tile_n * BS + tx;
    const bool row_ok = row < M, col_ok = col < N;
    // Row pointers are clamped in range; the predicates decide whether the value is used.
    const float* a = A + (size_t)(row_ok ? row : 0) * K;
    const float* b = B + (col_ok ? col : 0);

    float acc = 0.f;
    for (int k0 = 0; k0 < K; k0 += BS) {
        As[ty][tx] = (row_ok && k0 + tx < K) ? a[k0 + tx] : 0.f;
        Bs[ty][tx] = (col_ok && k0 + ty < K) ? b[(size_t)(k0 + ty) * N] : 0.f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BS; ++k) acc += As[ty][k] * Bs[k][tx];
        __syncthreads();
    }
    if (row_ok && col_ok) {
        float* c = C + (size_t)row * N + col;
        *c = beta == 0.f ? alpha * acc : alpha * acc + beta * *c;
    }
}
