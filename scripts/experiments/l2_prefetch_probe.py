"""Does an L2 prefetch issued by a kernel that then exits land in L2 for a later kernel? (probes/l2_prefetch.cu)

Per case, from a CUDA graph, L2 flushed before each replay: [prefetch kernel (mode), torch.cuda._sleep (a
latency-bound gap, ~20 us), read_stream over the buffer]; the read's time is what changes. Rows: no prefetch,
and the four modes (mode 3, loads the CTA waits for, is the data surely in L2). (A read timed right after a
read is host-bound, nothing being queued ahead of it on the GPU, so no separate L2-warm row is taken.)

    python scripts/experiments/l2_prefetch_probe.py [--mb 12,24] [--ctas 264]
"""
from __future__ import annotations

import argparse

import torch

from tilefish.bench.timing import flush_l2
from tilefish.runtime import KernelSpec, get_kernel, i32, i64, launch

MODES = {0: "bulk prefetch, exit", 1: "bulk prefetch, wait 20 us", 2: "prefetch.global.L2 lines, exit",
         3: "loads (CTA waits for data)"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", default="12,24")
    p.add_argument("--ctas", type=int, default=264)
    a = p.parse_args()
    dev = torch.device("cuda")
    sink = torch.zeros(1, dtype=torch.int32, device=dev)
    reader = get_kernel(KernelSpec("probes/read_stream.cu", "read_stream<4, false>"))
    probes = {m: get_kernel(KernelSpec("probes/l2_prefetch.cu", f"l2_prefetch_probe<{m}>")) for m in MODES}
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    gap_cycles = int(20e-6 * torch.cuda.get_device_properties(0).clock_rate * 1e3)
    print(f"{torch.cuda.get_device_name()}: gap {gap_cycles} cycles (~20 us)")
    for mb in map(int, a.mb.split(",")):
        buf = torch.randint(0, 255, (mb << 20,), dtype=torch.uint8, device=dev)
        words = buf.numel() // 16

        def read():
            launch(reader, sm * 4, 256, buf.data_ptr(), i64(words), sink.data_ptr())

        def case(mode):
            def run():
                if mode is not None:
                    launch(probes[mode], a.ctas, 128, buf.data_ptr(), i64(buf.numel()), sink.data_ptr(), i32(20000))
                torch.cuda._sleep(gap_cycles)
            return run

        rows = {"none": case(None), **{MODES[m]: case(m) for m in MODES}}
        times = {}
        for _ in range(2):
            for name, pre in rows.items():
                ts = []
                for _ in range(30):
                    flush_l2()
                    pre()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    read()
                    e1.record()
                    torch.cuda.synchronize()
                    ts.append(e0.elapsed_time(e1) * 1e3)
                times.setdefault(name, []).extend(ts)
        for name, ts in times.items():
            ts = sorted(ts)
            print(f"{mb:3d} MB  {name:34s} read {ts[len(ts) // 2]:7.1f} us  ({mb * 1.048576 / ts[len(ts) // 2] * 1e3:6.0f} GB/s)")


if __name__ == "__main__":
    main()
