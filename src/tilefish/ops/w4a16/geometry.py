"""What a W4A16 plan launches once its split is decided: grids, thread-block clusters, shared memory,
scratch, and whether its partial last wave runs as a launch of its own.

split_geometry is pure arithmetic on (configuration, k split or stream-K grid, shape, GPU); the
dispatcher's seam dispatch.launch_geometry decides the split where a caller leaves it open and
calls it, and everything downstream takes the geometry from there: the launchers (launch.py) launch
it, plan() reports it, decide counts its CTAs.
"""
from __future__ import annotations

from typing import NamedTuple

from .configs import HOPPER_BK, ONE_CTA_PER_SM_SMEM, SKINNY_BK, HopperConfig, SkinnyConfig, column_tiles
from .layout import BK
from .policy import SEPARATE_TAIL_MODES
from .time_model import split_fits_clusters


class Launch(NamedTuple):
    """One kernel launch of a plan: its grid (x, y, z) in CTAs, CTAs a thread-block cluster along x
    (1: none) and the first tile it computes (the wgmma kernel's tile_base: a separate tail's launch)."""

    grid: tuple[int, int, int]
    cluster: int = 1
    first_tile: int = 0


class LaunchGeometry(NamedTuple):
    """What a plan launches: slices, the k split (1: none; the stream-K kernels share k through
    their grid); ctas, CTAs in all; cluster, CTAs a thread-block cluster (a k split summed through
    distributed shared memory; 1: none); smem, dynamic shared memory a CTA; partial_floats, fp32
    partial sums a call allocates; tile_counters, int32 counters the split tiles' fixups meet at;
    launches, the kernel launches in order."""

    slices: int
    ctas: int
    cluster: int
    smem: int
    partial_floats: int
    tile_counters: int
    launches: tuple[Launch, ...]

    @property
    def scratch_bytes(self) -> int:
        return 4 * (self.partial_floats + self.tile_counters)


