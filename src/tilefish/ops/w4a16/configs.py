"""The three W4A16 kernels' configurations, their KernelSpecs and design spaces.

  GemmConfig    kernels/w4a16/gemm.cu, mma.sync, any GPU: tiles with k split `slices` ways.
  HopperConfig  kernels/w4a16/wgmma.cu, sm_90a: register-A wgmma tiles with k split `slices` ways
                (through DSMEM clusters or a workspace), or stream-K (streamk=True): a 1-D grid of
                `ctas` CTAs sharing the (tile, k stage) units.
  SkinnyConfig  kernels/w4a16/skinny.cu, sm_90a, small m: always stream-K over the weight (`ctas` CTAs).

Labels (sweeps, A/Bs, bench rows) name a configuration: mma.sync ones "m16n128w2x4s4[-swap][-reg]",
"wg-m64n256c2s6" (tile mode; a plan adds "/x<slices>"), "wg-m64n256c2s6-streamk" and
"skinny-m8n256w1s3x2[-st]". Result files recorded before the labels were made unambiguous say
"...-sk" for stream-K and "sk-..." for skinny: canonical_label / parse_plan read both.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

import torch

from ...runtime import KernelSpec
from ...runtime.device import HOPPER_CLUSTERS
from .layout import BK, DTYPES

SOURCE = "w4a16/gemm.cu"
HOPPER_SOURCE = "w4a16/wgmma.cu"
SKINNY_SOURCE = "w4a16/skinny.cu"
THREADS = 256
HOPPER_BK = 64
SKINNY_BK = 128
MAX_CLUSTER_SLICES = 8     # a portable cluster: k splits up to this run as one cluster (DSMEM fixup)
ONE_CTA_PER_SM_SMEM = 116 * 1024  # dynamic smem above half an SM's 228 KB: one CTA an SM
# Clusters of each size resident at once with one CTA an SM, on the H200 (runtime.cluster_capacity;
# a cluster sits in one GPC). The default where no device is asked (tests, tables); launches pass
# their device's.
H200_CLUSTERS = HOPPER_CLUSTERS


@dataclass(frozen=True)
class GemmConfig:
    """The mma.sync kernel (kernels/w4a16/gemm.cu, any GPU): 16 mb x 64 wn tiles, k split into `slices`."""
    mb: int = 1       # 16-row m blocks per tile (BM = 16 mb)
    wn: int = 2       # warps along n (BN = 64 wn)
    wk: int = 4       # warps along k (block-level k reduction)
    stages: int = 4
    swap: bool = False  # m <= 8: weights as the MMA A operand, x^T as B (one MMA per weight word)
    breg: bool = False  # weights straight to a register ring (no shared-memory stage for them)
    streamk = False     # k split into `slices`, never stream-K

    @property
    def bm(self) -> int:
        return 16 * self.mb

    @property
    def bn(self) -> int:
        return 64 * self.wn

    def label(self) -> str:
        return (f"m{self.bm}n{self.bn}w{self.wn}x{self.wk}s{self.stages}{'-swap' if self.swap else ''}"
                f"{'-reg' if self.breg else ''}")

    def smem_bytes(self, group_size: int, asym: bool) -> int:
        a = self.bm * BK * 2
        b = 0 if self.breg else BK * self.bn // 2
        s = (BK // group_size) * self.bn * 2 if group_size > 0 else 0
        z = ((BK // group_size) if group_size > 0 else 1) * self.bn * 2 if asym else 0
        pipeline = self.stages * (a + b + s + z)
        reduction = (self.wk - 1) * self.wn * 32 * (self.mb * (16 if self.swap else 32)) * 4
        return max(pipeline, reduction)


@dataclass(frozen=True)
class HopperConfig:
    """The sm_90a wgmma kernel (kernels/w4a16/wgmma.cu): weights are wgmma's A operand from
    registers, x its B operand (N = the m tile) through TMA."""
    mt: int = 64      # m tile (the wgmma n): 16, 32, 64, 128 or 256
    nt: int = 4       # packed words per lane per k16 = m64 accumulator tiles per warpgroup
    cons: int = 2     # consumer warpgroups (each covers nt 64-column strips)
    stages: int = 4
    streamk: bool = False  # stream-K: one wave of CTAs sharing the (tile, k stage) units evenly
    swap = False
    breg = False

    def __post_init__(self):
        # The kernel's static_asserts, checked here so a bad config is a ValueError, not an NVRTC error.
        if self.mt not in (16, 32, 64, 128, 256) or self.nt not in (1, 2, 4) or self.cons not in (1, 2):
            raise ValueError(f"HopperConfig needs mt in (16, 32, 64, 128, 256), nt in (1, 2, 4), cons in (1, 2); "
                             f"got mt={self.mt}, nt={self.nt}, cons={self.cons}")
        if self.nt * self.mt // 2 > 128:
            raise ValueError(f"HopperConfig: nt * mt / 2 = {self.nt * self.mt // 2} accumulators a thread (max 128)")
        if self.cons == 1 and self.mt > 128:
            raise ValueError("HopperConfig: one consumer warpgroup launches at 128 registers, so mt <= 128")
        if self.stages < 2:
            raise ValueError(f"HopperConfig needs stages >= 2, got {self.stages}")
        if self.smem_bytes(32, True) > 227 * 1024:
            raise ValueError(f"HopperConfig {self.label()} needs {self.smem_bytes(32, True)} bytes of shared memory "
                             "(max 227 KiB); use fewer stages")

    def ctas_per_sm(self, group_size: int, asym: bool) -> int:
        """Resident CTAs an SM (the stream-K grid is one wave of them): one consumer warpgroup
        launches at 128 registers a thread, so two fit where the shared memory does."""
        return 2 if self.cons == 1 and self.smem_bytes(group_size, asym) <= 113 * 1024 else 1

    @property
    def bm(self) -> int:
        return self.mt

    @property
    def bn(self) -> int:
        return 64 * self.nt * self.cons

    @property
    def threads(self) -> int:
        return (self.cons + 1) * 128

    @property
    def k_tile(self) -> int:
        return HOPPER_BK

    def label(self) -> str:
        return f"wg-m{self.mt}n{self.bn}c{self.cons}s{self.stages}{'-streamk' if self.streamk else ''}"

    def smem_bytes(self, group_size: int, asym: bool) -> int:
        x = self.mt * HOPPER_BK * 2
        w = self.nt * self.cons * 2048
        s_rows = 0 if group_size == -1 else (1 if group_size >= HOPPER_BK else HOPPER_BK // group_size)
        z_rows = (1 if group_size == -1 else s_rows) if asym else 0
        per_stage = x + w + (s_rows + z_rows) * self.bn * 2
        staging = self.mt * (self.bn * 2 + 16) if self.streamk else 0  # stream-K: the epilogue's own area
        return 1024 + self.stages * per_stage + 16 * self.stages + staging  # + alignment slack, + barriers


@dataclass(frozen=True)
class SkinnyConfig:
    """The sm_90a stream-K kernel for small m (kernels/w4a16/skinny.cu): every CTA streams an equal
    share of the (tile, 128-k stage) units; mma.sync with the weights as the A operand."""
    mt: int = 16          # rows of x per tile (8, 16 or 32): m <= mt
    ns: int = 4           # 64-column strips per tile
    wk: int = 2           # consumer warps per strip (they split each stage's 8 k16 rows)
    stages: int = 4
    ctas_per_sm: int = 2  # grid = SMs x this (at most one unit per CTA)
    staged: bool = False  # the end-of-launch fixups through shared memory (a separate build; see skinny.cu)
    streamk = True        # always: a grid of `ctas` CTAs (default SMs x ctas_per_sm)
    swap = False
    breg = False

    def __post_init__(self):
        if self.mt not in (8, 16, 32) or self.ns not in (1, 2, 4) or self.wk not in (1, 2, 4, 8):
            raise ValueError(f"SkinnyConfig needs mt in (8, 16, 32), ns in (1, 2, 4), wk in (1, 2, 4, 8); "
                             f"got mt={self.mt}, ns={self.ns}, wk={self.wk}")
        if self.stages < 2 or self.ctas_per_sm not in (1, 2):
            raise ValueError(f"SkinnyConfig needs stages >= 2 and ctas_per_sm in (1, 2); got {self.stages}, "
                             f"{self.ctas_per_sm}")
        if self.ctas_per_sm == 2 and self.mt > 16:
            raise ValueError("SkinnyConfig: mt = 32 launches with the register budget of one CTA per SM")
        self.check_smem(32, True)  # the heaviest format (4 scale and 4 zero-point rows a stage)

    def smem_limit(self) -> int:
        # 228 KiB an SM, 1 KiB reserved a CTA, and the kernel's static __shared__ (< 256 B: the finisher's
        # hand-off records and barriers) beside the dynamic bytes counted here.
        return (227 * 1024 if self.ctas_per_sm == 1 else 113 * 1024) - 256

    def check_smem(self, group_size: int, asym: bool) -> None:
        need = self.ring_bytes(group_size, asym)
        if need > self.smem_limit():
            raise ValueError(f"SkinnyConfig {self.label()} with group_size={group_size}{' asym' if asym else ''} "
                             f"needs {need} bytes of shared memory; {self.ctas_per_sm} CTA(s) per SM allow "
                             f"{self.smem_limit()}; use fewer stages")

    @property
    def bm(self) -> int:
        return self.mt

    @property
    def bn(self) -> int:
        return 64 * self.ns

    @property
    def threads(self) -> int:
        return (self.ns * self.wk + 2) * 32  # consumers, the producer warp, the finisher warp

    def label(self) -> str:
        return f"skinny-m{self.mt}n{self.bn}w{self.wk}s{self.stages}x{self.ctas_per_sm}{'-st' if self.staged else ''}"

    def smem_bytes(self, group_size: int, asym: bool) -> int:
        ring = self.ring_bytes(group_size, asym)
        # A staged build takes all the shared memory its CTAs per SM leave: past the ring it is
        # room for more slots in one batch of the final fixup.
        return max(ring, self.smem_limit()) if self.staged else ring

    def ring_bytes(self, group_size: int, asym: bool) -> int:
        x = 2 * self.mt * 128
        w = self.ns * 4096
        s_rows = 0 if group_size == -1 else (1 if group_size >= SKINNY_BK else SKINNY_BK // group_size)
        z_rows = (1 if group_size == -1 else s_rows) if asym else 0
        stage = -(-(x + w + (s_rows + z_rows) * self.bn * 2) // 1024) * 1024
        red = (self.wk - 1) * self.ns * (2 * self.mt) * 32 * 4
        return 1024 + self.stages * stage + 16 * self.stages + red  # + alignment slack, barriers


def column_tiles(cfg, n: int) -> int:
    """Column tiles of a launch over n columns. The wgmma kernel takes any n % 64 == 0: its last
    column tile may be ragged (fewer strips than the tile; wgmma.cu); the other kernels need whole tiles."""
    return -(-n // cfg.bn) if isinstance(cfg, HopperConfig) else n // cfg.bn


def fits_n(cfg, n: int) -> bool:
    """Whether the configuration's kernel can run n columns (the wgmma kernel: n % 64; others: n % its tile)."""
    return n % 64 == 0 if isinstance(cfg, HopperConfig) else n % cfg.bn == 0


