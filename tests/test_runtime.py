"""Runtime on the CPU: NVRTC compilation, the disk cache, compile errors, compile-all for sm_80/sm_90."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from tilefish.ops import kernel_specs
from tilefish.runtime import CompileError, KernelSpec, compile_kernel
from tilefish.runtime import compiler


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFISH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TILEFISH_CACHE", "1")
    return tmp_path / "cache"


@pytest.fixture
def scratch_kernel(tmp_path, monkeypatch):
    """A throwaway kernels/ tree so tests can write sources."""
    root = tmp_path / "kernels"
    (root / "common").mkdir(parents=True)
    (root / "common" / "h.cuh").write_text("#pragma once\n#define SCALE 2.0f\n")
    monkeypatch.setattr(compiler, "KERNEL_ROOT", root)
    return root


def test_compile_and_cache_roundtrip(tmp_cache, scratch_kernel):
    (scratch_kernel / "k.cu").write_text(textwrap.dedent('''
        #include "common/h.cuh"
        template <int N> __global__ void scale(float* x) { x[threadIdx.x] *= SCALE * N; }
    '''))
    spec = KernelSpec("k.cu", "scale<3>")
    first = compile_kernel(spec, "sm_90")
    assert not first.from_cache and first.cubin and first.lowered_name.startswith("_Z")
    assert first.resources.registers > 0 and not first.resources.spills
    second = compile_kernel(spec, "sm_90")
    assert second.from_cache and second.cubin == first.cubin
    # editing an included header changes the key
    (scratch_kernel / "common" / "h.cuh").write_text("#pragma once\n#define SCALE 4.0f\n")
    assert not compile_kernel(spec, "sm_90").from_cache
    # corrupt entries are recompiled, never fatal
    for f in tmp_cache.rglob("*.cubin"):
        f.write_bytes(b"garbage")
    assert not compile_kernel(spec, "sm_90").from_cache
    for f in tmp_cache.rglob("*.json"):
        f.write_text("{not json")
    assert not compile_kernel(spec, "sm_90").from_cache


def test_truncated_entries_are_recompiled(tmp_cache, scratch_kernel):
    (scratch_kernel / "k.cu").write_text('extern "C" __global__ void k(float* x) { x[0] = 2; }')
    spec = KernelSpec("k.cu", "k")
    good = compile_kernel(spec, "sm_80")
    for pattern in ("*.cubin", "*.json"):
        for f in tmp_cache.rglob(pattern):
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])  # a write cut short
        again = compile_kernel(spec, "sm_80")
        assert not again.from_cache and again.cubin == good.cubin
        assert compile_kernel(spec, "sm_80").from_cache  # the recompile stored a whole entry again


def test_unwritable_cache_directory_still_compiles(tmp_path, scratch_kernel, monkeypatch):
    """A cache directory that cannot be created or written (here below a regular file, which stops root
    as well as users) costs a recompile per process, never an error."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("TILEFISH_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv("TILEFISH_CACHE", "1")
    (scratch_kernel / "k.cu").write_text('extern "C" __global__ void k(float* x) { x[0] = 3; }')
    spec = KernelSpec("k.cu", "k")
    first, second = compile_kernel(spec, "sm_80"), compile_kernel(spec, "sm_80")
    assert first.cubin and second.cubin == first.cubin and not second.from_cache


def _compile_in_process(root: str, cache: str, start, results) -> None:
    os.environ["TILEFISH_CACHE_DIR"], os.environ["TILEFISH_CACHE"] = cache, "1"
    compiler.KERNEL_ROOT = Path(root)
    start.wait()  # every process compiles at the same moment
    ck = compile_kernel(KernelSpec("k.cu", "scale<5>"), "sm_90")
    results.put((ck.cubin, ck.lowered_name))


