"""Launch every HGEMM ladder step once at 4096^3 (fp16) so ncu can read the counter each step moves.

    ncu --clock-control none --csv --profile-from-start off -k regex:hgemm --metrics <list> python scripts/experiments/ncu_hgemm.py
(scripts/experiments/ncu_hgemm.sh runs it with the metric list and writes the CSV).

Steps come from ops.KERNELS, so a new step (07_wgmma_tma) is picked up without editing this file.
A step whose call raises (e.g. the wgmma step on a GPU that is not sm_90) is skipped with a note on
stderr.  Only the second launch of each step lies between profiler start/stop: the first one
compiles and loads the kernel, and with --profile-from-start off ncu ignores it without a
--launch-skip count that would depend on how many steps ran.
"""
import sys

import torch

from tilefish.ops import hgemm as ops

n = 4096
a = torch.randn(n, n, device="cuda", dtype=torch.float16)  # [M, K]
b = torch.randn(n, n, device="cuda", dtype=torch.float16)  # [K, N], row-major
steps = []
for step in ops.KERNELS:  # compile and load outside the profiled range
    try:
        ops.hgemm(a, b, kernel=step)
        torch.cuda.synchronize()  # surface an asynchronous launch failure here, not in the profiled range
    except Exception as e:  # noqa: BLE001 -- any failure means "this GPU cannot run the step": skip it
        print(f"ncu_hgemm: skipping {step}: {type(e).__name__}: {e}", file=sys.stderr)
        continue
    steps.append(step)
torch.cuda.profiler.start()
for step in steps:
    torch.cuda.nvtx.range_push(step)
    ops.hgemm(a, b, kernel=step)
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
