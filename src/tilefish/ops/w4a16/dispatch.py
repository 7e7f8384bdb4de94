"""W4A16 dispatch: which kernel, configuration and k split (or stream-K) a call gets, from (m, n, k,
SM count, compute capability, weight format, dtype). choose_config is the entry point:

  sm_90  m <= 16: the skinny kernel where choose_skinny_config takes it (m <= 2 on the smallest
         weights: the mma.sync swap kernel); from HOPPER_MIN_M up to MODEL_MAX_M, the wgmma plan of
         least predicted time under the fitted time model (time_model.py, choose_hopper_plan); from
         MODEL_MAX_M up, the older per-range rule (_choose_hopper_config), which the model's sweep
         does not cover. NF4 at 128 < m < MODEL_MAX_M: the 256-row tile (NF4_TALL_TILE).
  other  the mma.sync kernel (choose_mma_config, k split by choose_slices).

The rules' thresholds come from H200 sweeps and same-process A/Bs; the comments say which.
"""
from __future__ import annotations

import functools
from dataclasses import replace
from typing import NamedTuple

import torch

from ...runtime import KernelSpec
from .configs import (H200_CLUSTERS, HOPPER_BK, HOPPER_CONFIGS, SKINNY_BK, GemmConfig, HopperConfig, SkinnyConfig,
                      column_tiles, kernel_spec, ragged_waste_ok)
from .geometry import LaunchGeometry, split_geometry
from .layout import BK, DTYPES, MXFP4_GROUP, TABLE_CODEBOOKS
from .time_model import hopper_time_model, predicted_hopper_us
from .tuned import Plan, TunedTable

HOPPER_MIN_M = 9     # sm_90: the wgmma kernel from this m up where the skinny kernel declines (below: mma.sync)
MODEL_MAX_M = 2048   # the time model's plans below this m, the per-range rule from it up
SMALL_WEIGHT_NK = 100_000_000
TINY_WEIGHT_NK = 32_000_000
MAX_HOPPER_SLICES = 8
STREAMK_MAX_M = 1024
HOPPER_SLICES = (1, 2, 3, 4, 6, 8)


def _uses_hopper(m: int, n: int, k: int) -> bool:
    return m >= HOPPER_MIN_M


