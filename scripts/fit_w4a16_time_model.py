"""Fit the W4A16 wgmma kernel's dispatch time model (ops.w4a16.HOPPER_TIME_MODEL) to H200 sweeps of
scripts/sweep_w4a16_streamk.py, and report how close its picks come to the fastest measured plan.

    time (us) = F + T x load + A x rounds + PHI x fixup + PHI_C x cluster fixup

with the features of ops.w4a16.hopper_plan_features (load: 64-k stages of the busiest SM; rounds:
the same with co-resident CTAs counted once; fixup: log2(slices), x waves at m < 256
(ops.w4a16.FIXUP_PER_WAVE), through the workspace or through DSMEM clusters). One fit per weight
format (group scales or per-channel: the sweeps' records say which), m regime (below
ops.w4a16.MODEL_LARGE_M the launches are bound by memory and latency, from it up by the tensor
cores; one fit across both left its m = 256 / 1024 picks 1.9 / 1.0% behind the best plan on
average, fits of their own 0.3 / 0.1%) and configuration: non-negative least squares on relative
error (rows divided by the measured time), so short and long launches weigh alike; fp16 and bf16
sweeps of a format go into one fit. Stream-K configurations have no k split: F, T, A and PHI, whose
feature is log2 of the CTAs that share a tile (the fixup chain of its partial sums).
Robust: a second pass drops the samples measured at more than 1.5x their first-pass prediction (a
sweep now and then catches the machine in a slow spell: one plan at 141.6 us between neighbours
at 15-17) and says how many.

Usage: python scripts/fit_w4a16_time_model.py SWEEP.json[+SK_SWEEP.json] [...]
SWEEP+SK_SWEEP: SWEEP's stream-K rows replaced by SK_SWEEP's (a sweep of the stream-K configurations
only, CONFIGS=..., after a change to the stream-K code), each scaled by the day factor: the median
ratio, SWEEP over SK_SWEEP, of the dispatcher's tile-mode pick timed in both ("auto" with the same
label), so the two days' clocks do not bias the choice between stream-K and tile plans.
Prints the HOPPER_TIME_MODEL literal, then the in-sample pick quality per sweep.
"""
import collections
import json
import sys

import numpy as np
from scipy.optimize import nnls

from tilefish.bench.w4a16 import merge_streamk_resweep
from tilefish.ops import w4a16 as ops

SMS = 132
OUTLIER = 1.5


def parse(label):
    name, _, sl = label.partition("/x")
    cfg = next(c for c in ops.HOPPER_CONFIGS if c.label() == name)
    return cfg, (int(sl) if sl else None)


def features(cfg, slices, cluster, m, n, k):
    return list(ops.hopper_plan_features(cfg, slices, m, n, k, SMS, bool(cluster)))


def fit(recs):
    rows = collections.defaultdict(list)
    for r in recs:
        for t, label, cluster in r["configs"]:
            cfg, sl = parse(label)
            rows[cfg.label()].append((features(cfg, sl, cluster, r["m"], r["n"], r["k"]), t))
    model, dropped = {}, 0
    for label, data in sorted(rows.items()):
        cols = [0, 1, 2, 3] if label.endswith("-sk") else [0, 1, 2, 3, 4]
        for first in (True, False):
            x = np.array([f for f, _ in data])
            t = np.array([t for _, t in data])
            coef, _ = nnls((x / t[:, None])[:, cols], np.ones(len(data)))
            full = np.zeros(x.shape[1])
            full[cols] = coef
            if first:
                keep = t < OUTLIER * (x @ full)
                dropped += int((~keep).sum())
                data = [d for d, kept in zip(data, keep) if kept]
        model[label] = tuple(round(float(v), 3) for v in full)
    return model, dropped


regime = ops.hopper_model_regime


def load(arg):
    base_path, _, sk_path = arg.partition("+")
    base = json.load(open(base_path))
    if not sk_path:
        return base
    merged, day = merge_streamk_resweep(base, json.load(open(sk_path)))
    print(f"# {sk_path}: day factor {day:.3f}", file=sys.stderr)
    return merged


def main():
    sweeps = {arg: load(arg) for arg in sys.argv[1:]}
    recs = [r for rs in sweeps.values() for r in rs]
    models = {}
    for reg in ("small_m", "large_m"):
        models[reg] = {}
        for fmt in ("grouped", "per_channel"):
            models[reg][fmt], dropped = fit([r for r in recs if regime(r["m"]) == reg and (r["group"] != -1) == (fmt == "grouped")])
            print(f"# {reg} {fmt}: {dropped} sample(s) over {OUTLIER}x their first-pass prediction left out", file=sys.stderr)
    print("HOPPER_TIME_MODEL = {")
    for reg, by_fmt in models.items():
        print(f'    "{reg}": {{')
        for fmt, model in by_fmt.items():
            print(f'        "{fmt}": {{')
            for label, coef in model.items():
                print(f'            "{label}": {coef},')
            print("        },")
        print("    },")
    print("}")
    for path, rs in sweeps.items():
        ratios = []
        for r in rs:
            model = models[regime(r["m"])]["grouped" if r["group"] != -1 else "per_channel"]
            times = {label: t for t, label, _ in r["configs"] if parse(label)[0].label() in model}
            clusters = {label: c for _, label, c in r["configs"]}
            best = min(times.values())
            pred = {label: float(np.dot(model[parse(label)[0].label()],
                                        features(*parse(label), clusters[label], r["m"], r["n"], r["k"])))
                    for label in times}
            pick = min(pred, key=pred.get)
            ratios.append((times[pick] / best, r["m"], r["n"], r["k"], pick, times[pick], best))
        worst = max(ratios)
        print(f"{path}: pick / best mean {sum(x[0] for x in ratios) / len(ratios):.3f}, worst {worst[0]:.3f} "
              f"(m {worst[1]} n {worst[2]} k {worst[3]}: {worst[4]} {worst[5]:.1f} vs {worst[6]:.1f} us)")


if __name__ == "__main__":
    main()
