// HGEMM step 1: one tensor-core mma.sync per warp, operands staged through shared memory.
// C = A @ B, A [M, K] row-major, B [K, N] row-major (B_NK = false) or B [N, K] row-major
// (B_NK = true, the nn.Linear weight layout), T = __half or __nv_bfloat16, fp32 accumulation,
// C [M, N] row-major in T.
//
// Tiling: one warp (one block of 32 threads) owns one 16 x 8 tile of C, the shape of one
// mma.sync.m16n8k16. Per 16-deep k step the warp copies a 16 x 16 A tile and a 16 x 8 B tile
// into shared memory (one 16-byte load per lane), reads them back as mma fragments with
// ldmatrix (x4 for A; x2.trans for a [K, N] B, x2 for an [N, K] B) and issues a single mma.
//
// What changed vs SGEMM: the math runs on tensor cores (one instruction = 4096 FMAs) and the
// register fragments have a fixed, lane-scattered layout (see Mma<T> in common/ptx.cuh), which
// ldmatrix produces directly from row addresses, so no thread computes a fragment by hand.
//
// Edges: rows of A/B past M/N and k past K are zero-filled; stores are predicated.  K % 8 == 0
// (every 16-byte chunk is wholly inside or outside K) and, for B [K, N], N % 8 == 0.
//
// Limits: there is no data reuse at all -- each A element is loaded N/8 times and each B element
// M/16 times from L2 -- and one mma per two barriers and two global loads leaves the tensor
// cores idle almost all the time. It exists to show the fragment plumbing in the simplest form.
#include "common/ptx.cuh"
#include "hgemm/epilogue.cuh"

namespace hg {
using tf::u32;

__device__ __forceinline__ uint4 load16_or_zero(const void* p, bool valid) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (valid) v = *reinterpret_cast<const uint4*>(p);
    return v;
}

}  // namespace hg

template <typename T, bool B_NK>
__global__ void __launch_bounds__(32)
hgemm_mma_naive(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
    using namespace hg;
    constexpr int SB_LD = B_NK ? 16 : 8;  // sB is [8 n][16 k] or [16 k][8 n]
    __shared__ __align__(128) T sA[16 * 16];
    __shared__ __align__(128) T sB[16 * 8];
    const int lane = threadIdx.x;
    const int m0 = blockIdx.y * 16, n0 = blockIdx.x * 8;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};

    for (int k0 = 0; k0 < K; k0 += 16) {
        {   // A: 16 rows x 2 chunks of 8 -> one chunk per lane
            const int r = lane >> 1, c = (lane & 1) * 8;
            const int gm = m0 + r, gk = k0 + c;
            *reinterpret_cast<uint4*>(&sA[r * 16 + c]) =
                load16_or_zero(A + (size_t)(gm < M ? gm : 0) * K + gk, gm < M && gk < K);
        }
        if (lane < 16) {
            if constexpr (B_NK) {  // [8 n][16 k]: 8 rows x 2 chunks
                const int r = lane >> 1, c = (lane & 1) * 8;
                const int gn = n0 + r, gk = k0 + c;
                *reinterpret_cast<uint4*>(&sB[r * SB_LD + c]) =
                    load16_or_zero(B + (size_t)(gn < N ? gn : 0) * K + gk, gn < N && gk < K);
            } else {               // [16 k][8 n]: 16 rows x 1 chunk
                const int gk = k0 + lane;
                *reinterpret_cast<uint4*>(&sB[lane * SB_LD]) =
                    load16_or_zero(B + (size_t)(gk < K ? gk : 0) * N + n0, gk < K && n0 < N);
            }
        }
        __syncthreads();
        tf::u32 a[4], b[2];
        tf::ldmatrix_x4(a, &sA[(lane & 15) * 16 + (lane >> 4) * 8]);
        if constexpr (B_NK) tf::ldmatrix_x2(b, &sB[(lane & 7) * SB_LD + ((lane >> 3) & 1) * 8]);
        else tf::ldmatrix_x2_trans(b, &sB[(lane & 15) * SB_LD]);
        tf::Mma<T>::run(acc, a, b[0], b[1]);
        __syncthreads();
    }
    store_frag<T>(C, M, N, m0, n0, acc);
}
