"""The grouped expert op's two CUDA paths on real MoE shapes: the five-launch grouped path against the two-launch
decode path (ops/moe_decode.py), each forced, and the automatic choice, from CUDA graphs (L2 flushed, alternating
rounds), as % of the selected experts' bytes at the copy rate measured in the same process.

    python scripts/experiments/moe_paths.py [--models qwen3-30b-a3b,gpt-oss-20b] [--tokens 1,2,4,8,16] [--fmts int4,mxfp4]
"""
from __future__ import annotations

import argparse
import json

import torch

from tilefish.bench import moe as bm
from tilefish.bench.ceilings import copy_bandwidth_gbps
from tilefish.bench.moe_shapes import MODELS, floor_us, parse_models, selected_bytes
from tilefish.bench.timing import time_alternating_us
from tilefish.ops.moe_decode import takes_decode_path
from tilefish.ops.moe_kernels import grouped_experts_cuda
from tilefish.ops.w4a16.workspace import new_counters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default="1,2,4,8,16,32")
    p.add_argument("--fmts", default="int4,mxfp4")
    p.add_argument("--out")
    a = p.parse_args()
    dev = torch.device("cuda")
    copy = copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s")
    rows = []
    for model in parse_models(a.models):
        module = bm.dense_experts(model, dev)
        for fmt in a.fmts.split(","):
            gu, dn, gb, db, act = bm.quantized_weights(module, model, fmt)
            for t in map(int, a.tokens.split(",")):
                ids, w = bm.routing(model, t, dev)
                x = torch.randn(t, model.hidden, device=dev, dtype=torch.bfloat16)
                counters = new_counters(dev)
                calls = {path: (lambda path=path: grouped_experts_cuda(x, ids, w, gu, dn, act, gb, db, counters, path))
                         for path in ("grouped", "decode")}
                ref = calls["grouped"]().float()
                err = ((calls["decode"]().float() - ref).norm() / ref.norm()).item()
                graphs = [bm.graphed(fn) for fn in calls.values()]  # keep graphs alive
                replays = {path: g[0] for path, g in zip(calls, graphs)}
                us = time_alternating_us(replays, rounds=4, per_round=10)
                floor = floor_us(selected_bytes(model, fmt, ids), copy)
                auto = "decode" if takes_decode_path(t, model.topk, model.experts) else "grouped"
                row = dict(model=model.name, fmt=fmt, tokens=t, grouped_us=us["grouped"], decode_us=us["decode"],
                           floor_us=floor, auto=auto, decode_vs_grouped_rel_err=err)
                rows.append(row)
                print(f"{model.name:16s} {fmt:6s} t{t:<4d} grouped {us['grouped']:7.1f} us ({100 * floor / us['grouped']:4.0f}%)"
                      f"  decode {us['decode']:7.1f} us ({100 * floor / us['decode']:4.0f}%)  floor {floor:6.1f}  "
                      f"auto {auto:7s} speedup {us['grouped'] / us['decode']:.2f}x  rel {err:.1e}", flush=True)
                del graphs, replays
            del gu, dn
        del module
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