def ragged_waste_ok(cfg, n: int) -> bool:
    """A plan the dispatcher weighs: a ragged last column tile that pads n by at most an eighth
    (n 2880 in 128-column tiles: 64 columns, 2%; n 192 in 256-column tiles: 33%, not weighed)."""
    return fits_n(cfg, n) and 8 * (column_tiles(cfg, n) * cfg.bn - n) <= n


# A table codebook builds every kernel with its decoder (kernels/w4a16/dequant.cuh: WeightDecoder).
CODEBOOK_DEFINES = {"nf4": "TF_W4A16_NF4", "mxfp4": "TF_W4A16_MXFP4"}


@functools.lru_cache(maxsize=None)
def kernel_spec(dtype: torch.dtype, cfg: GemmConfig | HopperConfig | SkinnyConfig, group_size: int,
                asym: bool, codebook: str = "int4") -> KernelSpec:
    if codebook != "int4":
        if codebook not in CODEBOOK_DEFINES or asym:
            raise ValueError(f"codebook {codebook!r} with asym={asym}: the kernels build int4 (with or without "
                             "zero points) or symmetric nf4 / mxfp4")
        spec = kernel_spec(dtype, cfg, group_size, False)
        return replace(spec, defines=spec.defines + ((CODEBOOK_DEFINES[codebook], "1"),))
    group = 0 if group_size == -1 else group_size
    if isinstance(cfg, SkinnyConfig):
        name = (f"w4a16_skinny<{DTYPES[dtype]}, {cfg.mt}, {cfg.ns}, {cfg.wk}, {cfg.stages}, {cfg.ctas_per_sm}, {group}, "
                f"{'true' if asym else 'false'}, {'true' if cfg.staged else 'false'}>")
        return KernelSpec(SKINNY_SOURCE, name, hot=True, arch_specific=True, min_sm=90)
    if isinstance(cfg, HopperConfig):
        name = (f"w4a16_wgmma<{DTYPES[dtype]}, {cfg.mt}, {cfg.nt}, {cfg.cons}, {cfg.stages}, {group}, "
                f"{'true' if asym else 'false'}, {'true' if cfg.streamk else 'false'}>")
        return KernelSpec(HOPPER_SOURCE, name, hot=True, arch_specific=True, min_sm=90)
    name = (f"w4a16_gemm<{DTYPES[dtype]}, {cfg.mb}, {cfg.wn}, {cfg.wk}, {cfg.stages}, {group}, "
            f"{'true' if asym else 'false'}, {'true' if cfg.swap else 'false'}, {'true' if cfg.breg else 'false'}>")
    return KernelSpec(SOURCE, name, hot=True)


