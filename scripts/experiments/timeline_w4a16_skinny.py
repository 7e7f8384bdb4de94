"""Per-CTA %globaltimer timeline of the W4A16 skinny kernel (kernels/w4a16/skinny.cu built with
-D TF_TIMELINE), to see where the time of a decode-size launch goes: launch skew, first data,
streaming, the stream-K fixup tail. Each CTA stamps (ns): 0 entry, 1 barriers ready, 2 first stage
landed, 3 its consumers' final hand-off done, 4 the finisher's exit, 5 the consumers' end (after
the final fixup), 8 its final segment's main loop end, 9 the tile counter's reply to the final
record, 10 the consumers past fix_ready; plus its SM id. The last CTA's chain is printed.

Usage: [CTA_FACTORS=1,2,4] [SHAPES=KxN,...] [M=1,8] [CONFIGS=skinny-m8n256w1s3x2,...]
       [VARIANTS=,TF_W4A16_NF4] python scripts/experiments/timeline_w4a16_skinny.py
(one line per shape x m x config x grid x variant; a variant is a define added to the build, or
none: the shipped kernel. The stamps are kernels/w4a16/timeline.cuh's macros. TF_W4A16_SC_FENCES, the
fence A/B build, is gone from the kernels: check out an older commit to rerun it)
"""
import dataclasses
import os

import torch

from tilefish.bench.timing import flush_l2
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.runtime import get_kernel, i32, launch, tensor_map_2d
from tilefish.bench.timing import w4a16_workspace

CASES = [(4096, 4096), (8192, 8192), (28672, 8192)]
if os.environ.get("SHAPES"):
    CASES = [tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(",")]
CONFIGS = [ops.SkinnyConfig(8, 4, 1, 3, 2), ops.SkinnyConfig(8, 4, 2, 4, 2)]
if os.environ.get("CONFIGS"):
    CONFIGS = [ops.parse_plan(label)[0] for label in os.environ["CONFIGS"].split(",")]
MS = [int(v) for v in os.environ.get("M", "1").split(",")]
VARIANTS = os.environ.get("VARIANTS", "").split(",")
CTA_FACTORS = [int(v) for v in os.environ.get("CTA_FACTORS", "1").split(",")]  # x SMs x ctas_per_sm


def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))]


def timeline_launch(w, x, cfg, ctas, variant=""):
    """The TF_TIMELINE build of `cfg` (plus the define `variant`) on fp16 x (m x k) and the packed
    g128 weight w, over `ctas` CTAs: (run, stamps, out). run() launches it; stamps() is the last
    launch's (ctas, 16) int64 %globaltimer / SM-id table."""
    m, k = x.shape
    n = w.n
    spec = ops.kernel_spec(torch.float16, cfg, 128, False)
    extra = ((variant, "1"),) if variant else ()
    kern = get_kernel(dataclasses.replace(spec, defines=spec.defines + (("TF_TIMELINE", "1"),) + extra))
    slot_floats = ctas * 2 * cfg.mt * cfg.bn
    ws = torch.zeros(slot_floats + ctas * 32, dtype=torch.float32, device="cuda")
    counters = torch.zeros(n // cfg.bn, dtype=torch.int32, device="cuda")
    out = torch.empty(m, n, dtype=torch.float16, device="cuda")
    map_x = tensor_map_2d(x, cfg.mt, 64)

    def run():
        launch(kern, ctas, cfg.threads, map_x, w.packed.data_ptr(), w.scales.data_ptr(), 0, 0, out.data_ptr(),
               ws.data_ptr(), counters.data_ptr(), i32(m), i32(n), i32(k), 0, i32(0),  # no residual, not gated
               smem=cfg.smem_bytes(128, False))
    return run, lambda: ws[slot_floats:].view(torch.int64).view(ctas, 16), out


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for k, n in CASES:
        dense = torch.randn(n, k, device="cuda", dtype=torch.float16)
        w = ops.pack(quantize_rtn(dense, 128, True, scale_dtype=torch.float16, clip_search=False))
        for m, cfg, factor, variant in [(m, c, f, v) for m in MS for c in CONFIGS for f in CTA_FACTORS for v in VARIANTS
                                        if m <= c.mt]:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ctas = sms * cfg.ctas_per_sm * factor
            run, stamps, out = timeline_launch(w, x, cfg, ctas, variant)
            for _ in range(3):
                run()
            spans = []
            for rep in range(7):
                flush_l2()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(); run(); e.record(); e.synchronize()
                tl = stamps().cpu()
                t0 = tl[:, 0].min().item()
                rel = (tl[:, :11] - t0).float() / 1e3  # us from the first CTA's entry
                spans.append((s.elapsed_time(e) * 1e3, rel))
            spans.sort(key=lambda r: r[0])
            ev, rel = spans[len(spans) // 2]
            c = {i: rel[:, i].tolist() for i in range(11)}
            last = max(range(ctas), key=lambda j: c[5][j])  # the CTA that ends the launch
            print(f"k{k} n{n} m{m} {cfg.label()}{' ' + variant if variant else ''} ctas {ctas}: events {ev:5.1f} us, span {max(max(c[4]), max(c[5])):5.1f} | first data "
                  f"p50 {q(c[2], .5):4.1f} max {max(c[2]):4.1f} | loop end p10 {q(c[8], .1):5.1f} p50 {q(c[8], .5):5.1f} "
                  f"max {max(c[8]):5.1f} | consumers' end p50 {q(c[5], .5):5.1f} p90 {q(c[5], .9):5.1f} max {max(c[5]):5.1f} | "
                  f"last entry {max(c[0]):5.1f} | last CTA: loop end {c[8][last]:5.1f}, hand-off {c[3][last]:5.1f}, "
                  f"counter {c[9][last]:5.1f}, fix_ready {c[10][last]:5.1f}, end {c[5][last]:5.1f}")
            ref = ops.matmul_impl(x, w, workspace=w4a16_workspace(x.device))
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            assert err < 1e-2, err


if __name__ == "__main__":
    main()
