"""The public seam of the W4A16 / NF4 dispatch: what a call launches, for this GPU or a described one.

plan(m, n, k, ...) answers, without launching anything and without a GPU when one is described
(runtime.GpuSpec): which kernel and configuration, how many CTAs, the k split or stream-K grid,
thread-block clusters, shared memory, scratch bytes, where the decision came from and the time
model's prediction. The launcher (launch.py) takes its configuration and split from the same
decision (dispatch.decide) and its grids, clusters, shared memory and scratch from the same
geometry (dispatch.launch_geometry) with the present GPU's numbers, so a plan printed here is the
plan that runs. Both are made under a LaunchPolicy (policy.py): the active one unless one is given.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...runtime.device import GpuSpec
from .configs import GemmConfig, HopperConfig, SkinnyConfig
from .dispatch import MODEL_MAX_M, decide, plan_geometry
from .geometry import Launch
from .layout import CODEBOOKS, DTYPES, check_shape
from .policy import LaunchPolicy, resolve_policy
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
    else None; launches: the kernel launches (grid in CTAs, cluster, first tile: two where the
    partial last wave runs apart, geometry.separate_tail); policy: the LaunchPolicy it was made under."""

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
    launches: tuple[Launch, ...] = ()
    policy: LaunchPolicy = LaunchPolicy()

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
         codebook: str = "int4", zero_points: bool = False, gpu: GpuSpec | None = None,
         policy: LaunchPolicy | None = None) -> MatmulPlan:
    """The launch plan of x [m, k] @ a 4-bit weight [k, n] (group_size: -1 per channel; codebook
    "int4" or "nf4"; zero_points: asymmetric int4) on `gpu` (default: the current CUDA device) under
    `policy` (default: the active one, ops.w4a16.launch_policy)."""
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
    policy = resolve_policy(policy)
    gpu = GpuSpec.current() if gpu is None else gpu
    if not isinstance(gpu, GpuSpec):
        raise TypeError(f"gpu must be a tilefish.GpuSpec or None (the current GPU), got {type(gpu).__name__}")
    clusters = policy.planner_clusters(gpu.clusters)
    table = table_for(gpu_key(gpu.name, gpu.sm_count))
    chosen, source = decide(m, n, k, gpu.sm_count, gpu.cc, group_size, clusters, dtype, codebook, table,
                            gpu.smem_per_block, zero_points)
    geo = plan_geometry(chosen, m, n, k, gpu.sm_count, group_size, zero_points, clusters, policy.separate_tail)
    cfg, predicted = chosen.cfg, None
    if isinstance(cfg, HopperConfig) and m < MODEL_MAX_M:
        predicted = predicted_hopper_us(cfg, None if cfg.streamk else geo.slices, m, n, k, gpu.sm_count, clusters,
                                        group_size != -1)
    return MatmulPlan(m, n, k, gpu, cfg, geo.slices, geo.ctas, geo.cluster, geo.smem, geo.scratch_bytes, source,
                      predicted, geo.launches, policy)
