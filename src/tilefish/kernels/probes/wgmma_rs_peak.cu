// Ceiling probe: how fast does wgmma with A from registers (the W4A16 Hopper kernel's form:
// dequantized weights as A, x as B with N = the m tile) run on this GPU, by N, and what does the
// in-loop dequantization cost on top of it?
// Each warpgroup runs the W4A16 kernel's issue pattern with no memory traffic: per 64-wide k
// stage, two k16 steps at a time, NT m64nNk16 wgmmas per step into NT accumulator tiles, one
// commit per two steps, then wait until only that group is in flight. DEQ = 0 reuses fixed A
// registers; DEQ = 1 dequantizes a word per (step, tile) first (the lop3 path), DEQ = 2 also
// multiplies by a group scale (4 HMUL2 a word, the group-128 path). B is one stage of x in shared
// memory (128-byte swizzle), filled with a non-zero pattern (zeros would lower the power draw).
// Used by scripts/bench_probes.py to bound the W4A16 wgmma kernel at m = 16 .. 256.
#include "common/wgmma.cuh"
#include "w4a16/dequant.cuh"
#include "probes/probe_clock.cuh"

template <typename T, int N, int NT, int DEQ>
__global__ void __launch_bounds__(256) wgmma_rs_peak(float* __restrict__ sink, long long* __restrict__ clocks, int iters) {
    using namespace tf;
    using DQ = Dequant<T>;
    using V2 = Vec2<T>;
    constexpr int STEPS = 4, ACC = N / 2;
    extern __shared__ unsigned char smem_raw[];
    unsigned char* sx = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
    for (int i = threadIdx.x; i < N * 64 * 2 / 4; i += blockDim.x)  // N rows x 64 k of T
        reinterpret_cast<u32*>(sx)[i] = 0x3c003800u ^ (i * 0x00050003u & 0x03ff03ffu);
    __syncthreads();
    ProbeClock probe_clock;
    probe_clock.start();
    const u32 lane = threadIdx.x & 31;
    float acc[NT][ACC];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int r = 0; r < ACC; ++r) acc[j][r] = 0.f;
    constexpr int SETS = DEQ ? STEPS : 1;  // DEQ = 0: every step reads one unchanging set
    u32 afrag[SETS][NT][4];
#pragma unroll
    for (int kk = 0; kk < SETS; ++kk)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) afrag[kk][j][r] = (lane * 0x00010001u + kk + j + r) & 0x03ff03ffu | 0x38003800u;
    u32 word = lane * 0x9e3779b9u;
    const typename DQ::Zero z = DQ::zero(8.f);
    const typename V2::type sc = V2::dup(V2::one(0.01f + lane * 1e-4f));
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int k0 = 0; k0 < STEPS; k0 += 2) {
            if constexpr (DEQ > 0) {
#pragma unroll
                for (int kk = k0; kk < k0 + 2; ++kk)
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        u32 f[4];
                        DQ::run(word + (kk * NT + j) * 0x01010101u, z, z, f);
                        if constexpr (DEQ == 2) {
#pragma unroll
                            for (int p = 0; p < 4; ++p) {
                                typename V2::type v = *reinterpret_cast<typename V2::type*>(&f[p]);
                                v = __hmul2(v, sc);
                                f[p] = *reinterpret_cast<u32*>(&v);
                            }
                        }
                        afrag[kk][j][0] = f[0]; afrag[kk][j][1] = f[2]; afrag[kk][j][2] = f[1]; afrag[kk][j][3] = f[3];
                    }
            }
            wgmma_fence();
#pragma unroll
            for (int kk = k0; kk < k0 + 2; ++kk) {
                const u64 db = wgmma_desc_sw128(sx + kk * 32, 16, 1024);
#pragma unroll
                for (int j = 0; j < NT; ++j) WgmmaRS<N, T>::run(acc[j], afrag[DEQ ? kk : 0][j], db, 1);
            }
            wgmma_commit();
            wgmma_wait<1>();
        }
        word = word * 1664525u + 1013904223u;  // new words every stage: the dequantization cannot be hoisted
    }
    wgmma_wait<0>();
    probe_clock.stop(clocks);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int r = 0; r < ACC; ++r) s += acc[j][r];
    if (s == 1.2345f) sink[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the chains alive
}
