"""Where the host time of one small NF4 dequantize call goes (run on a GPU machine)."""
import cProfile
import pstats
import time

import torch

from tilefish import nf4
from tilefish.ops.nf4 import dequantize_impl, launch_dequantize

q = nf4.quantize(torch.randn(64, 64, device="cuda"), blocksize=64)
out = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")
for _ in range(100):
    nf4.dequantize(q, torch.bfloat16)
torch.cuda.synchronize()
for name, fn in [("public dequantize", lambda: nf4.dequantize(q, torch.bfloat16)),
                 ("impl (validate+alloc+launch)", lambda: dequantize_impl(q, torch.bfloat16)),
                 ("launch only", lambda: launch_dequantize(q, out)),
                 ("validate only", q.validate),
                 ("torch.empty", lambda: torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")),
                 ("torch add (reference op)", lambda: torch.add(out, out))]:
    t0 = time.perf_counter()
    for _ in range(3000):
        fn()
    dt = (time.perf_counter() - t0) / 3000 * 1e6
    torch.cuda.synchronize()
    print(f"{name:32s} {dt:7.1f} us/call")
pr = cProfile.Profile()
pr.enable()
for _ in range(3000):
    nf4.dequantize(q, torch.bfloat16)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
