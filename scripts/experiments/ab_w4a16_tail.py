"""Same-process A/B of the W4A16 wgmma kernel's partial last wave: one launch against the tail as a
launch of its own (ops.w4a16.separate_tail), on the dispatcher's plan, for every benchmark shape,
group 128 and per-channel, where the plan is a whole-tile, two-CTA-an-SM one with a partial last
wave that fits one CTA an SM. Alternating rounds, L2 flushed, cuBLAS in the same rounds; the two
sides differ only in the LaunchPolicy their calls pass (separate_tail "never" / "always").

Usage: python scripts/experiments/ab_w4a16_tail.py OUT.json fp16|bf16 M[,M...]
"""
import json
import sys

import torch

from tilefish.bench.timing import time_alternating_us
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.bench.timing import w4a16_workspace

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192),
          (8192, 57344), (28672, 8192)]
ROUNDS, PER_ROUND = 4, 6


def main():
    out_path, dname = sys.argv[1], sys.argv[2]
    ms = [int(v) for v in sys.argv[3].split(",")]
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for k, n in SHAPES:
        dense = torch.randn(n, k, device="cuda", dtype=dt)
        for group in (128, -1):
            p = ops.pack(quantize_rtn(dense, group, True, scale_dtype=dt, clip_search=False))
            for m in ms:
                cfg, slices = ops.choose_hopper_plan(m, n, k, sms, grouped=group != -1)
                tiles = (n // cfg.bn) * -(-m // cfg.mt)
                tail = ops.separate_tail(cfg, tiles, slices or 0, 1, group, False, sms, "always")
                rule = ops.separate_tail(cfg, tiles, slices or 0, 1, group, False, sms, "rule")
                if not tail:
                    continue
                x = torch.randn(m, k, device="cuda", dtype=dt)
                def with_mode(mode):
                    policy = ops.LaunchPolicy(separate_tail=mode)
                    return lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), policy=policy)

                us = time_alternating_us({"one launch": with_mode("never"), "tail apart": with_mode("always"),
                                          "cuBLAS": lambda: torch.nn.functional.linear(x, dense)},
                                         rounds=ROUNDS, per_round=PER_ROUND)
                results.append({"k": k, "n": n, "m": m, "group": group, "dtype": dname, "plan": cfg.label(),
                                "tiles": tiles, "tail": tail, "rule_separates": bool(rule), "us": us})
                print(f"{dname} k{k} n{n} g{group} m{m} {cfg.label()} tiles {tiles} tail {tail}: "
                      f"one launch {us['one launch']:7.1f}  tail apart {us['tail apart']:7.1f}  cuBLAS {us['cuBLAS']:7.1f} us"
                      f"  (rule: {'apart' if rule else 'one launch'})", flush=True)
    with open(out_path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rounds": ROUNDS, "per_round": PER_ROUND,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
