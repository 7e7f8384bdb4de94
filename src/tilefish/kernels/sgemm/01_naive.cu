// SGEMM step 1: naive.  C = alpha * A @ B + beta * C, fp32, row-major A [M,K], B [K,N], C [M,N].
//
// Tiling: one thread per element of C; a block is BS*BS threads covering a BS x BS tile of C;
// the grid is 1-D over the ceil(M/BS) * ceil(N/BS) tiles (tile column fastest), so no grid
// dimension limit is ever hit.
//
// Mapping (the point of this step): consecutive threads take consecutive ROWS of C.  In one
// warp-wide load of the k loop, the 32 lanes read A[row .. row+31][k]: 32 addresses K floats
// apart, i.e. 32 separate 32-byte sectors for 128 useful bytes; they all read the same B[k][col]
// (a broadcast); the final store of C is strided by N too.
//
// Limits: every thread streams a whole row of A and a whole column of B from global memory/L2
// (2K loads per 2K flops: arithmetic intensity 0.25 flop/byte before caches), and the A loads
// are uncoalesced.  Memory-latency bound; expect well under 1% of FFMA peak.
//
// Bounds: any M, N, K >= 1 (threads outside C do nothing).  beta == 0 never reads C.

template <int BS>
__global__ void __launch_bounds__(BS * BS)
sgemm_naive(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
            int M, int N, int K, float alpha, float beta) {
    const int tiles_n = (N + BS - 1) / BS;
    const int tile_m = blockIdx.x / tiles_n;
    const int tile_n = blockIdx.x - tile_m * tiles_n;
    const int row = tile_m * BS + (int)(threadIdx.x % BS);  // lanes walk down a column of C
    const int col = tile_n * BS + (int)(threadIdx.x / BS);
    if (row >= M || col >= N) return;

    const float* a = A + (size_t)row * K;
    const float* b = B + col;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc += a[k] * b[(size_t)k * N];

    float* c = C + (size_t)row * N + col;
    *c = beta == 0.f ? alpha * acc : alpha * acc + beta * *c;
}
