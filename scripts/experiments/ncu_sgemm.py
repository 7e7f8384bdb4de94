"""Launch every SGEMM ladder step once at 2048^3 so ncu can read the counter each step moves.

    ncu --clock-control none --csv -k regex:sgemm --metrics <list> python scripts/experiments/ncu_sgemm.py
(scripts/experiments/ncu_sgemm.sh runs it with the metric list and writes the CSV).
"""
import torch

from tilefish.ops import sgemm as ops

n = 2048
a = torch.randn(n, n, device="cuda")
b = torch.randn(n, n, device="cuda")
c = torch.empty(n, n, device="cuda")
for step in ops.KERNELS:  # compile and load outside the profiled launches' timing
    ops.sgemm(a, b, c, kernel=step)
torch.cuda.synchronize()
for step in ops.KERNELS:
    torch.cuda.nvtx.range_push(step)
    ops.sgemm(a, b, c, kernel=step)
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
