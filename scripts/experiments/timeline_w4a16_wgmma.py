"""Per-CTA %globaltimer timeline of the W4A16 wgmma kernel (kernels/w4a16/wgmma.cu
built with -D TF_TIMELINE), to see where a mid-m launch's time goes: first data, main loop, the
k-split fixup (DSMEM cluster or global workspace), exit. Each CTA stamps (ns): 0 entry, 1 first
stage landed, 2 main loop done, 5 partial staged (DSMEM: after the cluster barrier) or written
(workspace: after the counter), 3 fixup done (or its partial handed on), 4 exit; stream-K plans
also the first segment of a CTA whose range spans two tiles (loop end, partial written), and no 3.

Usage: python scripts/experiments/timeline_w4a16_wgmma.py   (the dispatcher's plan, and the same config unsplit;
env TIMELINE_CASES="k:n:m:group:plan,..." for given plans, e.g. 4096:6144:256:-1:wg-m128n128c2s6-streamk)
"""
import dataclasses
import os

import torch

from tilefish.bench.timing import flush_l2
from tilefish.ops import w4a16 as ops
from tilefish.ops.w4a16 import launch
from tilefish.quant.int4 import quantize_rtn

CASES = [(8192, 8192, 64, -1), (4096, 6144, 64, 128), (8192, 8192, 128, 128), (28672, 8192, 64, -1),
         (8192, 10240, 32, 128), (4096, 4096, 256, 128)]


def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]


def runs(sms):
    """(k, n, m, group, config, slices) to time: env TIMELINE_CASES="k:n:m:group:plan,..." (a plan
    label, ops.w4a16.parse_plan, stream-K included: slices None), else the dispatcher's plan of each
    case in CASES and the same config unsplit."""
    if os.environ.get("TIMELINE_CASES"):
        for c in os.environ["TIMELINE_CASES"].split(","):
            k, n, m, g, label = c.split(":", 4)
            cfg, sl = ops.parse_plan(label)
            yield int(k), int(n), int(m), int(g), cfg, sl
        return
    for k, n, m, g in CASES:
        cfg, sl = ops.choose_hopper_plan(m, n, k, sms)
        if cfg.streamk:
            cfg = ops.HopperConfig(cfg.mt, cfg.nt, cfg.cons, 6 if cfg.cons == 2 else cfg.stages)
            sl = 2
        for slices in sorted({sl, 1}):
            yield k, n, m, g, cfg, slices


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    spec_of = launch.kernel_spec  # the launch path builds its kernels through launch.kernel_spec
    launch.kernel_spec = lambda *a: dataclasses.replace(spec_of(*a),
                                                        defines=spec_of(*a).defines + (("TF_TIMELINE", "1"),))
    weights = {}
    for k, n, m, g, cfg, slices in runs(sms):
        if (k, n, g) not in weights:
            weights = {(k, n, g): ops.pack(quantize_rtn(torch.randn(n, k, device="cuda"), g, True,
                                                        scale_dtype=torch.float16, clip_search=False))}
        w = weights[(k, n, g)]
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        tiles = (n // cfg.bn) * -(-m // cfg.mt)
        if cfg.streamk:  # one wave of CTAs, two workspace slots each
            ctas = slices or sms * cfg.ctas_per_sm(g, False)
            slot_floats, grid = ctas * 2 * cfg.mt * cfg.bn, {"ctas": ctas}
        else:
            slices = slices or 1
            ctas, slot_floats, grid = tiles * slices, tiles * slices * cfg.mt * cfg.bn, {"slices": slices}
        split = ctas if cfg.streamk else slices  # printed as x<split>
        ws = torch.zeros(slot_floats + ctas * 16, dtype=torch.float32, device="cuda")
        counters = torch.zeros(max(tiles, 4096), dtype=torch.int32, device="cuda")
        plan = ops.LaunchPlan.build(w, None, m, x.device, cfg, grid.get("slices"), grid.get("ctas"))
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        run = lambda: plan._enqueue(x.data_ptr(), out.data_ptr(), ws.data_ptr(), counters.data_ptr())  # noqa: E731
        for _ in range(3):  # the plan's launches on this script's scratch: the stamps go after the partials
            run()
        spans = []
        for _ in range(9):
            flush_l2()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); run(); e.record(); e.synchronize()
            tl = ws[slot_floats:].view(torch.int64).view(ctas, 8).cpu()
            rel = (tl - tl[:, 0].min()).float() / 1e3
            spans.append((s.elapsed_time(e) * 1e3, rel))
        spans.sort(key=lambda r: r[0])
        ev, rel = spans[len(spans) // 2]
        c = {i: rel[:, i].tolist() for i in range(8)}
        loop = [b - a for a, b in zip(c[1], c[2])]
        fixup = "" if cfg.streamk else f"| fixup end max {max(c[3]):5.1f} "  # stream-K builds do not stamp 3
        print(f"k{k} n{n} m{m} g{g} {cfg.label()} x{split} ({ctas} CTAs): events {ev:5.1f} us | entry max {max(c[0]):4.1f} "
              f"| first data p50 {q(c[1], .5):4.1f} max {max(c[1]):4.1f} | loop p50 {q(loop, .5):5.1f} max {max(loop):5.1f} "
              f"| loop end p50 {q(c[2], .5):5.1f} max {max(c[2]):5.1f} | staged max {max(c[5]) if split > 1 else 0:5.1f} {fixup}"
              f"| exit p50 {q(c[4], .5):5.1f} max {max(c[4]):5.1f}", flush=True)
        early = [i for i in range(ctas) if c[6][i] > 0] if cfg.streamk else []
        if early:  # stream-K: the first segment of the CTAs whose range spans two tiles
            e6, e7 = [c[6][i] for i in early], [c[7][i] for i in early]
            print(f"    stream-K, {len(early)} CTAs with an early segment: its loop end p50 {q(e6, .5):5.1f} max {max(e6):5.1f} "
                  f"| written p50 {q(e7, .5):5.1f} max {max(e7):5.1f} | hand-off p50 {q([b - a for a, b in zip(e6, e7)], .5):4.2f} "
                  f"| last loop p50 {q([c[2][i] - c[7][i] for i in early], .5):5.1f} | last written p50 "
                  f"{q([c[5][i] - c[2][i] for i in range(ctas) if c[5][i] > 0], .5):4.2f} | exit - last written p50 "
                  f"{q([c[4][i] - c[5][i] for i in range(ctas) if c[5][i] > 0], .5):4.2f}", flush=True)
    launch.kernel_spec = spec_of


if __name__ == "__main__":
    main()
