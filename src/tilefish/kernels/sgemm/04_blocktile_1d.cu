// SGEMM step 4: 1-D block tiling (several results per thread).
// C = alpha * A @ B + beta * C, fp32, row-major A [M,K], B [K,N], C [M,N].
//
// Tiling: a block owns a BM x BN tile of C and walks k in BK-deep chunks staged in shared
// memory (As[BM][BK], Bs[BK][BN]).  Each of the BM*BN/TM threads computes a column strip of TM
// results: rows tr*TM .. tr*TM+TM-1, column tc, in TM accumulator registers.
//
// What changed vs step 3: in the inner loop a thread loads ONE value of B (Bs[k][tc], kept in a
// register) and reuses it for TM FFMAs, each of which needs only one more LDS (As[..][k], a
// broadcast because a warp shares tr).  Shared-memory loads per FFMA drop from 2 to
// (1 + 1/TM); global traffic per FFMA drops too, because the block tile is larger (64 x 64 by
// default: every element loaded from global memory is used 64 times).
//
// Limits: still ~1 LDS per FFMA, so the shared-memory pipe caps throughput; scalar (32-bit)
// global loads; loads and math do not overlap (two __syncthreads per chunk).
//
// Bounds: any M, N, K >= 1: out-of-range elements of the staged tiles are zeros, out-of-range
// rows/columns of C are not stored.  beta == 0 never reads C.

template <int BM, int BN, int BK, int TM>
__global__ void __launch_bounds__(BM * BN / TM)
sgemm_blocktile_1d(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                   int M, int N, int K, float alpha, float beta) {
    constexpr int NT = BM * BN / TM;
    static_assert(BM % TM == 0, "TM must divide BM");
    static_assert((BM * BK) % NT == 0 && (BK * BN) % NT == 0, "tiles must split evenly over the threads");
    __shared__ float As[BM][BK];
    __shared__ float Bs[BK][BN];

    const int tiles_n = (N + BN - 1) / BN;
    const int tile_m = blockIdx.x / tiles_n;
    const int tile_n = blockIdx.x - tile_m * tiles_n;
    const int m0 = tile_m * BM, n0 = tile_n * BN;
    const int tid = threadIdx.x;
    const int tc = tid % BN;   // a warp covers consecutive columns of one row strip
    const int tr = tid / BN;

    float acc[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) acc[i] = 0.f;

    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int it = 0; it < BM * BK / NT; ++it) {
            const int e = tid + it * NT;  // consecutive threads: consecutive k of a row
            const int r = e / BK, c = e % BK;
            const int gr = m0 + r, gc = k0 + c;
            As[r][c] = (gr < M && gc < K) ? A[(size_t)gr * K + gc] : 0.f;
        }
#pragma unroll
        for (int it = 0; it < BK * BN / NT; ++it) {
            const int e = tid + it * NT;  // consecutive threads: consecutive n of a row
            const int r = e / BN, c = e % BN;
            const int gr = k0 + r, gc = n0 + c;
            Bs[r][c] = (gr < K && gc < N) ? B[(size_t)gr * N + gc] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            const float b = Bs[k][tc];
#pragma unroll
            for (int i = 0; i < TM; ++i) acc[i] += As[tr * TM + i][k] * b;
        }
        __syncthreads();
    }

    const int col = n0 + tc;
    if (col >= N) return;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + tr * TM + i;
        if (row < M) {
            float* c = C + (size_t)row * N + col;
            *c = beta == 0.f ? alpha * acc[i] : alpha * acc[i] + beta * *c;
        }
    }
}
