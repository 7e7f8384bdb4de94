"""Fit the W4A16 wgmma kernel's dispatch time model (ops/w4a16/time_model.py) to H200 sweeps of
scripts/sweep_w4a16_streamk.py, write its coefficients to the package data file the dispatcher loads
(src/tilefish/ops/w4a16/time_model_h200.json), and report how close its picks come to the fastest
measured plan.

    time (us) = F + T x load + A x rounds + PHI x fixup + PHI_C x cluster fixup

with the features of time_model.hopper_plan_features (load: 64-k stages of the busiest SM; rounds:
the same with co-resident CTAs counted once; fixup: log2(slices), x waves at m < 256
(time_model.FIXUP_PER_WAVE), through the workspace or through DSMEM clusters). One fit per weight
format (group scales or per-channel: the sweeps' records say which), m regime (below
time_model.MODEL_LARGE_M the launches are bound by memory and latency, from it up by the tensor
cores; one fit across both left its m = 256 / 1024 picks 1.9 / 1.0% behind the best plan on
average, fits of their own 0.3 / 0.1%) and configuration: non-negative least squares on relative
error (rows divided by the measured time), so short and long launches weigh alike; fp16 and bf16
sweeps of a format go into one fit. Stream-K configurations have no k split: F, T, A and PHI, whose
feature is log2 of the CTAs that share a tile (the fixup chain of its partial sums).
Robust: a second pass drops the samples measured at more than 1.5x their first-pass prediction (a
sweep now and then catches the machine in a slow spell: one plan at 141.6 us between neighbours
at 15-17) and says how many.

Usage: python scripts/fit_w4a16_time_model.py [--out PATH] SWEEP.json[+SK_SWEEP.json] [...]
SWEEP+SK_SWEEP: SWEEP's stream-K rows replaced by SK_SWEEP's (a sweep of the stream-K configurations
only, CONFIGS=..., after a change to the stream-K code), each scaled by the day factor: the median
ratio, SWEEP over SK_SWEEP, of the dispatcher's tile-mode pick timed in both ("auto" with the same
label), so the two days' clocks do not bias the choice between stream-K and tile plans.
Writes the coefficients, with the sweeps and the model form they were fitted with, to --out (default
the package's time_model_h200.json; the shipped file is this script's output for the settled sweeps
merged with their counter-peek stream-K re-sweeps, docs/w4a16.md), then prints the in-sample pick
quality per sweep. Sweep records may label plans in the spelling before the stream-K / skinny labels
were renamed ("-sk"): configs.parse_plan reads both.
"""
import argparse
import collections
import json
import re
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from tilefish.bench.w4a16 import merge_streamk_resweep
from tilefish.ops import w4a16 as ops
from tilefish.ops.w4a16 import time_model

SMS = 132
OUTLIER = 1.5
ROOT = Path(__file__).resolve().parents[1]


def parse(label):
    cfg, sl = ops.parse_plan(label)
    if cfg not in ops.HOPPER_CONFIGS:
        raise ValueError(f"{label}: not one of the wgmma design space's configurations (HOPPER_CONFIGS)")
    return cfg, sl


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
        cols = [0, 1, 2, 3] if parse(label)[0].streamk else [0, 1, 2, 3, 4]
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


def write_model(models, sweep_args, path):
    """The fit as JSON: provenance, the model form (time_model's constants the features used) and the
    coefficients, one configuration a line."""
    def shown(arg):  # a sweep path relative to the repository where it lies inside it
        parts = []
        for p in arg.split("+"):
            p = Path(p).resolve()
            parts.append(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p))
        return "+".join(parts)
    data = {"fitted_by": "scripts/fit_w4a16_time_model.py", "sweeps": [shown(a) for a in sweep_args],
            "time_us": "F + T x load + A x rounds + PHI x fixup + PHI_C x cluster_fixup",
            "coefficients": ["F", "T", "A", "PHI", "PHI_C"],
            "model_large_m": time_model.MODEL_LARGE_M, "fixup_per_wave": time_model.FIXUP_PER_WAVE,
            "model": {reg: {fmt: {label: list(coef) for label, coef in by_label.items()}
                            for fmt, by_label in by_fmt.items()} for reg, by_fmt in models.items()}}
    text = json.dumps(data, indent=1)
    # a list of numbers or names on one line
    item = r'-?[0-9.e+-]+|"[A-Za-z_]+"'
    text = re.sub(rf"\[\n\s+((?:{item})(?:,\n\s+(?:{item}))*)\n\s+\]",
                  lambda g: "[" + ", ".join(v.strip() for v in g.group(1).split(",")) + "]", text)
    Path(path).write_text(text + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+", metavar="SWEEP.json[+SK_SWEEP.json]")
    ap.add_argument("--out", default=str(time_model.TIME_MODEL_FILE), help="where to write (default: %(default)s)")
    args = ap.parse_args()
    sweeps = {arg: load(arg) for arg in args.sweeps}
    recs = [r for rs in sweeps.values() for r in rs]
    models = {}
    for reg in ("small_m", "large_m"):
        models[reg] = {}
        for fmt in ("grouped", "per_channel"):
            models[reg][fmt], dropped = fit([r for r in recs if regime(r["m"]) == reg and (r["group"] != -1) == (fmt == "grouped")])
            print(f"# {reg} {fmt}: {dropped} sample(s) over {OUTLIER}x their first-pass prediction left out", file=sys.stderr)
    write_model(models, args.sweeps, args.out)
    print(f"# wrote {args.out}", file=sys.stderr)
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
