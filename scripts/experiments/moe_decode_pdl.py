"""The MoE decode path's down launch with and without programmatic dependent launch (moe_decode.
PROGRAMMATIC_DOWN_LAUNCH): the same two kernels, the same plan, from CUDA graphs (L2 flushed, alternating rounds);
results compared bitwise, times as % of the selected experts' bytes at the copy rate measured in the same process.

    python scripts/experiments/moe_decode_pdl.py [--models qwen3-30b-a3b,gpt-oss-20b] [--tokens 1,2,4] [--fmts int4]
"""
from __future__ import annotations

import argparse
import json

import torch

from tilefish.bench import moe as bm
from tilefish.bench.ceilings import copy_bandwidth_gbps
from tilefish.bench.moe_shapes import MODELS, floor_us, parse_models, selected_bytes
from tilefish.bench.timing import time_alternating_us
from tilefish.ops import moe_decode as md
from tilefish.ops import moe_kernels as mk
from tilefish.ops.w4a16.workspace import new_counters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--tokens", default="1,2,4")
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
                launches = {}
                for name, pdl in (("plain", False), ("pdl", True)):
                    md.PROGRAMMATIC_DOWN_LAUNCH = pdl
                    launches[name] = mk.experts_launch(x, ids, w, gu, dn, act, gb, db, counters)
                md.PROGRAMMATIC_DOWN_LAUNCH = True
                if not isinstance(launches["plain"], md.DecodeLaunch):
                    print(f"{model.name:16s} {fmt:6s} t{t:<4d} takes the grouped path: left out")
                    continue
                calls = {name: (lambda f=f: f(x, ids, w)) for name, f in launches.items()}
                same = torch.equal(calls["plain"](), calls["pdl"]())
                graphs = [bm.graphed(fn) for fn in calls.values()]
                us = time_alternating_us({n: g[0] for n, g in zip(calls, graphs)}, rounds=6, per_round=10)
                floor = floor_us(selected_bytes(model, fmt, ids), copy)
                row = dict(model=model.name, fmt=fmt, tokens=t, plain_us=us["plain"], pdl_us=us["pdl"],
                           floor_us=floor, bitwise_equal=same)
                rows.append(row)
                print(f"{model.name:16s} {fmt:6s} t{t:<4d} plain {us['plain']:6.1f} us ({100 * floor / us['plain']:3.0f}%)"
                      f"  pdl {us['pdl']:6.1f} us ({100 * floor / us['pdl']:3.0f}%)  floor {floor:5.1f}  "
                      f"speedup {us['plain'] / us['pdl']:.3f}x  bitwise {'equal' if same else 'DIFFERENT'}", flush=True)
                del graphs
            del gu, dn
        del module
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), copy_gbps=copy, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