def split_geometry(cfg, slices: int | None, ctas: int | None, m: int, n: int, k: int, sm_count: int, group: int,
                   zero_points: bool, clusters: tuple[tuple[int, int], ...],
                   separate_tail_mode: str = "rule") -> LaunchGeometry:
    """The launches of cfg with its k split decided: `slices` (an int) for a tile kernel, `ctas` for
    a stream-K one (None: one wave, SMs x CTAs an SM, at most one unit a CTA). A wgmma split runs
    as clusters of its slices where time_model.split_fits_clusters says so (2..MAX_CLUSTER_SLICES
    slices, all the clusters at once, one CTA an SM, by `clusters`: the cluster capacity the
    planners see, LaunchPolicy.planner_clusters; a cluster that did not fit would run in a second
    wave); other splits sum through fp32 partials in global memory, meeting at a tile counter.
    separate_tail_mode: LaunchPolicy.separate_tail."""
    smem = cfg.smem_bytes(group, zero_points)
    if isinstance(cfg, SkinnyConfig):
        tiles, k_stages = n // cfg.bn, -(-k // SKINNY_BK)
        if slices is not None and slices > 1:  # the cluster split: a tile's k in `slices` CTAs, one cluster
            if slices > min(16, k_stages):
                raise ValueError(f"{cfg.label()}/x{slices}: a cluster split takes 2..min(16, k / 128 = "
                                 f"{k_stages}) slices")
            if cfg.mt != 8:
                raise ValueError(f"{cfg.label()}/x{slices}: a cluster split runs on 8-row tiles (mt = 8) only")
            # With the DSMEM split off (no clusters planned) the same grid runs as plain stream-K, whose
            # workspace and counters every cluster-split geometry keeps (a kernel build without it runs that).
            ctas, cluster = tiles * slices, slices if clusters else 1
            return LaunchGeometry(slices, ctas, cluster, smem, ctas * 2 * cfg.mt * cfg.bn, tiles,
                                  (Launch((ctas, 1, 1), cluster),))
        ctas = max(1, min(ctas or sm_count * cfg.ctas_per_sm, tiles * k_stages, 2**31 - 1))
        return LaunchGeometry(1, ctas, 1, smem, ctas * 2 * cfg.mt * cfg.bn, tiles, (Launch((ctas, 1, 1)),))
    if isinstance(cfg, HopperConfig):
        n_tiles, m_tiles, k_stages = column_tiles(cfg, n), -(-m // cfg.mt), k // HOPPER_BK
        tiles = n_tiles * m_tiles
        if cfg.streamk:
            ctas = max(1, min(ctas or sm_count * cfg.ctas_per_sm(group, zero_points), tiles * k_stages, 2**31 - 1))
            return LaunchGeometry(1, ctas, 1, smem, ctas * 2 * cfg.mt * cfg.bn, tiles, (Launch((ctas, 1, 1)),))
        slices = max(1, min(slices, k_stages, 65535))  # gridDim.z
        if split_fits_clusters(cfg, slices, m, n, clusters):
            return LaunchGeometry(slices, tiles * slices, slices, max(smem, ONE_CTA_PER_SM_SMEM), 0, 0,
                                  (Launch((m_tiles * slices, n_tiles, 1), slices),))
        split = slices > 1
        tail = separate_tail(cfg, tiles, slices, 1, group, zero_points, sm_count, separate_tail_mode)
        launches = ((Launch((tiles - tail, 1, 1)), Launch((tail, 1, 1), 1, tiles - tail)) if tail
                    else (Launch((m_tiles, n_tiles, slices)),))
        return LaunchGeometry(slices, tiles * slices, 1, smem, tiles * slices * cfg.mt * cfg.bn if split else 0,
                              tiles if split else 0, launches)
    n_tiles, m_tiles, k_tiles = n // cfg.bn, -(-m // cfg.bm), -(-k // BK)  # k % 128 == 64: a half last tile
    tiles = n_tiles * m_tiles
    slices = max(1, min(slices, k_tiles))
    split = slices > 1
    return LaunchGeometry(slices, tiles * slices, 1, smem, tiles * slices * cfg.bm * cfg.bn if split else 0,
                          tiles if split else 0, (Launch((m_tiles, n_tiles, slices)),))


def separate_tail(cfg, tiles: int, slices: int, cluster: int, group_size: int, asym: bool, sm_count: int,
                  mode: str = "rule") -> int:
    """How many tiles of a whole-tile wgmma launch (no k split) to run as a launch of their own (0:
    one launch): the partial last wave of a per-channel weight's plan, when the kernel fits two CTAs
    an SM and that wave fits one CTA an SM but fills more than half the SMs. mode:
    LaunchPolicy.separate_tail ("never": 0; "always": any such partial wave, group scales too).

    Why: in one launch the hardware hands each pair of slots freed together to two tail CTAs. The
    per-channel kernel's CTAs finish a wave nearly together, so a large tail runs two an SM on half
    the SMs (each at ~1.6x the time of a CTA alone) while the other SMs idle; a launch of its own
    starts on an idle GPU, which places CTAs one an SM first. With group scales the first wave's
    CTAs finish apart and the tail spreads by itself, and a small tail gains little: there the
    second launch only adds its start and the wait for the first wave's last CTA (~5 us). The
    measurements are in docs/w4a16.md."""
    if mode not in SEPARATE_TAIL_MODES:
        raise ValueError(f"LaunchPolicy.separate_tail must be 'rule', 'never' or 'always', got {mode!r}")
    if (mode == "never" or not isinstance(cfg, HopperConfig) or cfg.streamk or slices != 1 or cluster != 1
            or cfg.ctas_per_sm(group_size, asym) != 2):
        return 0
    slots = 2 * sm_count
    tail = tiles % slots
    if tiles <= slots or tail > sm_count:
        return 0
    return tail if mode == "always" or (group_size == -1 and tail > sm_count // 2) else 0