CONFIGS = [GemmConfig(1, 1, 8), GemmConfig(1, 2, 4), GemmConfig(1, 4, 2),
           GemmConfig(2, 1, 8), GemmConfig(2, 2, 4), GemmConfig(2, 4, 2),
           GemmConfig(1, 1, 8, 8), GemmConfig(1, 2, 4, 8), GemmConfig(2, 1, 8, 6), GemmConfig(2, 2, 4, 6),
           GemmConfig(1, 4, 2, 6), GemmConfig(1, 4, 2, 8),
           GemmConfig(1, 1, 8, 4, True), GemmConfig(1, 2, 4, 4, True), GemmConfig(1, 4, 2, 4, True),
           GemmConfig(1, 1, 8, 4, True, True), GemmConfig(1, 2, 4, 4, True, True), GemmConfig(1, 4, 2, 3, True, True),
           GemmConfig(1, 2, 4, 4, False, True), GemmConfig(1, 2, 4, 6, True, True)]

# The wgmma kernel's design space (bench --variants sweeps it with every split).
HOPPER_CONFIGS = [HopperConfig(16, 4, 1, 8), HopperConfig(16, 4, 2, 8), HopperConfig(32, 4, 1, 6),
                  HopperConfig(32, 4, 2, 6), HopperConfig(64, 4, 1, 6), HopperConfig(64, 4, 2, 6),
                  HopperConfig(64, 2, 2, 6), HopperConfig(128, 2, 1, 4), HopperConfig(128, 2, 2, 6),
                  HopperConfig(128, 1, 2, 6), HopperConfig(256, 1, 2, 5),
                  HopperConfig(32, 2, 1, 8), HopperConfig(64, 2, 1, 8),
                  HopperConfig(16, 4, 1, 8, True), HopperConfig(32, 4, 1, 6, True), HopperConfig(64, 2, 2, 6, True),
                  HopperConfig(64, 4, 1, 4, True), HopperConfig(128, 1, 2, 6, True), HopperConfig(128, 2, 1, 3, True),
                  HopperConfig(128, 2, 2, 5, True)]

