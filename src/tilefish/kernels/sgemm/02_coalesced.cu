// SGEMM step 2: global-memory coalescing.  C = alpha * A @ B + beta * C, fp32, row-major.
//
// Tiling: as step 1 (one thread per C element, BS*BS threads per BS x BS tile, 1-D grid).
//
// What changed: the thread -> element mapping is transposed.  Consecutive threads now take
// consecutive COLUMNS of C, so in each iteration of the k loop a warp reads 32 consecutive
// floats of one row of B (one 128-byte request instead of 32 sectors), all lanes read the same
// A[row][k] (a broadcast), and the final store of C is one contiguous 128-byte write per warp.
// Same instructions, roughly 8-10x fewer memory transactions.
//
// Limits: still no reuse inside the SM beyond what L1 happens to keep: every FFMA needs two
// loads, so the kernel is bound by L1/L2 load throughput, far from the FFMA pipes.
//
// Bounds: any M, N, K >= 1.  beta == 0 never reads C.

template <int BS>
__global__ void __launch_bounds__(BS * BS)
sgemm_coalesced(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                int M, int N, int K, float alpha, float beta) {
    const int tiles_n = (N + BS - 1) / BS;
    const int tile_m = blockIdx.x / tiles_n;
    const int tile_n = blockIdx.x - tile_m * tiles_n;
    const int row = tile_m * BS + (int)(threadIdx.x / BS);
    const int col = tile_n * BS + (int)(threadIdx.x % BS);  // lanes walk along a row of C
    if (row >= M || col >= N) return;

    const float* a = A + (size_t)row * K;
    const float* b = B + col;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += a[k] * b[(size_t)k * N];

    float* c = C + (size_t)row * N + col;
    *c = beta == 0.f ? alpha * acc : alpha * acc + beta * *c;
}
