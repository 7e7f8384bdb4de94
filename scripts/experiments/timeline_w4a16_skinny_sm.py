"""Is a skinny-kernel CTA's main-loop end a property of its SM? Per-CTA %globaltimer stamps (the
TF_TIMELINE build, as scripts/experiments/timeline_w4a16_skinny.py) over 15 launches at m = 1, grouped by SM id:
the split-half correlation of each SM's mean lateness (its CTAs' latest loop end minus the launch's
median), the spread of those means, the first data per SM, and the two CTAs of one SM.

Usage: [SHAPES=KxN,...] [CONFIGS=skinny-m8n256w1s3x2,...] python scripts/experiments/timeline_w4a16_skinny_sm.py
"""
import os
import statistics as st

import torch

from tilefish.bench.timing import flush_l2
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn

from timeline_w4a16_skinny import timeline_launch  # noqa: E402 (this script's own directory)

LAUNCHES = 15


def per_sm_runs(k, n, cfg, sms):
    """Per launch: {SM id: [(loop end, first data) of each of its CTAs]}, us from the first entry."""
    w = ops.pack(quantize_rtn(torch.randn(n, k, device="cuda", dtype=torch.float16), 128, True,
                              scale_dtype=torch.float16, clip_search=False))
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    ctas = sms * cfg.ctas_per_sm
    run, stamps, _ = timeline_launch(w, x, cfg, ctas)
    for _ in range(3):
        run()
    runs = []
    for _ in range(LAUNCHES):
        flush_l2()
        run()
        torch.cuda.synchronize()
        tl = stamps().cpu()
        rel = (tl - tl[:, 0].min()).float() / 1e3
        by_sm = {}
        for c in range(ctas):
            by_sm.setdefault(int(tl[c, 7]), []).append((rel[c, 8].item(), rel[c, 2].item()))
        runs.append(by_sm)
    return runs


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in os.environ.get("SHAPES", "28672x8192").split(","):
        k, n = map(int, shape.split("x"))
        for label in os.environ.get("CONFIGS", "skinny-m8n256w1s3x2").split(","):
            runs = per_sm_runs(k, n, ops.parse_plan(label)[0], sms)
            late = {}  # SM -> per launch: its latest CTA's loop end minus the launch's median
            for by_sm in runs:
                med = st.median(v[0] for cs in by_sm.values() for v in cs)
                for sm, cs in by_sm.items():
                    late.setdefault(sm, []).append(max(v[0] for v in cs) - med)
            keys = sorted(late)
            half = LAUNCHES // 2
            a = [st.mean(late[s][:half]) for s in keys]
            b = [st.mean(late[s][half:2 * half]) for s in keys]
            means = {s: st.mean(v) for s, v in late.items()}
            spread = st.mean(max(late[s][i] for s in keys) for i in range(LAUNCHES))
            print(f"k{k} n{n} {label}: split-half correlation of per-SM lateness {st.correlation(a, b):.2f}; "
                  f"per-SM mean lateness sd {st.pstdev(means.values()):.2f} us; latest SM minus median {spread:.2f} us")
            print("  SM: mean lateness (us) " + " ".join(f"{s}:{means[s]:+.2f}" for s in keys))
            first = [st.mean(min(v[1] for v in by_sm[s]) for by_sm in runs) for s in keys]
            print(f"  first data per SM (mean over launches): {min(first):.2f} .. {max(first):.2f} us")
            pairs = [abs(cs[0][0] - cs[1][0]) for by_sm in runs for cs in by_sm.values() if len(cs) == 2]
            if pairs:
                print(f"  two CTAs of one SM: mean |loop end difference| {st.mean(pairs):.2f} us")


if __name__ == "__main__":
    main()
