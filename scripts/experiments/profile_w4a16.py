"""Host-time breakdown of one small W4A16 call, and kernels for ncu to look at (run on a GPU machine)."""
import cProfile
import pstats
import sys
import time

import torch

from tilefish import w4a16
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.bench.timing import w4a16_workspace

if "--ncu" in sys.argv:  # a few launches of the cases worth looking at under ncu
    import os  # env NCU_CASES="m,k,n[,group[,plan]];...", group 128 unless given (-1: per channel); fp16

    cases = [c.split(",") for c in os.environ.get("NCU_CASES", "1,28672,8192;1,8192,57344").split(";")]
    for c in cases:
        m, k, n, group = (int(v) for v in (c + ["128"])[:4])
        cfg, slices = ops.parse_plan(c[4]) if len(c) > 4 else (None, None)  # default: the dispatcher's plan
        p = ops.pack(quantize_rtn(torch.randn(n, k, device="cuda"), group, True, scale_dtype=torch.float16, clip_search=False))
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        label = cfg.label() if cfg else ops.choose_config(m, n, k, 132, 90, group).label()
        print(f"m {m} k {k} n {n} g{group}: {label}", file=sys.stderr)
        for _ in range(3):  # ncu skips the first launches: they compile and warm up
            ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=cfg, slices=slices)
    torch.cuda.synchronize()
    sys.exit(0)

CASES = [("mma.sync, m 1, k 256 x n 128", 1, 256, 128), ("skinny, m 1, k 4096 x n 8192", 1, 4096, 8192),
         ("wgmma, m 64, k 4096 x n 4096", 64, 4096, 4096)]
for label, m, k, n in CASES:
    p = ops.pack(quantize_rtn(torch.randn(n, k, device="cuda"), 128, True, scale_dtype=torch.float16, clip_search=False))
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = x.new_empty(n, k)
    for _ in range(100):
        w4a16.matmul(x, p)
    torch.cuda.synchronize()
    print(f"== {label}: {ops.choose_config(m, n, k, 132, 90, 128).label()}")
    for name, fn in [("public matmul", lambda: w4a16.matmul(x, p)),
                     ("matmul_impl", lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device))),
                     ("validate", lambda: ops._validate(x, p, None)),
                     ("torch.nn.functional.linear", lambda: torch.nn.functional.linear(x, w))]:
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{name:32s} {(t1 - t0) / 2000 * 1e6:7.1f} us/call (host)")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        w4a16.matmul(x, p)
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(16)
