"""The public seam of the SGEMM and HGEMM dispatch: what a call launches, for this GPU or a described one.

tilefish.hgemm.plan(m, n, k, ...) / tilefish.sgemm.plan(m, n, k, ...) answer without launching anything,
and without a GPU when one is described (runtime.GpuSpec): the ladder step and its configuration, the
kernel variant, grid, threads, shared memory and where the choice came from. Each asks its family's
`decide` and `launch_grid`, the functions its launcher asks with the present GPU's numbers, so a plan
printed here is the launch that runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime import KernelSpec
from ..runtime.device import GpuSpec
from . import hgemm as hg
from . import sgemm as sg


@dataclass(frozen=True)
class GemmPlan:
    """One call's launch plan. config: the ladder step's configuration; kernel_spec: the kernel variant
    that runs (configuration x dtype x B layout); grid: what the launcher launches, in CTAs (an int, or
    (x, y) for the 2-D grids of HGEMM steps 01-05); ctas: their product (step 07: its persistent grid,
    at most one CTA an SM); cluster: CTAs a thread-block cluster (1: none); smem_bytes: shared memory a
    CTA, static and dynamic; workspace_bytes: scratch a call takes (none: 0); source: "table" (an entry
    of the family's tuned tables), "rule" (HGEMM step 07's tiles picked by rule) or "given" (the
    caller's configuration); predicted_us: None (these families have no time model)."""

    m: int
    n: int
    k: int
    gpu: GpuSpec
    config: hg.HgemmConfig | sg.SgemmConfig
    kernel_spec: KernelSpec
    grid: int | tuple[int, int]
    ctas: int
    cluster: int
    threads: int
    smem_bytes: int
    workspace_bytes: int
    source: str
    predicted_us: float | None

    @property
    def step(self) -> str:
        """The ladder step, e.g. "07_wgmma_tma"."""
        return self.config.step

    @property
    def label(self) -> str:
        """The configuration as bench rows name it, e.g. "09_pipelined<BM=128,...>"."""
        return self.config.label()


def hgemm_plan(m: int, n: int, k: int, *, dtype: torch.dtype = torch.float16, b_transposed: bool = False,
               kernel="auto", gpu: GpuSpec | None = None) -> GemmPlan:
    """The launch plan of tilefish.hgemm(a [m, k], b, kernel=kernel, b_transposed=b_transposed) for a, b
    of `dtype` on `gpu` (default: the current CUDA device). b_transposed: b is a contiguous [N, K] (a
    transposed view of a contiguous matrix is the other layout, as in the op). The op's ValueError /
    TypeError for bad arguments, before anything else."""
    _check_dims(m, n, k)
    hg.check_dtype(dtype)
    hg.check_layout(b_transposed)
    hg.check_kernel(kernel)
    hg.check_sizes(m, n, k)
    hg.check_rows(n, k, b_transposed)
    gpu = _gpu(gpu)
    cfg, source = hg.decide(m, n, kernel, gpu.sm_count, gpu.cc, gpu.smem_per_block)
    grid = hg.launch_grid(cfg, m, n, gpu.sm_count, gpu.clusters)
    return GemmPlan(m, n, k, gpu, cfg, cfg.spec(dtype, b_transposed), grid, _ctas(grid),
                    cfg.CLUSTER if cfg.info.hopper else 1, cfg.threads, cfg.smem_for(b_transposed), 0, source, None)


def sgemm_plan(m: int, n: int, k: int, *, kernel="auto", aligned: bool = True,
               gpu: GpuSpec | None = None) -> GemmPlan:
    """The launch plan of tilefish.sgemm(a [m, k], b [k, n], kernel=kernel) on `gpu` (default: the
    current CUDA device). aligned: a, b and c start on 16-byte boundaries (torch's allocations do; an
    offset view may not), which with K % 4 == 0 and N % 4 == 0 lets the vectorized steps run (else a
    step name falls back to ops.sgemm.FALLBACK). The op's ValueError / TypeError for bad arguments,
    before anything else."""
    _check_dims(m, n, k)
    if not isinstance(aligned, bool):
        raise TypeError(f"aligned must be a bool, got {type(aligned).__name__}")
    sg.check_kernel(kernel)
    sg.check_sizes(m, n, k)
    vector = sg.can_vectorize(k, n, aligned)
    sg.check_vector(kernel, vector)
    gpu = _gpu(gpu)
    cfg, source = sg.decide(m, n, vector, kernel, gpu.sm_count, gpu.smem_per_block)
    grid = sg.launch_grid(cfg, m, n)
    return GemmPlan(m, n, k, gpu, cfg, cfg.spec, grid, grid, 1, cfg.threads, cfg.smem_bytes, 0, source, None)


def _check_dims(m, n, k) -> None:
    for name, v in (("m", m), ("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def _gpu(gpu: GpuSpec | None) -> GpuSpec:
    if gpu is None:
        return GpuSpec.current()
    if not isinstance(gpu, GpuSpec):
        raise TypeError(f"gpu must be a tilefish.GpuSpec or None (the current GPU), got {type(gpu).__name__}")
    return gpu


def _ctas(grid) -> int:
    return math.prod(grid) if isinstance(grid, tuple) else grid
