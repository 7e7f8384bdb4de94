// SGEMM step 5: 2-D block tiling (an outer product per thread).
// C = alpha * A @ B + beta * C, fp32, row-major A [M,K], B [K,N], C [M,N].
//
// Tiling: a block owns a BM x BN tile of C (128 x 128 by default) and walks k in BK-deep chunks
// staged in shared memory.  Each of the (BM/TM)*(BN/TN) threads (256 by default) computes a
// TM x TN sub-tile (8 x 8) in registers: per k it loads TM values of A and TN values of B into
// registers and does the TM*TN FFMAs of their outer product.
//
// What changed vs step 4: reuse in both directions.  Shared-memory loads per FFMA drop from
// ~1 to (TM+TN)/(TM*TN) = 1/4, and the larger block tile halves global/L2 traffic per FFMA
// again (arithmetic intensity of the block tile: BM*BN / (2*(BM+BN)) = 32 FFMA per loaded
// float).  A is stored k-major in shared memory (As[k][m], transposed while it is copied), so
// a thread's TM values of A for one k are contiguous, like its TN values of B.
//
// Limits: scalar 32-bit global loads and stores; the transposing stores to As and the reads of
// Bs[k][tc*TN .. +TN] (lanes TN words apart) have shared-memory bank conflicts; loads and math
// do not overlap (two __syncthreads per chunk).
//
// This step is also the library's general fallback: it needs no alignment and no divisibility,
// so tilefish.sgemm uses it whenever the vectorized steps' preconditions (K % 4 == 0,
// N % 4 == 0, 16-byte aligned A, B, C) do not hold.
//
// Bounds: any M, N, K >= 1.  beta == 0 never reads C.

template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
sgemm_blocktile_2d(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                   int M, int N, int K, float alpha, float beta) {
    constexpr int NT = (BM / TM) * (BN / TN);
    static_assert(BM % TM == 0 && BN % TN == 0, "thread tile must divide the block tile");
    static_assert((BM * BK) % NT == 0 && (BK * BN) % NT == 0, "tiles must split evenly over the threads");
    __shared__ float As[BK][BM];  // k-major: a thread's TM values of A for one k are contiguous
    __shared__ float Bs[BK][BN];

    const int tiles_n = (N + BN - 1) / BN;
    const int tile_m = blockIdx.x / tiles_n;
    const int tile_n = blockIdx.x - tile_m * tiles_n;
    const int m0 = tile_m * BM, n0 = tile_n * BN;
    const int tid = threadIdx.x;
    const int tc = tid % (BN / TN);
    const int tr = tid / (BN / TN);

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;
    float ra[TM], rb[TN];

    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int it = 0; it < BM * BK / NT; ++it) {
            const int e = tid + it * NT;  // coalesced along k, transposed into As
            const int r = e / BK, c = e % BK;
            const int gr = m0 + r, gc = k0 + c;
            As[c][r] = (gr < M && gc < K) ? A[(size_t)gr * K + gc] : 0.f;
        }
#pragma unroll
        for (int it = 0; it < BK * BN / NT; ++it) {
            const int e = tid + it * NT;
            const int r = e / BN, c = e % BN;
            const int gr = k0 + r, gc = n0 + c;
            Bs[r][c] = (gr < K && gc < N) ? B[(size_t)gr * N + gc] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
#pragma unroll
            for (int i = 0; i < TM; ++i) ra[i] = As[k][tr * TM + i];
#pragma unroll
            for (int j = 0; j < TN; ++j) rb[j] = Bs[k][tc * TN + j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += ra[i] * rb[j];
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + tr * TM + i;
        if (row >= M) continue;
        float* crow = C + (size_t)row * N;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int col = n0 + tc * TN + j;
            if (col < N) {
                float* c = crow + col;
                *c = beta == 0.f ? alpha * acc[i][j] : alpha * acc[i][j] + beta * *c;
            }
        }
    }
}
