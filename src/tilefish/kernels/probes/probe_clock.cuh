// The SM clock during a probe's run. A probe calls start() where its timed work begins and
// stop() where it ends; block 0's thread 0 writes the cycles (clock64) and nanoseconds
// (%globaltimer) of both ends, which scripts/bench_probes.py turns into the clock the rate was
// measured at (the chip's clock varies with power, so a peak is only comparable at its clock).
#pragma once

namespace tf {

struct ProbeClock {
    long long c0, t0;

    __device__ __forceinline__ void start() {
        c0 = clock64();
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    }

    __device__ __forceinline__ void stop(long long* clocks) const {
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            long long t1;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
            clocks[0] = c0; clocks[1] = clock64(); clocks[2] = t0; clocks[3] = t1;
        }
    }
};

}  // namespace tf
