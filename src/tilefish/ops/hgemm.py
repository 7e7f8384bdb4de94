"""HGEMM ladder: C = A @ B in fp16 / bf16 on tensor cores (mma.sync m16n8k16, fp32 accumulation).

validate -> pick a ladder step and its tile configuration -> get the kernel -> launch.

Steps (kernels/hgemm/<name>.cu, docs/hgemm.md explains each):
  01_mma_naive       one warp per 16 x 8 tile, one mma per k step, operands through smem
  02_block_ldmatrix  block tiling, several warps, ldmatrix.x4 (A) / x2(.trans) (B)
  03_padded          + padded smem rows (no ldmatrix bank conflicts)
  04_swizzled        + XOR swizzle instead of padding (conflict-free, dense)
  05_multistage      + cp.async STAGES-deep pipeline, register double-buffered fragments
  06_rasterized      + grouped tile order (GROUP_M) for L2 reuse          <- kernel="auto" before sm_90
  07_wgmma_tma       Hopper: TMA + mbarrier ring, wgmma from smem, producer / consumer warpgroups
                     (setmaxnreg), persistent grid                       <- kernel="auto" on sm_90

Preconditions
-------------
* a [M, K]; b [K, N] (b_transposed=False) or b [N, K] (b_transposed=True, the nn.Linear weight
  layout, used as is -- no transposed copy).  fp16 or bf16, both the same dtype; 2-D; on one
  CUDA device (or both on the CPU).  The output is a new [M, N] tensor of the input dtype.
* Any M and N: edge tiles are zero-filled on load and predicated on store.
* K % 8 == 0, and for b [K, N] also N % 8 == 0: rows are copied in 16-byte chunks (8 elements),
  so every row must start on a 16-byte boundary.  Violations raise ValueError naming the multiple.
* a and b must be 16-byte aligned (data_ptr() % 16 == 0; torch allocations are).  Non-contiguous
  operands are copied with .contiguous() first -- except a transposed view of a contiguous
  matrix for b (e.g. w.t() of an [N, K] weight), which is used in place with the other B layout.
* CPU tensors use the reference: fp32 matmul cast to the dtype (`hgemm_reference`).

kernel="auto": step 07 on sm_90 (wgmma needs the sm_90a target, which runs on Hopper only), step 06
elsewhere, with TUNED[step], or TUNED_SMALL[step] when TUNED's tile gives fewer blocks than the GPU
has SMs (small M x N; on sm_90 a narrower or shorter tile still where even those are few: see
`_tuned_for`).  Asking for step 07 by name on another GPU raises ValueError.

One decision, two callers: `decide` (a cached pure function of M, N, the kernel asked for and the GPU's
SMs, cc and shared memory per block) picks the configuration and `launch_grid` its grid; the launcher
asks both with the present GPU's numbers, `tilefish.hgemm.plan` (ops/gemm_plan.py) with any GPU's, so a
printed plan is what runs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..runtime import KernelSpec, device_info, get_kernel, i32, launch, tensor_map_2d
from ..runtime.device import SMEM_PER_BLOCK_BY_CC, GpuSpec

_INT_MAX = 2**31 - 1
_STATIC_SMEM_LIMIT = 48 * 1024
_DYN_SMEM_LIMIT = 227 * 1024  # Hopper opt-in per block; A100 allows 163 KB (the launcher re-checks)
_DTYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
K_MULTIPLE = 8   # K % 8 == 0 (and N % 8 == 0 for b [K, N]): 16-byte rows


@dataclass(frozen=True)
class Step:
    """One ladder step: kernels/hgemm/<name>.cu holding `func<T, B_NK, params...>`."""

    name: str
    func: str
    params: tuple[str, ...]
    dynamic_smem: bool = False
    min_sm: int = 80            # 90: Hopper only (built for sm_90a, arch_specific)

    @property
    def hopper(self) -> bool:
        return self.min_sm >= 90

    @property
    def source(self) -> str:
        return f"hgemm/{self.name}.cu"

    @property
    def index(self) -> int:
        return int(self.name[:2])


_BLK = ("BM", "BN", "BK", "WM", "WN")
STEPS: dict[str, Step] = {s.name: s for s in (
    Step("01_mma_naive", "hgemm_mma_naive", ()),
    Step("02_block_ldmatrix", "hgemm_block_ldmatrix", _BLK),
    Step("03_padded", "hgemm_padded", _BLK),
    Step("04_swizzled", "hgemm_swizzled", _BLK),
    Step("05_multistage", "hgemm_multistage", _BLK + ("STAGES",), dynamic_smem=True),
    Step("06_rasterized", "hgemm_rasterized", _BLK + ("STAGES", "GROUP_M"), dynamic_smem=True),
    Step("07_wgmma_tma", "hgemm_wgmma", ("BM", "BN", "STAGES", "GROUP_M", "CLUSTER", "PINGPONG", "TMA_STORE"),
         dynamic_smem=True,
         min_sm=90),
)}
KERNELS: tuple[str, ...] = tuple(STEPS)
AUTO_STEP = "06_rasterized"        # before Hopper
AUTO_STEP_SM90 = "07_wgmma_tma"    # on sm_90
WGMMA_BK = 64                      # step 07: one 128-byte swizzle row of k per stage
WGMMA_STAGING_BYTES = 2 * 64 * 64 * 2  # step 07, TMA_STORE = 1: two 64 x 64 boxes of C per consumer
HOT_FROM = 4  # steps >= 04 are hot: the compile test rejects spills


@dataclass(frozen=True)
class HgemmConfig:
    """A ladder step plus its tile parameters, e.g. HgemmConfig.of("05_multistage", BM=128, ...)."""

    step: str
    values: tuple[int, ...]

    @classmethod
    def of(cls, step: str, **params: int) -> "HgemmConfig":
        st = STEPS[step]
        if set(params) != set(st.params):
            raise ValueError(f"{step} takes parameters {st.params}, got {tuple(params)}")
        return cls(step, tuple(int(params[p]) for p in st.params))

    @property
    def info(self) -> Step:
        return STEPS[self.step]

    @functools.cached_property  # read several times per launch: build the dict once per config
    def params(self) -> dict[str, int]:
        return dict(zip(self.info.params, self.values))

    def __getattr__(self, name: str) -> int:
        if name.isupper():
            p = self.params
            if name in p:
                return p[name]
        raise AttributeError(name)

    def label(self) -> str:
        return f"{self.step}<{','.join(f'{k}={v}' for k, v in self.params.items())}>"

    def short(self) -> str:
        p = self.params
        if not p:
            return "16x8 per warp"
        if self.info.hopper:
            return (f"{p['BM']}x{p['BN']}x{WGMMA_BK} wg{2 if p['PINGPONG'] else p['BM'] // 64}+1 s{p['STAGES']} "
                    f"g{p['GROUP_M']}" + (f" c{p['CLUSTER']}" if p["CLUSTER"] > 1 else "")
                    + (" pingpong" if p["PINGPONG"] else "") + (" tmastore" if p["TMA_STORE"] else ""))
        s = f"{p['BM']}x{p['BN']}x{p['BK']} w{p['WM']}x{p['WN']}"
        if "STAGES" in p:
            s += f" s{p['STAGES']}"
        if "GROUP_M" in p:
            s += f" g{p['GROUP_M']}"
        return s

    @property
    def tile(self) -> tuple[int, int]:
        p = self.params
        return (16, 8) if not p else (p["BM"], p["BN"])

    @property
    def consumers(self) -> int:
        """Step 07's consumer warpgroups: two whole-tile consumers (ping-pong) or one per 64 rows."""
        return 2 if self.params["PINGPONG"] else self.params["BM"] // 64

    @functools.cached_property  # threads, smem_bytes: read on every launch, fixed per config
    def threads(self) -> int:
        p = self.params
        if self.info.hopper:  # a producer warpgroup + a consumer per 64 rows (ping-pong: two whole-tile consumers)
            return (self.consumers + 1) * 128
        return 32 if not p else (p["BM"] // p["WM"]) * (p["BN"] // p["WN"]) * 32

    @functools.cached_property
    def smem_bytes(self) -> int:
        """Shared memory per block (dynamic for steps 05-06, static otherwise), either B layout."""
        p = self.params
        if not p:
            return (16 * 16 + 16 * 8) * 2
        if self.info.hopper:  # the ring, C staging (TMA_STORE: two 64 x 64 boxes a consumer), its
            # 2 x STAGES + 2 mbarriers, 1 KB slack for 1024-byte alignment
            staging = self.consumers * WGMMA_STAGING_BYTES if p["TMA_STORE"] else 0
            return (p["BM"] + p["BN"]) * WGMMA_BK * 2 * p["STAGES"] + staging + 16 * p["STAGES"] + 16 + 1024
        bm, bn, bk = p["BM"], p["BN"], p["BK"]
        if self.step == "03_padded":  # max over the two B layouts
            return (bm * (bk + 8) + max(bk * (bn + 8), bn * (bk + 8))) * 2
        return (bm + bn) * bk * 2 * p.get("STAGES", 1)

    def smem_for(self, b_nk: bool) -> int:
        """Shared memory per block with B as [N, K] (b_nk) or [K, N]: step 03 pads each layout's rows
        differently (smem_bytes is the larger); every other step takes smem_bytes in both."""
        if self.step != "03_padded":
            return self.smem_bytes
        bm, bn, bk = self.BM, self.BN, self.BK
        return (bm * (bk + 8) + (bn * (bk + 8) if b_nk else bk * (bn + 8))) * 2

    @property
    def dynamic_smem(self) -> int:
        return self.smem_bytes if self.info.dynamic_smem else 0

    def grid_tiles(self, m: int, n: int) -> tuple[int, int]:
        bm, bn = self.tile
        return -(-m // bm), -(-n // bn)

    def grid(self, m: int, n: int, sm_count: int = 132, max_clusters: int | None = None):
        """Launch grid: 1-D grouped order for step 06, persistent for step 07 (at most one block
        per SM, and at most max_clusters resident clusters), (tiles_n, tiles_m) for the others."""
        tm, tn = self.grid_tiles(m, n)
        if self.info.hopper:  # whole clusters: CLUSTER vertically adjacent tiles per cluster
            cl = self.params["CLUSTER"]
            fit = sm_count // cl if max_clusters is None else min(max_clusters, sm_count // cl)
            return min(-(-tm // cl) * tn, max(fit, 1)) * cl
        return tm * tn if self.step == "06_rasterized" else (tn, tm)

    def blocks(self, m: int, n: int) -> int:
        tm, tn = self.grid_tiles(m, n)
        return tm * tn

    def spec(self, dtype: torch.dtype = torch.float16, b_transposed: bool = False) -> KernelSpec:
        return _spec(self, _DTYPES[dtype], bool(b_transposed))

    def problem(self) -> str | None:
        """Why this configuration cannot be instantiated (mirrors the kernels' static_asserts), or None."""
        p = self.params
        if len(self.values) != len(self.info.params):
            return "bad parameter list"
        if not p:
            return None
        if min(v for k, v in p.items() if k not in ("PINGPONG", "TMA_STORE")) <= 0:
            return "parameters must be positive"
        if self.info.hopper:
            if p["BM"] not in (64, 128):
                return "BM must be 64 or 128 (one 64-row consumer warpgroup each)"
            if p["BN"] not in (64, 128, 256):
                return "BN must be 64, 128 or 256 (wgmma n; TMA box <= 256)"
            if p["STAGES"] < 2:
                return "STAGES >= 2"
            if p["CLUSTER"] not in (1, 2):
                return "CLUSTER must be 1 or 2"
            if (p["BN"] // 64) % p["CLUSTER"]:
                return "BN / 64 must split over the cluster (multicast halves of B)"
            if p["PINGPONG"] not in (0, 1):
                return "PINGPONG must be 0 (cooperative) or 1 (ping-pong)"
            if p["TMA_STORE"] not in (0, 1):
                return "TMA_STORE must be 0 (direct stores) or 1 (smem staging + TMA store)"
            if p["PINGPONG"] and p["BM"] * p["BN"] > 128 * 128:
                return "ping-pong: one consumer holds the whole BM x BN tile, so BM x BN <= 128 x 128"
            if self.smem_bytes > _DYN_SMEM_LIMIT:
                return "dynamic smem > 227 KB"
            return None
        bm, bn, bk, wm, wn = (p[k] for k in _BLK)
        t = self.threads
        if bm % wm or bn % wn:
            return "warp tile must divide the block tile"
        if not 32 <= t <= 1024:
            return f"{t} threads per block"
        if wm % 16 or bk % 16 or wn % (16 if self.info.dynamic_smem else 8):
            return "warp tile must be a multiple of the mma tile (16 x 8, n16 for steps 05-06)"
        for v in (bn // 8, bk // 8):
            if v & (v - 1):
                return "BN / 8 and BK / 8 must be powers of two (swizzle)"
        for rows, cols in ((bm, bk), (bk, bn), (bn, bk)):
            if (rows * cols // 8) % t:
                return "tiles must split evenly into 16-byte chunks over the threads"
        if self.info.dynamic_smem:
            if p["STAGES"] < 2:
                return "STAGES >= 2"
            if bk % 32:
                return "BK must be a multiple of 32 (k16 step 0 of every stage uses fragment buffer 0)"
            if self.smem_bytes > _DYN_SMEM_LIMIT:
                return "dynamic smem > 227 KB"
            if p.get("GROUP_M", 1) < 1:
                return "GROUP_M >= 1"
        elif self.smem_bytes > _STATIC_SMEM_LIMIT:
            return "static smem > 48 KB"
        return None


@functools.lru_cache(maxsize=None)
def _spec(cfg: HgemmConfig, tname: str, b_nk: bool) -> KernelSpec:
    args = ", ".join([tname, "true" if b_nk else "false"] + [str(v) for v in cfg.values])
    return KernelSpec(cfg.info.source, f"{cfg.info.func}<{args}>", hot=cfg.info.index >= HOT_FROM,
                      arch_specific=cfg.info.hopper, min_sm=cfg.info.min_sm)


def _cfg(step: str, *values: int) -> HgemmConfig:
    cfg = HgemmConfig(step, tuple(values))
    assert cfg.problem() is None, (cfg, cfg.problem())
    return cfg


# Chosen configuration per step: steps 05-06 from the H200 variant sweep at 4096^3 fp16 after the
# fragment double buffer crossed stage boundaries (bench/results/h200/hgemm_variants_05_06.json:
# 128x256x64, 8 warps of 64x64, 3 stages, 0.56-0.57 of cuBLAS; 256x128x64 within 1%);
# steps 02-04 keep the classic 128 x 128 x 32 / 8-warp tiling of the teaching ladder.
TUNED: dict[str, HgemmConfig] = {
    "01_mma_naive": _cfg("01_mma_naive"),
    "02_block_ldmatrix": _cfg("02_block_ldmatrix", 128, 128, 32, 64, 32),
    "03_padded": _cfg("03_padded", 128, 128, 32, 64, 32),
    "04_swizzled": _cfg("04_swizzled", 128, 128, 32, 64, 32),
    "05_multistage": _cfg("05_multistage", 128, 256, 64, 64, 64, 3),
    "06_rasterized": _cfg("06_rasterized", 128, 256, 64, 64, 64, 3, 8),
    # No cluster: the 2-CTA multicast of B measured 1.2-1.7% slower at 4096^3 and even elsewhere
    # (same-process A/B on the H200, docs/hgemm.md, "Clusters of 2 with multicast").
    "07_wgmma_tma": _cfg("07_wgmma_tma", 128, 256, 4, 8, 1, 0, 1),
}
# Used instead of TUNED[step] on GPUs whose per-block shared memory is below TUNED's (sm_86 / sm_89 /
# sm_120 allow 99 KB; TUNED 05-06 take 144 KB): 128 x 128 x 32, 48 KB (two blocks an SM there).
# BK 32, not 64: 128x128x64 spills 16 B on sm_120 (B [N, K]); BK 32 spills on no arch, 2% behind it on the H200.
TUNED_LOW_SMEM: dict[str, HgemmConfig] = {
    "05_multistage": _cfg("05_multistage", 128, 128, 32, 64, 64, 3),
    "06_rasterized": _cfg("06_rasterized", 128, 128, 32, 64, 64, 3, 8),
}
# Used instead of TUNED[step] when TUNED's tile gives fewer blocks than SMs (small M x N, decode).
TUNED_SMALL: dict[str, HgemmConfig] = {
    "05_multistage": _cfg("05_multistage", 64, 64, 64, 32, 32, 4),
    "06_rasterized": _cfg("06_rasterized", 64, 64, 64, 32, 32, 4, 8),
    "07_wgmma_tma": _cfg("07_wgmma_tma", 128, 128, 6, 8, 1, 1, 1),  # ping-pong (WGMMA_MID below)
}


# --- the design space for steps 05-06 ---------------------------------------------------------
# (BM, BN, WM, WN): block tile and warp tile (warp layout = BM/WM x BN/WN).
_BLOCK_SHAPES = (
    (128, 128, 64, 32),   # 8 warps 2 x 4
    (128, 128, 32, 64),   # 8 warps 4 x 2
    (128, 128, 64, 64),   # 4 warps 2 x 2
    (128, 256, 64, 64),   # 8 warps 2 x 4
    (256, 128, 64, 64),   # 8 warps 4 x 2
)


# Step 07: (BM, BN, STAGES) -- the ring as deep as 227 KB allows for each tile.
_WGMMA_SHAPES = ((128, 256, 4), (128, 256, 3), (128, 128, 6), (128, 128, 4), (64, 256, 5), (64, 128, 8))
# Ping-pong: (BM, BN, STAGES), a consumer holding the whole tile.
_WGMMA_PINGPONG_SHAPES = ((128, 128, 6), (128, 128, 5), (64, 256, 5))


def variant_configs(step: str | None = None, sm90: bool = False) -> list[HgemmConfig]:
    """The tuning space of steps 05-06 (every entry instantiates): tiles x BK {32, 64} x STAGES {3, 4},
    plus step 07's tiles x stages x GROUP_M {8, 16} when sm90 (or when step 07 is asked for)."""
    steps = [step] if step else ["05_multistage", "06_rasterized"] + (["07_wgmma_tma"] if sm90 else [])
    out: list[HgemmConfig] = []
    for st in steps:
        if st not in STEPS:
            raise ValueError(f"unknown HGEMM step {st!r}; one of {KERNELS}")
        if STEPS[st].hopper:
            for pp, shapes in ((0, _WGMMA_SHAPES), (1, _WGMMA_PINGPONG_SHAPES)):
                out += [cfg for (bm, bn, stages) in shapes for g in (8, 16) for cl in (1, 2) for tma_store in (0, 1)
                        if (cfg := HgemmConfig(st, (bm, bn, stages, g, cl, pp, tma_store))).problem() is None]
            out.append(TUNED_SMALL[st])
            continue
        if not STEPS[st].dynamic_smem:
            out.append(TUNED[st])
            continue
        extra = (8,) if st == "06_rasterized" else ()
        for (bm, bn, wm, wn) in _BLOCK_SHAPES:
            for bk in (32, 64):
                for stages in (3, 4):
                    cfg = HgemmConfig(st, (bm, bn, bk, wm, wn, stages) + extra)
                    if cfg.problem() is None and cfg.smem_bytes <= 163 * 1024:  # fits A100 too
                        out.append(cfg)
        out.append(TUNED_SMALL[st])
    return _dedup(out)


def _all_specs(cfgs) -> list[KernelSpec]:
    return _dedup(c.spec(dt, nk) for c in cfgs for dt in _DTYPES for nk in (False, True))


def variant_specs() -> list[KernelSpec]:
    """KernelSpecs of the steps 05-07 tuning space, both dtypes and both B layouts."""
    return _all_specs(variant_configs(sm90=True))


def dispatch_specs(arch: str | None = None) -> list[KernelSpec]:
    """Every KernelSpec `hgemm` can launch: TUNED + TUNED_SMALL of every step (+ TUNED_LOW_SMEM of
    steps 05-06, step 07's mid, narrow and short tiles) x dtype x B layout. arch ("sm_86"): those `select`
    can pick on that GPU (step 07 on sm_90 only; TUNED_LOW_SMEM where TUNED's tile does not fit)."""
    cfgs = list(TUNED.values()) + list(TUNED_SMALL.values()) + [WGMMA_MID, WGMMA_NARROW, WGMMA_SHORT]
    if arch is None:
        cfgs += list(TUNED_LOW_SMEM.values())
    else:
        cc = int(arch.rstrip("a").split("_")[1])
        cfgs = [_fit_smem(c, SMEM_PER_BLOCK_BY_CC.get(cc)) for c in cfgs if cc == 90 or not c.info.hopper]
    return _all_specs(cfgs + [_direct_store(c) for c in cfgs if c.info.hopper])


def _dedup(items) -> list:
    seen, out = set(), []
    for s in items:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# --- validation: the op's tensors; plan() checks its numbers with the same functions -------------
def check_dtype(dtype, what: str = "dtype") -> None:
    if dtype not in _DTYPES:
        raise TypeError(f"hgemm takes float16 or bfloat16: {what} is {dtype}")


def check_layout(b_transposed) -> None:
    if not isinstance(b_transposed, bool):
        raise TypeError(f"b_transposed must be a bool, got {type(b_transposed).__name__}")


def check_kernel(kernel) -> None:
    """kernel: "auto", a ladder step name or an HgemmConfig that can be instantiated."""
    if not (isinstance(kernel, HgemmConfig) or (isinstance(kernel, str) and (kernel == "auto" or kernel in STEPS))):
        raise ValueError(f"kernel must be 'auto', one of {KERNELS} or an HgemmConfig, got {kernel!r}")
    if isinstance(kernel, HgemmConfig) and kernel.problem() is not None:
        raise ValueError(f"{kernel.label()} cannot be instantiated: {kernel.problem()}")


def check_sizes(m: int, n: int, k: int) -> None:
    if max(m, n, k) > _INT_MAX:
        raise ValueError(f"dimensions must fit in int32, got M={m}, N={n}, K={k}")


def check_rows(n: int, k: int, b_nk: bool) -> None:
    """The kernels copy rows in 16-byte chunks: K % 8 == 0, and N % 8 == 0 for b [K, N] (not for b [N, K])."""
    if k % K_MULTIPLE:
        raise ValueError(f"hgemm needs K % {K_MULTIPLE} == 0 (16-byte rows of a), got K={k}; "
                         "pad K with zeros")
    if not b_nk and n % K_MULTIPLE:
        raise ValueError(f"hgemm with b [K, N] needs N % {K_MULTIPLE} == 0 (16-byte rows of b), got N={n}; "
                         "pass b as [N, K] with b_transposed=True for any N")


def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dtype(t.dtype, f"{name}.dtype")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _validate(a, b, kernel, b_transposed) -> tuple[int, int, int]:
    _check_tensor("a", a)
    _check_tensor("b", b)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    check_layout(b_transposed)
    m, k = a.shape
    n, kb = (b.shape[0], b.shape[1]) if b_transposed else (b.shape[1], b.shape[0])
    if k != kb:
        what = "b [N, K]" if b_transposed else "b [K, N]"
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, {what} is {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    if a.device.type not in ("cuda", "cpu"):
        raise ValueError(f"hgemm runs on CUDA or CPU tensors, not {a.device}")
    check_kernel(kernel)
    check_sizes(m, n, k)
    return m, n, k


def _check_kernel_preconditions(k: int, n: int, b_nk: bool, a: torch.Tensor, b: torch.Tensor) -> None:
    check_rows(n, k, b_nk)
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (data_ptr() % 16 == 0), got an offset of "
                             f"{t.data_ptr() % 16} bytes; use .clone()")


def auto_step(cc: int) -> str:
    """The step kernel="auto" runs on a GPU of compute capability cc (as 80, 90)."""
    return AUTO_STEP_SM90 if cc == 90 else AUTO_STEP


# Step 07 on large problems: the persistent grid works in rounds of `sm_count` tiles, so a tile
# count just above a multiple of it wastes most of a round (1024 x 14336: 448 tiles of 128 x 256 =
# 3.4 rounds -> 4, 85% busy). The smaller tile is slightly less efficient per FLOP but quantizes
# finer; pick the one with the higher (busy fraction x per-tile efficiency). The 128 x 128 tile runs
# ping-pong (two consumers on alternate tiles): on the H200 it beat the cooperative 128 x 128 tile
# at every shape where either was picked (e.g. 3072^3 0.84 vs 0.77 of cuBLAS, 512 x 14336 x 4096
# 0.94 vs 0.87; docs/hgemm.md).
WGMMA_MID = _cfg("07_wgmma_tma", 128, 128, 6, 8, 1, 1, 1)
# Fewer tiles than SMs: one 64 x 256 ping-pong tile a consumer for m <= 64 (decode: 0.88-1.01 of
# cuBLAS against 0.58-0.76 for the 128 x 128 tile, which wastes half its rows), else TUNED_SMALL.
WGMMA_NARROW = _cfg("07_wgmma_tma", 64, 256, 5, 8, 1, 1, 0)
NARROW_MAX_M = 64
# M > 64 with at most half as many 128 x 128 tiles as SMs (1024^3: 64 tiles on 132 SMs): every
# tile is alone on its SM, so a tile half as tall halves the time to the last store. The 64 x 128
# cooperative tile (one consumer warpgroup, 8 stages) took 1024^3 from 0.79 / 0.78 of cuBLAS
# (128 x 128 ping-pong) to 1.06 / 0.96 (fp16 / bf16), 1024 x 1024 x 2048 from 0.73 / 0.70 to
# 1.00 / 0.98; with more tiles than half the SMs the 128 x 128 tile stays ahead (1024 x 2048 x
# 1024: 1.02 against 0.96).
WGMMA_SHORT = _cfg("07_wgmma_tma", 64, 128, 8, 8, 1, 0, 1)
_WGMMA_TILE_EFFICIENCY = {(128, 256): 1.0, (128, 128): 0.97}


def _round_efficiency(cfg: HgemmConfig, m: int, n: int, sm_count: int) -> float:
    tiles = cfg.blocks(m, n)
    ctas = cfg.grid(m, n, sm_count)
    return tiles / (-(-tiles // ctas) * ctas) * _WGMMA_TILE_EFFICIENCY[cfg.tile]


def _tuned_for(step: str, m: int, n: int, sm_count: int) -> tuple[HgemmConfig, str]:
    """A step's configuration for an M x N output and its source: "table" (TUNED / TUNED_SMALL) or "rule"
    (step 07's narrow, short and mid tiles, which the rules below pick)."""
    cfg = TUNED[step]
    small = TUNED_SMALL.get(step)
    if small is not None and cfg.blocks(m, n) < sm_count:
        if step != AUTO_STEP_SM90:
            return small, "table"
        if m <= NARROW_MAX_M:
            return WGMMA_NARROW, "rule"
        return (WGMMA_SHORT, "rule") if 2 * small.blocks(m, n) <= sm_count else (small, "table")
    if step == AUTO_STEP_SM90 and cfg.tile in _WGMMA_TILE_EFFICIENCY:
        best = max((cfg, WGMMA_MID), key=lambda c: _round_efficiency(c, m, n, sm_count))
        return best, "table" if best is cfg else "rule"
    return cfg, "table"


def _choose(m: int, n: int, kernel, sm_count: int, cc: int, smem_limit: int | None) -> tuple[HgemmConfig, str]:
    if isinstance(kernel, HgemmConfig):
        return kernel, "given"
    cfg, source = _tuned_for(auto_step(cc) if kernel == "auto" else kernel, m, n, sm_count)
    fitted = _fit_smem(cfg, smem_limit)
    return (cfg, source) if fitted is cfg else (fitted, "table")


@functools.lru_cache(maxsize=4096)
def select(m: int, n: int, kernel="auto", sm_count: int = 132, cc: int = 90,
           smem_limit: int | None = None) -> HgemmConfig:
    """The tile configuration for an M x N output on a GPU with sm_count SMs, compute capability cc and
    smem_limit bytes of shared memory per block (None: as much as any config needs): decide's choice
    before its checks and N's epilogue (the tuning tools ask it for steps the GPU may not run)."""
    return _choose(m, n, kernel, sm_count, cc, smem_limit)[0]


def _fit_smem(cfg: HgemmConfig, smem_limit: int | None) -> HgemmConfig:
    """TUNED_LOW_SMEM's tile for a step whose tile needs more than smem_limit bytes a block (None: no limit)."""
    if smem_limit is not None and cfg.smem_bytes > smem_limit and cfg.step in TUNED_LOW_SMEM:
        return TUNED_LOW_SMEM[cfg.step]
    return cfg


def store_for(cfg: HgemmConfig, n: int) -> HgemmConfig:
    """Step 07 with the direct-store epilogue (TMA_STORE = 0) where C's rows are not 16-byte multiples
    (N % 8 != 0: no tensor map for C); cfg itself otherwise."""
    if cfg.info.hopper and cfg.TMA_STORE and n % 8:
        return _direct_store(cfg)
    return cfg


@functools.lru_cache(maxsize=4096)
def decide(m: int, n: int, kernel, sm_count: int, cc: int, smem_limit: int | None) -> tuple[HgemmConfig, str]:
    """The configuration a call on an M x N output runs, and where it came from: "table" (an entry of
    TUNED, TUNED_SMALL or TUNED_LOW_SMEM), "rule" (step 07's narrow / short / mid tile) or "given" (the
    caller's HgemmConfig). A pure function of numbers: the launcher asks it with the present GPU's,
    plan() with a described GPU's. Raises ValueError where the configuration cannot run on the GPU:
    step 07 off sm_90, or more shared memory a block than smem_limit."""
    cfg, source = _choose(m, n, kernel, sm_count, cc, smem_limit)
    if cfg.info.hopper and cc != 90:
        raise ValueError(f"{cfg.step} uses wgmma / TMA / setmaxnreg (sm_90a) and runs on Hopper (sm_90) "
                         f"only; this GPU is sm_{cc}. Use kernel='auto' or a step <= 06")
    if smem_limit is not None and cfg.smem_bytes > smem_limit:
        raise ValueError(f"{cfg.label()} needs {cfg.smem_bytes} B of shared memory a block; this GPU allows "
                         f"{smem_limit} B")
    return store_for(cfg, n), source


@functools.lru_cache(maxsize=4096)
def launch_grid(cfg: HgemmConfig, m: int, n: int, sm_count: int,
                clusters: tuple[tuple[int, int], ...] = ()) -> int | tuple[int, int]:
    """The grid, in CTAs, that launches cfg on an M x N output (HgemmConfig.grid): for step 07 at most
    one CTA an SM and, in clusters of CLUSTER > 1, at most the clusters the GPU holds at once
    (clusters: GpuSpec.clusters, its capacity at one CTA an SM: exact for the dispatched and tuned step 07
    tiles, which take over half an SM's shared memory; a smaller tile could only fit more). ValueError
    where CUDA's grid limits refuse it."""
    if cfg.info.hopper:
        return cfg.grid(m, n, sm_count, dict(clusters).get(cfg.CLUSTER) if cfg.CLUSTER > 1 else None)
    grid = cfg.grid(m, n)
    if isinstance(grid, tuple) and grid[1] > 65535:
        raise ValueError(f"M={m} needs {grid[1]} tile rows of {cfg.tile[0]}, more than gridDim.y allows "
                         f"(65535); use kernel='06_rasterized' (1-D grid)")
    if not isinstance(grid, tuple) and grid > _INT_MAX:
        raise ValueError(f"{m} x {n} needs {grid} blocks, more than a 1-D grid holds")
    return grid


def hgemm_reference(a: torch.Tensor, b: torch.Tensor, b_transposed: bool = False) -> torch.Tensor:
    """fp32 matmul of the fp16/bf16 operands, rounded once to their dtype."""
    bf = b.float().t() if b_transposed else b.float()
    return torch.matmul(a.float(), bf).to(a.dtype)


def _b_operand(b: torch.Tensor, b_transposed: bool) -> tuple[torch.Tensor, bool]:
    """(contiguous buffer, is [N, K]): a transposed view of a contiguous matrix switches layout, no copy."""
    if b.is_contiguous():
        return b, b_transposed
    bt = b.t()
    if bt.is_contiguous():
        return bt, not b_transposed
    return b.contiguous(), b_transposed


def launch_config(cfg: HgemmConfig, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, b_nk: bool) -> torch.Tensor:
    """Launch one configuration on contiguous, validated CUDA operands (no checks: the tuner's hot path),
    on launch_grid's grid."""
    m, k = a.shape
    n = c.shape[1]
    if cfg.info.hopper:
        return _launch_wgmma(store_for(cfg, n), a, b, c, b_nk)
    grid = launch_grid(cfg, m, n, device_info(a.device.index).sm_count)
    kern = get_kernel(cfg.spec(a.dtype, b_nk), a.device)
    launch(kern, grid, cfg.threads, a.data_ptr(), b.data_ptr(), c.data_ptr(), i32(m), i32(n), i32(k),
           smem=cfg.dynamic_smem)
    return c


def _direct_store(cfg: HgemmConfig) -> HgemmConfig:
    """Step 07 with the direct-store epilogue (TMA_STORE = 0): the fallback for N % 8 != 0."""
    return HgemmConfig.of(cfg.step, **{**cfg.params, "TMA_STORE": 0})


def _launch_wgmma(cfg: HgemmConfig, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, b_nk: bool) -> torch.Tensor:
    """Step 07: TMA maps for A (BM x 64 boxes) and B (BN x 64 K-major boxes for [N, K], 64 x 64
    N-major boxes for [K, N]), 128-byte swizzle, and for the TMA-store epilogue C (64 x 64 boxes);
    a persistent grid (launch_grid)."""
    m, k = a.shape
    n = c.shape[1]
    # clusters of 2 or more: as many as the GPU holds at once (GpuSpec.current measures it once a device)
    clusters = GpuSpec.current(a.device).clusters if cfg.CLUSTER > 1 else ()
    grid = launch_grid(cfg, m, n, device_info(a.device.index).sm_count, clusters)
    kern = get_kernel(cfg.spec(a.dtype, b_nk), a.device)
    map_a = tensor_map_2d(a, cfg.BM, WGMMA_BK)
    # B [N, K]: with a cluster each CTA loads (and multicasts) BN / CLUSTER rows of the box
    map_b = tensor_map_2d(b, cfg.BN // cfg.CLUSTER, WGMMA_BK) if b_nk else tensor_map_2d(b, WGMMA_BK, 64)
    map_c = tensor_map_2d(c, 64, 64) if cfg.TMA_STORE else map_a  # unused by TMA_STORE = 0
    launch(kern, grid, cfg.threads, map_a, map_b, map_c, c.data_ptr(), i32(m), i32(n), i32(k),
           smem=cfg.dynamic_smem, cluster=cfg.CLUSTER)
    return c


def hgemm(a: torch.Tensor, b: torch.Tensor, kernel="auto", b_transposed: bool = False) -> torch.Tensor:
    """C = A @ B (or A @ B.T for b [N, K] with b_transposed=True), fp16/bf16, fp32 accumulation.

    kernel: "auto" (step AUTO_STEP, tuned), a ladder step name from KERNELS, or an HgemmConfig.
    Returns a new [M, N] tensor of the input dtype.  See the module docstring for preconditions.
    """
    m, n, k = _validate(a, b, kernel, b_transposed)
    if a.device.type == "cpu":
        return hgemm_reference(a, b, b_transposed)
    a_k = a if a.is_contiguous() else a.contiguous()
    b_k, b_nk = _b_operand(b, b_transposed)
    _check_kernel_preconditions(k, n, b_nk, a_k, b_k)
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=a.dtype, device=a.device)
    if k == 0:
        return torch.zeros(m, n, dtype=a.dtype, device=a.device)
    info = device_info(a.device.index)
    cfg, _ = decide(m, n, kernel, info.sm_count, info.cc, info.smem_per_block_optin)
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    return launch_config(cfg, a_k, b_k, c, b_nk)
