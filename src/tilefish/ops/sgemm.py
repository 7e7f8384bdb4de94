"""SGEMM ladder: C = alpha * A @ B + beta * C in fp32, nine kernels from naive to cp.async-pipelined.

validate -> pick a ladder step and its tile configuration -> get the kernel -> launch.

Every step of the ladder stays dispatchable (`sgemm(a, b, kernel="03_smem_blocking")`), so the
benchmark and the tests can show what each step buys; docs/sgemm.md explains every step.

Preconditions and fallbacks
---------------------------
* a [M, K], b [K, N], c [M, N] (optional): float32, 2-D, on one CUDA device (or all on the CPU).
* Steps 01-05 take any M, N, K >= 1 and any alignment.
* Steps 06-09 (the vectorized ones) need K % 4 == 0, N % 4 == 0 and 16-byte aligned a, b, c,
  so every float4 is aligned and never crosses the end of a row.  When a *named* step's
  preconditions do not hold, `sgemm` silently runs FALLBACK ("05_blocktile_2d") instead;
  an explicit `SgemmConfig` is strict and raises ValueError.  `select(...)` reports which
  configuration a call would run.
* Non-contiguous a or b are copied to a contiguous tensor first (an explicit `.contiguous()`,
  one extra read and write of the operand).  A non-contiguous c is computed in a contiguous
  temporary and copied back into c (c is read for that copy only when beta != 0).
* beta == 0 never reads c, so NaN/Inf in c are ignored, as in BLAS.  c may not overlap a or b.
* CPU tensors use a float64 torch reference rounded to fp32 (`sgemm_reference`), so the op
  works without a GPU.

kernel="auto"
-------------
The fastest tuned step (AUTO_STEP, "09_pipelined") when the vectorized preconditions hold,
FALLBACK otherwise.  Its tile configuration is TUNED[step], unless the TUNED tile would give
fewer blocks than the GPU has SMs (small M x N), in which case TUNED_SMALL[step] (a smaller
tile, more blocks) is used.  TUNED / TUNED_SMALL come from `python -m tilefish.bench.sgemm_autotune`
on the H200 (see docs/sgemm.md).

One decision, two callers: `decide` (a cached pure function of M, N, whether the operands allow float4
access, the kernel asked for and the GPU's SMs and shared memory per block) picks the configuration and
`launch_grid` its grid; the launcher asks both with the present GPU's numbers, `tilefish.sgemm.plan`
(ops/gemm_plan.py) with any GPU's, so a printed plan is what runs.
"""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import torch

from ..runtime import KernelSpec, device_info, f32, get_kernel, i32, launch

_INT_MAX = 2**31 - 1
_STATIC_SMEM_LIMIT = 48 * 1024
_DYN_SMEM_LIMIT = 227 * 1024  # Hopper/Ampere opt-in per block; the launcher re-checks the device's


@dataclass(frozen=True)
class Step:
    """One ladder step: kernels/sgemm/<name>.cu holding the template `func<params...>`."""

    name: str
    func: str
    params: tuple[str, ...]
    vectorized: bool  # needs K % 4 == 0, N % 4 == 0 and 16-byte aligned a, b, c
    dynamic_smem: bool = False

    @property
    def source(self) -> str:
        return f"sgemm/{self.name}.cu"

    @property
    def index(self) -> int:
        return int(self.name[:2])


_SQ = ("BS",)
_BT = ("BM", "BN", "BK", "TM", "TN")
_WT = ("BM", "BN", "BK", "WM", "WN", "WNITER", "TM", "TN")
STEPS: dict[str, Step] = {s.name: s for s in (
    Step("01_naive", "sgemm_naive", _SQ, False),
    Step("02_coalesced", "sgemm_coalesced", _SQ, False),
    Step("03_smem_blocking", "sgemm_smem", _SQ, False),
    Step("04_blocktile_1d", "sgemm_blocktile_1d", ("BM", "BN", "BK", "TM"), False),
    Step("05_blocktile_2d", "sgemm_blocktile_2d", _BT, False),
    Step("06_vectorized", "sgemm_vectorized", _BT, True),
    Step("07_bank_conflict_free", "sgemm_bcf", _BT, True),
    Step("08_warptile", "sgemm_warptile", _WT, True),
    Step("09_pipelined", "sgemm_pipelined", _WT + ("STAGES", "MINB"), True, dynamic_smem=True),
)}
KERNELS: tuple[str, ...] = tuple(STEPS)  # the ladder, in order
FALLBACK = "05_blocktile_2d"             # any shape, any alignment
AUTO_STEP = "09_pipelined"               # the fastest step (confirm with `tilefish bench sgemm`)
HOT_FROM = 5                             # steps >= 05 are hot: the compile test rejects spills


