"""Run the W4A16 wgmma kernel under compute-sanitizer (memcheck / racecheck / synccheck) on a few
shapes that exercise every path: m below / across tiles, split k, groups, zero points, bias.
With --skinny, the skinny kernel instead: its configurations at m = 1 / 5 / full tile, grids that
split tiles over 2-24 CTAs (the finisher's mid-stream fixups and the consumers' final ones,
through registers or, in the staged builds, through shared memory).

With --stream-k, the wgmma kernel's stream-K builds: grids that cut tiles anywhere (so a CTA's last
segment takes the counter peek, or falls back to its slot and the atomic: which of the two runs depends
on the arrival order, so each case is launched several times; no build forces the slot path any more).

Every mode also runs k % 128 == 64 (k = 192, 832): the mma.sync and skinny kernels' half last tile / stage.

Usage: compute-sanitizer --tool memcheck python scripts/sanitize_w4a16_hopper.py [--skinny | --stream-k]
"""
import sys

import torch

from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn

torch.manual_seed(0)
if "--skinny" in sys.argv:
    for k, n, group, sym in ((4096, 256, 128, False), (2048, 512, -1, True), (832, 256, 64, False),
                             (192, 512, 32, True)):
        q = quantize_rtn(torch.randn(n, k, device="cuda"), group, sym, scale_dtype=torch.float16, clip_search=False)
        p = ops.pack(q)
        for cfg in (ops.SkinnyConfig(8, 4, 1, 3, 2), ops.SkinnyConfig(8, 4, 2, 8, 1), ops.SkinnyConfig(16, 2, 2, 6, 2),
                    ops.SkinnyConfig(8, 4, 1, 3, 2, staged=True), ops.SkinnyConfig(16, 4, 1, 4, 2, staged=True)):
            for m in (1, 5, cfg.mt):
                for ctas in (3, 24):
                    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                    ops.matmul_impl(x, p, torch.randn(n, device="cuda", dtype=torch.float16), cfg=cfg, ctas=ctas)
    torch.cuda.synchronize()
    print("sanitize run done (skinny)")
    sys.exit(0)
if "--stream-k" in sys.argv:
    for repeat in range(3):
        for k, n, group, sym in ((2048, 512, 64, False), (1024, 256, -1, True), (832, 512, 64, True)):
            q = quantize_rtn(torch.randn(n, k, device="cuda"), group, sym, scale_dtype=torch.float16, clip_search=False)
            p = ops.pack(q)
            for cfg in (ops.HopperConfig(128, 1, 2, 6, True), ops.HopperConfig(64, 2, 2, 6, True),
                        ops.HopperConfig(16, 4, 1, 8, True)):
                if n % cfg.bn:
                    continue
                for m in (cfg.mt - 3, cfg.mt + 5):
                    for ctas in (None, 7, 13):
                        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                        ops.matmul_impl(x, p, torch.randn(n, device="cuda", dtype=torch.float16), cfg=cfg, ctas=ctas)
    torch.cuda.synchronize()
    print("sanitize run done (stream-k)")
    sys.exit(0)
for k, n, group, sym in ((512, 256, 128, False), (256, 128, 32, True), (384, 512, -1, False), (192, 256, 64, False)):
    q = quantize_rtn(torch.randn(n, k, device="cuda"), group, sym, scale_dtype=torch.bfloat16, clip_search=False)
    p = ops.pack(q)
    for cfg in (ops.HopperConfig(16, 4, 1, 8), ops.HopperConfig(64, 2, 2, 6), ops.HopperConfig(128, 1, 2, 6),
                ops.HopperConfig(32, 2, 1, 8), ops.HopperConfig(64, 2, 1, 8)):
        if n % cfg.bn:
            continue
        for m, slices in ((5, 1), (70, 2), (130, 3)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ops.matmul_impl(x, p, torch.randn(n, device="cuda", dtype=torch.bfloat16), cfg=cfg, slices=slices)
# The mma.sync kernel's half last tile (k % 128 == 64), split and unsplit, register ring and swapped operands.
for k, n, group, sym in ((192, 256, 64, False), (832, 512, 32, True), (64, 256, -1, False)):
    q = quantize_rtn(torch.randn(n, k, device="cuda"), group, sym, scale_dtype=torch.float16, clip_search=False)
    p = ops.pack(q)
    for cfg in (ops.GemmConfig(1, 2, 4, 4), ops.GemmConfig(2, 1, 8, 6), ops.GemmConfig(1, 2, 4, 4, True, True),
                ops.GemmConfig(1, 4, 2, 4, True)):
        for m, slices in ((5, 1), (5, 3), (33, 2)):
            if cfg.swap and m > 8:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ops.matmul_impl(x, p, torch.randn(n, device="cuda", dtype=torch.float16), cfg=cfg, slices=slices)
torch.cuda.synchronize()
print("sanitize run done")