def test_processes_compiling_the_same_kernel_at_once(tmp_cache, scratch_kernel):
    """Real processes racing to compile and store one kernel: each gets a correct cubin, the entry left
    behind loads and matches, and no temporary file is left (writes are whole-file renames)."""
    import multiprocessing as mp

    (scratch_kernel / "k.cu").write_text(textwrap.dedent('''
        #include "common/h.cuh"
        template <int N> __global__ void scale(float* x) { x[threadIdx.x] *= SCALE * N; }
    '''))
    ctx = mp.get_context("spawn")
    start, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_compile_in_process, args=(str(scratch_kernel), str(tmp_cache), start, results))
             for _ in range(4)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    fresh = compile_kernel(KernelSpec("k.cu", "scale<5>"), "sm_90", use_cache=False)
    assert all(cubin == fresh.cubin and name == fresh.lowered_name for cubin, name in got)
    cached = compile_kernel(KernelSpec("k.cu", "scale<5>"), "sm_90")
    assert cached.from_cache and cached.cubin == fresh.cubin
    assert not list(tmp_cache.rglob("*.tmp"))


def test_cache_can_be_disabled(tmp_cache, scratch_kernel, monkeypatch):
    (scratch_kernel / "k.cu").write_text('extern "C" __global__ void k(float* x) { x[0] = 1; }')
    monkeypatch.setenv("TILEFISH_CACHE", "0")
    compile_kernel(KernelSpec("k.cu", "k"), "sm_80")
    assert not tmp_cache.exists() or not any(tmp_cache.rglob("*.cubin"))


def test_compile_error_names_kernel_and_carries_log(tmp_cache, scratch_kernel):
    (scratch_kernel / "bad.cu").write_text('extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }')
    with pytest.raises(CompileError) as e:
        compile_kernel(KernelSpec("bad.cu", "broken"), "sm_90")
    assert "broken" in str(e.value) and "undefined_name" in e.value.log


def test_arch_specific_target():
    assert KernelSpec("x.cu", "k", arch_specific=True).target("sm_90") == "sm_90a"
    assert KernelSpec("x.cu", "k").target("sm_90") == "sm_90"
    assert not KernelSpec("x.cu", "k", min_sm=90).supports("sm_80")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compile_all_dispatchable_kernels(arch, compiled_cache):
    """Every kernel the library can dispatch compiles (`tilefish compile`, once per session: conftest's
    compile_all), is in the cache that run left, and no hot kernel spills or uses a stack frame."""
    compiled_cache(arch)
    specs = [s for _, s in kernel_specs(arch=arch)]
    assert specs
    for spec in specs:
        ck = compile_kernel(spec, arch)
        assert ck.from_cache, f"{spec.name} {spec.defines}: compile-all left no cache entry for it on {arch}"
        assert ck.resources.registers > 0, spec.name
        if spec.hot:
            assert not ck.resources.spills, f"{spec.name} spills on {arch}: {ck.resources}"
            assert ck.resources.stack_bytes == 0, f"{spec.name} uses a stack frame on {arch}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_ceiling_probes_compile(arch, tmp_cache):
    """The probes behind the measured ceilings (scripts/bench_probes.py) build without spills."""
    for spec in (KernelSpec("probes/mma_sync_peak.cu", "mma_sync_peak<__half, 8>"),
                 KernelSpec("probes/mma_sync_peak.cu", "mma_sync_peak<__nv_bfloat16, 4>"),
                 KernelSpec("probes/read_stream.cu", "read_stream<4, true>"),
                 KernelSpec("probes/read_stream.cu", "read_stream<8, false>")):
        ck = compile_kernel(spec, arch)
        assert ck.resources.registers > 0 and not ck.resources.spills, (spec.name, ck.resources)


def test_wgmma_rs_probe_compiles_unserialized(tmp_cache):
    """The register-A wgmma probe (sm_90a) builds without spills and without ptxas serializing its
    wgmmas (which would make it measure something else than the W4A16 kernel's issue pattern)."""
    for name in ("wgmma_rs_peak<__half, 64, 4, 0>", "wgmma_rs_peak<__half, 16, 4, 2>",
                 "wgmma_rs_peak<__nv_bfloat16, 128, 2, 1>", "wgmma_rs_peak<__nv_bfloat16, 256, 1, 2>"):
        ck = compile_kernel(KernelSpec("probes/wgmma_rs_peak.cu", name, arch_specific=True, min_sm=90), "sm_90")
        assert ck.resources.registers > 0 and not ck.resources.spills, (name, ck.resources)
        assert "serialized" not in ck.log, (name, ck.log)


