"""Fit the W4A16 wgmma kernel's dispatch time model (ops.w4a16.HOPPER_TIME_MODEL) to H200 sweeps of
scripts/sweep_w4a16_streamk.py, and report how close its picks come to the fastest measured plan.

    time (us) = F + T x load + PHI x log2(slices) [workspace fixup] + PHI_C x log2(slices) [cluster fixup]

load is what ops.w4a16.hopper_plan_load computes (64-k stages of the busiest SM). Per weight format
(group scales or per-channel: the sweeps' records say which) and configuration, non-negative least
squares on relative error (rows divided by the measured time), so short and long launches weigh
alike; fp16 and bf16 sweeps of a format go into one fit. Stream-K configurations have no k split: F
and T only.

Usage: python scripts/fit_w4a16_time_model.py SWEEP.json [SWEEP.json ...]
Prints the HOPPER_TIME_MODEL literal, then the in-sample pick quality per sweep.
"""
import collections
import json
import math
import sys

import numpy as np
from scipy.optimize import nnls

from tilefish.ops import w4a16 as ops

SMS = 132


def parse(label):
    name, _, sl = label.partition("/x")
    cfg = next(c for c in ops.HOPPER_CONFIGS if c.label() == name)
    return cfg, (int(sl) if sl else None)


def features(cfg, slices, cluster, m, n, k):
    load = ops.hopper_plan_load(cfg, slices, m, n, k, SMS)
    lg = math.log2(slices or 1)
    return [1.0, load, 0.0 if cluster else lg, lg if cluster else 0.0]


def fit(recs):
    rows = collections.defaultdict(list)
    for r in recs:
        for t, label, cluster in r["configs"]:
            cfg, sl = parse(label)
            rows[cfg.label()].append((features(cfg, sl, cluster, r["m"], r["n"], r["k"]), t))
    model = {}
    for label, data in sorted(rows.items()):
        a = np.array([f for f, _ in data]) / np.array([t for _, t in data])[:, None]
        cols = [0, 1] if label.endswith("-sk") else [0, 1, 2, 3]
        coef, _ = nnls(a[:, cols], np.ones(len(data)))
        full = [0.0] * 4
        for c, v in zip(cols, coef):
            full[c] = round(float(v), 3)
        model[label] = tuple(full)
    return model


def main():
    sweeps = {path: json.load(open(path)) for path in sys.argv[1:]}
    models = {fmt: fit([r for recs in sweeps.values() for r in recs if (r["group"] != -1) == (fmt == "grouped")])
              for fmt in ("grouped", "per_channel")}
    print("HOPPER_TIME_MODEL = {")
    for fmt, model in models.items():
        print(f'    "{fmt}": {{')
        for label, coef in model.items():
            print(f'        "{label}": {coef},')
        print("    },")
    print("}")
    for path, recs in sweeps.items():
        ratios = []
        for r in recs:
            model = models["grouped" if r["group"] != -1 else "per_channel"]
            times = {label: t for t, label, _ in r["configs"]}
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
