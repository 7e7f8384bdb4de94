"""The public seam of the W4A16 / NF4 dispatch: what a call launches, for this GPU or a described one.

plan(m, n, k, ...) answers, without launching anything and without a GPU when one is described
(runtime.GpuSpec): which kernel and configuration, how many CTAs, the k split or stream-K grid,
thread-block clusters, shared memory, scratch bytes, where the decision came from and the time
model's prediction. The launcher (launch.py) takes its configuration and split from the same
decision (dispatch.decide) with the present GPU's numbers, so a plan printed here is the plan that runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime.device import GpuSpec
from .configs import (HOPPER_BK, MAX_CLUSTER_SLICES, ONE_CTA_PER_SM_SMEM, SKINNY_BK, GemmConfig, HopperConfig,
                      SkinnyConfig, column_tiles)
from .dispatch import MODEL_MAX_M, choose_hopper_slices, choose_slices, decide
from .layout import BK, CODEBOOKS, DTYPES, check_shape
from .time_model import predicted_hopper_us
from .tuned import gpu_key, table_for

KERNELS = {GemmConfig: "mma.sync", HopperConfig: "wgmma", SkinnyConfig: "skinny"}


@dataclass(frozen=True)
class MatmulPlan:
    """One call's launch plan. config: the kernel configuration; slices: the k split (1: none; the
    stream-K kernels share k through their grid instead); ctas: CTAs launched in all; cluster: CTAs
    a thread-block cluster (a k split summed through distributed shared memory; 1: none);
    smem_bytes: dynamic shared memory a CTA; workspace_bytes: scratch a call takes (fp32 partial
    sums, from the caching allocator, plus tile counters); source: "table", "nearby", "model" or
    "rule" (dispatch.decide); predicted_us: the fitted time model's time (wgmma plans it covers),
    else None."""

    m: int
    n: int
    k: int
    gpu: GpuSpec
    config: GemmConfig | HopperConfig | SkinnyConfig
    slices: int
    ctas: int
    cluster: int
    smem_bytes: int
    workspace_bytes: int
    source: str
    predicted_us: float | None

    @property
    def kernel(self) -> str:
        """The kernel: "mma.sync" (any GPU), "wgmma" or "skinny" (sm_90 only)."""
        return KERNELS[type(self.config)]

    @property
    def streamk(self) -> bool:
        return self.config.streamk

    @property
    def label(self) -> str:
        """The configuration and its split ("/x3") or stream-K grid ("/c264"), as bench rows name it."""
        return self.config.label() + (f"/c{self.ctas}" if self.streamk else f"/x{self.slices}" if self.slices > 1 else "")


def plan(m: int, n: int, k: int, *, group_size: int = 128, dtype: torch.dtype = torch.float16,
         codebook: str = "int4", zero_points: bool = False, gpu: GpuSpec | None = None) -> MatmulPlan:
    """The launch plan of x [m, k] @ a 4-bit weight [k, n] (group_size: -1 per channel; codebook
    "int4" or "nf4"; zero_points: asymmetric int4) on `gpu` (default: the current CUDA device)."""
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    check_shape(n, k, group_size)
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
    if codebook == "nf4" and (zero_points or group_size == -1):
        raise ValueError("codebook 'nf4' takes group scales and no zero points")
    gpu = GpuSpec.current() if gpu is None else gpu
    if not isinstance(gpu, GpuSpec):
        raise TypeError(f"gpu must be a tilefish.GpuSpec or None (the current GPU), got {type(gpu).__name__}")
    table = table_for(gpu_key(gpu.name, gpu.sm_count))
    chosen, source = decide(m, n, k, gpu.sm_count, gpu.cc, group_size, gpu.clusters, dtype, codebook, table,
                            gpu.smem_per_block, zero_points)
    return _geometry(chosen, m, n, k, group_size, zero_points, gpu, source)


def _geometry(chosen, m, n, k, group, asym, gpu: GpuSpec, source: str) -> MatmulPlan:
    """The launchers' grid, split and scratch for a chosen plan (launch.py: _mma_launches,
    _hopper_launches, _skinny_launches), from the GPU's description."""
    cfg, sms = chosen.cfg, gpu.sm_count
    smem, cluster, slices, predicted = cfg.smem_bytes(group, asym), 1, 1, None
    if isinstance(cfg, SkinnyConfig):
        tiles = n // cfg.bn
        ctas = max(1, min(chosen.ctas or sms * cfg.ctas_per_sm, tiles * -(-k // SKINNY_BK)))
        floats = ctas * 2 * cfg.mt * cfg.bn
    elif isinstance(cfg, HopperConfig):
        tiles = column_tiles(cfg, n) * -(-m // cfg.mt)
        if cfg.streamk:
            ctas = max(1, min(chosen.ctas or sms * cfg.ctas_per_sm(group, asym), tiles * (k // HOPPER_BK)))
            floats = ctas * 2 * cfg.mt * cfg.bn
        else:
            slices = chosen.slices or choose_hopper_slices(cfg, m, n, k, sms, gpu.clusters, group != -1)
            slices = max(1, min(slices, k // HOPPER_BK))
            ctas = tiles * slices
            in_clusters = 1 < slices <= MAX_CLUSTER_SLICES and tiles <= dict(gpu.clusters).get(slices, 0)
            if in_clusters:
                cluster, smem, floats = slices, max(smem, ONE_CTA_PER_SM_SMEM), 0
            else:
                floats = tiles * slices * cfg.mt * cfg.bn if slices > 1 else 0
        if m < MODEL_MAX_M:
            predicted = predicted_hopper_us(cfg, None if cfg.streamk else slices, m, n, k, sms, gpu.clusters,
                                            group != -1)
    else:
        tiles = (n // cfg.bn) * -(-m // cfg.bm)
        k_tiles = -(-k // BK)
        slices = max(1, min(chosen.slices or choose_slices(tiles, k_tiles, sms), k_tiles))
        ctas = tiles * slices
        floats = tiles * slices * cfg.bm * cfg.bn if slices > 1 else 0
    counted = cfg.streamk or (slices > 1 and cluster == 1)
    return MatmulPlan(m, n, k, gpu, cfg, slices, ctas, cluster, smem, 4 * floats + (4 * tiles if counted else 0),
                      source, predicted)
