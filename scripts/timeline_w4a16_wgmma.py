"""Per-CTA %globaltimer timeline of the W4A16 wgmma kernel in tile mode (kernels/w4a16/wgmma.cu
built with -D TF_TIMELINE), to see where a mid-m launch's time goes: first data, main loop, the
k-split fixup (DSMEM cluster or global workspace), exit. Each CTA stamps (ns): 0 entry, 1 first
stage landed, 2 main loop done, 5 partial staged (DSMEM: after the cluster barrier) or written
(workspace: after the counter), 3 fixup done (or its partial handed on), 4 exit.

Usage: python scripts/timeline_w4a16_wgmma.py   (the dispatcher's plan, and the same config unsplit)
"""
import dataclasses

import torch

from tilefish.bench.timing import flush_l2
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn

CASES = [(8192, 8192, 64, -1), (4096, 6144, 64, 128), (8192, 8192, 128, 128), (28672, 8192, 64, -1),
         (8192, 10240, 32, 128), (4096, 4096, 256, 128)]


def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    spec_of = ops.kernel_spec
    ops.kernel_spec = lambda *a: dataclasses.replace(spec_of(*a), defines=spec_of(*a).defines + (("TF_TIMELINE", "1"),))
    for k, n, m, g in CASES:
        w = ops.pack(quantize_rtn(torch.randn(n, k, device="cuda"), g, True, scale_dtype=torch.float16, clip_search=False))
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        cfg, sl = ops.choose_hopper_plan(m, n, k, sms)
        if cfg.sk:
            cfg = ops.HopperConfig(cfg.mt, cfg.nt, cfg.cons, 6 if cfg.cons == 2 else cfg.stages)
            sl = 2
        for slices in sorted({sl, 1}):
            tiles = (n // cfg.bn) * -(-m // cfg.mt)
            slot_floats = tiles * slices * cfg.mt * cfg.bn
            ctas = tiles * slices
            ws = torch.zeros(slot_floats + ctas * 16, dtype=torch.float32, device="cuda")
            counters = torch.zeros(max(tiles, 4096), dtype=torch.int32, device="cuda")
            ops._workspaces[(0, torch.cuda.current_stream().cuda_stream)] = (ws, counters)
            for _ in range(3):
                ops.matmul_impl(x, w, cfg=cfg, slices=slices)
            spans = []
            for _ in range(9):
                flush_l2()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); ops.matmul_impl(x, w, cfg=cfg, slices=slices); e.record(); e.synchronize()
                tl = ws[slot_floats:].view(torch.int64).view(ctas, 8).cpu()
                rel = (tl[:, :6] - tl[:, 0].min()).float() / 1e3
                spans.append((s.elapsed_time(e) * 1e3, rel))
            spans.sort(key=lambda r: r[0])
            ev, rel = spans[len(spans) // 2]
            c = {i: rel[:, i].tolist() for i in range(6)}
            loop = [b - a for a, b in zip(c[1], c[2])]
            print(f"k{k} n{n} m{m} g{g} {cfg.label()} x{slices} ({ctas} CTAs): events {ev:5.1f} us | entry max {max(c[0]):4.1f} "
                  f"| first data p50 {q(c[1], .5):4.1f} max {max(c[1]):4.1f} | loop p50 {q(loop, .5):5.1f} max {max(loop):5.1f} "
                  f"| loop end p50 {q(c[2], .5):5.1f} max {max(c[2]):5.1f} | staged max {max(c[5]) if slices > 1 else 0:5.1f} | fixup end max {max(c[3]):5.1f} "
                  f"| exit max {max(c[4]):5.1f}", flush=True)
            ops._workspaces.clear()
    ops.kernel_spec = spec_of


if __name__ == "__main__":
    main()
