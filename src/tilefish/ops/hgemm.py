"""HGEMM ladder: C = A @ B in fp16 / bf16 on tensor cores (mma.sync m16n8k16, fp32 accumulation).

validate -> pick a ladder step and its tile configuration -> get the kernel -> launch.

Steps (kernels/hgemm/<name>.cu, docs/hgemm.md explains each):
  01_mma_naive       one warp per 16 x 8 tile, one mma per k step, operands through smem
  02_block_ldmatrix  block tiling, several warps, ldmatrix.x4 (A) / x2(.trans) (B)
  03_padded          + padded smem rows (no ldmatrix bank conflicts)
  04_swizzled        + XOR swizzle instead of padding (conflict-free, dense)
  05_multistage      + cp.async STAGES-deep pipeline, register double-buffered fragments
  06_rasterized      + grouped tile order (GROUP_M) for L2 reuse          <- kernel="auto"

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

kernel="auto": step AUTO_STEP with TUNED[step], or TUNED_SMALL[step] when TUNED's tile gives fewer
blocks than the GPU has SMs (small M x N).  TUNED / TUNED_SMALL are placeholders until an H200
tuning run (`tilefish bench hgemm --variants`) fills them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..runtime import KernelSpec, device_info, get_kernel, i32, launch

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
)}
KERNELS: tuple[str, ...] = tuple(STEPS)
AUTO_STEP = "06_rasterized"
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

    @property
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
    def threads(self) -> int:
        p = self.params
        return 32 if not p else (p["BM"] // p["WM"]) * (p["BN"] // p["WN"]) * 32

    @property
    def smem_bytes(self) -> int:
        """Shared memory per block (dynamic for steps 05-06, static otherwise), either B layout."""
        p = self.params
        if not p:
            return (16 * 16 + 16 * 8) * 2
        bm, bn, bk = p["BM"], p["BN"], p["BK"]
        if self.step == "03_padded":  # max over the two B layouts
            return (bm * (bk + 8) + max(bk * (bn + 8), bn * (bk + 8))) * 2
        return (bm + bn) * bk * 2 * p.get("STAGES", 1)

    @property
    def dynamic_smem(self) -> int:
        return self.smem_bytes if self.info.dynamic_smem else 0

    def grid_tiles(self, m: int, n: int) -> tuple[int, int]:
        bm, bn = self.tile
        return -(-m // bm), -(-n // bn)

    def grid(self, m: int, n: int):
        """Launch grid: 1-D grouped order for step 06, (tiles_n, tiles_m) for the others."""
        tm, tn = self.grid_tiles(m, n)
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
        if min(self.values) <= 0:
            return "parameters must be positive"
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
    return KernelSpec(cfg.info.source, f"{cfg.info.func}<{args}>", hot=cfg.info.index >= HOT_FROM)


def _cfg(step: str, *values: int) -> HgemmConfig:
    cfg = HgemmConfig(step, tuple(values))
    assert cfg.problem() is None, (cfg, cfg.problem())
    return cfg


# Chosen configuration per step: steps 05-06 from the H200 variant sweep at 4096^3 fp16
# (bench/results/h200/hgemm_variants.json: 128x128x64, 64x64 warps, 3 stages, 50% of cuBLAS);
# steps 02-04 keep the classic 128 x 128 x 32 / 8-warp tiling of the teaching ladder.
TUNED: dict[str, HgemmConfig] = {
    "01_mma_naive": _cfg("01_mma_naive"),
    "02_block_ldmatrix": _cfg("02_block_ldmatrix", 128, 128, 32, 64, 32),
    "03_padded": _cfg("03_padded", 128, 128, 32, 64, 32),
    "04_swizzled": _cfg("04_swizzled", 128, 128, 32, 64, 32),
    "05_multistage": _cfg("05_multistage", 128, 128, 64, 64, 64, 3),
    "06_rasterized": _cfg("06_rasterized", 128, 128, 64, 64, 64, 3, 8),
}
# Used instead of TUNED[step] when TUNED's tile gives fewer blocks than SMs (small M x N, decode).
TUNED_SMALL: dict[str, HgemmConfig] = {
    "05_multistage": _cfg("05_multistage", 64, 64, 64, 32, 32, 4),
    "06_rasterized": _cfg("06_rasterized", 64, 64, 64, 32, 32, 4, 8),
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


def variant_configs(step: str | None = None) -> list[HgemmConfig]:
    """The tuning space of steps 05-06 (every entry instantiates): tiles x BK {32, 64} x STAGES {3, 4}."""
    steps = [step] if step else ["05_multistage", "06_rasterized"]
    out: list[HgemmConfig] = []
    for st in steps:
        if st not in STEPS:
            raise ValueError(f"unknown HGEMM step {st!r}; one of {KERNELS}")
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
    """KernelSpecs of the steps 05-06 tuning space, both dtypes and both B layouts."""
    return _all_specs(variant_configs())


def dispatch_specs() -> list[KernelSpec]:
    """Every KernelSpec `hgemm` can launch: TUNED + TUNED_SMALL of every step x dtype x B layout."""
    return _all_specs(list(TUNED.values()) + list(TUNED_SMALL.values()))


def _dedup(items) -> list:
    seen, out = set(), []
    for s in items:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# --- validation ------------------------------------------------------------------------------
def _check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPES:
        raise TypeError(f"hgemm takes float16 or bfloat16: {name} has dtype {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def _validate(a, b, kernel, b_transposed) -> tuple[int, int, int]:
    _check_tensor("a", a)
    _check_tensor("b", b)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if not isinstance(b_transposed, bool):
        raise TypeError(f"b_transposed must be a bool, got {type(b_transposed).__name__}")
    m, k = a.shape
    n, kb = (b.shape[0], b.shape[1]) if b_transposed else (b.shape[1], b.shape[0])
    if k != kb:
        what = "b [N, K]" if b_transposed else "b [K, N]"
        raise ValueError(f"inner dimensions differ: a is {tuple(a.shape)}, {what} is {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    if a.device.type not in ("cuda", "cpu"):
        raise ValueError(f"hgemm runs on CUDA or CPU tensors, not {a.device}")
    if not (isinstance(kernel, HgemmConfig) or kernel == "auto" or kernel in STEPS):
        raise ValueError(f"kernel must be 'auto', one of {KERNELS} or an HgemmConfig, got {kernel!r}")
    if isinstance(kernel, HgemmConfig) and kernel.problem() is not None:
        raise ValueError(f"{kernel.label()} cannot be instantiated: {kernel.problem()}")
    if max(m, n, k) > _INT_MAX:
        raise ValueError(f"dimensions must fit in int32, got M={m}, N={n}, K={k}")
    return m, n, k


def _check_kernel_preconditions(k: int, n: int, b_nk: bool, a: torch.Tensor, b: torch.Tensor) -> None:
    if k % K_MULTIPLE:
        raise ValueError(f"hgemm needs K % {K_MULTIPLE} == 0 (16-byte rows of a), got K={k}; "
                         "pad K with zeros")
    if not b_nk and n % K_MULTIPLE:
        raise ValueError(f"hgemm with b [K, N] needs N % {K_MULTIPLE} == 0 (16-byte rows of b), got N={n}; "
                         "pass b as [N, K] with b_transposed=True for any N")
    for name, t in (("a", a), ("b", b)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (data_ptr() % 16 == 0), got an offset of "
                             f"{t.data_ptr() % 16} bytes; use .clone()")


def _tuned_for(step: str, m: int, n: int, sm_count: int) -> HgemmConfig:
    cfg = TUNED[step]
    small = TUNED_SMALL.get(step)
    if small is not None and cfg.blocks(m, n) < sm_count:
        return small
    return cfg


def select(m: int, n: int, kernel="auto", sm_count: int = 132) -> HgemmConfig:
    """The configuration `hgemm` runs for an M x N output."""
    if isinstance(kernel, HgemmConfig):
        return kernel
    return _tuned_for(AUTO_STEP if kernel == "auto" else kernel, m, n, sm_count)


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
    """Launch one configuration on contiguous, validated CUDA operands (no checks: the tuner's hot path)."""
    m, k = a.shape
    n = c.shape[1]
    grid = cfg.grid(m, n)
    if isinstance(grid, tuple) and grid[1] > 65535:
        raise ValueError(f"M={m} needs {grid[1]} tile rows of {cfg.tile[0]}, more than gridDim.y allows "
                         f"(65535); use kernel='06_rasterized' (1-D grid)")
    if not isinstance(grid, tuple) and grid > _INT_MAX:
        raise ValueError(f"{m} x {n} needs {grid} blocks, more than a 1-D grid holds")
    kern = get_kernel(cfg.spec(a.dtype, b_nk), a.device)
    launch(kern, grid, cfg.threads, a.data_ptr(), b.data_ptr(), c.data_ptr(), i32(m), i32(n), i32(k),
           smem=cfg.dynamic_smem)
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
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    cfg = select(m, n, kernel, device_info(a.device.index).sm_count)
    return launch_config(cfg, a_k, b_k, c, b_nk)
