"""One decode step's kernels in launch order: start, duration and the gap before each, from the torch profiler
over graph replays of the e2e bench's compiled step (the timeline behind scripts/profile_e2e.py's sums).

Usage (device): python scripts/experiments/trace_e2e_step.py OUT.csv [layers] [batch]
(IMPLS=w4a16 by default, comma list as profile_e2e, plus w4a16-norope: the fused forward with transformers'
attention forward, i.e. without the rope_cache kernel; writes one CSV per impl: OUT.csv with the impl before .csv)
"""
import csv
import os
import sys
from pathlib import Path

import torch

from tilefish.bench import e2e
from tilefish.models.llama import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import profile_e2e  # noqa: E402  (scripts/profile_e2e.py: the variants and the captured step)


def main():
    out = sys.argv[1]
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    cfg = LlamaConfig.llama3_8b(layers)
    dev = torch.device("cuda")
    for impl in os.environ.get("IMPLS", "w4a16").split(","):
        torch.manual_seed(0)
        runner = e2e._HF(cfg, dev)
        with torch.no_grad(), profile_e2e.launch_policy_for(impl):
            profile_e2e.convert_variant(runner, impl)
            replay = profile_e2e.captured_step(runner, cfg, batch, dev)
            wall = e2e._time_ms(replay, dev, 30)
            for _ in range(3):
                replay()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    replay()
                    torch.cuda.synchronize()
            evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
            # the last replay's kernels: after the largest gap (the synchronize between replays)
            gaps = [evs[i].time_range.start - evs[i - 1].time_range.end for i in range(1, len(evs))]
            cut = max(range(len(gaps)), key=lambda i: gaps[i] if i > len(evs) // 2 else -1) + 1
            last = evs[cut:]
            t0 = last[0].time_range.start
            path = out.replace(".csv", f"_{impl}_b{batch}.csv")
            with open(path, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["start_us", "dur_us", "gap_us", "name"])
                prev = None
                for e in last:
                    gap = 0.0 if prev is None else e.time_range.start - prev
                    w.writerow([f"{e.time_range.start - t0:.2f}", f"{e.time_range.elapsed_us():.2f}", f"{gap:.2f}",
                                e.name[:160]])
                    prev = e.time_range.end
            span = last[-1].time_range.end - t0
            print(f"{impl} b{batch}: step {wall * 1e3:,.1f} us (graph replay), {len(last)} kernels spanning "
                  f"{span:,.1f} us -> {path}")
            runner.free()
        del runner
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
