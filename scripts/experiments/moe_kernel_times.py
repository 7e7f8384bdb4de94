"""Per-kernel GPU times of the grouped expert op's paths (torch.profiler over eager calls, L2 flushed before
each call), beside the whole call replayed from a CUDA graph: where a path's time goes.

    python scripts/experiments/moe_kernel_times.py --model qwen3-30b-a3b --fmt int4 --tokens 1
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from tilefish.bench import moe as bm
from tilefish.bench.moe_shapes import MODELS
from tilefish.bench.timing import flush_l2, time_alternating_us
from tilefish.ops.moe_kernels import grouped_experts_cuda
from tilefish.ops.w4a16.workspace import new_counters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b")
    p.add_argument("--fmt", default="int4")
    p.add_argument("--tokens", default="1")
    p.add_argument("--paths", default="grouped,decode")
    a = p.parse_args()
    dev = torch.device("cuda")
    for name in a.models.split(","):
        model = MODELS[name]
        module = bm.dense_experts(model, dev)
        gu, dn, gb, db, act = bm.quantized_weights(module, model, a.fmt)
        for t in map(int, a.tokens.split(",")):
            ids, w = bm.routing(model, t, dev)
            x = torch.randn(t, model.hidden, device=dev, dtype=torch.bfloat16)
            counters = new_counters(dev)
            for path in a.paths.split(","):
                fn = lambda: grouped_experts_cuda(x, ids, w, gu, dn, act, gb, db, counters, path)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        flush_l2()
                        fn()
                    torch.cuda.synchronize()
                per = collections.defaultdict(list)
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA and "flush" not in e.name and \
                            "fill" not in e.name.lower() and "elementwise" not in e.name.lower():
                        per[e.name[:90]].append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
                replay, graph = bm.graphed(fn)
                us = time_alternating_us({"graph": replay}, rounds=2, per_round=20)["graph"]
                total = sum(sum(v) / len(v) for v in per.values())
                print(f"{name} {a.fmt} t{t} {path}: graph replay {us:.1f} us; kernels {total:.1f} us:")
                for k, v in per.items():
                    print(f"    {sum(v) / len(v):7.1f} us  x{len(v) // 20}  {k}")
                del graph


if __name__ == "__main__":
    main()
