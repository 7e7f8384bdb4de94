"""W4A16 GEMM op: repack an Int4Weight into the kernel layout; validate -> pick a config -> launch.

Kernel layout (docs/w4a16.md has the fragment maps):
  packed  int32 [n/64, 8k], strip-major: for each 64-column strip S, its k16 rows r in order, each
          32 lanes x 4 words; word j of lane l = 4g + t holds, in nibble p,
          q[n = 64 S + 16 j + 8 h + g, k = 16 r + 8 a + 2 t + b] with p = 4 b + 2 h + a (the order in
          which lop3 peels nibble pairs into mma B fragments).
  scales  [groups, n] in the x dtype; for grouped weights permuted inside each 64-column strip so a
          lane's 8 scales (column 8 s + g, s = 0..7) are 16 contiguous bytes; per-channel scales stay
          in natural order (they multiply the accumulators in the epilogue).
  zeros   [groups, n] zero points as x-dtype values 0..15, permuted like grouped scales; None = 8.
  codebook  what a nibble means: "int4" ((q - zero) x scale), or "nf4" (NF4_TABLE[q] x scale, bitsandbytes'
          NormalFloat codes; no zero points). An nf4 word stores the nibbles above in the order
          p = 0 4 1 5 2 6 3 7 (NF4_NIBBLE_ORDER), which its table lookup in kernels/w4a16/dequant.cuh needs.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from ..quant.int4 import Int4Weight
from ..runtime import (KernelSpec, cluster_capacity, current_stream_handle, device_info, get_kernel, i32,
                       launch_prepared, prepare_launch)
from ..runtime.tma import tensor_map_rows

SOURCE = "w4a16/gemm.cu"
HOPPER_SOURCE = "w4a16/wgmma.cu"
SKINNY_SOURCE = "w4a16/skinny.cu"
THREADS = 256
BK = 128
HOPPER_BK = 64
SKINNY_BK = 128
DTYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
CODEBOOKS = ("int4", "nf4")
NF4_NIBBLE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble i of an nf4 word holds int4-layout nibble NF4_NIBBLE_ORDER[i]


@dataclass
class W4A16Weight:
    """A 4-bit weight in the kernel's layout, for y = x @ W^T with W [n, k]."""
    packed: torch.Tensor            # int32 [n/64, 8k] (strip-major, see the module docstring)
    scales: torch.Tensor            # fp16/bf16 [groups, n] (see module docstring for the order)
    zeros: torch.Tensor | None      # same dtype [groups, n] or None (symmetric)
    group_size: int                 # -1 (per channel), 32, 64, 128
    n: int
    k: int
    perm: torch.Tensor | None = None  # act-order: the kernel computes x[..., perm] @ W^T
    codebook: str = "int4"            # "int4" or "nf4" (module docstring)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def to(self, *args, **kwargs) -> "W4A16Weight":
        """Like Tensor.to: a device moves every tensor; a dtype (float16 / bfloat16, the activation
        dtype the weight serves) converts the scales and zero points only, never the packed words."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype not in DTYPES:
            raise TypeError(f"a W4A16 weight's dtype (its scales') must be float16 or bfloat16, got {dtype}")

        def move(t, values: bool):
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if values else None, non_blocking=non_blocking)
        return W4A16Weight(move(self.packed, False), move(self.scales, True), move(self.zeros, True), self.group_size,
                           self.n, self.k, move(self.perm, False), self.codebook)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [n, k] weight in the kernel's k order (act-order: permuted), each value
        code-value x scale computed in float64 and rounded once to dtype."""
        q = unpack(self)
        if self.codebook == "int4":
            return q.dequantize(dtype)
        from ..quant.nf4 import NF4_TABLE

        # a fresh tensor, not a copy of a cached one: under torch.compile's backward it is traced
        values = torch.tensor(NF4_TABLE, dtype=torch.float64, device=q.q.device)[q.q.long()]
        scales = q.scales.double().repeat_interleave(self.group_size if self.group_size != -1 else self.k, dim=1)
        return (values * scales).to(dtype)


def check_perm(perm: torch.Tensor, k: int) -> None:
    """An act-order permutation must be an integer tensor [k] holding each of 0..k-1 once (the op
    gathers x's columns with it; a bad index would read out of bounds on the GPU). Reads its values:
    call where a weight is built or loaded, not per call."""
    if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int32, torch.int64) or perm.shape != (k,):
        raise ValueError(f"perm must be an int32/int64 tensor of shape ({k},) (a permutation of in_features), got "
                         f"{getattr(perm, 'dtype', type(perm).__name__)} {tuple(getattr(perm, 'shape', ()))}")
    if perm.device.type != "meta" and not bool((torch.sort(perm).values == torch.arange(k, device=perm.device)).all()):
        raise ValueError(f"perm must hold each of 0..{k - 1} exactly once")


# ---- layout ---------------------------------------------------------------------------------------------------

