"""Sweep the W4A16 wgmma configurations x k splits against cuBLAS and the current dispatch (H200).

Usage: python scripts/experiments/sweep_w4a16_hopper.py OUT.json [fp16|bf16]. Prints, per (shape, m), cuBLAS,
auto (the dispatcher's pick) and the best three (config, slices), as time and ratio to cuBLAS.
"""
import json
import sys

import torch

from tilefish.bench.timing import time_cuda
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.bench.timing import w4a16_workspace

SHAPES = [(4096, 4096), (4096, 28672), (8192, 8192), (28672, 8192), (8192, 57344)]
MS = [16, 32, 64, 128, 256, 1024, 4096]
SLICES = (1, 2, 3, 4, 6, 8, 12, 16)


def main():
    out_path = sys.argv[1]
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[2] if len(sys.argv) > 2 else "fp16"]
    results = []
    for k, n in SHAPES:
        dense = torch.randn(n, k, device="cuda", dtype=dt)
        p = ops.pack(quantize_rtn(dense, 128, True, scale_dtype=dt, clip_search=False))
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            reps = 10 if m >= 1024 else 20
            t_cublas = time_cuda(lambda: torch.nn.functional.linear(x, dense), reps=reps).median_ms
            t_auto = time_cuda(lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device)), reps=reps).median_ms
            t_mma = time_cuda(lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=ops.choose_mma_config(m, n, k, 132)), reps=reps).median_ms
            rows = []
            for cfg in ops.HOPPER_CONFIGS:
                if n % cfg.bn or cfg.mt > max(32, 2 * m) or (m >= 128 and cfg.mt < 64):
                    continue
                tiles = (n // cfg.bn) * -(-m // cfg.mt)
                for sl in SLICES:
                    if sl > k // 256 or tiles * sl > 8 * 132 or (sl > 1 and tiles >= 2 * 132):
                        continue
                    grid = {"ctas": sl} if cfg.streamk else {"slices": sl}  # stream-K configs: sl CTAs
                    t = time_cuda(lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=cfg, **grid), reps=reps).median_ms
                    rows.append((t, cfg.label(), sl))
            rows.sort()
            auto_cfg = ops.choose_config(m, n, k, 132, 90, 128)  # the weights above: group 128
            rec = {"k": k, "n": n, "m": m, "cublas_us": t_cublas * 1e3, "auto_us": t_auto * 1e3,
                   "auto": auto_cfg.label(), "mma_us": t_mma * 1e3,
                   "best": [(t * 1e3, lab, sl) for t, lab, sl in rows[:5]]}
            results.append(rec)
            best = " | ".join(f"{lab} x{sl} {t * 1e3:.1f} ({t_cublas / t:.2f}x)" for t, lab, sl in rows[:3])
            print(f"k{k} n{n} m{m}: cuBLAS {t_cublas * 1e3:.1f} us; auto {auto_cfg.label()} {t_auto * 1e3:.1f} "
                  f"({t_cublas / t_auto:.2f}x); mma {t_mma * 1e3:.1f} ({t_cublas / t_mma:.2f}x); best {best}", flush=True)
        del dense, p
    json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