@dataclass(frozen=True)
class SgemmConfig:
    """A ladder step plus its template parameters, e.g. SgemmConfig.of("05_blocktile_2d", BM=128, ...)."""

    step: str
    values: tuple[int, ...]

    @classmethod
    def of(cls, step: str, **params: int) -> "SgemmConfig":
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

    def __getattr__(self, name: str) -> int:  # cfg.BM, cfg.STAGES ...
        if name.isupper():
            p = self.params
            if name in p:
                return p[name]
        raise AttributeError(name)

    def label(self) -> str:
        return f"{self.step}<{','.join(f'{k}={v}' for k, v in self.params.items())}>"

    def short(self) -> str:
        p = self.params
        if "BS" in p:
            return f"{p['BS']}x{p['BS']}"
        s = f"{p['BM']}x{p['BN']}x{p['BK']}"
        if "WM" in p:
            s += f" w{p['WM']}x{p['WN']}n{p['WNITER']}"
        s += f" t{p['TM']}" + (f"x{p['TN']}" if "TN" in p else "")
        if "STAGES" in p:
            s += f" s{p['STAGES']} b{p['MINB']}"
        return s

    # --- launch geometry -------------------------------------------------------------------
    @property
    def tile(self) -> tuple[int, int]:
        p = self.params
        return (p["BS"], p["BS"]) if "BS" in p else (p["BM"], p["BN"])

    @functools.cached_property  # threads, smem_bytes: read on every launch, fixed per config
    def threads(self) -> int:
        p = self.params
        if "BS" in p:
            return p["BS"] ** 2
        if "WM" in p:
            return (p["BM"] // p["WM"]) * (p["BN"] // p["WN"]) * 32
        if "TN" in p:
            return (p["BM"] // p["TM"]) * (p["BN"] // p["TN"])
        return p["BM"] * p["BN"] // p["TM"]

    @functools.cached_property
    def smem_bytes(self) -> int:
        """Shared memory per block (dynamic for step 09, static otherwise)."""
        p = self.params
        if self.step == "03_smem_blocking":
            return 2 * p["BS"] ** 2 * 4
        if "BM" not in p:
            return 0
        a_pitch = p["BM"] + 4 if self.info.index >= 7 else p["BM"]
        stage = p["BK"] * (a_pitch + p["BN"]) * 4
        return stage * p.get("STAGES", 1)

    @property
    def dynamic_smem(self) -> int:
        return self.smem_bytes if self.info.dynamic_smem else 0

    def grid(self, m: int, n: int) -> int:
        bm, bn = self.tile
        return -(-m // bm) * -(-n // bn)

    @functools.cached_property
    def spec(self) -> KernelSpec:
        return KernelSpec(self.info.source, f"{self.info.func}<{', '.join(map(str, self.values))}>",
                          hot=self.info.index >= HOT_FROM)

    def problem(self) -> str | None:
        """Why this configuration cannot be instantiated (mirrors the kernels' static_asserts), or None."""
        p, t = self.params, self.threads
        if len(self.values) != len(self.info.params) or min(self.values) <= 0:
            return "bad parameter list"
        if not 32 <= t <= 1024 or t % 32:
            return f"{t} threads per block"
        if "BS" in p:
            return None if self.smem_bytes <= _STATIC_SMEM_LIMIT else "static smem > 48 KB"
        bm, bn, bk, tm = p["BM"], p["BN"], p["BK"], p["TM"]
        tn = p.get("TN", 1)
        if bm % tm or bn % tn:
            return "thread tile must divide the block tile"
        if self.info.vectorized:
            if bk % 4 or bn % 4 or tm % 4 or tn % 4:
                return "float4 tiling needs BK, BN, TM, TN % 4 == 0"
            if self.step != "09_pipelined" and ((bm * bk) % (4 * t) or t % (bk // 4)):
                return "A tile must split evenly in float4s"
            if (bk * bn) % (4 * t) or t % (bn // 4):
                return "B tile must split evenly in float4s"
        elif (bm * bk) % t or (bk * bn) % t:
            return "tiles must split evenly over the threads"
        if "WM" in p:
            wm, wn, wni = p["WM"], p["WN"], p["WNITER"]
            if bm % wm or bn % wn:
                return "warp tile must divide the block tile"
            if (wm * wn) % (32 * tm * tn * wni):
                return "warp tile must split over 32 lanes"
            wmi = wm * wn // (32 * tm * tn * wni)
            if wmi < 1 or wm % wmi or wn % wni:
                return "sub-tile shape"
            wsm, wsn = wm // wmi, wn // wni
            if wsm % tm or wsn % tn or (wsm // tm) * (wsn // tn) != 32:
                return "a sub-tile must be exactly 32 lane tiles"
        if self.step == "09_pipelined":
            if p["STAGES"] < 2:
                return "STAGES >= 2"
            if bk % 8 or bm % ((t // 32) * 4):
                return "A copy pieces (4 rows x 8 k per warp) must tile BM x BK"
            if self.smem_bytes > _DYN_SMEM_LIMIT:
                return "dynamic smem > 227 KB"
            if 65536 // (p["MINB"] * t) < 64:
                return "MINB leaves fewer than 64 registers per thread"
        elif self.smem_bytes > _STATIC_SMEM_LIMIT:
            return "static smem > 48 KB"
        return None


def _cfg(step: str, *values: int) -> SgemmConfig:
    cfg = SgemmConfig(step, tuple(values))
    assert cfg.problem() is None, (cfg, cfg.problem())
    return cfg


# Chosen tile configuration per step: steps 07-09 are the H200 autotune winners
# (bench/results/h200/sgemm_autotune_07_08.json, sgemm_autotune_09.json; 4096^3 for TUNED,
# 1024^3 for TUNED_SMALL); 01-06 keep the classic teaching configurations of the worklog.
# Re-tune with: python -m tilefish.bench.sgemm_autotune --all --shape 4096 --shape 1024 --snippet
TUNED: dict[str, SgemmConfig] = {
    "01_naive": _cfg("01_naive", 32),
    "02_coalesced": _cfg("02_coalesced", 32),
    "03_smem_blocking": _cfg("03_smem_blocking", 32),
    "04_blocktile_1d": _cfg("04_blocktile_1d", 64, 64, 8, 8),
    "05_blocktile_2d": _cfg("05_blocktile_2d", 128, 128, 8, 8, 8),
    "06_vectorized": _cfg("06_vectorized", 128, 128, 8, 8, 8),
    "07_bank_conflict_free": _cfg("07_bank_conflict_free", 64, 128, 16, 8, 8),
    "08_warptile": _cfg("08_warptile", 64, 128, 16, 32, 64, 2, 4, 4),
    "09_pipelined": _cfg("09_pipelined", 128, 256, 16, 64, 64, 4, 4, 4, 2, 1),
}
# Used instead of TUNED[step] when TUNED's tile gives fewer blocks than SMs (small M x N).
TUNED_SMALL: dict[str, SgemmConfig] = {
    "05_blocktile_2d": _cfg("05_blocktile_2d", 64, 64, 8, 4, 4),
    "06_vectorized": _cfg("06_vectorized", 64, 64, 16, 4, 4),
    "07_bank_conflict_free": _cfg("07_bank_conflict_free", 64, 64, 16, 4, 8),
    "08_warptile": _cfg("08_warptile", 64, 64, 16, 32, 32, 2, 4, 4),
    "09_pipelined": _cfg("09_pipelined", 64, 128, 16, 32, 64, 2, 4, 4, 4, 2),
}


# --- the design space the autotuner sweeps ---------------------------------------------------
# Warp-tiled shapes (BM, BN, WM, WN, WNITER, TM, TN): threads, accumulators per lane.
_WARP_SHAPES = (
    (128, 128, 64, 32, 2, 4, 4),   # 256 thr, 8x8 per lane (cuBLAS-like 128x128, warps 2x4)
    (128, 128, 32, 64, 2, 4, 4),   # 256 thr, 8x8, warps 4x2
    (128, 128, 64, 32, 1, 8, 4),   # 256 thr, 8x8 as one 8x4 sub-tile pair
    (128, 64, 64, 32, 2, 4, 4),    # 128 thr, 8x8
    (64, 128, 32, 64, 2, 4, 4),    # 128 thr, 8x8
    (64, 64, 32, 32, 2, 4, 4),     # 128 thr, 4x8
    (128, 128, 64, 64, 4, 4, 4),   # 128 thr, 8x16
    (128, 256, 64, 64, 4, 4, 4),   # 256 thr, 8x16
    (256, 128, 64, 64, 4, 4, 4),   # 256 thr, 8x16
)


def _acc_per_lane(bm, bn, threads) -> int:
    return bm * bn // threads


def variant_configs(step: str | None = None) -> list[SgemmConfig]:
    """The autotune search space (every entry instantiates; see docs/sgemm.md)."""
    steps = [step] if step else list(KERNELS)
    out: list[SgemmConfig] = []
    for st in steps:
        if st not in STEPS:
            raise ValueError(f"unknown SGEMM step {st!r}; one of {KERNELS}")
        cands: list[tuple[int, ...]] = []
        if st in ("01_naive", "02_coalesced", "03_smem_blocking"):
            cands = [(16,), (32,)]
        elif st == "04_blocktile_1d":  # (BK = 16 with TM = 8 spills at its 512-thread register cap)
            cands = [(bm, bn, 8, tm) for bm in (64, 128) for bn in (64, 128) for tm in (4, 8)] + [(64, 64, 16, 4)]
        elif st in ("05_blocktile_2d", "06_vectorized", "07_bank_conflict_free"):
            cands = [(bm, bn, bk, tm, tn) for bm in (64, 128) for bn in (64, 128) for bk in (8, 16)
                     for tm in (4, 8) for tn in (4, 8)]
        elif st == "08_warptile":
            cands = [(bm, bn, bk, wm, wn, wni, tm, tn) for (bm, bn, wm, wn, wni, tm, tn) in _WARP_SHAPES
                     for bk in (8, 16)]
        elif st == "09_pipelined":
            for (bm, bn, wm, wn, wni, tm, tn) in _WARP_SHAPES:
                threads = (bm // wm) * (bn // wn) * 32
                acc = _acc_per_lane(bm, bn, threads)
                # MINB (min blocks per SM -> register cap 65536 / (MINB * threads)): caps that the
                # accumulators leave room for without spilling (checked for sm_80 and sm_90).
                if acc > 64:
                    minbs = (1,)
                elif threads == 256:
                    minbs = (1, 2)   # 255 or 128 registers
                elif acc > 32:
                    minbs = (2,)     # 128 threads x 64 accumulators spill at a 128-register cap
                else:
                    minbs = (2, 4)
                for bk in (8, 16):
                    for stages in (2, 3, 4):
                        for minb in minbs:
                            cands.append((bm, bn, bk, wm, wn, wni, tm, tn, stages, minb))
        for vals in cands:
            cfg = SgemmConfig(st, vals)
            if cfg.problem() is None:
                out.append(cfg)
    return out


def variant_specs() -> list[KernelSpec]:
    """KernelSpecs of the whole autotune search space (`tilefish compile --all`)."""
    return _dedup(c.spec for c in variant_configs())


def dispatch_specs(arch: str | None = None) -> list[KernelSpec]:
    """Every KernelSpec `sgemm` can launch: the tuned configuration of every step (+ small-grid ones).
    The same on every arch ("sm_86", None: any): no arch-specific step, every tile within 99 KB of smem."""
    specs = _dedup(c.spec for c in list(TUNED.values()) + list(TUNED_SMALL.values()))
    return [s for s in specs if arch is None or s.supports(arch)]


def _dedup(specs) -> list[KernelSpec]:
    seen, out = set(), []
    for s in specs:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# --- validation: the op's tensors; plan() checks its numbers with the same functions -------------
def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"sgemm is fp32 only: {name} has dtype {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def check_kernel(kernel) -> None:
    """kernel: "auto", a ladder step name or an SgemmConfig that can be instantiated."""
    if not (isinstance(kernel, SgemmConfig) or (isinstance(kernel, str) and (kernel == "auto" or kernel in STEPS))):
        raise ValueError(f"kernel must be 'auto', one of {KERNELS} or an SgemmConfig, got {kernel!r}")
    if isinstance(kernel, SgemmConfig) and kernel.problem() is not None:
        raise ValueError(f"{kernel.label()} cannot be instantiated: {kernel.problem()}")


def check_sizes(m: int, n: int, k: int) -> None:
    if max(m, n, k) > _INT_MAX:
        raise ValueError(f"dimensions must fit in int32, got M={m}, N={n}, K={k}")


def _validate(a, b, c, alpha, beta, kernel) -> None:
    _check_tensor("a", a)
    _check_tensor("b", b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if c is not None:
        _check_tensor("c", c)
        if tuple(c.shape) != (a.shape[0], b.shape[1]):
            raise ValueError(f"c has shape {tuple(c.shape)}, expected {(a.shape[0], b.shape[1])} (M, N)")
    for name, v in (("alpha", alpha), ("beta", beta)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
    if c is None and beta != 0:
        raise ValueError("beta != 0 needs c (C = alpha * A @ B + beta * C)")
    devs = {t.device for t in (a, b, c) if t is not None}
    if len(devs) > 1:
        raise ValueError(f"a, b{', c' if c is not None else ''} must be on one device, got {sorted(map(str, devs))}")
    dev = a.device
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"sgemm runs on CUDA or CPU tensors, not {dev}")
    check_kernel(kernel)
    check_sizes(a.shape[0], b.shape[1], a.shape[1])


def can_vectorize(k: int, n: int, aligned: bool) -> bool:
    """The vectorized steps' preconditions: K % 4 == 0, N % 4 == 0 and a, b, c 16-byte aligned."""
    return k % 4 == 0 and n % 4 == 0 and aligned


def vector_ok(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """The vectorized steps' preconditions, for the contiguous buffers the kernel would see."""
    return can_vectorize(a.shape[1], b.shape[1], not (a.data_ptr() % 16 or b.data_ptr() % 16 or c.data_ptr() % 16))


def check_vector(kernel, vector_ok_: bool) -> None:
    """An explicit SgemmConfig is strict: a vectorized one needs operands that allow float4 access."""
    if isinstance(kernel, SgemmConfig) and kernel.info.vectorized and not vector_ok_:
        raise ValueError(f"{kernel.label()} needs K % 4 == 0, N % 4 == 0 and 16-byte aligned a, b, c; "
                         f"use a ladder step name to get the {FALLBACK} fallback")


def _tuned_for(step: str, m: int, n: int, sm_count: int) -> SgemmConfig:
    cfg = TUNED[step]
    small = TUNED_SMALL.get(step)
    if small is not None and cfg.grid(m, n) < sm_count:
        return small
    return cfg


@functools.lru_cache(maxsize=4096)
def select(m: int, n: int, vector_ok_: bool, kernel="auto", sm_count: int = 132) -> SgemmConfig:
    """The configuration `sgemm` runs for an M x N output (see the module docstring); decide's choice
    before its shared-memory check."""
    if isinstance(kernel, SgemmConfig):
        check_vector(kernel, vector_ok_)
        return kernel
    step = AUTO_STEP if kernel == "auto" else kernel
    if STEPS[step].vectorized and not vector_ok_:
        step = FALLBACK
    return _tuned_for(step, m, n, sm_count)


@functools.lru_cache(maxsize=4096)
def decide(m: int, n: int, vector_ok_: bool, kernel, sm_count: int,
           smem_limit: int | None = None) -> tuple[SgemmConfig, str]:
    """The configuration a call on an M x N output runs, and where it came from: "table" (TUNED or
    TUNED_SMALL: every step name and "auto" resolve to an entry) or "given" (the caller's SgemmConfig).
    A pure function of numbers: the launcher asks it with the present GPU's, plan() with a described
    GPU's (no step is arch-specific, so cc does not enter). ValueError where the configuration cannot run:
    a vectorized SgemmConfig without vector_ok_, more shared memory a block than smem_limit."""
    cfg = select(m, n, vector_ok_, kernel, sm_count)
    if smem_limit is not None and cfg.smem_bytes > smem_limit:
        raise ValueError(f"{cfg.label()} needs {cfg.smem_bytes} B of shared memory a block; this GPU allows "
                         f"{smem_limit} B")
    return cfg, "given" if isinstance(kernel, SgemmConfig) else "table"


@functools.lru_cache(maxsize=4096)
def launch_grid(cfg: SgemmConfig, m: int, n: int) -> int:
    """The 1-D grid, in CTAs, that launches cfg on an M x N output (one CTA a tile); ValueError past CUDA's limit."""
    grid = cfg.grid(m, n)
    if grid > _INT_MAX:
        raise ValueError(f"{m} x {n} needs {grid} blocks of {cfg.tile}, more than a 1-D grid holds")
    return grid


def _overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    x0, y0 = x.data_ptr(), y.data_ptr()
    return x0 < y0 + y.numel() * 4 and y0 < x0 + x.numel() * 4


def sgemm_reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None,
                    alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """alpha * A @ B + beta * C in float64, rounded once to fp32 (c is not read when beta == 0)."""
    out = torch.matmul(a.double(), b.double())
    if alpha != 1:
        out.mul_(alpha)
    if c is not None and beta != 0:
        out.add_(c.double(), alpha=beta)
    return out.float()


def launch_config(cfg: SgemmConfig, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                  alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """Launch one configuration on contiguous CUDA fp32 operands (no validation: the autotuner's hot path)."""
    m, k = a.shape
    n = b.shape[1]
    grid = launch_grid(cfg, m, n)
    kern = get_kernel(cfg.spec, a.device)
    launch(kern, grid, cfg.threads, a.data_ptr(), b.data_ptr(), c.data_ptr(), i32(m), i32(n), i32(k),
           f32(alpha), f32(beta), smem=cfg.dynamic_smem)
    return c


def sgemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, alpha: float = 1.0,
          beta: float = 0.0, kernel="auto") -> torch.Tensor:
    """C = alpha * A @ B + beta * C in fp32 (no TF32).

    a [M, K], b [K, N]; c [M, N] is updated in place and returned when given, otherwise a new
    tensor is returned (beta must then be 0).  kernel: "auto", a ladder step name from KERNELS
    (vectorized steps fall back to FALLBACK when their preconditions fail), or an SgemmConfig.
    """
    _validate(a, b, c, alpha, beta, kernel)
    m, k = a.shape
    n = b.shape[1]
    alpha, beta = float(alpha), float(beta)

    if a.device.type == "cpu":
        res = sgemm_reference(a, b, c, alpha, beta)
        if c is None:
            return res
        return c.copy_(res)

    if m == 0 or n == 0:
        return c if c is not None else torch.empty(m, n, dtype=torch.float32, device=a.device)
    if k == 0:  # A @ B is all zeros
        if c is None:
            return torch.zeros(m, n, dtype=torch.float32, device=a.device)
        return c.zero_() if beta == 0 else c.mul_(beta)

    a_k = a if a.is_contiguous() else a.contiguous()  # explicit copies of strided operands
    b_k = b if b.is_contiguous() else b.contiguous()
    if c is None:
        c_k = torch.empty(m, n, dtype=torch.float32, device=a.device)
    elif c.is_contiguous():
        c_k = c
    else:
        c_k = c.contiguous() if beta != 0 else torch.empty(m, n, dtype=torch.float32, device=a.device)
    if c is not None and (_overlaps(c_k, a_k) or _overlaps(c_k, b_k)):
        raise ValueError("c must not share memory with a or b")

    info = device_info(a.device.index)
    cfg, _ = decide(m, n, vector_ok(a_k, b_k, c_k), kernel, info.sm_count, info.smem_per_block_optin)
    launch_config(cfg, a_k, b_k, c_k, alpha, beta)
    if c is not None and c_k is not c:
        c.copy_(c_k)
        return c
    return c_k