def _strip_permute(t: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> within each 64-column strip, position 8 g + s holds column 8 s + g."""
    rows, n = t.shape
    return t.reshape(rows, n // 64, 8, 8).transpose(-1, -2).reshape(rows, n)


def _strip_unpermute(t: torch.Tensor) -> torch.Tensor:
    return _strip_permute(t)  # the permutation is a transpose of 8x8 blocks: its own inverse


def check_shape(n: int, k: int, group_size: int) -> None:
    if n % 64:
        raise ValueError(f"W4A16 needs n (out_features) to be a multiple of 64; got n={n}")
    if k % BK:
        raise ValueError(f"W4A16 needs k (in_features) to be a multiple of {BK}; got k={k}")
    if group_size not in (-1, 32, 64, 128):
        raise ValueError(f"W4A16 group_size must be -1, 32, 64 or 128; got {group_size}")


def pack(w: Int4Weight, perm: torch.Tensor | None = None, codebook: str = "int4") -> W4A16Weight:
    """Int4Weight (q [n, k], scales/zeros [n, groups]) -> the kernel layout. Pure torch, any device.
    codebook "nf4": q holds NF4 codes (tilefish.nf4.prepare builds these), symmetric only."""
    n, k = w.n, w.k
    check_shape(n, k, w.group_size)
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
    if codebook == "nf4" and w.zeros is not None:
        raise ValueError("an nf4 codebook weight has no zero points")
    if perm is not None:
        check_perm(perm, k)
    q = w.q.to(torch.int64)
    # n = 64 S + 16 j + 8 h + g ; k = 16 r + 8 a + 2 t + b
    v = q.view(n // 64, 4, 2, 8, k // 16, 2, 4, 2)          # S j h g r a t b
    v = v.permute(0, 4, 3, 6, 1, 7, 2, 5)                     # S r g t j b h a
    v = v.reshape(n // 64, k // 16, 32, 4, 8)
    if codebook == "nf4":
        v = v[..., list(NF4_NIBBLE_ORDER)]
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    packed = words.reshape(n // 64, 8 * k).contiguous()
    scales = w.scales.t().contiguous()                       # [groups, n]
    if w.group_size != -1:
        scales = _strip_permute(scales).contiguous()
    zeros = None
    if w.zeros is not None:
        zeros = _strip_permute(w.zeros.t().to(w.scales.dtype)).contiguous()
    return W4A16Weight(packed, scales, zeros, w.group_size, n, k, perm, codebook)


def unpack(p: W4A16Weight) -> Int4Weight:
    """The inverse of pack (for tests and export): q holds the codes (int4 values or NF4 indices)."""
    n, k = p.n, p.k
    words = p.packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int64)
    v = (words.view(n // 64, k // 16, 32, 4, 1) >> shifts) & 0xF        # S r (g t) j p
    if p.codebook == "nf4":
        v = v[..., [NF4_NIBBLE_ORDER.index(i) for i in range(8)]]
    v = v.view(n // 64, k // 16, 8, 4, 4, 2, 2, 2)                      # S r g t j b h a
    v = v.permute(0, 4, 6, 2, 1, 7, 3, 5)                               # S j h g r a t b
    q = v.reshape(n, k).to(torch.uint8)
    scales = p.scales if p.group_size == -1 else _strip_unpermute(p.scales)
    zeros = None if p.zeros is None else _strip_unpermute(p.zeros).to(torch.uint8).t().contiguous()
    return Int4Weight(q.contiguous(), scales.t().contiguous(), zeros, p.group_size)


# ---- kernel configurations ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmConfig:
    mb: int = 1       # 16-row m blocks per tile (BM = 16 mb)
    wn: int = 2       # warps along n (BN = 64 wn)
    wk: int = 4       # warps along k (block-level k reduction)
    stages: int = 4
    swap: bool = False  # m <= 8: weights as the MMA A operand, x^T as B (one MMA per weight word)
    breg: bool = False  # weights straight to a register ring (no shared-memory stage for them)

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


@functools.lru_cache(maxsize=None)
def kernel_spec(dtype: torch.dtype, cfg: GemmConfig | HopperConfig | SkinnyConfig, group_size: int,
                asym: bool, codebook: str = "int4") -> KernelSpec:
    if codebook != "int4":
        if codebook != "nf4" or asym:
            raise ValueError(f"codebook {codebook!r} with asym={asym}: the kernels build int4 (with or without "
                             "zero points) or symmetric nf4")
        spec = kernel_spec(dtype, cfg, group_size, False)
        return replace(spec, defines=spec.defines + (("TF_W4A16_NF4", "1"),))
    group = 0 if group_size == -1 else group_size
    if isinstance(cfg, SkinnyConfig):
        name = (f"w4a16_skinny<{DTYPES[dtype]}, {cfg.mt}, {cfg.ns}, {cfg.wk}, {cfg.stages}, {cfg.ctas_per_sm}, {group}, "
                f"{'true' if asym else 'false'}, {'true' if cfg.staged else 'false'}>")
        return KernelSpec(SKINNY_SOURCE, name, hot=True, arch_specific=True, min_sm=90)
    if isinstance(cfg, HopperConfig):
        name = (f"w4a16_wgmma<{DTYPES[dtype]}, {cfg.mt}, {cfg.nt}, {cfg.cons}, {cfg.stages}, {group}, "
                f"{'true' if asym else 'false'}, {'true' if cfg.sk else 'false'}>")
        return KernelSpec(HOPPER_SOURCE, name, hot=True, arch_specific=True, min_sm=90)
    name = (f"w4a16_gemm<{DTYPES[dtype]}, {cfg.mb}, {cfg.wn}, {cfg.wk}, {cfg.stages}, {group}, "
            f"{'true' if asym else 'false'}, {'true' if cfg.swap else 'false'}, {'true' if cfg.breg else 'false'}>")
    return KernelSpec(SOURCE, name, hot=True)


@dataclass(frozen=True)
class HopperConfig:
    """The sm_90a wgmma kernel (kernels/w4a16/wgmma.cu): weights are wgmma's A operand from
    registers, x its B operand (N = the m tile) through TMA."""
    mt: int = 64      # m tile (the wgmma n): 16, 32, 64, 128 or 256
    nt: int = 4       # packed words per lane per k16 = m64 accumulator tiles per warpgroup
    cons: int = 2     # consumer warpgroups (each covers nt 64-column strips)
    stages: int = 4
    sk: bool = False  # stream-K: one wave of CTAs sharing the (tile, k stage) units evenly
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
        return f"wg-m{self.mt}n{self.bn}c{self.cons}s{self.stages}{'-sk' if self.sk else ''}"

    def smem_bytes(self, group_size: int, asym: bool) -> int:
        x = self.mt * HOPPER_BK * 2
        w = self.nt * self.cons * 2048
        s_rows = 0 if group_size == -1 else (1 if group_size >= HOPPER_BK else HOPPER_BK // group_size)
        z_rows = (1 if group_size == -1 else s_rows) if asym else 0
        per_stage = x + w + (s_rows + z_rows) * self.bn * 2
        staging = self.mt * (self.bn * 2 + 16) if self.sk else 0  # stream-K: the epilogue's own area
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
        return f"sk-m{self.mt}n{self.bn}w{self.wk}s{self.stages}x{self.ctas_per_sm}{'-st' if self.staged else ''}"

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

# sm_90 dispatch. m <= 16: the skinny kernel where choose_skinny_config takes it (m <= 2 on the smallest
# weights: the mma.sync swap kernel). Otherwise from m = 9 (HOPPER_MIN_M) below MODEL_MAX_M, the (wgmma configuration, k split or stream-K) plan
# of least predicted time under HOPPER_TIME_MODEL; from MODEL_MAX_M up, the older per-range rule (_choose_hopper_config), which the
# model's sweep does not cover.
HOPPER_MIN_M = 9
MODEL_MAX_M = 2048
MODEL_LARGE_M = 256  # the time model's second regime (tensor-bound launches) from this m up
SMALL_WEIGHT_NK = 100_000_000
TINY_WEIGHT_NK = 32_000_000
MAX_HOPPER_SLICES = 8
STREAMK_MAX_M = 512
HOPPER_SLICES = (1, 2, 3, 4, 6, 8)
MAX_CLUSTER_SLICES = 8     # a portable cluster: k splits up to this run as one cluster (DSMEM fixup)
HOPPER_DSMEM_SPLIT = True  # False: every k split sums through the global workspace (A/B, sweeps)
HOPPER_SEPARATE_TAIL = "rule"  # _separate_tail: "rule"; "never" / "always" (any partial wave that fits) for A/Bs
ONE_CTA_PER_SM_SMEM = 116 * 1024  # dynamic smem above half an SM's 228 KB: one CTA an SM
# Clusters of each size resident at once with one CTA an SM, on the H200 (runtime.cluster_capacity;
# a cluster sits in one GPC). The default where no device is asked (tests, tables); launches pass
# their device's.
H200_CLUSTERS = ((2, 66), (3, 39), (4, 30), (5, 22), (6, 17), (7, 15), (8, 15))

# Time model of the wgmma kernel, fitted by scripts/fit_w4a16_time_model.py (non-negative least
# squares on relative error, samples over 1.5x their first-pass prediction left out) to
# scripts/sweep_w4a16_streamk.py on the H200 at settled clocks (bench.timing's WARM_MS): fp16 and
# bf16, group 128 ("grouped") and per-channel ("per_channel", a model of its own: the group scale's
# multiplies shift the best tile), the 8 benchmark shapes, m = 16..1024, k splits through the
# workspace and through DSMEM clusters (bench/results/h200/w4a16_streamk_sweep_settled_*.json,
# docs/w4a16.md; the stream-K rows re-swept after the end-of-range counter peek, aceb3fa:
# w4a16_streamk_sweep_peek_sk_*.json, merged by the fit script with the day's clock factor). Two
# regimes, each fitted on its own sweeps: "small_m" (m < MODEL_LARGE_M, bound by memory and
# latency) and "large_m" (bound by the tensor cores; one fit across both left its m = 256 / 1024
# picks 1.9 / 1.0% behind the best plan on average, fits of their own 0.3 / 0.1%):
#   time (us) = F + T x load + A x rounds + PHI x fixup + PHI_C x cluster fixup
# with the features of hopper_plan_features: load = 64-k stages of the busiest SM, rounds = the same
# with its co-resident CTAs counted once, fixup = log2(slices) (x waves at m < 256: FIXUP_PER_WAVE),
# through the workspace or through DSMEM when the split runs as clusters; for stream-K, fixup =
# log2(CTAs sharing a tile), its partial sums' chain (without it the fit sent k 14336 x n 4096,
# m = 16, 16 CTAs a tile, to stream-K at 1.2x the best plan's time). F is launch, ramp and
# epilogue. Coefficients (F, T, A, PHI, PHI_C). In-sample its pick is 0.7-1.1% behind the best
# measured plan on average, 6-14% at worst (the previous form, without rounds and with one fixup
# per launch, one fit for all m: 2.8% on average, 30% at worst).
HOPPER_TIME_MODEL = {
    "small_m": {
        "grouped": {
            "wg-m128n128c1s3-sk": (9.13, 0.436, 0.0, 2.922, 0.0),
            "wg-m128n128c1s4": (4.931, 0.38, 0.0, 3.646, 3.529),
            "wg-m128n128c2s6": (5.393, 0.421, 0.0, 2.127, 2.43),
            "wg-m128n128c2s6-sk": (8.482, 0.457, 0.0, 1.986, 0.0),
            "wg-m128n256c2s5-sk": (7.837, 0.79, 0.0, 3.706, 0.0),
            "wg-m128n256c2s6": (7.007, 0.642, 0.0, 3.468, 2.659),
            "wg-m16n256c1s8": (6.89, 0.261, 0.111, 0.996, 0.969),
            "wg-m16n256c1s8-sk": (5.932, 0.354, 0.0, 1.709, 0.0),
            "wg-m16n512c2s8": (6.645, 0.656, 0.0, 1.382, 1.476),
            "wg-m256n128c2s5": (3.964, 0.672, 0.0, 4.074, 6.633),
            "wg-m32n128c1s8": (6.329, 0.157, 0.108, 1.281, 1.325),
            "wg-m32n256c1s6": (7.057, 0.33, 0.065, 1.378, 1.163),
            "wg-m32n256c1s6-sk": (5.931, 0.395, 0.0, 2.256, 0.0),
            "wg-m32n512c2s6": (6.625, 0.688, 0.0, 2.169, 1.9),
            "wg-m64n128c1s8": (6.173, 0.224, 0.074, 1.951, 1.739),
            "wg-m64n256c1s4-sk": (1.63, 0.539, 0.0, 6.117, 0.0),
            "wg-m64n256c1s6": (7.251, 0.468, 0.004, 2.569, 1.745),
            "wg-m64n256c2s6": (6.231, 0.5, 0.0, 2.046, 1.965),
            "wg-m64n256c2s6-sk": (6.776, 0.559, 0.0, 2.181, 0.0),
            "wg-m64n512c2s6": (7.444, 0.839, 0.0, 3.602, 2.567),
        },
        "per_channel": {
            "wg-m128n128c1s3-sk": (8.912, 0.421, 0.0, 3.183, 0.0),
            "wg-m128n128c1s4": (5.455, 0.371, 0.0, 3.687, 3.545),
            "wg-m128n128c2s6": (5.782, 0.366, 0.0, 2.228, 2.842),
            "wg-m128n128c2s6-sk": (9.696, 0.423, 0.0, 1.14, 0.0),
            "wg-m128n256c2s5-sk": (11.36, 0.717, 0.0, 2.718, 0.0),
            "wg-m128n256c2s6": (8.163, 0.602, 0.0, 3.406, 2.379),
            "wg-m16n256c1s8": (7.455, 0.199, 0.123, 1.118, 0.827),
            "wg-m16n256c1s8-sk": (7.377, 0.293, 0.0, 1.483, 0.0),
            "wg-m16n512c2s8": (7.258, 0.571, 0.0, 1.372, 1.292),
            "wg-m256n128c2s5": (4.553, 0.67, 0.0, 4.047, 6.855),
            "wg-m32n128c1s8": (6.435, 0.13, 0.1, 1.385, 1.382),
            "wg-m32n256c1s6": (7.91, 0.277, 0.058, 1.416, 0.915),
            "wg-m32n256c1s6-sk": (6.869, 0.334, 0.0, 2.253, 0.0),
            "wg-m32n512c2s6": (7.395, 0.587, 0.0, 2.174, 1.696),
            "wg-m64n128c1s8": (6.174, 0.199, 0.05, 2.201, 2.15),
            "wg-m64n256c1s4-sk": (4.159, 0.466, 0.0, 5.858, 0.0),
            "wg-m64n256c1s6": (7.277, 0.403, 0.0, 3.21, 1.864),
            "wg-m64n256c2s6": (6.88, 0.429, 0.0, 2.007, 1.81),
            "wg-m64n256c2s6-sk": (6.735, 0.488, 0.0, 2.299, 0.0),
            "wg-m64n512c2s6": (8.422, 0.753, 0.0, 3.53, 2.238),
        },
    },
    "large_m": {
        "grouped": {
            "wg-m128n128c1s3-sk": (0.0, 0.48, 0.0, 4.962, 0.0),
            "wg-m128n128c1s4": (0.0, 0.4, 0.036, 7.056, 6.271),
            "wg-m128n128c2s6": (0.278, 0.476, 0.0, 7.967, 4.909),
            "wg-m128n128c2s6-sk": (0.944, 0.523, 0.0, 5.313, 0.0),
            "wg-m128n256c2s5-sk": (2.049, 0.897, 0.0, 5.461, 0.0),
            "wg-m128n256c2s6": (0.0, 0.782, 0.0, 9.852, 5.347),
            "wg-m256n128c2s5": (0.0, 0.754, 0.0, 10.038, 5.613),
            "wg-m64n128c1s8": (3.772, 0.229, 0.094, 4.79, 0.0),
            "wg-m64n256c1s4-sk": (8.592, 0.537, 0.0, 1.769, 0.0),
            "wg-m64n256c1s6": (2.399, 0.43, 0.098, 5.826, 5.156),
            "wg-m64n256c2s6": (1.935, 0.543, 0.0, 7.652, 5.331),
            "wg-m64n256c2s6-sk": (5.752, 0.583, 0.0, 1.65, 0.0),
            "wg-m64n512c2s6": (0.0, 0.929, 0.0, 9.512, 6.907),
        },
        "per_channel": {
            "wg-m128n128c1s3-sk": (1.021, 0.441, 0.0, 5.337, 0.0),
            "wg-m128n128c1s4": (0.0, 0.349, 0.089, 8.224, 6.429),
            "wg-m128n128c2s6": (0.202, 0.418, 0.0, 7.947, 5.127),
            "wg-m128n128c2s6-sk": (1.211, 0.465, 0.0, 5.108, 0.0),
            "wg-m128n256c2s5-sk": (4.038, 0.831, 0.0, 4.818, 0.0),
            "wg-m128n256c2s6": (0.0, 0.722, 0.0, 10.357, 6.607),
            "wg-m256n128c2s5": (0.0, 0.728, 0.0, 10.437, 6.55),
            "wg-m64n128c1s8": (4.549, 0.197, 0.069, 5.239, 0.0),
            "wg-m64n256c1s4-sk": (10.344, 0.469, 0.0, 1.528, 0.0),
            "wg-m64n256c1s6": (1.399, 0.368, 0.099, 7.689, 6.38),
            "wg-m64n256c2s6": (2.645, 0.467, 0.0, 7.477, 4.969),
            "wg-m64n256c2s6-sk": (5.5, 0.512, 0.0, 2.251, 0.0),
            "wg-m64n512c2s6": (0.0, 0.837, 0.0, 9.677, 7.496),
        },
    },
}


def _uses_hopper(m: int, n: int, k: int) -> bool:
    return m >= HOPPER_MIN_M


def _fit_n(cfg: HopperConfig, n: int) -> HopperConfig:
    """Narrow a configuration until its column tile divides n (one warpgroup, then fewer strips)."""
    while n % cfg.bn:
        if cfg.cons == 2 and cfg.mt <= 128:
            cfg = HopperConfig(cfg.mt, cfg.nt, 1, cfg.stages, cfg.sk)
        else:
            cfg = HopperConfig(cfg.mt, cfg.nt // 2, cfg.cons, cfg.stages, cfg.sk)
    return cfg


def hopper_plan_load(cfg: HopperConfig, slices: int | None, m: int, n: int, k: int, sm_count: int) -> float:
    """64-k stages of the busiest SM, its CTAs counted one after another (tile mode: ceil(CTAs / SMs)
    x stages a CTA; stream-K, slices None: ceil(units / CTAs) x ceil(CTAs / SMs) for its one-wave grid)."""
    return hopper_plan_features(cfg, slices, m, n, k, sm_count, False)[1]


def hopper_model_regime(m: int) -> str:
    return "large_m" if m >= MODEL_LARGE_M else "small_m"


# Whether each wave of split tiles pays its own k-split fixup in the model (fixup = log2(slices) x
# waves) or the launch pays one (log2(slices)). Per wave fitted the m < 256 sweeps better (in-sample
# picks at m = 16-32 0.2-0.4% behind the best plan on average instead of 1.9-2.5%; m = 64-128
# alike). At m >= 256 it did not: m = 256 picks 1.8% behind on average instead of 0.3%, up to 12%
# (k 14336 x n 4096, m = 256: a 4-way split of 128 x 256 tiles over the 2-way split of 128 x 128
# ones, 52.4 against 49.2 us in a same-process A/B), so there the launch pays one.
FIXUP_PER_WAVE = {"small_m": True, "large_m": False}


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
    tiles, stages = (n // cfg.bn) * -(-m // cfg.mt), k // HOPPER_BK
    resident = 1 if cluster else cfg.ctas_per_sm(128, False)
    if cfg.sk:
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
    """Whether _hopper_launches will run this k split as clusters (DSMEM fixup), judged from the
    device's cluster capacity ((size, clusters resident at once), ...) instead of the kernel."""
    if cfg.sk or slices is None or not 1 < slices <= MAX_CLUSTER_SLICES:
        return False
    return (n // cfg.bn) * -(-m // cfg.mt) <= dict(clusters).get(slices, 0)


def hopper_time_model(m: int, grouped: bool = True) -> dict[str, tuple[float, ...]]:
    """HOPPER_TIME_MODEL's coefficients for m's regime and the weight's format, by configuration."""
    return HOPPER_TIME_MODEL[hopper_model_regime(m)]["grouped" if grouped else "per_channel"]


def predicted_hopper_us(cfg: HopperConfig, slices: int | None, m: int, n: int, k: int, sm_count: int,
                        clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS, grouped: bool = True) -> float | None:
    """HOPPER_TIME_MODEL's time for cfg (k split `slices` ways; stream-K: its default grid) on a
    weight with group scales or per-channel ones, or None for a configuration the model does not cover."""
    coef = hopper_time_model(m, grouped).get(cfg.label())
    if coef is None or n % cfg.bn:
        return None
    features = hopper_plan_features(cfg, slices, m, n, k, sm_count, split_fits_clusters(cfg, slices, m, n, clusters))
    return sum(c * f for c, f in zip(coef, features))


def _hopper_candidates(m: int, n: int, k: int, sm_count: int):
    """(config, slices) plans the dispatcher weighs: m tiles up to twice m (64+ rows from m = 128,
    128+ from m = 512), k splits of >= 4 stages up to 4 waves, stream-K up to m = STREAMK_MAX_M while
    the tiles fill fewer than two waves (it never won beyond; its model overrates it at m = 1024)."""
    for cfg in HOPPER_CONFIGS:
        if cfg.label() not in hopper_time_model(m) or n % cfg.bn:
            continue
        if cfg.mt > max(32, 2 * m) or (m >= 128 and cfg.mt < 64) or (m >= 512 and cfg.mt < 128):
            continue
        tiles = (n // cfg.bn) * -(-m // cfg.mt)
        if cfg.sk:
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
    return cfg, None if cfg.sk else _rule_slices(cfg, (n // cfg.bn) * -(-m // cfg.mt), k, sm_count)


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
    same-process A/B (scripts/ab_w4a16_plans.py, m = 2048 / 4096) had ahead: geomean vs cuBLAS
    0.918 -> 0.982 bf16, 0.962 -> 0.982 fp16; per-channel weights were even (0.986 / 0.982)."""
    def tiles(cfg: HopperConfig) -> int:
        return (n // cfg.bn) * -(-m // cfg.mt) if n % cfg.bn == 0 else 0

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


def choose_hopper_slices(cfg: HopperConfig, m: int, n: int, k: int, sm_count: int,
                         clusters: tuple[tuple[int, int], ...] = H200_CLUSTERS, grouped: bool = True) -> int:
    """k slices for a tile-mode configuration (the dispatcher's plan when it is that config, else
    the split of least predicted time for it)."""
    plan_cfg, plan_sl = choose_hopper_plan(m, n, k, sm_count, clusters, grouped)
    if plan_cfg == cfg and plan_sl is not None:
        return plan_sl
    if m < MODEL_MAX_M and cfg.label() in hopper_time_model(m):
        options = [sl for c, sl in _hopper_candidates(m, n, k, sm_count) if c == cfg]
        if options:
            return min(options, key=lambda sl: predicted_hopper_us(cfg, sl, m, n, k, sm_count, clusters, grouped))
    return _rule_slices(cfg, (n // cfg.bn) * -(-m // cfg.mt), k, sm_count)


# The skinny kernel on sm_90 (H200 sweeps, scripts/sweep_w4a16_skinny.py, docs/w4a16.md). Since the
# finisher warp (bench/results/h200/w4a16_skinny_sweep_fp16_g128.json) it beats the mma.sync kernel
# at m <= 8 on every benchmark shape but the smallest weight at m <= 2 (k 4096 x n 4096: 11.0 against
# 11.7 us; the mma.sync kernel's ramp is shorter), by 4-30% (k 8192 x n 10240, whose mma.sync grid
# quantizes badly). The old time model (mma.sync wave efficiency) misjudged the small shapes.
# m = 9-16 (bench/results/h200/w4a16_skinny_sweep_m16_fp16_g128.json, since the group scales of
# two 8-row blocks also go on the fp32 partial sums): sk-m16n128w2s6x2 beats the wgmma plan by
# 2-12% at m = 12 on all 8 shapes and at m = 16 on 6 (k 28672 x n 8192: 44.3 against 50.4 us);
# at m = 13-16 with n <= 4096 the wgmma kernel stays 0-3% ahead.
# Per-channel weights have no group scale to move onto the partials, and there the wgmma
# kernel's stream-K plan keeps n 57344 at m = 13-16 (same-process sweep,
# w4a16_skinny_sweep_m16_{fp16,bf16}_g-1.json: 73.3 against 77.5 us fp16, 77.2 against 83.2 bf16;
# elsewhere the two are within 0-5% either way).
SKINNY_MAX_M = 16
SKINNY_MMA_MAX_NK = 4096 * 4096  # at most this many weights and m <= 2: the mma.sync kernel
SKINNY_M16_MIN_N = 4097          # m = 13-16: the skinny kernel from this n up ...
SKINNY_M16_PER_CHANNEL_MAX_N = 32768  # ... and, per-channel, up to this n
SKINNY_WIDE_N = 32768            # m = 9-16 above this n: 256-column tiles, one warp a strip
PER_CHANNEL_WGMMA_MIN_K = 14336  # per-channel weights, m = 9-16: the wgmma kernel from this k ...
PER_CHANNEL_WGMMA_MIN_N = 16384  # ... or this n (up to SKINNY_WIDE_N)
SKINNY_STAGED_MIN_TRIPS = 4      # the staged-fixup build where the register fixup takes this many L2 round trips


def skinny_fixup_trips(cfg: SkinnyConfig, m: int, n: int, k: int, sm_count: int) -> int:
    """L2 round trips of the consumers' end-of-launch fixup through registers (skinny.cu's fixup):
    one per float4 a thread and batch of 8 slots, for the tile split over the most CTAs."""
    ks, tiles, ctas = k // SKINNY_BK, n // cfg.bn, sm_count * cfg.ctas_per_sm
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
    scale formats, bench/results/h200/w4a16_skinny_staged_*.json; staged / register time: 6-8
    trips 0.94-0.99, 4 trips 0.95-1.01 on every configuration but the 128-column 16-row one
    (0.98-1.04, kept on registers), 1-3 trips 0.98-1.09)."""
    cfg = _choose_skinny_config(m, n, k, sm_count, group, dtype)
    if (cfg is not None and not (cfg.mt == 16 and cfg.ns == 2)
            and skinny_fixup_trips(cfg, m, n, k, sm_count) >= SKINNY_STAGED_MIN_TRIPS):
        return replace(cfg, staged=True)
    return cfg


def _choose_skinny_config(m: int, n: int, k: int, sm_count: int, group: int | None,
                          dtype: torch.dtype | None) -> SkinnyConfig | None:
    if m > SKINNY_MAX_M or n % 128 or (m <= 2 and n * k <= SKINNY_MMA_MAX_NK):
        return None
    grouped = group != -1
    if m > 8:
        if m > 12 and (n < SKINNY_M16_MIN_N or (not grouped and n > SKINNY_M16_PER_CHANNEL_MAX_N)):
            return None
        # Per-channel weights have no group scale for the skinny kernel to move onto its fp32
        # partials, and at settled clocks the time model's wgmma plan beat it on the long-k and
        # wide weights at m = 10-16 (same-process A/B, bench/results/h200/w4a16_skinny_ab_m10-16_*_g-1.json:
        # k 28672 x n 8192 3-8%, k 4096 x n 28672 -1..+8%, k 14336 x n 4096 0-4%), not on the
        # others (k 8192 x n 8192 2-5% behind). n 57344 keeps the wide skinny tile at m <= 12
        # (6% ahead in bf16).
        if not grouped and n <= SKINNY_WIDE_N and (k >= PER_CHANNEL_WGMMA_MIN_K or n >= PER_CHANNEL_WGMMA_MIN_N):
            return None
        # Same-process A/Bs (scripts/ab_w4a16_plans.py, bench/results/h200/w4a16_skinny_ab_m3-16_rotated_*.json):
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
        if codebook == "nf4" and 128 < m < MODEL_MAX_M and n % NF4_TALL_TILE.bn == 0:
            return NF4_TALL_TILE
        return choose_hopper_config(m, n, sm_count, k, clusters, group != -1)
    return choose_mma_config(m, n, k, sm_count)


@functools.lru_cache(maxsize=4096)
def choose_mma_config(m: int, n: int, k: int, sm_count: int) -> GemmConfig:
    """Heuristic fitted to the H200 sweeps (`tilefish bench w4a16 --variants`, docs/w4a16.md).

    m <= 8: swapped operands + weights in a register ring, 256-column tiles with 3 stages (128
    columns with 6 stages when n needs it); m <= 16: 16-row tiles, register ring, 128 columns;
    larger m: 32-row tiles through shared memory, 256 columns while they give half a tile per SM.
    """
    if m <= 8:
        if n % 256 == 0:
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


NF4_GROUPS = (32, 64, 128)  # an NF4 weight's scale groups (tilefish.nf4.prepare: min(blocksize, 128))


def dispatch_specs() -> list[KernelSpec]:
    out = []
    cfgs = {choose_mma_config(m, n, 4096, sms) for m in (1, 8, 9, 16, 17, 32, 33, 64, 128, 4096)
            for n in (64, 128, 256, 4096, 8192, 14336, 28672, 57344) for sms in (108, 132)}
    cfgs |= {choose_hopper_config(m, n, 132, k, grouped=g) for m in (9, 16, 17, 32, 33, 64, 65, 128, 256, 512, 1024, 4096)
             for n in (64, 128, 256, 4096, 6144, 8192, 10240, 14336, 28672, 57344) for k in (4096, 8192, 28672)
             for g in (True, False)}
    cfgs |= {c for m in (1, 4, 8, 9, 16) for n in (128, 256, 4096, 6144, 10240, 57344)
             for k in (4096, 8192, 28672) for g in (-1, 128) for dt in DTYPES
             if (c := choose_skinny_config(m, n, k, 132, g, dt)) is not None}
    for dt in DTYPES:
        for cfg in sorted(cfgs, key=lambda c: c.label()):
            for g in (-1, 32, 64, 128):
                for asym in (False, True):
                    out.append(kernel_spec(dt, cfg, g, asym))
            for g in NF4_GROUPS:
                out.append(kernel_spec(dt, cfg, g, False, "nf4"))
    return out


def variant_specs() -> list[KernelSpec]:
    """The wgmma and skinny kernels' whole design space (tests and the sweep scripts use it)."""
    skinny = SKINNY_CONFIGS + [replace(c, staged=True) for c in SKINNY_CONFIGS]
    return ([kernel_spec(dt, cfg, g, asym) for cfg in HOPPER_CONFIGS + skinny for dt in DTYPES
             for g in (-1, 32, 64, 128) for asym in (False, True)]
            + [kernel_spec(dt, cfg, 64, False, "nf4") for cfg in CONFIGS + HOPPER_CONFIGS + skinny for dt in DTYPES])


# ---- workspace: per (device, stream) so concurrent streams never share counters ------------------------------

_workspaces: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, floats: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device.index, current_stream_handle(device.index))
    ws = _workspaces.get(key)
    if ws is None or ws[0].numel() < floats or ws[1].numel() < tiles:
        old_f = 0 if ws is None else ws[0].numel()
        old_t = 0 if ws is None else ws[1].numel()
        ws = (torch.empty(max(floats, old_f, 1 << 20), dtype=torch.float32, device=device),
              torch.zeros(max(tiles, old_t, 4096), dtype=torch.int32, device=device))
        _workspaces[key] = ws
    return ws


# ---- the op ---------------------------------------------------------------------------------------------------

def _validate(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(w, W4A16Weight):
        raise TypeError(f"w must be a W4A16Weight (tilefish.w4a16.quantize / from_gptq / from_awq), got {type(w).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if w.scales.dtype != x.dtype:
        raise TypeError(f"x is {x.dtype} but the weight's scales are {w.scales.dtype}; convert one of them "
                        "(W4A16Weight.scales.to(...))")
    if x.dim() == 0:
        raise ValueError(f"x must be [..., k] with k = {w.k}; got a 0-D tensor")
    if x.shape[-1] != w.k:
        raise ValueError(f"x has k={x.shape[-1]} (last dim) but the weight has in_features k={w.k}")
    check_shape(w.n, w.k, w.group_size)
    if w.codebook not in CODEBOOKS or (w.codebook == "nf4" and (w.zeros is not None or w.group_size == -1)):
        raise ValueError(f"codebook {w.codebook!r}: int4, or nf4 with group scales and no zero points")
    if w.packed.dtype != torch.int32 or w.packed.shape != (w.n // 64, 8 * w.k):
        raise ValueError(f"packed must be int32 [n/64, 8k] = {(w.n // 64, 8 * w.k)}, got {w.packed.dtype} "
                         f"{tuple(w.packed.shape)}")
    groups = 1 if w.group_size == -1 else w.k // w.group_size
    if w.scales.shape != (groups, w.n):
        raise ValueError(f"scales must be [groups, n] = {(groups, w.n)}, got {tuple(w.scales.shape)}")
    if w.zeros is not None and (w.zeros.dtype != x.dtype or w.zeros.shape != (groups, w.n)):
        raise ValueError(f"zeros must be {x.dtype} [groups, n] = {(groups, w.n)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype != x.dtype or bias.shape != (w.n,):
            raise ValueError(f"bias must be a {x.dtype} tensor of shape ({w.n},)")
    if w.perm is not None and (not isinstance(w.perm, torch.Tensor) or w.perm.dtype not in (torch.int32, torch.int64)
                               or w.perm.shape != (w.k,)):
        raise ValueError(f"perm must be an int32/int64 tensor of shape ({w.k},), got "
                         f"{getattr(w.perm, 'dtype', type(w.perm).__name__)} {tuple(getattr(w.perm, 'shape', ()))}")
    dev = x.device
    if (w.packed.device != dev or w.scales.device != dev or (w.zeros is not None and w.zeros.device != dev)
            or (bias is not None and bias.device != dev) or (w.perm is not None and w.perm.device != dev)):
        tensors = {"x": x, "packed": w.packed, "scales": w.scales, "zeros": w.zeros, "bias": bias, "perm": w.perm}
        raise ValueError("all tensors must be on one device; got "
                         + ", ".join(f"{a} on {t.device}" for a, t in tensors.items() if t is not None))


def matmul_impl(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None = None,
                cfg: GemmConfig | HopperConfig | None = None, slices: int | None = None) -> torch.Tensor:
    """slices: k splits for the tile kernels, the CTA count for the stream-K ones (skinny, wgmma sk);
    None: the dispatcher's choice. cfg: a configuration to force (sweeps, tests)."""
    _validate(x, w, bias)
    if slices is not None and (isinstance(slices, bool) or not isinstance(slices, int) or slices < 1):
        raise ValueError(f"slices must be a positive int or None, got {slices!r}")
    flat = x.dim() == 2  # the common case: no reshape in or out (~2 us each)
    lead = x.shape[:-1]
    x2 = x if flat else x.reshape(-1, w.k)
    if w.perm is not None:
        x2 = x2.index_select(1, w.perm)
    if x.device.type == "cpu":
        from ..reference import dense_matmul, w4a16_matmul

        if w.codebook == "int4":
            return w4a16_matmul(x2, unpack(w), bias).reshape(*lead, w.n)
        return dense_matmul(x2, w.dequantize(torch.float64), bias).reshape(*lead, w.n)
    if x.device.type != "cuda":
        raise ValueError(f"W4A16 runs on CUDA or CPU tensors, not {x.device}")
    x2 = x2.contiguous()
    if bias is not None:
        bias = bias.contiguous()  # the kernel reads bias[col] by pointer: a strided view gets an explicit copy
    m = x2.shape[0]
    out = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, w.n)
    if x2.data_ptr() % 16:  # an offset view: the kernels read x in 16-byte (TMA: aligned) pieces
        x2 = x2.clone()
    LaunchPlan.build(w, bias, m, x.device, cfg, slices).launch(x2.data_ptr(), out.data_ptr())
    return out if flat else out.reshape(*lead, w.n)


class LaunchPlan:
    """The kernel launches of one (weight, bias, m, device, stream): the configuration, grid, shared
    memory, workspace and every argument but x and the output, decided once. The op builds one a
    call; W4A16Linear keeps one per input shape and stream, so an eager call only allocates the
    output and launches (the per-call checks and choices were most of its host time)."""

    __slots__ = ("launches", "keep", "m", "k", "dtype", "device_index")

    def __init__(self, launches: list[tuple], keep: tuple, m: int, k: int, dtype: torch.dtype, device_index: int):
        self.launches = launches  # (kernel, launch config, TMA box of x or None: x by pointer, args before out, after)
        self.keep = keep          # tensors the arguments point into (weight, bias, workspace): kept alive
        self.m, self.k, self.dtype, self.device_index = m, k, dtype, device_index

    @classmethod
    def build(cls, w: W4A16Weight, bias: torch.Tensor | None, m: int, device: torch.device,
              cfg=None, slices: int | None = None) -> "LaunchPlan":
        """w and bias already validated (_validate), on `device` and contiguous; m >= 1."""
        for name, t in (("packed", w.packed), ("scales", w.scales), ("zeros", w.zeros)):
            if t is not None and (t.data_ptr() % 16 or not t.is_contiguous()):
                raise ValueError(f"{name} must be contiguous and 16-byte aligned for the CUDA kernel")
        info = device_info(device.index)
        cfg = cfg or choose_config(m, w.n, w.k, info.sm_count, info.cc, w.group_size, _device_clusters(info), w.dtype,
                                   w.codebook)
        if isinstance(cfg, HopperConfig):
            launches, ws = _hopper_launches(cfg, m, w, bias, slices, info)
        elif isinstance(cfg, SkinnyConfig):
            launches, ws = _skinny_launches(cfg, m, w, bias, slices, info)
        else:
            launches, ws = _mma_launches(cfg, m, w, bias, slices, info)
        return cls(launches, (w.packed, w.scales, w.zeros, bias) + ws, m, w.k, w.dtype, info.index)

    def launch(self, x_ptr: int, out_ptr: int) -> None:
        """x_ptr: x as [m, k] contiguous, 16-byte aligned, on the plan's device; out_ptr: [m, n] contiguous."""
        for kern, config, box, head, tail in self.launches:
            xa = x_ptr if box is None else tensor_map_rows(x_ptr, self.m, self.k, self.dtype, self.device_index, *box)
            launch_prepared(kern, config, xa, *head, out_ptr, *tail)


def _weight_args(w: W4A16Weight, bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    return (w.packed.data_ptr(), w.scales.data_ptr(), w.zeros.data_ptr() if w.zeros is not None else 0,
            bias.data_ptr() if bias is not None else 0)


def _mma_launches(cfg: GemmConfig, m: int, w: W4A16Weight, bias, slices: int | None, info):
    """The mma.sync kernel (any GPU): grid (m tiles, n tiles, k slices)."""
    if w.n % cfg.bn:
        raise ValueError(f"config {cfg.label()} needs n % {cfg.bn} == 0 (n={w.n})")
    if cfg.swap and m > 8:
        raise ValueError(f"config {cfg.label()} (swapped operands) handles m <= 8, got m={m}")
    asym = w.zeros is not None
    n_tiles, m_tiles, k_tiles = w.n // cfg.bn, -(-m // cfg.bm), w.k // BK
    tiles = n_tiles * m_tiles
    slices = slices or choose_slices(tiles, k_tiles, info.sm_count)
    slices = max(1, min(slices, k_tiles))
    device = w.packed.device
    ws, counters = _workspace(device, tiles * slices * cfg.bm * cfg.bn if slices > 1 else 0, tiles)
    kern = _kernel(w.dtype, cfg, w.group_size, asym, device.index, w.codebook)
    config = prepare_launch(kern, (m_tiles, n_tiles, slices), THREADS, _smem_bytes(cfg, w.group_size, asym))
    tail = (ws.data_ptr(), counters.data_ptr(), i32(m), i32(w.n), i32(w.k), i32(slices))
    return [(kern, config, None, _weight_args(w, bias), tail)], (ws, counters)


def _device_clusters(info) -> tuple[tuple[int, int], ...]:
    """The cluster capacity the sm_90 dispatcher plans with (one CTA an SM); () elsewhere, and ()
    while HOPPER_DSMEM_SPLIT is off. The flag acts here, on an argument of the cached planners
    (choose_config, choose_hopper_plan), so switching it never leaves a stale cached plan."""
    if not HOPPER_DSMEM_SPLIT:
        return ()
    caps = _clusters_by_device.get(info.index)
    if caps is None:
        caps = _clusters_by_device[info.index] = (cluster_capacity(info.index, 384, ONE_CTA_PER_SM_SMEM)
                                                  if info.cc == 90 else ())
    return caps


# Per-call lookups of the launch path, cached (each saved ~1 us of host time a call).
_clusters_by_device: dict[int, tuple[tuple[int, int], ...]] = {}
_kernels: dict[tuple, object] = {}


def _kernel(dtype: torch.dtype, cfg, group_size: int, asym: bool, device_index: int | None, codebook: str = "int4"):
    key = (dtype, cfg, group_size, asym, device_index, codebook)
    kern = _kernels.get(key)
    if kern is None:
        kern = _kernels[key] = get_kernel(kernel_spec(dtype, cfg, group_size, asym, codebook), device_index)
    return kern


@functools.lru_cache(maxsize=None)
def _smem_bytes(cfg, group_size: int, asym: bool) -> int:
    return cfg.smem_bytes(group_size, asym)


def _hopper_launches(cfg: HopperConfig, m: int, w: W4A16Weight, bias, slices: int | None, info):
    """The sm_90a wgmma kernel: a TMA map for x (mt x 64 boxes, 128-byte swizzle); grid (m tiles,
    n tiles, k slices), or for a stream-K config (cfg.sk) a 1-D grid of `slices` CTAs (default one
    wave: SMs x cfg.ctas_per_sm, at most one (tile, k stage) unit each). A 2-8 way k split whose
    clusters all fit at once runs as clusters of its slices: grid (m tiles x slices, n tiles). A
    partial last wave that _separate_tail picks runs as a second, 1-D launch from tile_base."""
    if info.cc != 90:
        raise ValueError(f"config {cfg.label()} uses wgmma / TMA (sm_90a) and runs on Hopper (sm_90) only; "
                         f"this GPU is sm_{info.cc}")
    if w.n % cfg.bn:
        raise ValueError(f"config {cfg.label()} needs n % {cfg.bn} == 0 (n={w.n})")
    asym = w.zeros is not None
    n_tiles, m_tiles, k_stages = w.n // cfg.bn, -(-m // cfg.mt), w.k // HOPPER_BK
    tiles = n_tiles * m_tiles
    units = tiles * k_stages
    if units >= 2**31:
        raise ValueError(f"m={m}, n={w.n}, k={w.k}: {units} (tile, k stage) units exceed the wgmma kernel's "
                         "32-bit unit index; split m into several calls")
    if cfg.sk:
        slices = max(1, min(slices or info.sm_count * cfg.ctas_per_sm(w.group_size, asym), units, 2**31 - 1))
        grid, ws_floats = slices, slices * 2 * cfg.mt * cfg.bn
    else:
        slices = slices or choose_hopper_slices(cfg, m, w.n, w.k, info.sm_count, _device_clusters(info),
                                                w.group_size != -1)
        slices = max(1, min(slices, k_stages, 65535))  # gridDim.z
        if n_tiles > 65535:
            raise ValueError(f"n={w.n} gives {n_tiles} column tiles of {cfg.bn}, more than gridDim.y allows (65535)")
        grid, ws_floats = (m_tiles, n_tiles, slices), tiles * slices * cfg.mt * cfg.bn if slices > 1 else 0
    # A k split of a tile runs as one thread-block cluster of its slices, which add their partials
    # through distributed shared memory, when all the clusters fit at once (a cluster must sit
    # inside one GPC; else the rest ran as a second wave) and with one CTA an SM (a cluster whose
    # CTAs doubled up on SMs left others idle: 0.6x in an A/B on the H200). Otherwise, for stream-K
    # and for splits wider than a portable cluster, the slices sum through the global workspace.
    device = w.packed.device
    kern = _kernel(w.dtype, cfg, w.group_size, asym, device.index, w.codebook)
    smem = _smem_bytes(cfg, w.group_size, asym)
    cluster = 1
    if _split_runs_as_clusters(cfg, kern, tiles, slices, smem):
        grid, ws_floats, cluster, smem = (m_tiles * slices, n_tiles, 1), 0, slices, max(smem, ONE_CTA_PER_SM_SMEM)
    ws, counters = _workspace(device, ws_floats, tiles)
    box = (cfg.mt, HOPPER_BK)
    tail = (ws.data_ptr(), counters.data_ptr(), i32(m), i32(w.n), i32(w.k), i32(slices), i32(int(cluster > 1)))
    head = _weight_args(w, bias)
    split = _separate_tail(cfg, tiles, slices, cluster, w.group_size, asym, info.sm_count)
    if split:
        return [(kern, prepare_launch(kern, tiles - split, cfg.threads, smem), box, head, tail + (i32(0),)),
                (kern, prepare_launch(kern, split, cfg.threads, smem), box, head, tail + (i32(tiles - split),))], \
            (ws, counters)
    return [(kern, prepare_launch(kern, grid, cfg.threads, smem, cluster), box, head, tail + (i32(0),))], (ws, counters)


def _separate_tail(cfg: HopperConfig, tiles: int, slices: int, cluster: int, group_size: int, asym: bool,
                   sm_count: int) -> int:
    """How many tiles of a whole-tile launch (no k split) to run as a launch of their own (0: one
    launch): the partial last wave of a per-channel weight's plan, when the kernel fits two CTAs an
    SM and that wave fits one CTA an SM but fills more than half the SMs.

    Why: in one launch the hardware hands each pair of slots freed together to two tail CTAs. The
    per-channel kernel's CTAs finish a wave nearly together, so a tail of 120 CTAs ran two an SM on
    60 SMs at ~1.6x the time of a CTA alone while the other SMs idled (per-CTA timeline, k 4096 x
    n 6144, m = 1024: 90 us). A launch of its own starts on an idle GPU, which places CTAs one an SM
    first: 76 us. With group scales the first wave's CTAs finish apart and the tail spreads by itself
    (75 us in one launch); there the second launch only adds its start and the wait for the first
    wave's last CTA (~5 us), as it did for a per-channel tail of 48 CTAs. Same-process A/B on the
    H200, scripts/ab_w4a16_tail.py; docs/w4a16.md."""
    if HOPPER_SEPARATE_TAIL not in ("rule", "never", "always"):
        raise ValueError(f"ops.w4a16.HOPPER_SEPARATE_TAIL must be 'rule', 'never' or 'always', got {HOPPER_SEPARATE_TAIL!r}")
    if HOPPER_SEPARATE_TAIL == "never" or cfg.sk or slices != 1 or cluster != 1 or cfg.ctas_per_sm(group_size, asym) != 2:
        return 0
    slots = 2 * sm_count
    tail = tiles % slots
    if tiles <= slots or tail > sm_count:
        return 0
    return tail if HOPPER_SEPARATE_TAIL == "always" or (group_size == -1 and tail > sm_count // 2) else 0


def _split_runs_as_clusters(cfg: HopperConfig, kern, tiles: int, slices: int, smem: int) -> bool:
    """Whether a k split of `tiles` tiles into `slices` runs as clusters (the DSMEM fixup): a tile
    mode split of 2..MAX_CLUSTER_SLICES whose clusters, one CTA an SM, all fit at once."""
    if cfg.sk or not 1 < slices <= MAX_CLUSTER_SLICES or not HOPPER_DSMEM_SPLIT:
        return False
    return tiles <= kern.max_active_clusters(slices, cfg.threads, max(smem, ONE_CTA_PER_SM_SMEM))


def hopper_split_uses_clusters(cfg: HopperConfig, m: int, n: int, k: int, slices: int, group_size: int,
                               asym: bool, dtype: torch.dtype, device: torch.device) -> bool:
    """What _hopper_launches decides for this plan (sweeps record it next to the time)."""
    kern = get_kernel(kernel_spec(dtype, cfg, group_size, asym), device)
    tiles = (n // cfg.bn) * -(-m // cfg.mt)
    return _split_runs_as_clusters(cfg, kern, tiles, slices, cfg.smem_bytes(group_size, asym))


def _skinny_launches(cfg: SkinnyConfig, m: int, w: W4A16Weight, bias, ctas: int | None, info):
    """The sm_90a stream-K kernel: a TMA map for x (mt x 64 boxes, 128-byte swizzle), a 1-D grid of
    `ctas` CTAs (default SMs x cfg.ctas_per_sm, at most one unit of (tile, 128-k stage) each)."""
    if info.cc != 90:
        raise ValueError(f"config {cfg.label()} uses TMA / bulk copies (sm_90a) and runs on Hopper (sm_90) only; "
                         f"this GPU is sm_{info.cc}")
    if m > cfg.mt:
        raise ValueError(f"config {cfg.label()} handles m <= {cfg.mt} rows, got m={m}")
    if w.n % cfg.bn:
        raise ValueError(f"config {cfg.label()} needs n % {cfg.bn} == 0 (n={w.n})")
    asym = w.zeros is not None
    tiles = w.n // cfg.bn
    units = tiles * (w.k // SKINNY_BK)
    ctas = max(1, min(ctas or info.sm_count * cfg.ctas_per_sm, units, 2**31 - 1))
    device = w.packed.device
    ws, counters = _workspace(device, ctas * 2 * cfg.mt * cfg.bn, tiles)
    kern = _kernel(w.dtype, cfg, w.group_size, asym, device.index, w.codebook)
    config = prepare_launch(kern, ctas, cfg.threads, _smem_bytes(cfg, w.group_size, asym))
    tail = (ws.data_ptr(), counters.data_ptr(), i32(m), i32(w.n), i32(w.k))
    return [(kern, config, (cfg.mt, 64), _weight_args(w, bias), tail)], (ws, counters)
