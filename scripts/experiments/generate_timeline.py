"""Where a generate() token's time goes, on the profiler's timeline (run on a GPU machine).

For each variant: generate(ids, N new tokens, static cache, HF's compile) and generate(ids, 1 token) under
torch.profiler; every figure is (run N - run 1) / (N - 1), one decode step. A step's wall splits into
  busy       the union of the GPU's kernel / copy / memset intervals
  in-graph   idle gaps between the kernels of one CUDA graph replay (launch latency, a carveout change)
  outside    the GPU idle between graph replays and eager kernels: the GPU waiting for the host
and the host's events (CPU ops, annotations, runtime calls) overlapping the outside gaps are summed by
name, so the time the GPU waits is attributed to what the host was doing then.
    python scripts/experiments/generate_timeline.py [--layers 8] [--impls fp16,w4a16,tilefish-nf4] [--tokens 33]
"""
import argparse
import bisect
import collections
import gc
import json
import os
import tempfile
import time

import torch

from tilefish.bench import e2e_generate
from tilefish.models.llama import LlamaConfig

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")


def trace(fn):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
        fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def merged(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def analyse(events):
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in HOST_CATS]
    graph_corr = {e["args"].get("correlation") for e in host if e["name"] == "cudaGraphLaunch"}
    busy = sum(b - a for a, b in merged((e["ts"], e["ts"] + e["dur"]) for e in gpu))
    out = {"busy": busy, "in_graph": 0.0, "outside": 0.0, "kernels": len(gpu), "graphs": len(graph_corr),
           "gap_before": collections.Counter(), "host_in_gaps": collections.Counter(),
           "kernel_time": collections.Counter()}
    for e in gpu:
        out["kernel_time"][e["name"][:70]] += e["dur"]
    end = gpu[0]["ts"] + gpu[0]["dur"] if gpu else 0
    prev = gpu[0] if gpu else None
    gaps = []
    for e in gpu[1:]:
        gap = e["ts"] - end
        if gap > 0:
            same_graph = (e["args"].get("correlation") == prev["args"].get("correlation")
                          and e["args"].get("correlation") in graph_corr)
            if same_graph:
                out["in_graph"] += gap
                out["gap_before"][e["name"][:70]] += gap
            else:
                out["outside"] += gap
                gaps.append((end, e["ts"]))
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    ends = [g1 for _, g1 in gaps]
    for h in host:
        a, b = h["ts"], h["ts"] + h.get("dur", 0)
        for g0, g1 in gaps[bisect.bisect_right(ends, a):]:
            if g0 >= b:
                break
            out["host_in_gaps"][h["name"][:70]] += min(b, g1) - max(a, g0)
    return out


def per_token(run_n, run_1, steps):
    d = {}
    for key in ("busy", "in_graph", "outside", "kernels", "graphs"):
        d[key] = (run_n[key] - run_1[key]) / steps
    for key in ("gap_before", "host_in_gaps", "kernel_time"):
        c = collections.Counter(run_n[key])
        c.subtract(run_1[key])
        d[key] = {k: v / steps for k, v in c.most_common(14)}
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--impls", default="fp16,w4a16,tilefish-nf4")
    ap.add_argument("--tokens", type=int, default=33)
    a = ap.parse_args()
    cfg = LlamaConfig.llama3_8b(a.layers)
    summary = []
    for impl in a.impls.split(","):
        model, info = e2e_generate._build(cfg, impl, torch.device("cuda"), 0, False)
        ids = torch.randint(3, 1000, (1, 32), generator=torch.Generator().manual_seed(0)).cuda()
        gen = lambda n: e2e_generate._generate(model, ids, n)  # noqa: E731
        gen(a.tokens), gen(a.tokens)
        walls = {n: sorted(e2e_generate._wall_s(lambda: gen(n)) for _ in range(5))[2] for n in (a.tokens, 1)}
        wall = (walls[a.tokens] - walls[1]) / (a.tokens - 1) * 1e6
        d = per_token(analyse(trace(lambda: gen(a.tokens))), analyse(trace(lambda: gen(1))), a.tokens - 1)
        print(f"\n=== {impl} ({info}), {a.layers} layers, per decode token (us) ===")
        print(f"wall {wall:.0f} (no profiler) | busy {d['busy']:.0f} | in-graph gaps {d['in_graph']:.0f} | "
              f"outside gaps {d['outside']:.0f} | kernels {d['kernels']:.0f} | graph launches {d['graphs']:.1f}")
        for title, key in (("GPU busy by kernel", "kernel_time"), ("in-graph gaps by the kernel after", "gap_before"),
                           ("host events during the outside gaps", "host_in_gaps")):
            print(f"  {title}:")
            for k, v in d[key].items():
                print(f"    {v:8.1f}  {k}")
        summary.append((impl, wall, d))
        model = None
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{'impl':<14} {'wall':>7} {'busy':>7} {'in-graph':>9} {'outside':>8} {'kernels':>8}  (us per token, "
          f"{a.layers} layers)")
    for impl, wall, d in summary:
        print(f"{impl:<14} {wall:7.0f} {d['busy']:7.0f} {d['in_graph']:9.0f} {d['outside']:8.0f} {d['kernels']:8.0f}")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"({time.time() - t0:.0f} s)")
