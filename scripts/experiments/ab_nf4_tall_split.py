"""NF4 at m = 256 on the tall tile (wg-m256n128c2s5): time per k split, same process, L2 flushed (a
regression found in `tilefish bench nf4 --quick`: k4096 n4096 28.6 us at a35518f, 136.9 us at a1cf587)."""
import torch

import tilefish
from tilefish.bench.timing import time_cuda
from tilefish.ops import w4a16 as ops

torch.manual_seed(0)
for k, n in [(4096, 4096), (14336, 4096), (8192, 10240)]:
    q = tilefish.nf4.quantize(torch.randn(n, k, device="cuda"), blocksize=64)
    p = tilefish.nf4.prepare(q, torch.bfloat16)
    x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
    ws = ops.Workspace("cuda")
    plan = tilefish.nf4.plan(256, n, k, dtype=torch.bfloat16)
    ref = tilefish.nf4.matmul(x, p)
    row = [f"k{k} n{n} plan {plan.label} cluster {plan.cluster}:"]
    for s in (1, 2, 3, 4):
        out = ops.matmul_impl(x, p.kernel, cfg=plan.config, slices=s, workspace=ws)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        t = time_cuda(lambda: ops.matmul_impl(x, p.kernel, cfg=plan.config, slices=s, workspace=ws), reps=50)
        row.append(f"x{s} {t.median_us:.1f} us (err {err:.1e})")
    t = time_cuda(lambda: tilefish.nf4.matmul(x, p, workspace=ws), reps=50)
    row.append(f"| dispatcher {t.median_us:.1f} us")
    print(" ".join(row))
