// SGEMM step 6: vectorized (128-bit) memory accesses.
// C = alpha * A @ B + beta * C, fp32, row-major A [M,K], B [K,N], C [M,N].
//
// Tiling: as step 5: a BM x BN block tile (128 x 128), BK-deep k chunks (8) staged in shared
// memory, (BM/TM)*(BN/TN) threads (256) each computing a TM x TN (8 x 8) outer-product tile.
//
// What changed vs step 5: every access that can be 16 bytes is 16 bytes.
//   * global -> register loads of A and B tiles are float4 (LDG.128): 4x fewer load
//     instructions and address computations; a warp's B load is one 512-byte contiguous run;
//   * A is transposed on its way into shared memory (As[k][m]) from the float4 registers;
//   * a thread's TM values of A and TN values of B for one k are read as TM/4 + TN/4 float4
//     (LDS.128) instead of TM + TN scalar LDS: 4 instead of 16 shared-memory instructions per
//     64 FFMAs, so the instruction stream is now mostly FFMA;
//   * C is read (only if beta != 0) and written as float4.
//   Global row pointers are computed once per block and advanced by BK / BK*N per chunk.
//
// Preconditions of this fast path: K % 4 == 0, N % 4 == 0, A, B, C 16-byte aligned (so every
// float4 is aligned and never straddles the end of a row).  The Python op checks them and
// falls back to step 5 otherwise.  Any M >= 1, and any K, N that are multiples of 4, work:
// partial tiles are zero-filled / not stored, a float4 chunk is either wholly in or wholly out.
//
// Limits: lanes of a warp read B fragments TN words apart (2-way bank conflicts), and the
// transposing stores to As conflict (2-way); loads and math still do not overlap.
// beta == 0 never reads C.

template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
sgemm_vectorized(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
                 int M, int N, int K, float alpha, float beta) {
    constexpr int NT = (BM / TM) * (BN / TN);
    constexpr int A_CHUNKS = BM * BK / 4 / NT;  // float4 loads of A per thread per k chunk
    constexpr int B_CHUNKS = BK * BN / 4 / NT;
    static_assert(BK % 4 == 0 && BN % 4 == 0 && TM % 4 == 0 && TN % 4 == 0, "float4 tiling");
    static_assert(A_CHUNKS >= 1 && A_CHUNKS * 4 * NT == BM * BK, "A tile must split evenly in float4s");
    static_assert(B_CHUNKS >= 1 && B_CHUNKS * 4 * NT == BK * BN, "B tile must split evenly in float4s");
    constexpr int A_ROW_STEP = NT / (BK / 4);  // rows covered by one pass of the block over A
    constexpr int B_ROW_STEP = NT / (BN / 4);
    __shared__ __align__(16) float As[BK][BM];
    __shared__ __align__(16) float Bs[BK][BN];

    const int tiles_n = (N + BN - 1) / BN;
    const int tile_m = blockIdx.x / tiles_n;
    const int tile_n = blockIdx.x - tile_m * tiles_n;
    const int m0 = tile_m * BM, n0 = tile_n * BN;
    const int tid = threadIdx.x;
    const int tc = tid % (BN / TN);
    const int tr = tid / (BN / TN);

    // Loader coordinates: A chunk (a_r + i*A_ROW_STEP, a_c4*4), B chunk (b_r + i*B_ROW_STEP, b_c4*4).
    const int a_r = tid / (BK / 4), a_c = (tid % (BK / 4)) * 4;
    const int b_r = tid / (BN / 4), b_c = (tid % (BN / 4)) * 4;
    const bool b_col_ok = n0 + b_c < N;
    const float* a_ptr = A + (size_t)(m0 + a_r) * K + a_c;
    const float* b_ptr = B + (size_t)b_r * N + n0 + b_c;

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int i = 0; i < A_CHUNKS; ++i) {
            const int r = a_r + i * A_ROW_STEP;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (m0 + r < M && k0 + a_c < K)
                v = *reinterpret_cast<const float4*>(a_ptr + (size_t)i * A_ROW_STEP * K);
            As[a_c + 0][r] = v.x;
            As[a_c + 1][r] = v.y;
            As[a_c + 2][r] = v.z;
            As[a_c + 3][r] = v.w;
        }
#pragma unroll
        for (int i = 0; i < B_CHUNKS; ++i) {
            const int r = b_r + i * B_ROW_STEP;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (b_col_ok && k0 + r < K)
                v = *reinterpret_cast<const float4*>(b_ptr + (size_t)i * B_ROW_STEP * N);
            *reinterpret_cast<float4*>(&Bs[r][b_c]) = v;
        }
        a_ptr += BK;
        b_ptr += (size_t)BK * N;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float ra[TM], rb[TN];
#pragma unroll
            for (int g = 0; g < TM / 4; ++g)
                *reinterpret_cast<float4*>(&ra[4 * g]) = *reinterpret_cast<const float4*>(&As[k][tr * TM + 4 * g]);
#pragma unroll
            for (int g = 0; g < TN / 4; ++g)
                *reinterpret_cast<float4*>(&rb[4 * g]) = *reinterpret_cast<const float4*>(&Bs[k][tc * TN + 4 * g]);
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
        for (int g = 0; g < TN / 4; ++g) {
            const int col = n0 + tc * TN + 4 * g;
            if (col >= N) continue;
            float4* cp = reinterpret_cast<float4*>(crow + col);
            float4 o = make_float4(alpha * acc[i][4 * g], alpha * acc[i][4 * g + 1],
                                   alpha * acc[i][4 * g + 2], alpha * acc[i][4 * g + 3]);
            if (beta != 0.f) {
                const float4 c = *cp;
                o.x += beta * c.x; o.y += beta * c.y; o.z += beta * c.z; o.w += beta * c.w;
            }
            *cp = o;
        }
    }
}
