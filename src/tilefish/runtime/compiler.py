"""CUDA C++ source + name expression + defines + arch -> cubin, with a disk cache.

NVRTC runs without a GPU, so everything here works on a CPU-only machine: that is how
`tilefish compile` and the CI compile test check every kernel variant for sm_80 and sm_90.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__

KERNEL_ROOT = Path(__file__).resolve().parent.parent / "kernels"

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class KernelSpec:
    """One dispatchable kernel variant.

    source: path below kernels/, e.g. "nf4/dequantize.cu".
    name:   a name expression ("nf4_dequantize<__nv_bfloat16, 0>") or an extern "C" symbol.
    defines: (NAME, VALUE) pairs passed as -D.
    hot:    a kernel on a hot path: the compile test fails if it spills.
    arch_specific: built for sm_90a (wgmma, TMA, setmaxnreg): sm_90 only, since wgmma exists on no
            other arch (sm_100a / sm_120 have none) and an "a" cubin runs on its own arch alone.
    min_sm: lowest compute capability (as 80, 90) the variant can be built for.
    """

    source: str
    name: str
    defines: tuple[tuple[str, str], ...] = ()
    hot: bool = False
    arch_specific: bool = False
    min_sm: int = 80

    def target(self, arch: str) -> str:
        arch = arch.rstrip("a")
        return arch + "a" if self.arch_specific and arch == "sm_90" else arch

    def supports(self, arch: str) -> bool:
        sm = int(arch.rstrip("a").split("_")[1])
        return sm == 90 if self.arch_specific else sm >= self.min_sm


@dataclass
class Resources:
    registers: int = -1
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    static_smem: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass
class CompiledKernel:
    spec: KernelSpec
    arch: str
    cubin: bytes
    lowered_name: str
    log: str
    resources: Resources = field(default_factory=Resources)
    from_cache: bool = False


class CompileError(RuntimeError):
    """NVRTC rejected a kernel; carries the kernel name and the full compile log."""

    def __init__(self, spec: KernelSpec, arch: str, log: str):
        self.spec, self.arch, self.log = spec, arch, log
        super().__init__(f"NVRTC failed to compile {spec.name!r} from kernels/{spec.source} "
                         f"for {arch} (defines {dict(spec.defines)}):\n{log}")


def cache_dir() -> Path:
    return Path(os.environ.get("TILEFISH_CACHE_DIR", Path.home() / ".cache" / "tilefish"))


def cache_enabled() -> bool:
    """False under TILEFISH_CACHE=0 (or false / no / off): every compile runs NVRTC."""
    return os.environ.get("TILEFISH_CACHE", "1") not in ("0", "false", "no", "off")


def line_info_enabled() -> bool:
    """True under TILEFISH_LINEINFO=1: kernels are built with -lineinfo (line tables for
    compute-sanitizer and ncu reports; the code is the same) under cache keys of their own."""
    return os.environ.get("TILEFISH_LINEINFO", "0") in ("1", "true", "yes", "on")


def _read_with_includes(path: Path, seen: set[Path] | None = None) -> str:
    """The file's text followed by every quoted include it pulls in (for the cache key)."""
    seen = set() if seen is None else seen
    path = path.resolve()
    if path in seen:
        return ""
    seen.add(path)
    text = path.read_text()
    parts = [text]
    for inc in _INCLUDE_RE.findall(text):
        for base in (path.parent, KERNEL_ROOT):
            cand = base / inc
            if cand.is_file():
                parts.append(f"\n//@@ {inc}\n" + _read_with_includes(cand, seen))
                break
    return "".join(parts)


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def _include_dirs(source: Path) -> list[str]:
    import cuda.pathfinder as pf

    dirs = [str(source.parent), str(KERNEL_ROOT)]
    cudart = pf.find_nvidia_header_directory("cudart")
    if cudart:
        dirs.append(str(cudart))
    return dirs


def _options(spec: KernelSpec, target: str, source: Path):
    from cuda.core import ProgramOptions

    return ProgramOptions(
        name=f"kernels/{spec.source}",
        arch=target,
        std="c++17",
        include_path=_include_dirs(source),
        define_macro=[(k, str(v)) for k, v in spec.defines] or None,
        ptxas_options=["-v"],
        lineinfo=line_info_enabled(),
    )


def cache_key(spec: KernelSpec, arch: str) -> str:
    source = KERNEL_ROOT / spec.source
    h = hashlib.sha256()
    for part in (_read_with_includes(source), spec.name, repr(spec.defines), spec.target(arch),
                 nvrtc_version(), __version__, "std=c++17;ptxas=-v" + (";lineinfo" if line_info_enabled() else "")):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


_RES_BLOCK = re.compile(r"Function properties for (\S+)\n(.*?)(?=Function properties for|\Z)", re.S)


