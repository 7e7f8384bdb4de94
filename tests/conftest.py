"""Shared test helpers: the gpu marker, per-dtype tolerances, relative error, NaN poisoning, ulps; the
per-test seed (every failure names the seed that reproduces it); compile-all once per session; a large GPU
selection compiles every dispatchable kernel in parallel first (TILEFISH_TEST_WARM).

Seeds: each test starts with torch, random and numpy seeded from a session base seed and the test's id
(`seed_for`), so a test's random data do not depend on which other tests ran before it. The base comes
from the environment variable TILEFISH_TEST_SEED, else it is drawn at random and printed in the session
header; a failing test's report carries a "tilefish seed" section with the command that reproduces it.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

SEED_ENV = "TILEFISH_TEST_SEED"


def _base_seed() -> int:
    text = os.environ.get(SEED_ENV, "").strip()
    if text:
        try:
            return int(text, 0)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV} must be an integer, got {text!r}") from None
    return random.SystemRandom().randrange(2**31)


BASE_SEED = _base_seed()


def seed_for(nodeid: str, base: int = BASE_SEED) -> int:
    """The seed of one test: a function of the base seed and the test's id only (not of the test order)."""
    return zlib.crc32(f"{base}:{nodeid}".encode()) & 0x7FFFFFFF


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # every device's generator
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass


_SEED_KEY = pytest.StashKey[int]()


def pytest_report_header(config):
    return f"tilefish: {SEED_ENV}={BASE_SEED} (set it to rerun with the same random data)"


@pytest.fixture(autouse=True)
def _seed_rngs(request) -> int:
    """Every test starts with torch / random / numpy seeded by its own seed."""
    s = seed_for(request.node.nodeid)
    request.node.stash[_SEED_KEY] = s
    seed_everything(s)
    return s


@pytest.fixture
def seed(_seed_rngs) -> int:
    """This test's seed, for tests that build their own generators from it."""
    return _seed_rngs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        s = item.stash.get(_SEED_KEY, None)
        rep.sections.append(("tilefish seed", f"this test's seed {s}; to rerun it with the same random data:\n"
                                              f"  {SEED_ENV}={BASE_SEED} pytest '{item.nodeid}'"))

# Relative-error tolerances ||out - ref|| / ||ref|| for matmul-like ops, by output dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


# A large GPU selection on a fresh kernel cache would compile hundreds of kernels one at a time, as tests
# first launch them: such a run first compiles every dispatchable kernel for this GPU in parallel processes
# (the whole GPU suite on a fresh 16-core H100 machine: over 10 minutes without, 7 with, the 1,034 kernels in
# 54 s; the rest is the tests' forced configurations; about 2 minutes on a warm cache). TILEFISH_TEST_WARM=1
# forces it for any selection, =0 turns it off.
WARM_ENV = "TILEFISH_TEST_WARM"
WARM_MIN_GPU_TESTS = 200


def pytest_collection_finish(session):
    mode = os.environ.get(WARM_ENV, "").strip()
    if mode not in ("", "0", "1"):
        raise pytest.UsageError(f"{WARM_ENV} must be 0 or 1, got {mode!r}")
    n_gpu = sum(1 for item in session.items if "gpu" in item.keywords)
    if not HAS_CUDA or mode == "0" or (mode != "1" and n_gpu < WARM_MIN_GPU_TESTS):
        return
    from tilefish.bench.progress import warm_kernels
    from tilefish.ops import kernel_specs
    from tilefish.runtime import device_info

    line = warm_kernels([spec for _, spec in kernel_specs()], device_info().arch)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"tilefish: {line.replace(' before timing', '')} (before {n_gpu} GPU tests; "
                            f"{WARM_ENV}=0 skips this)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none visible to torch)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (unwritten elements?)"
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN so unwritten elements cannot pass a check."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)
    return t


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of a and b's (same) floating dtype."""
    assert a.dtype == b.dtype
    itype = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    bits = a.element_size() * 8

    def ordered(x):  # map float bits to a monotonic integer line (sign-magnitude -> two's complement)
        i = x.contiguous().view(itype).to(torch.int64)
        return torch.where(i < 0, -(i & ((1 << (bits - 1)) - 1)), i)

    return (ordered(a) - ordered(b)).abs()


def capture(fn):
    """fn() run once on a side stream (kernels loaded, plans made) and then captured in a CUDA graph there:
    (the graph, what the captured call returned, its tensors the graph's outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = fn()
    torch.cuda.current_stream().wait_stream(s)
    return graph, out


@pytest.fixture
def cuda():
    if not HAS_CUDA:
        pytest.skip("needs an NVIDIA GPU")
    return torch.device("cuda")


# Kernels launched on this GPU by other processes: a loop of small kernels and a GEMM, until the parent exits.
_OTHER_PROCESS_LOAD = """
import os, sys, torch
parent = os.getppid()
a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
v = torch.randn(1 << 20, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
while os.getppid() == parent:
    for _ in range(50):
        v.mul_(1.0001).add_(1e-6)
    a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


@pytest.fixture
def time_sliced_gpu(cuda):
    """Three other processes launch kernels on this GPU while the test runs, so the GPU time-slices between
    contexts: that is when a programmatic-dependent-launch chain that read the kernel ahead's output through
    L1 or the non-coherent cache got stale data (kernels/common/ptx.cuh, grid_dependency_wait)."""
    procs = [subprocess.Popen([sys.executable, "-c", _OTHER_PROCESS_LOAD], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                pytest.fail("a background GPU process did not start")
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


# ---- compile-all, once per session ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileAll:
    """One `tilefish compile --arch <arch>` run into a fresh kernel cache (`cache`, shared by the tests)."""
    arch: str
    cache: Path
    returncode: int
    stdout: str
    stderr: str


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@pytest.fixture(scope="session")
def compile_all(tmp_path_factory):
    """compile_all(arch) -> CompileAll: `tilefish compile --arch <arch> -j <cpus>` (every dispatchable kernel),
    run once per arch and session from an empty cache directory; tests that need every kernel compiled
    (the CLI's table, no spills, SASS) read that cache instead of compiling again."""
    cache = tmp_path_factory.mktemp("compile-all-cache")
    runs: dict[str, CompileAll] = {}

    def run(arch: str) -> CompileAll:
        if arch not in runs:
            env = {**os.environ, "TILEFISH_CACHE_DIR": str(cache), "TILEFISH_CACHE": "1"}
            r = subprocess.run([sys.executable, "-m", "tilefish.cli", "compile", "--arch", arch, "-j", str(_cpus())],
                               capture_output=True, text=True, timeout=3600, env=env)
            runs[arch] = CompileAll(arch, cache, r.returncode, r.stdout, r.stderr)
        return runs[arch]

    return run


@pytest.fixture
def compiled_cache(compile_all, monkeypatch):
    """use(arch) -> Path: compile-all for arch (once per session), then this process's kernel cache is its
    cache directory, so compile_kernel of a dispatchable kernel is a cache hit."""
    def use(arch: str) -> Path:
        run = compile_all(arch)
        monkeypatch.setenv("TILEFISH_CACHE_DIR", str(run.cache))
        monkeypatch.setenv("TILEFISH_CACHE", "1")
        return run.cache

    return use
