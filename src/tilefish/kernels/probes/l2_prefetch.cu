// Probe: does an L2 prefetch a kernel issues still land in L2 once that kernel has exited, for a later kernel
// to read? (scripts/experiments/l2_prefetch_probe.py). Each CTA takes its share of `bytes`:
//   MODE 0: thread 0 issues cp.async.bulk.prefetch.L2 (32 KB pieces) and the CTA exits;
//   MODE 1: the same, then the CTA waits spin_ns before it exits;
//   MODE 2: every thread issues prefetch.global.L2 for its 128-byte lines and exits;
//   MODE 3: every thread loads its lines (ld.global.nc, results folded into sink): the CTA waits for the data.
#include "common/ptx.cuh"

template <int MODE>
__global__ void l2_prefetch_probe(const unsigned char* __restrict__ p, long long bytes, unsigned* __restrict__ sink,
                                  int spin_ns) {
    using namespace tf;
    const long long piece = ((bytes + gridDim.x - 1) / gridDim.x + 15) & ~15LL;
    const long long lo = blockIdx.x * piece, hi = lo + piece < bytes ? lo + piece : bytes;
    if (MODE <= 1) {
        if (threadIdx.x == 0)
            for (long long o = lo; o < hi; o += 32768)
                l2_prefetch_span(p + o, (unsigned)(hi - o < 32768 ? hi - o : 32768));
        if (MODE == 1) {
            const long long t0 = clock64();
            while (clock64() - t0 < (long long)spin_ns * 2) __nanosleep(1000);
        }
    } else if (MODE == 2) {
        for (long long o = lo + 128LL * threadIdx.x; o < hi; o += 128LL * blockDim.x)
            asm volatile("prefetch.global.L2 [%0];" :: "l"(p + o));
    } else {
        u32 x = 0;
        for (long long o = lo + 128LL * threadIdx.x; o < hi; o += 128LL * blockDim.x) x ^= ld_nc_v4(p + o).x;
        if (x == 0x9e3779b9u) sink[0] = x;
    }
}