# The skinny (stream-K) kernel's design space.
SKINNY_CONFIGS = [SkinnyConfig(8, 4, 2, 4, 2), SkinnyConfig(8, 4, 1, 3, 2), SkinnyConfig(8, 2, 4, 8, 2), SkinnyConfig(8, 4, 2, 8, 1),
                  SkinnyConfig(16, 4, 1, 4, 2), SkinnyConfig(16, 2, 2, 6, 2), SkinnyConfig(16, 2, 2, 8, 1), SkinnyConfig(16, 4, 2, 8, 1),
                  SkinnyConfig(16, 2, 4, 8, 1), SkinnyConfig(32, 4, 2, 6, 1), SkinnyConfig(32, 2, 4, 8, 1)]


def canonical_label(label: str) -> str:
    """A configuration or plan label in today's spelling: the spellings of results recorded before
    the labels were made unambiguous, skinny "sk-m8n256w1s3x2" and wgmma stream-K
    "wg-m64n256c2s6-sk", become "skinny-m8n256w1s3x2" and "wg-m64n256c2s6-streamk"; any other label
    (a "/x<slices>" plan suffix included) is returned as it is. For reading committed result files."""
    name, sep, split = label.partition("/")
    if name.startswith("sk-"):
        name = "skinny-" + name[len("sk-"):]
    elif name.startswith("wg-") and name.endswith("-sk"):
        name = name[:-len("-sk")] + "-streamk"
    return name + sep + split


