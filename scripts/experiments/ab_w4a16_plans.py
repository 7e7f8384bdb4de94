"""Same-process A/B of W4A16 wgmma plans on the benchmark shapes: each plan and cuBLAS timed in
alternating rounds (so a GPU that heats up under long launches slows every plan alike), samples
pooled, median reported. For choices the sweeps cannot settle because one launch-after-another
comparison drifts with the clocks (m >= 2048).

Usage: python scripts/experiments/ab_w4a16_plans.py OUT.json fp16|bf16 GROUP M[,M...] PLAN [PLAN ...]
PLAN is a configuration label with an optional k split, as in the sweeps: wg-m128n256c2s6/x1,
wg-m128n256c2s5-streamk, or a skinny one (skinny-m8n256w1s4x2, any stage count; -st: the
staged-fixup build; ops.w4a16.parse_plan reads them, and the older spellings "...-sk" and "sk-...");
"auto" is the dispatcher's choice, "auto-st" its skinny configuration as the staged-fixup build
(skipped where the dispatcher takes another kernel; checked bitwise against "auto"),
"wg-model" the time model's wgmma plan (choose_hopper_plan) where the dispatcher may take another
kernel. Env SHAPES=KxN,KxN limits the shapes (default: the eight benchmark shapes).
"""
import dataclasses
import os
import json
import sys

import torch

from tilefish.bench.timing import time_alternating_us
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.bench.timing import w4a16_workspace

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192),
          (8192, 57344), (28672, 8192)]
if os.environ.get("SHAPES"):
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(",")]
ROUNDS, PER_ROUND = 4, 6


def parse(label):
    """(config, k slices or None): a plan label (ops.w4a16.parse_plan), or (None, None) for this
    script's "auto", "auto-st" and "wg-model"."""
    if label in ("auto", "auto-st", "wg-model"):
        return None, None
    return ops.parse_plan(label)


def main():
    out_path, dname, group = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ms = [int(v) for v in sys.argv[4].split(",")]
    plans = sys.argv[5:]
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
    results = []
    for k, n in SHAPES:
        q = quantize_rtn(torch.randn(n, k, device="cuda", dtype=dt), group, True, scale_dtype=dt, clip_search=False)
        p = ops.pack(q)
        deq = q.dequantize(torch.float32).to(dt)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            fns = {"cuBLAS": lambda: torch.nn.functional.linear(x, deq)}
            chosen = {}
            for label in plans:
                cfg, sl = parse(label)
                if label == "wg-model":
                    cfg, sl = ops.choose_hopper_plan(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count,
                                                     grouped=group != -1)
                    chosen[label] = cfg.label() + ("" if sl is None else f"/x{sl}")
                if label == "auto-st":  # the dispatcher's skinny choice as its staged-fixup build
                    cfg = ops.choose_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count, 90,
                                            group, dtype=dt)
                    if not isinstance(cfg, ops.SkinnyConfig):
                        continue
                    cfg = dataclasses.replace(cfg, staged=True)
                    chosen[label] = cfg.label()
                if cfg is None or (n % cfg.bn == 0 and m <= (cfg.mt if isinstance(cfg, ops.SkinnyConfig) else m)):
                    fns[label] = lambda cfg=cfg, sl=sl: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=cfg, slices=sl)
            if "auto" in fns and "auto-st" in fns:  # same sums in the same order: bitwise equal
                assert torch.equal(fns["auto"](), fns["auto-st"]()), f"k{k} n{n} m{m}: auto-st differs from auto"
            us = time_alternating_us(fns, rounds=ROUNDS, per_round=PER_ROUND)
            best = min((u, name) for name, u in us.items() if name != "cuBLAS")
            results.append({"k": k, "n": n, "m": m, "dtype": dname, "group": group, "us": us, "plans": chosen})
            print(f"k{k} n{n} m{m}: " + ", ".join(f"{chosen.get(name, name)} {u:.1f} ({us['cuBLAS'] / u:.2f}x)" for name, u in us.items())
                  + f"; best {best[1]}", flush=True)
        del q, p, deq
        json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
