"""Run the NF4 matmul's plans under compute-sanitizer (memcheck / racecheck): the dispatcher's
pick at m across the skinny / wgmma / mma.sync regimes, both dtypes, bias; then with fp16 every
configuration of each kernel family (mma.sync at m = 5 and 37, wgmma incl. stream-K and split k at
m = 300, skinny at m = 5 over 24 CTAs).

Usage: compute-sanitizer --tool memcheck --report-api-errors no python scripts/sanitize_nf4.py
"""
import torch

from tilefish import nf4
from tilefish.ops import w4a16 as ops

torch.manual_seed(0)
plans = set()
for dt in (torch.bfloat16, torch.float16):
    for k, n, blocksize in ((1024, 512, 64), (2048, 768, 256)):
        q = nf4.quantize((torch.randn(n, k, device="cuda") * 0.05).to(dt), blocksize=blocksize)
        p = nf4.prepare(q, dt)
        bias = torch.randn(n, device="cuda", dtype=dt)
        for m in (1, 5, 16, 33, 64, 130, 300):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            nf4.matmul(x, p, bias if m % 2 else None)
            plans.add(ops.choose_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count,
                                        90, p.kernel.group_size, dtype=dt).label())
        if dt == torch.float16:
            for cfg in ops.CONFIGS:
                for m in (5, 37):
                    if n % cfg.bn == 0 and not (cfg.swap and m > 8):
                        ops.matmul_impl(torch.randn(m, k, device="cuda", dtype=dt), p.kernel, cfg=cfg)
            for cfg in ops.HOPPER_CONFIGS:
                if n % cfg.bn == 0:
                    ops.matmul_impl(torch.randn(300, k, device="cuda", dtype=dt), p.kernel, bias, cfg=cfg,
                                    slices=None if cfg.streamk else 2)
            for cfg in ops.SKINNY_CONFIGS:
                if n % cfg.bn == 0:
                    ops.matmul_impl(torch.randn(5, k, device="cuda", dtype=dt), p.kernel, bias, cfg=cfg, ctas=24)
torch.cuda.synchronize()
print("sanitize run done (nf4):", ", ".join(sorted(plans)))
