// SGEMM step 7: shared-memory bank-conflict-free layout.
// C = alpha * A @ B + beta * C, fp32, row-major A [M,K], B [K,N], C [M,N].
//
// Tiling: as step 6: a BM x BN block tile (128 x 128), BK-deep k chunks (8), (BM/TM)*(BN/TN)
// threads (256), each computing TM x TN (8 x 8) results, float4 everywhere.
//
// What changed vs step 6: the two shared-memory bank conflicts are removed.
//   * Reads.  A thread no longer owns a contiguous TM x TN block of C: its TN columns are TN/4
//     float4-wide groups spaced (BN/TN)*4 columns apart (and likewise its TM rows).  So, for one
//     k, lane tc reads Bs[k][g*(BN/TN)*4 + tc*4 .. +3]: consecutive lanes read consecutive
//     16-byte words, one conflict-free wavefront per 8 lanes (step 6 had lanes 32 bytes apart,
//     2-way conflicts).  The A reads become 16-byte runs of the same kind.
//   * Stores.  As is padded to BM + 4 floats per k row.  The transposing store of a float4
//     of A writes As[c+j][r] for the warp's 16 rows r and 2 values of c; without padding the two
//     c's hit the same bank (row pitch 128 words = 0 mod 32 banks), with pitch BM + 4 they land
//     16 banks apart.  BM + 4 keeps every row 16-byte aligned for the float4 reads.
//   C is written in the same strided pattern: each float4 store of a warp covers a contiguous
//   run of 64 bytes per row.
//
// Preconditions of this fast path (checked in Python, fallback step 5): K % 4 == 0,
// N % 4 == 0, A, B, C 16-byte aligned.  Any M >= 1.  beta == 0 never reads C.
//
// Limits: loads and math do not overlap (global loads go through registers, two
// __syncthreads per chunk), and a warp's working set spans the whole 128-wide block tile, so
// per k each warp pulls 2 x 256 B of B for only 2 x 4 rows of A.

template <int BM, int BN, int BK, int TM, int TN>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
sgemm_bcf(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C,
          int M, int N, int K, float alpha, float beta) {
    constexpr int TR = BM / TM, TC = BN / TN;  // thread grid over the block tile
    constexpr int NT = TR * TC;
    constexpr int A_CHUNKS = BM * BK / 4 / NT;
    constexpr int B_CHUNKS = BK * BN / 4 / NT;
    constexpr int AS_LD = BM + 4;  // padded pitch of As (see header)
    static_assert(BK % 4 == 0 && BN % 4 == 0 && TM % 4 == 0 && TN % 4 == 0, "float4 tiling");
    static_assert(A_CHUNKS >= 1 && A_CHUNKS * 4 * NT == BM * BK, "A tile must split evenly in float4s");
    static_assert(B_CHUNKS >= 1 && B_CHUNKS * 4 * NT == BK * BN, "B tile must split evenly in float4s");
    constexpr int A_ROW_STEP = NT / (BK / 4);
    constexpr int B_ROW_STEP = NT / (BN / 4);
    __shared__ __align__(16) float As[BK][AS_LD];
    __shared__ __align__(16) float Bs[BK][BN];

    const int tiles_n = (N + BN - 1) / BN;
    const int tile_m = blockIdx.x / tiles_n;
    const int tile_n = blockIdx.x - tile_m * tiles_n;
    const int m0 = tile_m * BM, n0 = tile_n * BN;
    const int tid = threadIdx.x;
    const int tc = tid % TC;
    const int tr = tid / TC;

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
                *reinterpret_cast<float4*>(&ra[4 * g]) =
                    *reinterpret_cast<const float4*>(&As[k][g * TR * 4 + tr * 4]);
#pragma unroll
            for (int g = 0; g < TN / 4; ++g)
                *reinterpret_cast<float4*>(&rb[4 * g]) =
                    *reinterpret_cast<const float4*>(&Bs[k][g * TC * 4 + tc * 4]);
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += ra[i] * rb[j];
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = m0 + (i / 4) * TR * 4 + tr * 4 + (i % 4);
        if (row >= M) continue;
        float* crow = C + (size_t)row * N;
#pragma unroll
        for (int g = 0; g < TN / 4; ++g) {
            const int col = n0 + g * TC * 4 + tc * 4;
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