@pytest.mark.gpu
def test_time_paired_alternates_and_pools():
    """bench.timing.time_paired: (fn, peer) Timings pooled over the rounds, each the right length."""
    import torch

    from tilefish.bench.timing import time_paired

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    long_fn = lambda: torch.cuda._sleep(200_000)  # noqa: E731 -- ~100 us
    short_fn = lambda: torch.cuda._sleep(20_000)  # noqa: E731
    t_long, t_short = time_paired(long_fn, short_fn, rounds=3, reps=12, warmup=1, min_reps=4)
    assert t_long.reps == t_short.reps == 12
    assert t_long.median_ms > 3 * t_short.median_ms > 0


@pytest.mark.gpu
def test_time_alternating_us_medians_per_callable():
    """bench.timing.time_alternating_us: one median (us) per callable, in the callables' order."""
    import torch

    from tilefish.bench.timing import time_alternating_us

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    us = time_alternating_us({"long": lambda: torch.cuda._sleep(200_000), "short": lambda: torch.cuda._sleep(20_000)},
                             rounds=2, per_round=3, warmup=1)
    assert list(us) == ["long", "short"]
    assert us["long"] > 3 * us["short"] > 0


@pytest.mark.gpu
def test_non_portable_clusters_are_allowed_for_each_kernel_launched(tmp_cache, scratch_kernel):
    """Two kernels launched with the same configuration in clusters of 16 (above the portable 8; sm_90): each
    kernel gets the driver's permission, though prepare_launch's memo of configurations is shared by kernels
    (the second kernel once failed with CUDA_ERROR_INVALID_CLUSTER_SIZE)."""
    import torch

    from tilefish.runtime import get_kernel, launch_prepared, prepare_launch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("clusters of 16 need sm_90")
    (scratch_kernel / "c.cu").write_text(textwrap.dedent('''
        template <int N> __global__ void add(int* p) { atomicAdd(p, N); }
    '''))
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    for n in (1, 2):
        kernel = get_kernel(KernelSpec("c.cu", f"add<{n}>"), torch.cuda.current_device())
        launch_prepared(kernel, prepare_launch(kernel, 32, 32, cluster=16), count.data_ptr())
    torch.cuda.synchronize()
    assert count.item() == 32 * 32 * 1 + 32 * 32 * 2


def test_time_alternating_us_rejects_bad_arguments():
    """Bad rounds / per_round or no callables: a ValueError naming the constraint, before any timing."""
    from tilefish.bench.timing import time_alternating_us

    for kw in ({"rounds": 0}, {"per_round": 0}, {"rounds": 1.5}):
        with pytest.raises(ValueError, match="rounds >= 1 and per_round >= 1"):
            time_alternating_us({"f": lambda: None}, **kw)
    with pytest.raises(ValueError, match="at least one callable"):
        time_alternating_us({})


def test_cluster_capacity_rejects_bad_launch_shapes():
    """A bad block size or a negative smem size is a ValueError naming the constraint, checked
    before any device or driver call."""
    from tilefish.runtime import cluster_capacity

    for block, smem in ((0, 1024), (2048, 1024), (128, -1)):
        with pytest.raises(ValueError, match="1 <= block <= 1024"):
            cluster_capacity(0, block, smem)