def parse_resources(log: str, lowered_name: str) -> Resources:
    """Registers, stack, spills and static smem of one function from a `ptxas -v` log."""
    res = Resources()
    for m in _RES_BLOCK.finditer(log):
        if m.group(1) != lowered_name:
            continue
        body = m.group(2)
        if s := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", body):
            res.stack_bytes, res.spill_stores, res.spill_loads = map(int, s.groups())
        if r := re.search(r"Used (\d+) registers", body):
            res.registers = int(r.group(1))
        if sm := re.search(r"(\d+) bytes smem", body):
            res.static_smem = int(sm.group(1))
    return res


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _load_cached(spec: KernelSpec, arch: str, key: str) -> CompiledKernel | None:
    base = cache_dir() / f"v{__version__}"
    try:
        meta = json.loads((base / f"{key}.json").read_text())
        cubin = (base / f"{key}.cubin").read_bytes()
        if hashlib.sha256(cubin).hexdigest() != meta["cubin_sha256"]:
            return None
        return CompiledKernel(spec, arch, cubin, meta["lowered_name"], meta["log"],
                              parse_resources(meta["log"], meta["lowered_name"]), from_cache=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or corrupt entry: recompile


def is_cached(spec: KernelSpec, arch: str) -> bool:
    """Whether the disk cache holds a whole entry for the kernel (compile_kernel would not run NVRTC)."""
    return _load_cached(spec, arch, cache_key(spec, arch)) is not None


def _store(ck: CompiledKernel, key: str) -> None:
    base = cache_dir() / f"v{__version__}"
    try:
        _atomic_write(base / f"{key}.cubin", ck.cubin)
        meta = {"lowered_name": ck.lowered_name, "log": ck.log, "spec": repr(ck.spec),
                "arch": ck.arch, "cubin_sha256": hashlib.sha256(ck.cubin).hexdigest()}
        _atomic_write(base / f"{key}.json", json.dumps(meta).encode())
    except OSError:
        pass  # a read-only or full cache directory must never break a call


def compile_kernel(spec: KernelSpec, arch: str, use_cache: bool | None = None) -> CompiledKernel:
    """Compile (or fetch from the disk cache) one kernel variant for `arch` ('sm_80', 'sm_90')."""
    from cuda.core import Program
    from cuda.core._utils.cuda_utils import NVRTCError

    if not spec.supports(arch):
        need = "sm_90 (built for sm_90a)" if spec.arch_specific else f"sm_{spec.min_sm} or newer"
        raise ValueError(f"{spec.name} needs {need}, not {arch}")
    use_cache = cache_enabled() if use_cache is None else use_cache
    key = cache_key(spec, arch)
    if use_cache and (hit := _load_cached(spec, arch, key)) is not None:
        return hit

    source = KERNEL_ROOT / spec.source
    target = spec.target(arch)
    prog = Program(source.read_text(), code_type="c++", options=_options(spec, target, source))
    log = io.StringIO()
    try:
        obj = prog.compile("cubin", name_expressions=[spec.name], logs=log)
    except NVRTCError as e:
        raise CompileError(spec, target, str(e) + log.getvalue()) from None
    finally:
        prog.close()
    mapping = obj.symbol_mapping or {}
    lowered = mapping.get(spec.name, spec.name)
    if isinstance(lowered, bytes):
        lowered = lowered.decode()
    text = log.getvalue()
    ck = CompiledKernel(spec, arch, bytes(obj.code), lowered, text, parse_resources(text, lowered))
    if use_cache:
        _store(ck, key)
    return ck


def _compile_job(job: tuple[KernelSpec, str]) -> tuple[Resources | None, str | None]:
    """One compile_many job, in a worker process or in the caller's."""
    spec, arch = job
    try:
        ck = compile_kernel(spec, arch)
        if ck.resources.registers < 0 and ck.from_cache:  # an entry stored without a ptxas report
            ck = compile_kernel(spec, arch, use_cache=False)
        return ck.resources, None
    except CompileError as e:
        return None, e.log


def compile_many(jobs: list[tuple[KernelSpec, str]], processes: int = 1, on_done=None, initializer=None,
                 initargs: tuple = ()) -> list[tuple[Resources | None, str | None]]:
    """Compile (spec, arch) jobs into the disk cache, in `processes` parallel processes (NVRTC is single-threaded).

    Returns, in job order, (resources, None), or (None, the compile log) for a CompileError; any other
    exception propagates. on_done(i, result) is called in this process as job i finishes (completion
    order). initializer(*initargs) runs first in every process that compiles (a caller's compiler patches).
    """
    from concurrent.futures import ProcessPoolExecutor, as_completed

    jobs = list(jobs)
    results: list = [None] * len(jobs)
    # With a CUDA driver present NVRTC serves repeated compiles from the driver's JIT cache
    # (~/.nv/ComputeCache) and ptxas then prints no -v report: the registers / spill check would
    # see nothing (195 of 1291 kernels on the H200 in a second compile-all). Set before the first
    # compile and inherited by the worker processes; undone on return.
    unset = "CUDA_CACHE_DISABLE" not in os.environ
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
    try:
        if processes <= 1 or len(jobs) <= 1:
            if initializer is not None:
                initializer(*initargs)
            for i, job in enumerate(jobs):
                results[i] = _compile_job(job)
                if on_done is not None:
                    on_done(i, results[i])
            return results
        with ProcessPoolExecutor(min(processes, len(jobs)), initializer=initializer, initargs=initargs) as pool:
            index = {pool.submit(_compile_job, job): i for i, job in enumerate(jobs)}
            for f in as_completed(index):
                i = index[f]
                results[i] = f.result()
                if on_done is not None:
                    on_done(i, results[i])
        return results
    finally:
        if unset:
            os.environ.pop("CUDA_CACHE_DISABLE", None)
