// Ceiling probe: how fast can mma.sync m16n8k16 (fp32 accumulate) issue on this GPU?
// Every warp runs CHAINS independent accumulator chains from registers only (no memory in the
// loop), so the measured rate is the tensor pipe's mma.sync limit at the launch's warps per SM.
// Used by scripts/bench_probes.py to put a measured number under the HGEMM ladder's steps 05-06.
#include "common/ptx.cuh"
#include "probes/probe_clock.cuh"

template <typename T, int CHAINS>
__global__ void mma_sync_peak(float* __restrict__ sink, long long* __restrict__ clocks, int iters) {
    using namespace tf;
    ProbeClock probe_clock;
    probe_clock.start();
    const u32 lane = threadIdx.x;
    // Operands from the thread index, so the compiler cannot fold the products.
    u32 a[4] = {lane * 0x00010001u, lane ^ 0x3c003c00u, lane + 0x38003800u, lane | 0x34003400u};
    const u32 b0 = lane * 0x00030003u ^ 0x3c003c00u, b1 = lane + 0x30003000u;
    float acc[CHAINS][4];
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.f;
    for (int i = 0; i < iters; ++i) {
#pragma unroll
        for (int c = 0; c < CHAINS; ++c) Mma<T>::run(acc[c], a, b0, b1);
    }
    probe_clock.stop(clocks);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < CHAINS; ++c) s += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    if (s == 1.2345f) sink[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the chains alive
}
