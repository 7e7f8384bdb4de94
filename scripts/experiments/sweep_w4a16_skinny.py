"""Sweep the W4A16 stream-K skinny configurations (kernels/w4a16/skinny.cu) against cuBLAS and the
current dispatch, m <= 32 (H200). Each configuration is checked against the float64 reference
once per (shape, m) before it is timed.

Besides cuBLAS and the dispatch's pick it times the two kernels the skinny one competes with at
these m: the mma.sync kernel's own plan (m <= 16) and the wgmma kernel's model plan (m >= 9).

Usage: python scripts/experiments/sweep_w4a16_skinny.py OUT.json [fp16|bf16] [group]   (env MS=1,8,16 limits m,
SHAPES=KxN,... the weights, CODEBOOK=nf4 sweeps NF4 weights (blocksize = group, double quant))
"""
import json
import os
import sys

import torch

from tilefish import nf4
from tilefish.bench.timing import time_cuda
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.reference import dense_matmul, nf4_dequantize_fp32_chain, w4a16_matmul
from tilefish.bench.timing import w4a16_workspace

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192),
          (8192, 57344), (28672, 8192)]
MS = [int(v) for v in os.environ.get("MS", "1,2,4,8,16,32").split(",")]
if os.environ.get("SHAPES"):  # e.g. SHAPES=4096x6144,14336x4096 (k x n)
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(",")]
CTA_FACTORS = (None, 1)
CODEBOOK = os.environ.get("CODEBOOK", "int4")


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def main():
    out_path = sys.argv[1]
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[2] if len(sys.argv) > 2 else "fp16"]
    group = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for k, n in SHAPES:
        dense = torch.randn(n, k, device="cuda", dtype=dt)
        if CODEBOOK == "nf4":
            q = nf4.quantize(dense, blocksize=group, double_quant=True)
            p = nf4.prepare(q, dt).kernel
            deq = nf4_dequantize_fp32_chain(q, dt)
        else:
            q = quantize_rtn(dense, group, True, scale_dtype=dt, clip_search=False)
            p = ops.pack(q)
            deq = q.dequantize(torch.float32).to(dt)
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = dense_matmul(x, deq) if CODEBOOK == "nf4" else w4a16_matmul(x, q)
            t_cublas = time_cuda(lambda: torch.nn.functional.linear(x, deq), reps=30).median_ms
            t_auto = time_cuda(lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device)), reps=30).median_ms
            peers = {}
            if m <= 16:
                mma = ops.choose_mma_config(m, n, k, sms)
                peers["mma"] = (mma.label(), time_cuda(lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=mma), reps=30).median_ms * 1e3)
            if m >= ops.HOPPER_MIN_M:
                hcfg, hsl = ops.choose_hopper_plan(m, n, k, sms)
                peers["wgmma"] = (f"{hcfg.label()} s{hsl}",
                                  time_cuda(lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=hcfg, slices=hsl), reps=30).median_ms * 1e3)
            rows = []
            for cfg in ops.SKINNY_CONFIGS:
                if m > cfg.mt or n % cfg.bn or (cfg.mt > 8 and m <= cfg.mt // 2 and cfg.mt != 16):
                    continue
                for f in CTA_FACTORS:
                    ctas = None if f is None else f * sms
                    y = ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=cfg, ctas=ctas)
                    err = rel_err(y, ref)
                    t = time_cuda(lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=cfg, ctas=ctas), reps=30).median_ms
                    rows.append((t, cfg.label(), f or cfg.ctas_per_sm, err))
            rows.sort()
            auto_cfg = ops.choose_config(m, n, k, sms, 90, p.group_size, dtype=dt, codebook=p.codebook)
            worst = max(r[3] for r in rows)
            rec = {"k": k, "n": n, "m": m, "group": group, "dtype": str(dt), "cublas_us": t_cublas * 1e3,
                   "auto_us": t_auto * 1e3, "auto": auto_cfg.label(), "peers": peers, "worst_rel_err": worst,
                   "all": [(t * 1e3, lab, f, e) for t, lab, f, e in rows]}
            results.append(rec)
            best = " | ".join(f"{lab} x{f} {t * 1e3:.1f} ({t_cublas / t:.2f}x)" for t, lab, f, _ in rows[:3])
            print(f"k{k} n{n} m{m}: cuBLAS {t_cublas * 1e3:.1f}; auto {auto_cfg.label()} {t_auto * 1e3:.1f} "
                  f"({t_cublas / t_auto:.2f}x); {' '.join(f'{a} {b} {c:.1f}' for a, (b, c) in peers.items())}; best {best}; max err {worst:.1e}", flush=True)
        del dense, p, deq, q
    json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