def parse_plan(label: str) -> tuple[GemmConfig | HopperConfig | SkinnyConfig, int | None]:
    """A plan label -> (configuration, k slices or None): the inverse of label() for any
    configuration of the three kernels (any stage count, not only the design spaces'), with an
    optional "/x<slices>" k split for the tile kernels and the skinny kernel (its cluster split: each tile's
    k in that many slices, one CTA each, summed in a cluster); the pre-rename spellings too (canonical_label)."""
    label = canonical_label(label)
    name, _, split = label.partition("/x")
    slices = int(split) if split else None
    cfg = None
    if g := re.fullmatch(r"skinny-m(\d+)n(\d+)w(\d+)s(\d+)x(\d)(-st)?", name):
        mt, bn, wk, stages, cps = (int(v) for v in g.groups()[:5])
        cfg = SkinnyConfig(mt, bn // 64, wk, stages, cps, g.group(6) is not None)
    elif g := re.fullmatch(r"wg-m(\d+)n(\d+)c(\d)s(\d+)(-streamk)?", name):
        mt, bn, cons, stages = (int(v) for v in g.groups()[:4])
        cfg = HopperConfig(mt, bn // (64 * cons), cons, stages, g.group(5) is not None)
    elif g := re.fullmatch(r"m(\d+)n(\d+)w(\d+)x(\d+)s(\d+)(-swap)?(-reg)?", name):
        bm, wn, wk, stages = (int(v) for v in (g.group(1), g.group(3), g.group(4), g.group(5)))
        cfg = GemmConfig(bm // 16, wn, wk, stages, g.group(6) is not None, g.group(7) is not None)
    if cfg is None or cfg.label() != name:
        raise ValueError(f"{label!r} is not a W4A16 plan label (configs.py's docstring has the forms)")
    if cfg.streamk and slices is not None and not isinstance(cfg, SkinnyConfig):
        raise ValueError(f"plan {label!r}: {cfg.label()} is stream-K, it takes no k split")
    return cfg, slices


def variant_specs() -> list[KernelSpec]:
    """The wgmma and skinny kernels' whole design space (tests and the sweep scripts use it)."""
    skinny = SKINNY_CONFIGS + [replace(c, staged=True) for c in SKINNY_CONFIGS]
    return ([kernel_spec(dt, cfg, g, asym) for cfg in HOPPER_CONFIGS + skinny for dt in DTYPES
             for g in (-1, 32, 64, 128) for asym in (False, True)]
            + [kernel_spec(dt, cfg, 64, False, "nf4") for cfg in CONFIGS + HOPPER_CONFIGS + skinny for dt in DTYPES])
