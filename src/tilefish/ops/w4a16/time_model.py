"""The wgmma kernel's time model: the dispatcher's predicted time of a (configuration, k split or
stream-K) plan on sm_90, from which dispatch.choose_hopper_plan takes the least.

Fitted by scripts/fit_w4a16_time_model.py (non-negative least squares on relative error, samples
over 1.5x their first-pass prediction left out) to scripts/sweep_w4a16_streamk.py on the H200 at
settled clocks (bench.timing's WARM_MS): fp16 and bf16, group 128 ("grouped") and per-channel
("per_channel", a model of its own: the group scale's multiplies shift the best tile), the 8
benchmark shapes, m = 16..1024, k splits through the workspace and through DSMEM clusters
(bench/results/h200/w4a16_streamk_sweep_settled_*.json, docs/w4a16.md; the stream-K rows re-swept
after the end-of-range counter peek, aceb3fa: w4a16_streamk_sweep_peek_sk_*.json, merged by the fit
script with the day's clock factor). The fit script writes the coefficients to
time_model_h200.json beside this module (package data), which HOPPER_TIME_MODEL is loaded from.

Two regimes, each fitted on its own sweeps: "small_m" (m < MODEL_LARGE_M, bound by memory and
latency) and "large_m" (bound by the tensor cores; one fit across both left its m = 256 / 1024
picks 1.9 / 1.0% behind the best plan on average, fits of their own 0.3 / 0.1%):

  time (us) = F + T x load + A x rounds + PHI x fixup + PHI_C x cluster fixup

with the features of hopper_plan_features: load = 64-k stages of the busiest SM, rounds = the same
with its co-resident CTAs counted once, fixup = log2(slices) (x waves at m < 256: FIXUP_PER_WAVE),
through the workspace or through DSMEM when the split runs as clusters; for stream-K, fixup =
log2(CTAs sharing a tile), its partial sums' chain (without it the fit sent k 14336 x n 4096,
m = 16, 16 CTAs a tile, to stream-K at 1.2x the best plan's time). F is launch, ramp and
epilogue. Coefficients (F, T, A, PHI, PHI_C), by configuration label. In-sample its pick is
0.7-1.1% behind the best measured plan on average, 6-14% at worst (the previous form, without
rounds and with one fixup per launch, one fit for all m: 2.8% on average, 30% at worst).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .configs import H200_CLUSTERS, HOPPER_BK, MAX_CLUSTER_SLICES, HopperConfig, column_tiles, fits_n

MODEL_LARGE_M = 256  # the time model's second regime (tensor-bound launches) from this m up

# Whether each wave of split tiles pays its own k-split fixup in the model (fixup = log2(slices) x
# waves) or the launch pays one (log2(slices)). Per wave fitted the m < 256 sweeps better (in-sample
# picks at m = 16-32 0.2-0.4% behind the best plan on average instead of 1.9-2.5%; m = 64-128
# alike). At m >= 256 it did not: m = 256 picks 1.8% behind on average instead of 0.3%, up to 12%
# (k 14336 x n 4096, m = 256: a 4-way split of 128 x 256 tiles over the 2-way split of 128 x 128
# ones, 52.4 against 49.2 us in a same-process A/B), so there the launch pays one.
FIXUP_PER_WAVE = {"small_m": True, "large_m": False}

TIME_MODEL_FILE = Path(__file__).with_name("time_model_h200.json")


def load_time_model(path: Path = TIME_MODEL_FILE) -> dict[str, dict[str, dict[str, tuple[float, ...]]]]:
    """The coefficients a fit wrote: {regime: {"grouped" | "per_channel": {config label: (F, T, A,
    PHI, PHI_C)}}}. (The file also records the sweeps and the model form, MODEL_LARGE_M and
    FIXUP_PER_WAVE, it was fitted with; the dispatch tests check the form against this module's.)"""
    model = json.loads(path.read_text())["model"]
    return {regime: {fmt: {label: tuple(coef) for label, coef in by_label.items()} for fmt, by_label in by_fmt.items()}
            for regime, by_fmt in model.items()}


HOPPER_TIME_MODEL = load_time_model()


def hopper_model_regime(m: int) -> str:
    return "large_m" if m >= MODEL_LARGE_M else "small_m"


def hopper_plan_features(cfg: HopperConfig, slices: int | None, m: int, n: int, k: int, sm_count: int,
                         cluster: bool) -> tuple[float, float, float, float, float]:
    """The time model's features of a plan, (1, load, rounds, fixup, cluster fixup):
    - load: 64-k stages of the busiest SM, its CTAs counted one after another;
    - rounds: the same with the CTAs an SM holds at once counted once (waves x stages a CTA). Two
      CTAs sharing an SM stream faster than one alone (the memory-bound m = 16-64 plans: k 28672 x
      n 8192, m = 32, an 8-way split at two CTAs an SM beat the 4-way split at one by 8%), which
      load alone, the same for both, could not tell;
    - fixup: log2(slices), times the waves where FIXUP_PER_WAVE says so for m's regime, through the
      workspace or (cluster: the split runs as clusters, one CTA an SM) through DSMEM; stream-K:
      log2 of the CTAs that share a tile (stages a tile over units a CTA)."""
    tiles, stages = column_tiles(cfg, n) * -(-m // cfg.mt), k // HOPPER_BK
    resident = 1 if cluster else cfg.ctas_per_sm(128, False)
    if cfg.streamk:
        units = tiles * stages
        ctas = min(sm_count * cfg.ctas_per_sm(128, False), units)
        per_cta = float(-(-units // ctas))
        split = math.log2(max(1.0, stages / per_cta))
    else:
        s = slices or 1
        ctas, per_cta, split = tiles * s, stages / s, math.log2(s)
    waves = -(-ctas // (sm_count * resident))
    load = per_cta * -(-ctas // sm_count)
    fixup = split * (waves if FIXUP_PER_WAVE[hopper_model_regime(m)] else 1)
    return 1.0, load, per_cta * waves, 0.0 if cluster else fixup, fixup if cluster else 0.0


def split_fits_clusters(cfg: HopperConfig, slices: int | None, m: int, n: int,
                        clusters: tuple[tuple[int, int], ...]) -> bool:
    """Whether this k split runs as clusters (DSMEM fixup): a tile-mode split of
    2..MAX_CLUSTER_SLICES whose clusters all fit at once by the device's cluster capacity ((size,
    clusters resident at once), ...). The one copy of the rule: the time model weighs it and
    geometry.split_geometry launches it."""
    if cfg.streamk or slices is None or not 1 < slices <= MAX_CLUSTER_SLICES:
        return False
    return column_tiles(cfg, n) * -(-m // cfg.mt) <= dict(clusters).get(slices, 0)


def hopper_time_model(m: int, grouped: bool = True) -> dict[str, tuple[float, ...]]:
    """HOPPER_TIME_MODEL's coefficients for m's regime and the weight's format, by configuration."""
    return HOPPER_TIME_MODEL[hopper_model_regime(m)]["grouped" if grouped else "per_channel"]


def predicted_hopper_us(cfg: HopperConfig, slices: int | None, m: int, n: int, k: int, sm_count: int,
                        clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS, grouped: bool = True) -> float | None:
    """HOPPER_TIME_MODEL's time for cfg (k split `slices` ways; stream-K: its default grid) on a
    weight with group scales or per-channel ones, or None for a configuration the model does not cover."""
    coef = hopper_time_model(m, grouped).get(cfg.label())
    if coef is None or not fits_n(cfg, n):
        return None
    features = hopper_plan_features(cfg, slices, m, n, k, sm_count, split_fits_clusters(cfg, slices, m, n, clusters))
    return sum(c * f for c, f in zip(coef, features))


def hopper_plan_load(cfg: HopperConfig, slices: int | None, m: int, n: int, k: int, sm_count: int) -> float:
    """64-k stages of the busiest SM, its CTAs counted one after another (tile mode: ceil(CTAs / SMs)
    x stages a CTA; stream-K, slices None: ceil(units / CTAs) x ceil(CTAs / SMs) for its one-wave grid)."""
    return hopper_plan_features(cfg, slices, m, n, k, sm_count, False)[1]

