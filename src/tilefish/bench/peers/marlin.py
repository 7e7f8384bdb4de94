"""The original Marlin FP16xINT4 kernel (IST-DASLab/marlin) as a benchmark peer of the W4A16 GEMM.

Marlin is not a pip package with wheels: it is two source files (``marlin/marlin_cuda.cpp``, the
torch binding, and ``marlin/marlin_cuda_kernel.cu``) built as a torch C++/CUDA extension. This module

* converts a tilefish :class:`Int4Weight` into Marlin's weight and scale layout (:func:`pack_marlin`,
  pure torch, any device) and back (:func:`unpack_marlin`), so both kernels multiply the same
  integers and the same scales;
* builds the extension with ``torch.utils.cpp_extension.load`` from a vendored copy of the two files
  (default ``<repo>/.peers/marlin/``, an ignored path; ``scripts/vendor_marlin.sh`` makes it) into
  ``$TILEFISH_CACHE_DIR/v<version>/peers/marlin-<hash>/``, patching one PTX helper first (below);
* calls it with Marlin's own defaults (:meth:`MarlinPeer.matmul`).

What Marlin supports (checked by :meth:`MarlinPeer.available`; from its ``Layer`` and ``marlin_cuda``):
fp16 activations and scales only; symmetric weights (``q - 8``, as tilefish's ``zeros=None``); group
size -1 (one group over k) or 128; ``k % 128 == 0`` and ``n % 256 == 0`` (its default thread tiles are
k128 x n128 for m <= 16 and k64 x n256 above, and ``Layer`` asks for both at once); sm_80 or newer
(cp.async, ldmatrix, mma.m16n8k16). Any m >= 1. The workspace is ``n / 128 * max_par`` int32 zeros
(its lock counters, left zero by every launch), ``max_par = 16`` by default.

Marlin's layout, for a logical weight ``W [n, k]`` (tilefish's ``q`` transposed to Marlin's ``[k, n]``):

* B, int32 ``[k / 16, 2 n]``: each row holds one 16-row band of k. The band is cut into 16 x 16 tiles
  (k x n), each tile written row-major (k outer), tiles side by side along n. Every 4 tiles (1024
  values) are then reordered so that one 16-byte load by lane ``l`` of a warp brings, for each of the 4
  tiles, the 8 values that lane needs for two m16n8k16 B fragments: k rows ``2 (l % 4) + {0, 1, 8, 9}``
  of n column ``l / 4`` and of column ``l / 4 + 8``. Within each 8 values the order is then
  interleaved ``[0, 2, 4, 6, 1, 3, 5, 7]`` before packing nibble i (bits 4i..4i+3) from value i, so that
  one mask ``0x000f000f`` (and shifts of it) picks a (value 2j, value 2j+1) pair into a half2.
* s, fp16 ``[groups, n]`` (groups = k / 128, or 1): the scales transposed, each row's n columns
  permuted in blocks: grouped, blocks of 64 transposed as 8 x 8; one group (``G == k``, also when
  k == 128 with group 128, as Marlin decides it by ``s.shape[0] == 1``), blocks of 32 in the order
  ``(i, j) -> 2 i + [0, 1, 8, 9, 16, 17, 24, 25][j]``.

The PTX patch: Marlin streams B with ``createpolicy.fractional.L2::evict_first`` feeding
``cp.async.cg.shared.global.L2::cache_hint``. ptxas 13.x drops the createpolicy and the kernel traps
(as reported from the GPU runs; not reproducible without a GPU), so the build replaces that pair with a plain
``cp.async.cg.shared.global`` (the same copy without the L2 eviction hint). It is a text patch applied
to a copy of the vendored source in the build directory (the vendored copy stays as fetched); the
build fails, naming the pattern, if the source no longer holds it.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ...quant.int4 import Int4Weight

__all__ = [
    "KERNEL_FILE",
    "BINDING_FILE",
    "MAX_PAR",
    "SUPPORTED_GROUPS",
    "MarlinBuildError",
    "MarlinPatchError",
    "MarlinPeer",
    "MarlinWeight",
    "pack_marlin",
    "unpack_marlin",
    "patch_kernel_source",
    "find_source_dir",
    "vendor_sources",
    "workspace_size",
]

KERNEL_FILE = "marlin_cuda_kernel.cu"
BINDING_FILE = "marlin_cuda.cpp"
SOURCE_ENV = "TILEFISH_MARLIN_SRC"  # a directory holding the two files; else .peers/marlin/
MAX_PAR = 16                        # Marlin's Python default (marlin.mul and Layer's workspace)
SUPPORTED_GROUPS = (-1, 128)
K_MULTIPLE, N_MULTIPLE = 128, 256   # Layer's check; covers both default thread tiles (k128 n128, k64 n256)
TILE = 16                           # the 16 x 16 (k x n) tile of the B layout
NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds value NIBBLE_ORDER[i] of its 8


class MarlinPatchError(RuntimeError):
    """The vendored kernel source does not hold the PTX the build must patch."""


class MarlinBuildError(RuntimeError):
    """The Marlin extension did not build (the message's last lines carry the compiler output)."""


# ----------------------------------------------------------------------------------------------------------------
# layout


def _lane_tile_order(device=None) -> torch.Tensor:
    """int64 [1024]: position j of a packed 1024-value block (4 tiles) takes tile-order value [j].

    Tile order: tile t (0..3) of the block, then row r (k) and column c (n) of the 16 x 16 tile:
    t * 256 + r * 16 + c. Lane l's 32 values (one 16-byte load, 4 words) are, for each tile t, the
    k rows 2 (l % 4) + {0, 1, 8, 9} of columns l / 4 (first half) and l / 4 + 8 (second half) -- the
    m16n8k16 B fragments of the n8 blocks 0 and 1 -- each 8 then interleaved by NIBBLE_ORDER.
    """
    lane = torch.arange(32, device=device)
    rows = 2 * (lane % 4)[:, None] + torch.tensor([0, 1, 8, 9], device=device)           # [32, 4]
    cols = (lane // 4)[:, None] + torch.tensor([0, 8], device=device)                     # [32, 2]
    frag = TILE * rows[:, None, :] + cols[:, :, None]                                     # [32, 2 halves, 4 rows]
    per_tile = frag.reshape(32, 1, 8) + (TILE * TILE) * torch.arange(4, device=device)[None, :, None]
    interleave = torch.tensor(NIBBLE_ORDER, device=device)
    return per_tile[:, :, interleave].reshape(-1)                                         # [32 lanes * 4 tiles * 8]


def _scale_order(single: bool, device=None) -> torch.Tensor:
    """int64 [P]: Marlin's scale column j (within a block of P) takes logical column [j]."""
    if single:  # P = 32: i in 0..3 outer, then 8 columns 2i + {0, 1} + 8 * {0..3}
        return torch.arange(32, device=device).reshape(4, 4, 2).permute(1, 0, 2).reshape(-1)
    return torch.arange(64, device=device).reshape(8, 8).t().reshape(-1)  # P = 64: an 8 x 8 transpose


def _check_layout_shape(n: int, k: int, group_size: int) -> None:
    if group_size not in SUPPORTED_GROUPS:
        raise ValueError(f"Marlin supports group_size -1 or 128; got {group_size}")
    if k % TILE or k <= 0:
        raise ValueError(f"Marlin's layout needs k (in_features) a positive multiple of {TILE}; got {k}")
    if n % 64 or n <= 0:
        raise ValueError(f"Marlin's layout needs n (out_features) a positive multiple of 64; got {n}")
    if group_size != -1 and k % group_size:
        raise ValueError(f"k = {k} must be a multiple of group_size = {group_size}")


def _single_group(k: int, group_size: int) -> bool:
    return group_size == -1 or group_size == k


def pack_marlin(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(B int32 [k / 16, 2 n], s fp16 [groups, n]) in Marlin's layout, on w's device: the same integers
    and scales as ``w`` (symmetric, fp16 scales, group -1 or 128, n % 64 == 0, k % 16 == 0)."""
    if not isinstance(w, Int4Weight):
        raise TypeError(f"pack_marlin takes an Int4Weight; got {type(w).__name__}")
    if w.zeros is not None:
        raise ValueError("Marlin is symmetric only (q - 8); this weight has zero points")
    if w.scales.dtype != torch.float16:
        raise TypeError(f"Marlin's scales are fp16; this weight's are {w.scales.dtype}")
    n, k = w.n, w.k
    _check_layout_shape(n, k, w.group_size)
    dev = w.q.device
    t = w.q.t().to(torch.int64)                                                   # [k, n], Marlin's orientation
    t = t.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3)           # [band, n tile, r, c]
    t = t.reshape(-1, 1024)[:, _lane_tile_order(dev)]                             # 4 tiles a block, lane order
    t = t.reshape(k // TILE, 2 * n, 8)
    words = (t << (4 * torch.arange(8, device=dev))).sum(-1)                      # nibble i from value i; < 2^32
    words = words - ((words >> 31) << 32)                                         # as signed int32
    B = words.to(torch.int32).contiguous()

    s = w.scales.t()                                                              # [groups, n]
    order = _scale_order(_single_group(k, w.group_size), dev)
    s = s.reshape(-1, order.numel())[:, order].reshape(w.groups, n).contiguous()
    return B, s


def unpack_marlin(B: torch.Tensor, s: torch.Tensor, n: int, k: int, group_size: int) -> Int4Weight:
    """The Int4Weight (symmetric, fp16 scales) that :func:`pack_marlin` turned into (B, s)."""
    _check_layout_shape(n, k, group_size)
    groups = 1 if _single_group(k, group_size) else k // group_size
    if not isinstance(B, torch.Tensor) or B.dtype != torch.int32 or tuple(B.shape) != (k // TILE, 2 * n):
        raise ValueError(f"B must be int32 [k / 16, 2 n] = {(k // TILE, 2 * n)}; got "
                         f"{getattr(B, 'dtype', type(B).__name__)} {tuple(getattr(B, 'shape', ()))}")
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float16 or tuple(s.shape) != (groups, n):
        raise ValueError(f"s must be fp16 [groups, n] = {(groups, n)}; got "
                         f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")
    dev = B.device
    words = B.to(torch.int64) & 0xFFFFFFFF
    vals = (words.unsqueeze(-1) >> (4 * torch.arange(8, device=dev))) & 0xF       # [k / 16, 2 n, 8]
    blocks = vals.reshape(-1, 1024)
    tiles = torch.empty_like(blocks)
    tiles[:, _lane_tile_order(dev)] = blocks
    q = tiles.reshape(k // TILE, n // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(k, n)
    order = _scale_order(groups == 1, dev)
    flat = s.reshape(-1, order.numel())
    scales = torch.empty_like(flat)
    scales[:, order] = flat
    scales = scales.reshape(groups, n).t().contiguous()
    return Int4Weight(q.t().to(torch.uint8).contiguous(), scales, None, group_size)


def workspace_size(n: int, max_par: int = MAX_PAR) -> int:
    """Marlin's lock workspace, in int32 entries: ``n / 128 * max_par`` (its binding's check)."""
    return n // 128 * max_par


# ----------------------------------------------------------------------------------------------------------------
# sources and the PTX patch

# cp_async4_stream's asm body: a fractional evict-first policy, then the hinted copy.
_POLICY_RE = re.compile(
    r'"\s*\.reg\s+\.b64\s+p;\\n"\s*'
    r'"\s*createpolicy\.fractional\.L2::evict_first\.b64\s+p,\s*1\.0;\s*(?:\\n)?"\s*'
    r'"\s*cp\.async\.cg\.shared\.global\.L2::cache_hint\s+\[%0\],\s*\[%1\],\s*%2,\s*p;\\n"'
)
_PLAIN_COPY = '"   cp.async.cg.shared.global [%0], [%1], %2;\\n"'


def patch_kernel_source(text: str) -> str:
    """Marlin's kernel source with its L2 evict-first ``createpolicy`` + ``cp.async ... .L2::cache_hint``
    pair replaced by a plain ``cp.async.cg.shared.global`` (same copy, no hint); with ptxas 13.x the
    createpolicy is dropped and the kernel traps. Raises MarlinPatchError unless the pattern occurs
    exactly once (a source that changed must be looked at, not silently built)."""
    found = _POLICY_RE.findall(text)
    if len(found) != 1:
        raise MarlinPatchError(
            f"expected the createpolicy.fractional.L2::evict_first + cp.async.cg.shared.global.L2::cache_hint "
            f"asm pair exactly once in {KERNEL_FILE}; found it {len(found)} times (a different Marlin revision? "
            f"check cp_async4_stream)")
    out = _POLICY_RE.sub(lambda _: _PLAIN_COPY, text)
    assert "createpolicy" not in out and ".L2::cache_hint" not in out
    return out


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[4]  # src/tilefish/bench/peers/marlin.py -> the checkout


def _candidate_dirs() -> list[Path]:
    dirs = []
    if os.environ.get(SOURCE_ENV):
        dirs.append(Path(os.environ[SOURCE_ENV]))
    dirs += [Path.cwd() / ".peers" / "marlin", _repo_root() / ".peers" / "marlin"]
    return list(dict.fromkeys(dirs))


def find_source_dir() -> Path | None:
    """The first of $TILEFISH_MARLIN_SRC, ./.peers/marlin, <repo>/.peers/marlin holding both files."""
    for d in _candidate_dirs():
        if (d / KERNEL_FILE).is_file() and (d / BINDING_FILE).is_file():
            return d
    return None


def vendor_sources(git_dir: str | os.PathLike, dest: str | os.PathLike | None = None, rev: str = "HEAD") -> Path:
    """Copy Marlin's two sources (and its LICENSE, COMMIT = the revision, marlin/__init__.py as
    marlin_layer.py for the layout test) out of a Marlin git directory (e.g. the fetched mirror) into
    dest (default <repo>/.peers/marlin). Returns dest. scripts/vendor_marlin.sh does the same."""
    import subprocess

    dest = Path(dest) if dest is not None else _repo_root() / ".peers" / "marlin"
    dest.mkdir(parents=True, exist_ok=True)

    def show(path: str) -> bytes:
        return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{rev}:{path}"], check=True,
                              capture_output=True).stdout

    for name in (KERNEL_FILE, BINDING_FILE):
        (dest / name).write_bytes(show(f"marlin/{name}"))
    (dest / "LICENSE").write_bytes(show("LICENSE"))
    (dest / "marlin_layer.py").write_bytes(show("marlin/__init__.py"))
    commit = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", rev], check=True, capture_output=True,
                            text=True).stdout.strip()
    (dest / "COMMIT").write_text(commit + "\n")
    return dest


# ----------------------------------------------------------------------------------------------------------------
# the peer


@dataclass
class MarlinWeight:
    """A weight in Marlin's layout, ready for :meth:`MarlinPeer.matmul`: B, s and its workspace."""

    B: torch.Tensor
    s: torch.Tensor
    workspace: torch.Tensor
    n: int
    k: int
    group_size: int


_BUILT: dict[str, object] = {}  # build key -> loaded extension module (one load per process)


class MarlinPeer:
    """Marlin (IST-DASLab/marlin) built as a torch extension from the vendored sources.

    ``available(dtype, group_size, k, n, symmetric)`` -> None or a one-line reason; ``build()`` (once,
    memoized; raises MarlinBuildError) -> the extension; ``prepare(w)`` -> MarlinWeight;
    ``matmul(x, B, s, workspace)`` -> fp16 [..., n].
    """

    name = "Marlin"

    def __init__(self, source_dir: str | os.PathLike | None = None, verbose: bool = False):
        self._source_dir = Path(source_dir) if source_dir is not None else None
        self.verbose = verbose
        self.build_error: str | None = None   # the one-line reason of a failed build
        self.build_log: str | None = None     # its full text
        self._module = None

    # -- environment probes (methods, so tests can replace them) -----------------------------------------------
    def source_dir(self) -> Path | None:
        if self._source_dir is not None:
            ok = (self._source_dir / KERNEL_FILE).is_file() and (self._source_dir / BINDING_FILE).is_file()
            return self._source_dir if ok else None
        return find_source_dir()

    def commit(self) -> str | None:
        """The vendored Marlin revision (COMMIT file written by the vendoring step), if known."""
        d = self.source_dir()
        f = d / "COMMIT" if d else None
        return f.read_text().strip() if f and f.is_file() else None

    def _cuda_home(self) -> str | None:
        from torch.utils import cpp_extension

        return cpp_extension.CUDA_HOME

    def _ninja(self) -> bool:
        from torch.utils import cpp_extension

        return cpp_extension.is_ninja_available()

    def _extra_includes(self) -> list[str]:
        """Marlin's binding includes ATen/cuda/CUDAContext.h, which needs cusparse.h / cublas_v2.h. A toolkit
        without them (a slim image) gets them from pip's nvidia-* wheels beside torch, if those have them."""
        import site
        import sys

        home = self._cuda_home()
        if home is None or (Path(home) / "include" / "cusparse.h").is_file():
            return []
        roots = [Path(p) for p in (*site.getsitepackages(), site.getusersitepackages(), *sys.path) if p]
        found = {str(d) for r in roots for d in r.glob("nvidia/*/include") if (d / "cusparse.h").is_file()}
        return sorted(found)

    def _torch_cuda(self) -> str | None:
        return torch.version.cuda

    def _capability(self) -> tuple[int, int] | None:
        return torch.cuda.get_device_capability() if torch.cuda.is_available() else None

    # -- availability ------------------------------------------------------------------------------------------
    @staticmethod
    def problem_reason(dtype=torch.float16, group_size: int = 128, k: int | None = None, n: int | None = None,
                       symmetric: bool = True) -> str | None:
        """Why Marlin cannot run this problem (None if it can): dtype, group size, zero points, shape."""
        if dtype != torch.float16:
            return f"fp16 only (got {str(dtype).replace('torch.', '')})"
        if group_size not in SUPPORTED_GROUPS:
            return f"group size -1 or 128 only (got {group_size})"
        if not symmetric:
            return "symmetric weights only (no zero points)"
        bad = []
        if k is not None and k % K_MULTIPLE:
            bad.append(f"k % {K_MULTIPLE} (k={k})")
        if n is not None and n % N_MULTIPLE:
            bad.append(f"n % {N_MULTIPLE} (n={n})")
        if bad:
            return "shape: needs " + ", ".join(bad) + " == 0"
        return None

    def environment_reason(self) -> str | None:
        """Why Marlin cannot be built or run here (None if it can, as far as is known before building)."""
        if self.source_dir() is None:
            where = ", ".join(str(d) for d in ([self._source_dir] if self._source_dir else _candidate_dirs()))
            return f"Marlin sources not vendored (looked in {where}; run scripts/vendor_marlin.sh)"
        if self._torch_cuda() is None:
            return "torch is a CPU-only build (no CUDA extension can be built)"
        if self._cuda_home() is None:
            return "nvcc not found (no CUDA toolkit; set CUDA_HOME)"
        if not self._ninja():
            return "ninja not found (torch.utils.cpp_extension.load needs it)"
        cap = self._capability()
        if cap is None:
            return "no CUDA device"
        if cap < (8, 0):
            return f"needs sm_80 or newer (device is sm_{cap[0]}{cap[1]})"
        if self.build_error is not None:
            return self.build_error
        return None

    def available(self, dtype=torch.float16, group_size: int = 128, k: int | None = None, n: int | None = None,
                  symmetric: bool = True, build: bool = False) -> str | None:
        """None when Marlin can run this problem here, else a one-line reason. build=True also builds
        (once) and reports a failed build as the reason."""
        why = self.problem_reason(dtype, group_size, k, n, symmetric) or self.environment_reason()
        if why is None and build:
            try:
                self.build()
            except MarlinBuildError:
                why = self.build_error
        return why

    # -- build -------------------------------------------------------------------------------------------------
    def _arch(self) -> str:
        cap = self._capability()
        return f"{cap[0]}.{cap[1]}" if cap else "none"

    def build(self):
        """The loaded extension module (``mul(A, B, C, s, workspace, thread_k, thread_n, sms, max_par)``),
        compiled on first use into the tilefish cache directory. Raises MarlinBuildError with the reason."""
        if self._module is not None:
            return self._module
        if self.build_error is not None:
            raise MarlinBuildError(self.build_error)
        why = self.environment_reason()
        if why is not None:
            raise MarlinBuildError(why)
        from torch.utils import cpp_extension

        from ... import __version__
        from ...runtime.compiler import cache_dir

        src = self.source_dir()
        try:
            kernel = patch_kernel_source((src / KERNEL_FILE).read_text())
        except MarlinPatchError as e:
            self.build_error = f"build failed: {e}"
            raise MarlinBuildError(self.build_error) from e
        binding = (src / BINDING_FILE).read_text()
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST") or self._arch()
        key = hashlib.sha256("\0".join([kernel, binding, torch.__version__, str(self._torch_cuda()), arch,
                                        __version__]).encode()).hexdigest()[:16]
        if key in _BUILT:
            self._module = _BUILT[key]
            return self._module
        build_dir = cache_dir() / f"v{__version__}" / "peers" / f"marlin-{key}"
        build_dir.mkdir(parents=True, exist_ok=True)
        for name, text in ((KERNEL_FILE, kernel), (BINDING_FILE, binding)):
            path = build_dir / name
            if not path.is_file() or path.read_text() != text:  # rewriting would force a rebuild
                tmp = path.with_suffix(path.suffix + ".tmp")
                tmp.write_text(text)
                os.replace(tmp, path)
        old_arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # the current device only, not every arch torch knows
        try:
            module = cpp_extension.load(
                name=f"tilefish_marlin_{key}",
                sources=[str(build_dir / BINDING_FILE), str(build_dir / KERNEL_FILE)],
                extra_cflags=["-O3"],
                extra_include_paths=self._extra_includes(),
                extra_cuda_cflags=["-O3", "-lineinfo", "--expt-relaxed-constexpr"],  # ceildiv in device code
                build_directory=str(build_dir),
                verbose=self.verbose,
            )
        except Exception as e:  # compiler errors arrive as RuntimeError / CalledProcessError / ImportError
            self.build_log = f"{type(e).__name__}: {e}"
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            detail = next((ln for ln in lines if "error" in ln.lower() and ln != lines[0]), lines[0] if lines
                          else type(e).__name__)
            self.build_error = f"build failed: {detail[:200]} (log: {build_dir})"
            (build_dir / "build_error.log").write_text(self.build_log)
            raise MarlinBuildError(self.build_error + "\n" + self.build_log) from e
        finally:
            if old_arch is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = old_arch
        _BUILT[key] = self._module = module
        return module

    # -- use ---------------------------------------------------------------------------------------------------
    @staticmethod
    def workspace(n: int, device, max_par: int = MAX_PAR) -> torch.Tensor:
        """Zeroed int32 lock workspace of ``n / 128 * max_par`` entries (allocate once per weight)."""
        return torch.zeros(workspace_size(n, max_par), dtype=torch.int32, device=device)

    def prepare(self, w: Int4Weight, device=None) -> MarlinWeight:
        """w in Marlin's layout on ``device`` (default: w's), with its workspace. Raises ValueError when
        Marlin cannot run it (see problem_reason)."""
        why = self.problem_reason(w.scales.dtype, w.group_size, w.k, w.n, w.symmetric)
        if why is not None:
            raise ValueError(f"Marlin cannot run this weight: {why}")
        device = torch.device(device) if device is not None else w.device
        B, s = pack_marlin(w.to(device))
        return MarlinWeight(B, s, self.workspace(w.n, device), w.n, w.k, w.group_size)

    def matmul(self, x: torch.Tensor, B: torch.Tensor, s: torch.Tensor, workspace: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W^T with Marlin's defaults (thread_k = thread_n = -1: auto tiles, sms = -1: all SMs,
        max_par = 16). x fp16 CUDA [..., k]; B, s from pack_marlin; workspace from :meth:`workspace`."""
        mod = self._module or self.build()
        k, n = x.shape[-1], s.shape[1]
        if x.dtype != torch.float16 or not x.is_cuda:
            raise TypeError(f"Marlin takes fp16 CUDA activations; got {x.dtype} on {x.device}")
        if B.shape[0] * TILE != k or B.shape[1] != 2 * n:
            raise ValueError(f"B {tuple(B.shape)} does not fit x's k = {k} and s's n = {n}")
        x2 = x.reshape(-1, k)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if out is None:
            out = torch.empty(x2.shape[0], n, dtype=torch.float16, device=x.device)
        mod.mul(x2, B, out, s, workspace, -1, -1, -1, MAX_PAR)
        return out.view(*x.shape[:-1], n)
