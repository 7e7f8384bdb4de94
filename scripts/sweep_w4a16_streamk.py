"""Sweep the W4A16 wgmma kernel's stream-K configurations (HopperConfig streamk=True) against cuBLAS,
the current dispatch and the tile-mode configurations, m = 16..1024 (H200). Each stream-K
configuration is checked against the float64 reference once per (shape, m) before it is timed.
Each plan is recorded as [time us, label, cluster]: cluster = 1 when its k split ran as clusters of
its slices (the DSMEM fixup; a run inside `ops.w4a16.launch_policy(LaunchPolicy(dsmem_split=False))`
has none), which the time model weighs apart.

Usage: python scripts/sweep_w4a16_streamk.py OUT.json [fp16|bf16] [group] [m,m,...]
Env CONFIGS=label,label limits the plans to those configurations (HopperConfig labels, every k
split of each), to add configurations to an existing sweep; SHAPES=KxN,KxN limits the shapes.
"""
import json
import os
import sys

import torch

from tilefish.bench.timing import time_cuda
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.reference import w4a16_matmul
from tilefish.bench.timing import w4a16_workspace

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192),
          (8192, 57344), (28672, 8192)]
if os.environ.get("SHAPES"):
    SHAPES = [tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(",")]
MS = [16, 24, 32, 64, 128, 256, 512, 1024]
ONLY = {ops.canonical_label(c) for c in os.environ["CONFIGS"].split(",")} if os.environ.get("CONFIGS") else None
SLICES = (1, 2, 3, 4, 6, 8)


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def candidates(m, n, k, sms):
    """(config, slices): tile configs with k split 1..8 ways (up to 4 waves, >= 4 stages a slice),
    stream-K configs with their default one-wave grid (slices None)."""
    out = []
    for cfg in ops.HOPPER_CONFIGS:
        if ONLY is not None and cfg.label() not in ONLY:
            continue
        if n % cfg.bn or cfg.mt > max(32, 2 * m) or (m >= 128 and cfg.mt < 64) or (m >= 512 and cfg.mt < 128):
            continue
        if cfg.streamk:
            out.append((cfg, None))
            continue
        tiles = (n // cfg.bn) * -(-m // cfg.mt)
        for sl in SLICES:
            if sl == 1 or (tiles * sl <= 4 * sms and k // 64 // sl >= 4):
                out.append((cfg, sl))
    return out


def main():
    out_path = sys.argv[1]
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[sys.argv[2] if len(sys.argv) > 2 else "fp16"]
    group = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    ms = [int(v) for v in sys.argv[4].split(",")] if len(sys.argv) > 4 else MS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = []
    for k, n in SHAPES:
        dense = torch.randn(n, k, device="cuda", dtype=dt)
        q = quantize_rtn(dense, group, True, scale_dtype=dt, clip_search=False)
        p = ops.pack(q)
        deq = q.dequantize(torch.float32).to(dt)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = w4a16_matmul(x, q) if m <= 256 else None
            reps = 10 if m >= 1024 else 15
            t_cublas = time_cuda(lambda: torch.nn.functional.linear(x, deq), reps=reps).median_ms * 1e3
            auto = ops.choose_config(m, n, k, sms, 90, group)
            t_auto = time_cuda(lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device)), reps=reps).median_ms * 1e3
            rows = []
            for cfg, sl in candidates(m, n, k, sms):
                if cfg.streamk and ref is not None:
                    err = rel_err(ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=cfg), ref)
                    assert err < 2e-2, (cfg.label(), k, n, m, err)
                t = time_cuda(lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=cfg, slices=sl), reps=reps).median_ms * 1e3
                cl = sl is not None and ops.hopper_split_uses_clusters(cfg, m, n, k, sl, group, False, dt, x.device)
                rows.append((t, cfg.label() + ("" if sl is None else f"/x{sl}"), int(cl)))
            rows.sort()
            best_sk = next(((t, lab) for t, lab, _ in rows if lab.endswith("-streamk")), (float("nan"), "-"))
            best_tile = next(((t, lab) for t, lab, _ in rows if not lab.endswith("-streamk")), (float("nan"), "-"))
            auto_sl = (ops.choose_hopper_slices(auto, m, n, k, sms)
                       if isinstance(auto, ops.HopperConfig) and not auto.streamk else None)
            rec = {"k": k, "n": n, "m": m, "dtype": str(dt), "group": group, "cublas_us": t_cublas,
                   "auto": auto.label() + ("" if auto_sl is None else f"/x{auto_sl}"), "auto_us": t_auto, "configs": rows}
            results.append(rec)
            print(f"k{k} n{n} m{m}: cuBLAS {t_cublas:.1f}; auto {auto.label()} {t_auto:.1f} ({t_cublas / t_auto:.2f}x); "
                  f"best streamk {best_sk[1]} {best_sk[0]:.1f} ({t_cublas / best_sk[0]:.2f}x); "
                  f"best tile {best_tile[1]} {best_tile[0]:.1f} ({t_cublas / best_tile[0]:.2f}x)", flush=True)
        del dense, p, q, deq
        json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