def test_time_alternating_us_rotates_the_order(monkeypatch):
    """Each round starts at a different callable, so none always runs right after the same one
    (the place after a heavy launch is slower); the result keeps the callables' order."""
    from tilefish.bench import timing

    order = []

    def fake_samples(fn, reps, warmup, flush, min_reps, max_seconds):
        order.append(fn())
        return [1.0]

    monkeypatch.setattr(timing, "_samples_ms", fake_samples)
    us = timing.time_alternating_us({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, rounds=3, per_round=1)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert list(us) == ["a", "b", "c"]


def test_bench_warm_ms_env_is_checked(monkeypatch):
    """TILEFISH_BENCH_WARM_MS: a number of milliseconds >= 0, else a ValueError naming the variable."""
    from tilefish.bench import timing

    monkeypatch.setenv("TILEFISH_BENCH_WARM_MS", "0")
    assert timing._warm_ms_from_env() == 0.0
    for bad in ("abc", "-5", "nan"):
        monkeypatch.setenv("TILEFISH_BENCH_WARM_MS", bad)
        with pytest.raises(ValueError, match="TILEFISH_BENCH_WARM_MS"):
            timing._warm_ms_from_env()


OTHER_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120")


def test_arch_specific_kernels_are_supported_on_sm90_only():
    """wgmma / TMA / setmaxnreg kernels (built for sm_90a) exist on Hopper alone: never supported, never
    compiled, for any other arch, newer ones included; a plain kernel of the same min_sm is."""
    hopper = [s for _, s in kernel_specs() if s.arch_specific]
    assert hopper
    for spec in hopper:
        assert spec.supports("sm_90") and spec.supports("sm_90a") and spec.target("sm_90") == "sm_90a"
        assert not any(spec.supports(arch) for arch in OTHER_ARCHS), spec.name
    assert all(KernelSpec("x.cu", "k", min_sm=90).supports(a) for a in ("sm_90", "sm_100", "sm_120"))
    with pytest.raises(ValueError, match="sm_90"):
        compile_kernel(hopper[0], "sm_100")  # refused before NVRTC runs


def test_kernel_specs_per_arch():
    """kernel_specs(arch): the kernels the dispatchers launch on that GPU. No arch-specific kernel off
    sm_90, the wgmma ones on it; every HGEMM plan `select` makes for the GPU's cc and shared memory is
    among them, and none needs more shared memory than the GPU gives a block."""
    from tilefish.ops import hgemm
    from tilefish.runtime.device import SMEM_PER_BLOCK_BY_CC

    every = {s for _, s in kernel_specs()}
    for arch in OTHER_ARCHS:
        specs = [s for _, s in kernel_specs(arch=arch)]
        assert specs and not any(s.arch_specific for s in specs) and set(specs) <= every, arch
    sm90 = [s for _, s in kernel_specs(arch="sm_90")]
    assert any(s.name.startswith("hgemm_wgmma") for s in sm90)
    assert any(s.arch_specific and s.source.startswith("w4a16/") for s in sm90)
    for arch in OTHER_ARCHS + ("sm_90",):
        cc, smem = int(arch[3:]), SMEM_PER_BLOCK_BY_CC[int(arch[3:])]
        specs = set(hgemm.dispatch_specs(arch))
        steps = ("auto",) + tuple(k for k in hgemm.KERNELS if cc == 90 or not hgemm.STEPS[k].hopper)
        for m, n in ((1, 4096), (64, 64), (1024, 1024), (4096, 4096), (16384, 14336)):
            for kernel in steps:
                cfg = hgemm.select(m, n, kernel, 84, cc, smem)
                assert cfg.spec() in specs and cfg.spec(b_transposed=True) in specs, (arch, m, n, kernel)
        tables = (hgemm.TUNED, hgemm.TUNED_SMALL, hgemm.TUNED_LOW_SMEM)
        assert all(c.smem_bytes <= smem for t in tables for c in t.values() if c.spec() in specs), arch


def test_compile_many_keeps_job_order_and_returns_compile_logs(tmp_cache, tmp_path, monkeypatch):
    """Jobs compiled in two processes come back in job order: resources for a kernel that builds, the
    compile log (not an exception) for one NVRTC rejects; on_done sees each job once; the kernels land in
    the disk cache; CUDA_CACHE_DISABLE is set for the compiles and undone afterwards."""
    from tilefish.runtime import compile_many, is_cached

    monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)
    (tmp_path / "good.cu").write_text("template <int N> __global__ void scale(float* x) { x[threadIdx.x] *= N; }\n")
    (tmp_path / "bad.cu").write_text('extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }\n')
    good = [KernelSpec(str(tmp_path / "good.cu"), f"scale<{n}>") for n in (1, 2)]
    jobs = [(good[0], "sm_80"), (KernelSpec(str(tmp_path / "bad.cu"), "broken"), "sm_90"), (good[1], "sm_120")]
    seen = {}
    results = compile_many(jobs, processes=2, on_done=lambda i, r: seen.setdefault(i, r))
    assert [r is None for r, _ in results] == [False, True, False]
    assert results[0][0].registers > 0 and results[2][0].registers > 0 and results[0][1] is None
    assert "undefined_name" in results[1][1]
    assert seen == dict(enumerate(results))
    assert is_cached(*jobs[0]) and is_cached(*jobs[2]) and not is_cached(*jobs[1])
    assert "CUDA_CACHE_DISABLE" not in os.environ
    assert compile_many(jobs[:1]) == results[:1]  # in process, from the cache