def _fit_n(cfg: HopperConfig, n: int) -> HopperConfig:
    """Narrow a configuration (one warpgroup, then fewer strips) until its ragged last column tile
    pads n by at most an eighth (ragged_waste_ok)."""
    while not ragged_waste_ok(cfg, n):
        if cfg.cons == 2 and cfg.mt <= 128:
            cfg = HopperConfig(cfg.mt, cfg.nt, 1, cfg.stages, cfg.streamk)
        else:
            cfg = HopperConfig(cfg.mt, cfg.nt // 2, cfg.cons, cfg.stages, cfg.streamk)
    return cfg



def _hopper_candidates(m: int, n: int, k: int, sm_count: int):
    """(config, slices) plans the dispatcher weighs: m tiles up to twice m (64+ rows from m = 128,
    128+ from m = 512), k splits of >= 4 stages up to 4 waves, stream-K up to m = STREAMK_MAX_M while
    the tiles fill fewer than two waves. Stream-K is what rescues a tile count that quantizes badly
    on the SMs (k 5120 x n 5120 at m = 1024: 160 tiles of 128 x 256 on 132 SMs); from m = 2048 the
    tiles fill enough waves that it never won (docs/w4a16.md, "Dispatch per GPU")."""
    for cfg in HOPPER_CONFIGS:
        if cfg.label() not in hopper_time_model(m) or not ragged_waste_ok(cfg, n):
            continue
        if cfg.mt > max(32, 2 * m) or (m >= 128 and cfg.mt < 64) or (m >= 512 and cfg.mt < 128):
            continue
        tiles = column_tiles(cfg, n) * -(-m // cfg.mt)
        if cfg.streamk:
            if m <= STREAMK_MAX_M and tiles < 2 * sm_count * cfg.ctas_per_sm(128, False):
                yield cfg, None
            continue
        for sl in HOPPER_SLICES:
            if sl == 1 or (tiles * sl <= 4 * sm_count and k // HOPPER_BK // sl >= 4):
                yield cfg, sl


@functools.lru_cache(maxsize=4096)
def choose_hopper_plan(m: int, n: int, k: int, sm_count: int,
                       clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS,
                       grouped: bool = True) -> tuple[HopperConfig, int | None]:
    """The (config, k slices or None for stream-K) the dispatcher launches on sm_90. clusters: the
    device's cluster capacity (runtime.cluster_capacity; the H200's by default); grouped: the weight
    has group scales (the m >= MODEL_MAX_M rule takes other tiles for per-channel weights)."""
    if m < MODEL_MAX_M:
        plans = [(predicted_hopper_us(cfg, sl, m, n, k, sm_count, clusters, grouped), cfg.label(), cfg, sl)
                 for cfg, sl in _hopper_candidates(m, n, k, sm_count)]
        if plans:
            _, _, cfg, sl = min(plans, key=lambda p: (p[0], p[1]))
            return cfg, sl
    cfg = _fit_n(_choose_hopper_config(m, n, sm_count, k, grouped), n)
    return cfg, None if cfg.streamk else _rule_slices(cfg, column_tiles(cfg, n) * -(-m // cfg.mt), k, sm_count)


def choose_hopper_config(m: int, n: int, sm_count: int, k: int = 8192,
                         clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS, grouped: bool = True) -> HopperConfig:
    return choose_hopper_plan(m, n, k, sm_count, clusters, grouped)[0]


def _choose_hopper_config(m: int, n: int, sm_count: int, k: int, grouped: bool = True) -> HopperConfig:
    """The per-m-range rule (an earlier H200 sweep), kept where the time model was not fitted:
    16-row tiles for small m or tiny weights; 64-row tiles with two warpgroups of 2 strips;
    128-row tiles with two warpgroups of one strip while the tiles do not fill the SMs (then split
    k), else one warpgroup of 2 strips and two CTAs per SM; 128 x 256 tiles with two warpgroups for
    m >= 1024 with >= 2 tiles per SM. From MODEL_MAX_M up, grouped weights take 256 x 128 tiles
    (wgmma N = 256: the group scale's multiplies are spread over twice the tensor work), which a
    same-process A/B (scripts/experiments/ab_w4a16_plans.py, m = 2048 / 4096) had ahead: geomean vs cuBLAS
    0.918 -> 0.982 bf16, 0.962 -> 0.982 fp16; per-channel weights were even (0.986 / 0.982)."""
    def tiles(cfg: HopperConfig) -> int:
        return column_tiles(cfg, n) * -(-m // cfg.mt) if ragged_waste_ok(cfg, n) else 0

    nk = n * k
    if m <= 16 or (m <= 32 and nk < SMALL_WEIGHT_NK) or (m <= 64 and nk < TINY_WEIGHT_NK):
        big = HopperConfig(16, 4, 2, 8)
        return big if m <= 16 and tiles(big) >= 0.75 * sm_count else HopperConfig(16, 4, 1, 8)
    if m <= 32:
        big = HopperConfig(32, 4, 2, 6)
        return big if tiles(big) >= 0.75 * sm_count else HopperConfig(32, 4, 1, 6)
    if m <= 64:
        mid = HopperConfig(64, 2, 2, 6)
        return mid if 0 < tiles(mid) <= 1.5 * sm_count else HopperConfig(64, 4, 1, 6)
    if m >= MODEL_MAX_M and grouped and tiles(HopperConfig(256, 1, 2, 5)) >= sm_count:
        return HopperConfig(256, 1, 2, 5)
    if m >= 1024 and tiles(HopperConfig(128, 2, 2, 6)) >= 2 * sm_count:
        return HopperConfig(128, 2, 2, 6)
    narrow = HopperConfig(128, 1, 2, 6)
    return narrow if tiles(narrow) <= sm_count else HopperConfig(128, 2, 1, 4)


def _rule_slices(cfg: HopperConfig, tiles: int, k: int, sm_count: int) -> int:
    """The rule's k split: toward one CTA per SM, at most 4 ways, >= 4 stages (256 k) a slice."""
    return max(1, min(4, k // HOPPER_BK // 4, round(sm_count / tiles)))


@functools.lru_cache(maxsize=4096)
def choose_hopper_slices(cfg: HopperConfig, m: int, n: int, k: int, sm_count: int,
                         clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS, grouped: bool = True) -> int:
    """k slices for a tile-mode configuration (the dispatcher's plan when it is that config, else
    the split of least predicted time for it). Cached: the launcher asks it on every call of a plan
    that leaves the split to it, and weighing the candidates costs 60-260 us of Python (the NF4 tall
    tile at m = 256 ran host-bound, 3-6x its kernel time, until this was cached)."""
    plan_cfg, plan_sl = choose_hopper_plan(m, n, k, sm_count, clusters, grouped)
    if plan_cfg == cfg and plan_sl is not None:
        return plan_sl
    if m < MODEL_MAX_M and cfg.label() in hopper_time_model(m):
        options = [sl for c, sl in _hopper_candidates(m, n, k, sm_count) if c == cfg]
        if options:
            return min(options, key=lambda sl: predicted_hopper_us(cfg, sl, m, n, k, sm_count, clusters, grouped))
    return _rule_slices(cfg, column_tiles(cfg, n) * -(-m // cfg.mt), k, sm_count)



# The skinny kernel on sm_90 (H200 sweeps, scripts/experiments/sweep_w4a16_skinny.py, docs/w4a16.md). Since the
# finisher warp (bench/results/h200/ab/w4a16_skinny_sweep_fp16_g128.json) it beats the mma.sync kernel
# at m <= 8 on every benchmark shape by 4-30% (k 8192 x n 10240, whose mma.sync grid quantizes badly) but the
# smallest weight at m <= 2, timed alone (k 4096 x n 4096: 11.7 against 11.0 us; the mma.sync kernel's ramp is
# shorter). In a decode step that weight is o, let in early by rope_attention: the skinny plan's first ring is
# its whole share, so the weight streams while the attention computes, and the step is 1.0-1.3 us a layer
# faster than with the mma.sync plan (8 layers, same process: bench/results/h200/ab/chain_plans_early_o.txt).
# A smaller weight at m <= 2 whose (tile, k stage) units are fewer than the full grid's CTAs (k 2048 x n 2048:
# 128 units for 264 CTAs) keeps the mma.sync kernel: the skinny grid would shrink to its units, and the decode
# step was measured on k 4096 x n 4096 (512 units) only.
# The old time model (mma.sync wave efficiency) misjudged the small shapes.
# m = 9-16 (bench/results/h200/ab/w4a16_skinny_sweep_m16_fp16_g128.json, since the group scales of
# two 8-row blocks also go on the fp32 partial sums): skinny-m16n128w2s6x2 beats the wgmma plan by
# 2-12% at m = 12 on all 8 shapes and at m = 16 on 6 (k 28672 x n 8192: 44.3 against 50.4 us);
# at m = 13-16 with n <= 4096 the wgmma kernel stays 0-3% ahead.
# Per-channel weights have no group scale to move onto the partials, and there the wgmma
# kernel's stream-K plan keeps n 57344 at m = 13-16 (same-process sweep,
# w4a16_skinny_sweep_m16_{fp16,bf16}_g-1.json: 73.3 against 77.5 us fp16, 77.2 against 83.2 bf16;
# elsewhere the two are within 0-5% either way).
SKINNY_MAX_M = 16
SKINNY_M16_MIN_N = 4097          # m = 13-16: the skinny kernel from this n up ...
SKINNY_M16_PER_CHANNEL_MAX_N = 32768  # ... and, per-channel, up to this n
SKINNY_WIDE_N = 32768            # m = 9-16 above this n: 256-column tiles, one warp a strip
PER_CHANNEL_WGMMA_MIN_K = 14336  # per-channel weights, m = 9-16: the wgmma kernel from this k ...
PER_CHANNEL_WGMMA_MIN_N = 16384  # ... or this n (up to SKINNY_WIDE_N)
SKINNY_STAGED_MIN_TRIPS = 4      # the staged-fixup build where the register fixup takes this many L2 round trips


def skinny_fixup_trips(cfg: SkinnyConfig, m: int, n: int, k: int, sm_count: int) -> int:
    """L2 round trips of the consumers' end-of-launch fixup through registers (skinny.cu's fixup):
    one per float4 a thread and batch of 8 slots, for the tile split over the most CTAs."""
    ks, tiles, ctas = -(-k // SKINNY_BK), n // cfg.bn, sm_count * cfg.ctas_per_sm
    units = tiles * ks

    def cta_of_unit(u):  # skinny.cu's: the CTA whose equal share holds unit u
        return ((u + 1) * ctas - 1) // units
    slots = max(cta_of_unit((t + 1) * ks - 1) - cta_of_unit(t * ks) + 1 for t in range(tiles))
    per_thread = -(-min(cfg.mt, m) * cfg.bn // 4 // (cfg.ns * cfg.wk * 32))
    return per_thread * -(-slots // 8)


def choose_skinny_config(m: int, n: int, k: int, sm_count: int, group: int | None = None,
                         dtype: torch.dtype | None = None) -> SkinnyConfig | None:
    """The stream-K kernel's configuration where it is expected to win on sm_90, else None.
    group: the weight's group size (-1 per channel; None when not known, treated as grouped);
    dtype: x's (None: fp16's choices). Its staged-fixup build where the register fixup would take
    SKINNY_STAGED_MIN_TRIPS L2 round trips or more (same-process A/B, m = 1-16, both dtypes and
    scale formats, bench/results/h200/ab/w4a16_skinny_staged_*.json; staged / register time: 6-8
    trips 0.94-0.99, 4 trips 0.95-1.01 on every configuration but the 128-column 16-row one
    (0.98-1.04, kept on registers), 1-3 trips 0.98-1.09)."""
    cfg = _choose_skinny_config(m, n, k, sm_count, group, dtype)
    if cfg is not None and m <= 2 and n // cfg.bn * -(-k // SKINNY_BK) < cfg.ctas_per_sm * sm_count:
        return None  # fewer (tile, stage) units than the grid has CTAs: the mma.sync kernel (see above)
    if (cfg is not None and not (cfg.mt == 16 and cfg.ns == 2)
            and skinny_fixup_trips(cfg, m, n, k, sm_count) >= SKINNY_STAGED_MIN_TRIPS):
        return replace(cfg, staged=True)
    return cfg


def _choose_skinny_config(m: int, n: int, k: int, sm_count: int, group: int | None,
                          dtype: torch.dtype | None) -> SkinnyConfig | None:
    if m > SKINNY_MAX_M or n % 128:
        return None
    grouped = group != -1
    if m > 8:
        if m > 12 and (n < SKINNY_M16_MIN_N or (not grouped and n > SKINNY_M16_PER_CHANNEL_MAX_N)):
            return None
        # Per-channel weights have no group scale for the skinny kernel to move onto its fp32
        # partials, and at settled clocks the time model's wgmma plan beat it on the long-k and
        # wide weights at m = 10-16 (same-process A/B, bench/results/h200/ab/w4a16_skinny_ab_m10-16_*_g-1.json:
        # k 28672 x n 8192 3-8%, k 4096 x n 28672 -1..+8%, k 14336 x n 4096 0-4%), not on the
        # others (k 8192 x n 8192 2-5% behind). n 57344 keeps the wide skinny tile at m <= 12
        # (6% ahead in bf16).
        if not grouped and n <= SKINNY_WIDE_N and (k >= PER_CHANNEL_WGMMA_MIN_K or n >= PER_CHANNEL_WGMMA_MIN_N):
            return None
        # Same-process A/Bs (scripts/experiments/ab_w4a16_plans.py, bench/results/h200/ab/w4a16_skinny_ab_m3-16_rotated_*.json):
        # on n 57344 the 256-column tile with one warp a strip was 3.5-9% ahead; on n 4096 at m <= 12,
        # one CTA of 8 stages an SM 12-14% (k 4096) or even (k 14336, -2..+1%).
        if n > SKINNY_WIDE_N and n % 256 == 0:
            return SkinnyConfig(16, 4, 1, 4, 2)
        if n <= 4096:
            return SkinnyConfig(16, 2, 2, 8, 1)
        return SkinnyConfig(16, 2, 2, 6, 2)
    if n % 256:
        return SkinnyConfig(8, 2, 4, 8, 2)
    # m <= 2: one warp a strip, two CTAs an SM (128 registers: group scales on the fp32 partial
    # sums); m = 3-8: two warps a strip with one CTA of 8 stages an SM (the m = 4 / 8 best on 7 of
    # the 8 shapes of the sweep, 1-9% ahead of the two-CTA configuration), except on large weights
    # (same-process A/Bs, w4a16_skinny_ab_m3-16_rotated_*.json and w4a16_skinny_ab_stages_*.json):
    # with group scales, two CTAs of one warp a strip (bf16 2-10% ahead; fp16 0-7% since they run
    # 3 stages); per-channel in bf16, two CTAs of two warps a strip (0-6%).
    # The one-warp configuration runs 3 stages: 1-7% ahead of 4 on the mid and large weights at
    # m = 1-4 (geomean 1.2-2.7% by format; w4a16_skinny_ab_stages_*.json), even on the small ones.
    if m <= 2:
        return SkinnyConfig(8, 4, 1, 3, 2)
    if n * k >= SMALL_WEIGHT_NK and (grouped or dtype == torch.bfloat16):
        return SkinnyConfig(8, 4, 1, 3, 2) if grouped else SkinnyConfig(8, 4, 2, 4, 2)
    return SkinnyConfig(8, 4, 2, 8, 1)


# NF4 at 128 < m < MODEL_MAX_M: the 256-row tile. The NF4 decode costs ~2.5x the int4 one and a
# tile decodes its weights once for all its rows, so the tallest tile wins where the int4 time
# model (fitted without that cost) picks 128-row tiles or stream-K: same-process on the H100 at
# m = 256 / 512 over the eight benchmark weights, 0.70-0.90x -> 0.77-1.10x of cuBLAS (docs/nf4.md).
NF4_TALL_TILE = HopperConfig(256, 1, 2, 5)


@functools.lru_cache(maxsize=4096)
def choose_config(m: int, n: int, k: int, sm_count: int, cc: int = 80, group: int | None = None,
                  clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS,
                  dtype: torch.dtype | None = None, codebook: str = "int4") -> GemmConfig | HopperConfig | SkinnyConfig:
    """clusters: the device's cluster capacity on sm_90 (runtime.cluster_capacity), which decides
    which k splits the wgmma kernel runs as clusters; the H200's by default. dtype: x's (the skinny
    kernel's best configuration differs between fp16 and bf16 on large weights); None: fp16's."""
    if cc == 90:
        skinny = choose_skinny_config(m, n, k, sm_count, group, dtype)
        if skinny is not None:
            return skinny
    if cc == 90 and _uses_hopper(m, n, k):
        if codebook in TABLE_CODEBOOKS and 128 < m < MODEL_MAX_M and ragged_waste_ok(NF4_TALL_TILE, n):
            return NF4_TALL_TILE
        return choose_hopper_config(m, n, sm_count, k, clusters, group != -1)
    return choose_mma_config(m, n, k, sm_count)


@functools.lru_cache(maxsize=4096)
def choose_mma_config(m: int, n: int, k: int, sm_count: int) -> GemmConfig:
    """Heuristic fitted to the H200 sweeps (`tilefish bench w4a16 --variants`, docs/w4a16.md).

    m <= 8: swapped operands + weights in a register ring, 256-column tiles with 3 stages (128
    columns with 6 stages when n needs it, or when 256-column tiles split as far as k allows
    would not reach half the SMs: n 1280 x k 8192 gives 80 CTAs of them, 160 of 128 columns);
    m <= 16: 16-row tiles, register ring, 128 columns; larger m: 32-row tiles through shared
    memory, 256 columns while they give half a tile per SM.
    """
    if m <= 8:
        most_slices = max(1, -(-k // BK) // MIN_K_TILES_PER_SLICE)
        if n % 256 == 0 and 2 * (n // 256) * most_slices >= sm_count:
            return GemmConfig(1, 4, 2, 3, swap=True, breg=True)
        if n % 128 == 0:
            return GemmConfig(1, 2, 4, 6, swap=True, breg=True)
        return GemmConfig(1, 1, 8, 4, swap=True, breg=True)
    if m <= 16:
        if n % 128 == 0:
            return GemmConfig(1, 2, 4, 4, breg=True)
        return GemmConfig(1, 1, 8, 4)
    m_tiles = -(-m // 32)
    if n % 256 == 0 and (n // 256) * m_tiles * 2 >= sm_count:
        wn = 4
    elif n % 128 == 0:
        wn = 2
    else:
        wn = 1
    return GemmConfig(2, wn, 8 // wn, 4)


MIN_K_TILES_PER_SLICE = 4


def choose_slices(tiles: int, k_tiles: int, sm_count: int) -> int:
    """Split k so that tiles x slices is about two blocks per SM (>= 4 k tiles per slice)."""
    return max(1, min(k_tiles // MIN_K_TILES_PER_SLICE, round(2 * sm_count / tiles)))


DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

# Shared memory a W4A16 kernel declares statically (barriers, hand-off records) besides the dynamic
# bytes a configuration counts: a plan is legal on a GPU when both fit its opt-in limit per block.
KERNEL_STATIC_SMEM = 64
# A nearby weight's configuration (at m <= 16) is taken only while the time model, where it covers
# both, predicts it within this factor of the model's own plan; else the model's plan runs.
NEARBY_MAX_PREDICTED_SLOWDOWN = 1.10
# At m <= COVERAGE_MAX_M a weight of COVERAGE_MIN_BYTES or more is bandwidth-bound: a plan that
# launches fewer CTAs than SMs leaves bandwidth idle (the H100 m = 16 cliff: 48 CTAs on 132 SMs).
COVERAGE_MAX_M = 64
COVERAGE_MIN_BYTES = 4 << 20
COVERAGE_MIN_FRACTION = 0.75


def fits_smem(cfg, group: int | None, zero_points: bool, smem_limit: int | None) -> bool:
    """Whether cfg's kernel fits `smem_limit` bytes of shared memory per block (None: no limit)."""
    return smem_limit is None or cfg.smem_bytes(128 if group is None else group, zero_points) \
        + KERNEL_STATIC_SMEM <= smem_limit


def fit_mma_smem(cfg: GemmConfig, group: int | None, zero_points: bool, smem_limit: int | None) -> GemmConfig:
    """cfg, or the nearest mma.sync configuration that fits the GPU's shared memory per block: fewer
    stages down to 3 first (the same tiles and grid; three 64-k stages in flight a CTA still cover a
    consumer GPU's latency), then half the columns with twice the k warps (the same 8 warps)."""
    c = cfg
    while not fits_smem(c, group, zero_points, smem_limit):
        if c.stages > 3:
            c = replace(c, stages=c.stages - 1)
        elif c.wn > 1:
            c = replace(cfg, wn=c.wn // 2, wk=c.wk * 2)
        elif c.stages > 2:
            c = replace(c, stages=c.stages - 1)
        else:
            raise ValueError(f"no mma.sync configuration of {cfg.bm} rows fits {smem_limit} B of shared memory "
                             "per block")
    return c


def _legal(plan: Plan, m: int, n: int, cc: int, group, zero_points: bool, smem_limit: int | None) -> bool:
    """Whether a (tuned) plan can launch here: its kernel exists on this GPU, takes m rows and n
    columns, and fits the shared memory per block."""
    return ((cc == 90 or isinstance(plan.cfg, GemmConfig)) and plan.runs_at(m) and ragged_waste_ok(plan.cfg, n)
            and fits_smem(plan.cfg, group, zero_points, smem_limit))


MAX_SKINNY_CLUSTER_SPLIT = 8  # the portable cluster size


def choose_skinny_cluster_split(cfg: SkinnyConfig, n: int, k: int, sm_count: int, capacity) -> int | None:
    """The cluster split (k slices a tile, one cluster of them) of a skinny plan whose launch may start while a
    light kernel ahead of it runs (light_ahead: a norm; behind a GEMM a cluster cannot start until a GPC has
    room for all of it, and it lost 5.5 us a layer, docs/e2e.md), or None for its stream-K grid. capacity(S):
    the clusters of S of this kernel the GPU holds at once (the driver's answer). The largest S up to
    MAX_SKINNY_CLUSTER_SPLIT whose clusters all fit, that keeps at least one CTA an SM, and whose CTAs stream at
    most one unit more than stream-K's longest (q/k/v 4096 x 6144 at m = 1 on the H200: S = 8, 4 units against
    3: -0.26 us a layer at b1 and -0.66 at b4 in the decode step, against its stream-K grid). 8-row tiles only."""
    if cfg.mt != 8:
        return None
    tiles, stages = n // cfg.bn, -(-k // SKINNY_BK)
    longest_streamk = -(-(tiles * stages) // (sm_count * cfg.ctas_per_sm))
    for s in range(min(MAX_SKINNY_CLUSTER_SPLIT, stages), 1, -1):
        if tiles * s < sm_count:
            return None
        if -(-stages // s) <= longest_streamk + 1 and tiles <= capacity(s):
            return s
    return None


@functools.lru_cache(maxsize=8192)
def launch_geometry(cfg, slices: int | None, ctas: int | None, m: int, n: int, k: int, sm_count: int, group,
                    zero_points: bool, clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS,
                    separate_tail_mode: str = "rule") -> LaunchGeometry:
    """What configuration cfg launches for x [m, k] @ a weight [k, n] (group: -1 per channel; None:
    not known, 128's) on a GPU of sm_count SMs whose cluster capacity the planners see as `clusters`
    (LaunchPolicy.planner_clusters: () with the DSMEM split off): geometry.split_geometry with the k
    split `slices` of a tile kernel or the grid `ctas` of a stream-K one, and where they are None
    the launcher's defaults (this dispatcher's split; one wave of CTAs). separate_tail_mode:
    LaunchPolicy.separate_tail.

    The one copy of the launch geometry: the launchers (launch.py) launch exactly this, plan()
    reports it, decide counts its CTAs. Cached: LaunchPlan.build asks it on every call of the op."""
    g = 128 if group is None else group
    if slices is None and not cfg.streamk:
        if isinstance(cfg, HopperConfig):
            slices = choose_hopper_slices(cfg, m, n, k, sm_count, clusters, group != -1)
        elif isinstance(cfg, GemmConfig):
            slices = choose_slices((n // cfg.bn) * -(-m // cfg.bm), -(-k // BK), sm_count)
    return split_geometry(cfg, slices, ctas, m, n, k, sm_count, g, zero_points, clusters, separate_tail_mode)


def plan_geometry(plan: Plan, m: int, n: int, k: int, sm_count: int, group, zero_points: bool,
                  clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS,
                  separate_tail_mode: str = "rule") -> LaunchGeometry:
    """launch_geometry of a tuned.Plan (its configuration, and its split or grid where it has one)."""
    return launch_geometry(plan.cfg, plan.slices, plan.ctas, m, n, k, sm_count, group, zero_points, clusters,
                           separate_tail_mode)


def _with_split_for(cfg, m: int, n: int, k: int, sm_count: int, clusters, grouped: bool) -> Plan:
    """A configuration taken from another weight, with the k split this weight needs: a wgmma tile
    configuration gets the split of least predicted time for it here (or the rule's); the stream-K
    kernels and the mma.sync kernel get the launcher's default (one wave; about two CTAs an SM)."""
    if isinstance(cfg, HopperConfig) and not cfg.streamk:
        return Plan(cfg, choose_hopper_slices(cfg, m, n, k, sm_count, clusters, grouped))
    return Plan(cfg)


def _predicted_us(plan: Plan, m, n, k, sm_count, clusters, grouped) -> float | None:
    if not isinstance(plan.cfg, HopperConfig) or m >= MODEL_MAX_M:
        return None
    slices = plan.slices
    if not plan.cfg.streamk and slices is None:
        slices = choose_hopper_slices(plan.cfg, m, n, k, sm_count, clusters, grouped)
    return predicted_hopper_us(plan.cfg, None if plan.cfg.streamk else slices, m, n, k, sm_count, clusters, grouped)


@functools.lru_cache(maxsize=8192)
def decide(m: int, n: int, k: int, sm_count: int, cc: int = 80, group: int | None = None,
           clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS, dtype: torch.dtype | None = None,
           codebook: str = "int4", table: TunedTable | None = None, smem_limit: int | None = None,
           zero_points: bool = False) -> tuple[Plan, str]:
    """(the launch plan of a call, where it came from): "table" (this GPU's tuned table holds the
    weight and an m near this one), "nearby" (at m <= 16, a nearby weight's tuned configuration with
    the split this weight needs, kept only while the model predicts it within
    NEARBY_MAX_PREDICTED_SLOWDOWN of its own plan and it covers the SMs), "model" (the fitted time
    model's plan: sm_90, wgmma, m < MODEL_MAX_M) or "rule" (the per-kernel rules). Every plan fits
    smem_limit bytes of shared memory per block (None: no limit) and at m <= COVERAGE_MAX_M a
    plan from another weight launches at least one CTA an SM on a weight of COVERAGE_MIN_BYTES."""
    grouped = group != -1
    default = _rules_plan(m, n, k, sm_count, cc, group, clusters, dtype, codebook, smem_limit, zero_points)
    if table is None:
        return default
    args = (DTYPE_NAMES.get(dtype, "fp16"), grouped, codebook, k, n, m)
    plan = table.lookup(*args)
    if plan is not None and _legal(plan, m, n, cc, group, zero_points, smem_limit):
        return plan, "table"
    near = table.lookup_nearby(*args)
    if near is None or not _legal(near, m, n, cc, group, zero_points, smem_limit):
        return default
    near = _with_split_for(near.cfg, m, n, k, sm_count, clusters, grouped)
    if m <= COVERAGE_MAX_M and n * k // 2 >= COVERAGE_MIN_BYTES and \
            plan_geometry(near, m, n, k, sm_count, group, zero_points, clusters).ctas < COVERAGE_MIN_FRACTION * sm_count:
        return default
    near_us = _predicted_us(near, m, n, k, sm_count, clusters, grouped)
    model_us = _predicted_us(default[0], m, n, k, sm_count, clusters, grouped)
    if near_us is not None and model_us is not None and near_us > NEARBY_MAX_PREDICTED_SLOWDOWN * model_us:
        return default
    return near, "nearby"


def _rules_plan(m, n, k, sm_count, cc, group, clusters, dtype, codebook, smem_limit, zero_points) -> tuple[Plan, str]:
    """The plan without a tuned table: choose_config's configuration (fitted to the shared memory)
    with the launcher's split."""
    cfg = choose_config(m, n, k, sm_count, cc, group, clusters, dtype, codebook)
    if isinstance(cfg, GemmConfig):
        return Plan(fit_mma_smem(cfg, group, zero_points, smem_limit)), "rule"
    from_model = (isinstance(cfg, HopperConfig) and m < MODEL_MAX_M and not (codebook in TABLE_CODEBOOKS and cfg == NF4_TALL_TILE)
                  and cfg.label() in hopper_time_model(m))
    return Plan(cfg), "model" if from_model else "rule"  # the launcher's split: the model's where it planned one


def choose_plan(m: int, n: int, k: int, sm_count: int, cc: int = 80, group: int | None = None,
                clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS, dtype: torch.dtype | None = None,
                codebook: str = "int4", table: TunedTable | None = None, smem_limit: int | None = None,
                zero_points: bool = False) -> Plan:
    """The launch plan of a call (decide's, without where it came from)."""
    return decide(m, n, k, sm_count, cc, group, clusters, dtype, codebook, table, smem_limit, zero_points)[0]


NF4_GROUPS = (32, 64, 128)  # an NF4 weight's scale groups (tilefish.nf4.prepare: min(blocksize, 128))



def shipped_table_configs() -> set:
    """Every configuration a tuned table shipped in the package names (they are dispatchable too)."""
    from .tuned import PACKAGE_TABLES, read_table_doc

    out = set()
    for path in sorted(PACKAGE_TABLES.glob("*.json")):
        out |= {Plan.parse(e["plan"]).cfg for e in read_table_doc(path)["entries"]}
    return out


class KernelBuild(NamedTuple):
    """One dispatchable kernel: a configuration built for one weight format (group_size -1: per
    channel; codebook "int4", "nf4" or "mxfp4")."""

    dtype: torch.dtype
    config: GemmConfig | HopperConfig | SkinnyConfig
    group_size: int
    zero_points: bool
    codebook: str = "int4"

    @property
    def spec(self) -> KernelSpec:
        return kernel_spec(self.dtype, self.config, self.group_size, self.zero_points, self.codebook)


def _every_format(dtype: torch.dtype, cfg) -> list[KernelBuild]:
    """cfg in every weight format (a sanitizer or sweep may run any of them)."""
    return ([KernelBuild(dtype, cfg, g, asym) for g in (-1, 32, 64, 128) for asym in (False, True)]
            + [KernelBuild(dtype, cfg, g, False, "nf4") for g in NF4_GROUPS]
            + [KernelBuild(dtype, cfg, MXFP4_GROUP, False, "mxfp4")])


def dispatch_builds(arch: str | None = None) -> list[KernelBuild]:
    """The kernels the dispatcher launches, as configurations and formats: on a GPU of `arch` (e.g.
    "sm_89": the mma.sync configurations fitted to its shared memory; the wgmma and skinny ones on
    sm_90 only), or on any GPU (None)."""
    from ...runtime.device import SMEM_PER_BLOCK_BY_CC

    cc = None if arch is None else int(arch.removeprefix("sm_").rstrip("a"))
    limits = sorted({SMEM_PER_BLOCK_BY_CC.get(cc)} if cc is not None else set(SMEM_PER_BLOCK_BY_CC.values()) | {None},
                    key=lambda v: v or 0)
    mma = {choose_mma_config(m, n, 4096, sms) for m in (1, 8, 9, 16, 17, 32, 33, 64, 128, 4096)
           for n in (64, 128, 256, 1280, 4096, 8192, 14336, 28672, 57344) for sms in (82, 108, 132, 170)}
    # the configurations of every format fitted to the shared memory
    fitted = {fit_mma_smem(c, g, asym, lim) for c in mma for lim in limits
              for g, asym in [(g, a) for g in (-1, 32, 64, 128) for a in (False, True)]}
    out = [b for dt in DTYPES for cfg in sorted(fitted, key=lambda c: c.label()) for b in _every_format(dt, cfg)]
    if cc not in (None, 90):
        return out
    cfgs = {choose_hopper_config(m, n, 132, k, grouped=g) for m in (9, 16, 17, 32, 33, 64, 65, 128, 256, 512, 1024, 4096)
            for n in (64, 128, 256, 4096, 6144, 8192, 10240, 14336, 28672, 57344) for k in (4096, 8192, 28672)
            for g in (True, False)}
    cfgs |= {c for m in (1, 4, 8, 9, 16) for n in (128, 256, 4096, 6144, 10240, 57344)
             for k in (4096, 8192, 28672) for g in (-1, 128) for dt in DTYPES
             if (c := choose_skinny_config(m, n, k, 132, g, dt)) is not None}
    cfgs |= shipped_table_configs()
    out += [b for dt in DTYPES for cfg in sorted(cfgs - mma, key=lambda c: c.label()) for b in _every_format(dt, cfg)]
    return list(dict.fromkeys(out))


def dispatch_specs(arch: str | None = None) -> list[KernelSpec]:
    """The KernelSpecs of dispatch_builds(arch) (tilefish compile, the warm-ups)."""
    return list(dict.fromkeys(b.spec for b in dispatch_builds(arch)))
