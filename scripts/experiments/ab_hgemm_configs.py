"""Same-process A/B of HGEMM ladder configurations against cuBLAS: each configuration and cuBLAS
timed in alternating rounds (a GPU that heats up slows them alike), samples pooled, median
reported; each configuration's result is also checked against an fp32 reference first.

Usage: python scripts/experiments/ab_hgemm_configs.py OUT.json fp16|bf16 SHAPE[,SHAPE...] CONFIG [CONFIG ...]
SHAPE is MxNxK or a single number for a cube; CONFIG is STEP:V,V,... with the step's tile
parameters (e.g. 05_multistage:128,256,64,64,64,3), or a step name for its TUNED configuration.
"""
import json
import sys

import torch

from tilefish.bench.timing import time_alternating_us
from tilefish.ops import hgemm as ops

ROUNDS, PER_ROUND = 4, 8


def parse_config(text):
    step, _, values = text.partition(":")
    if not values:
        return ops.TUNED[step]
    cfg = ops.HgemmConfig(step, tuple(int(v) for v in values.split(",")))
    if (why := cfg.problem()) is not None:
        raise SystemExit(f"{text}: {why}")
    return cfg


def parse_shape(text):
    dims = [int(v) for v in text.split("x")]
    return tuple(dims * 3) if len(dims) == 1 else tuple(dims)


def main():
    out_path, dname = sys.argv[1], sys.argv[2]
    shapes = [parse_shape(s) for s in sys.argv[3].split(",")]
    labels = sys.argv[4:]
    cfgs = {label: parse_config(label) for label in labels}
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
    results = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dt)
        b = torch.randn(k, n, device="cuda", dtype=dt)
        ref = a.float() @ b.float()
        fns = {"cuBLAS": lambda: torch.matmul(a, b)}
        errs = {}
        for label, cfg in cfgs.items():
            out = ops.hgemm(a, b, kernel=cfg)
            errs[label] = ((out.float() - ref).norm() / ref.norm()).item()
            fns[label] = lambda cfg=cfg: ops.hgemm(a, b, kernel=cfg)
        us = time_alternating_us(fns, rounds=ROUNDS, per_round=PER_ROUND)
        results.append({"m": m, "n": n, "k": k, "dtype": dname, "us": us, "rel_err": errs})
        print(f"{dname} {m}x{n}x{k}: cuBLAS {us['cuBLAS']:.1f} us")
        for label in labels:
            tflops = 2 * m * n * k / us[label] / 1e6
            print(f"   {label:44s} {us[label]:9.1f} us {tflops:6.1f} TFLOP/s  "
                  f"{us['cuBLAS'] / us[label]:.3f}x  err {errs[label]:.1e}", flush=True)
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rounds": ROUNDS, "per_round": PER_ROUND,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
