// Ceiling probe: the DRAM read rate a plain streaming kernel reaches (no writes), as the floor
// for weight-streaming kernels (W4A16 / NF4 at small m), where a device copy also pays for writes.
// Grid-stride over 16-byte words, UNROLL non-coherent loads in flight per thread; L2_256 adds the
// 256-byte L2 prefetch hint.
#include "common/ptx.cuh"

template <int UNROLL, bool L2_256>
__global__ void read_stream(const uint4* __restrict__ src, long long words, unsigned* __restrict__ sink) {
    using namespace tf;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    u32 x = 0;
    for (; i + (UNROLL - 1) * stride < words; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = L2_256 ? ld_nc_v4_l2_256(src + i + u * stride) : ld_nc_v4(src + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < words; i += stride) {
        const uint4 v = ld_nc_v4(src + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x9e3779b9u) sink[0] = x;  // keeps the loads alive
}
