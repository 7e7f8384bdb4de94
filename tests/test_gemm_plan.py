"""tilefish.hgemm.plan / tilefish.sgemm.plan: the launch plans of described GPUs on the CPU (legal on that GPU,
among the kernels `tilefish compile` builds for it, deterministic, every output tile covered, no Hopper step
off sm_90, bad arguments refused as the op refuses them), the callable modules, and on the GPU the plan
against the launch the op makes (recorded at runtime.launch, checked against the loaded kernel's attributes)."""
from __future__ import annotations

import importlib
import math

import pytest
import torch

import tilefish
from tilefish import GpuSpec

hg = importlib.import_module("tilefish.ops.hgemm")
sg = importlib.import_module("tilefish.ops.sgemm")

GPUS = {
    "H100": GpuSpec("NVIDIA H100 80GB HBM3", 132, 90),
    "H200": GpuSpec("NVIDIA H200", 132, 90),
    "A100": GpuSpec("NVIDIA A100-SXM4-80GB", 108, 80),
    "L40S": GpuSpec("NVIDIA L40S", 142, 89),
    "RTX 3090": GpuSpec("NVIDIA GeForce RTX 3090", 82, 86),
    "RTX 4090": GpuSpec("NVIDIA GeForce RTX 4090", 128, 89),
    "B200": GpuSpec("NVIDIA B200", 148, 100),
    "RTX 5090": GpuSpec("NVIDIA GeForce RTX 5090", 170, 120),
}
MS = (1, 7, 16, 33, 64, 65, 100, 128, 257, 1000, 4096, 14336)
NS = (8, 24, 136, 1000, 4096, 14336, 28672)     # multiples of 8: b [K, N] takes them
ODD_NS = (1, 23, 1001, 4097)                    # b [N, K] only (HGEMM); any N for SGEMM
KS = (8, 72, 4096)


def _hgemm_kernels(gpu):
    return ("auto",) + tuple(s for s in hg.KERNELS if gpu.cc == 90 or not hg.STEPS[s].hopper)


def _hgemm_plans(gpu):
    for kernel in _hgemm_kernels(gpu):
        for b_nk in (False, True):
            for n in NS + (ODD_NS if b_nk else ()):
                for m in MS:
                    for k in KS:
                        for dtype in (torch.float16, torch.bfloat16):
                            yield tilefish.hgemm.plan(m, n, k, dtype=dtype, b_transposed=b_nk, kernel=kernel, gpu=gpu)


def _sgemm_plans(gpu):
    for kernel in ("auto",) + sg.KERNELS:
        for aligned in (True, False):
            for n in NS + ODD_NS:
                for m in MS:
                    for k in KS + (5,):
                        yield tilefish.sgemm.plan(m, n, k, kernel=kernel, aligned=aligned, gpu=gpu)


def _tiles(p) -> int:
    bm, bn = p.config.tile
    return -(-p.m // bm) * -(-p.n // bn)


@pytest.mark.parametrize("name", list(GPUS))
def test_every_hgemm_plan_can_launch_on_that_gpu(name):
    """Shared memory within the GPU's limit a block, no Hopper step off sm_90, a kernel `tilefish compile
    --arch` builds for that GPU, a thread count CUDA takes, and a CTA for every output tile (step 07: a
    persistent grid of at most one CTA an SM, in whole clusters)."""
    gpu = GPUS[name]
    specs = set(hg.dispatch_specs(gpu.arch))
    count = 0
    for p in _hgemm_plans(gpu):
        count += 1
        where = (name, p.m, p.n, p.k, p.label)
        assert p.config.problem() is None, where
        assert p.smem_bytes <= gpu.smem_per_block, where
        assert gpu.cc == 90 or not p.config.info.hopper, where
        assert p.kernel_spec in specs and p.kernel_spec.supports(gpu.arch), where
        assert 32 <= p.threads <= 1024, where
        if p.config.info.hopper:
            assert p.ctas <= gpu.sm_count and p.ctas % p.cluster == 0, where
            assert p.ctas >= min(_tiles(p), gpu.sm_count // p.cluster * p.cluster) or p.cluster > 1, where
        else:
            assert p.ctas == _tiles(p) and p.cluster == 1, where
        assert p.workspace_bytes == 0 and p.predicted_us is None and p.source in ("table", "rule"), where
    assert count > 5000


@pytest.mark.parametrize("name", list(GPUS))
def test_every_sgemm_plan_can_launch_on_that_gpu(name):
    """The same for SGEMM: within shared memory, built by `tilefish compile`, one CTA a tile, and the
    vectorized steps only where K % 4 == 0, N % 4 == 0 and the operands are aligned."""
    gpu = GPUS[name]
    specs = set(sg.dispatch_specs(gpu.arch))
    for p in _sgemm_plans(gpu):
        where = (name, p.m, p.n, p.k, p.label)
        assert p.config.problem() is None and p.smem_bytes <= gpu.smem_per_block, where
        assert p.kernel_spec in specs, where
        assert p.ctas == p.grid == _tiles(p) and p.cluster == 1, where
        if p.config.info.vectorized:
            assert p.k % 4 == 0 and p.n % 4 == 0, where
        assert p.source == "table" and p.workspace_bytes == 0 and p.predicted_us is None, where


@pytest.mark.parametrize("name", ["H100", "A100", "RTX 4090", "RTX 5090"])
def test_plans_are_deterministic(name):
    gpu = GPUS[name]
    assert list(_hgemm_plans(gpu)) == list(_hgemm_plans(gpu))
    assert list(_sgemm_plans(gpu)) == list(_sgemm_plans(gpu))


def test_ctas_are_the_grids_product():
    """ctas counts every CTA of the grid, 2-D grids (HGEMM steps 01-05) included."""
    seen_2d = False
    for gpu in GPUS.values():
        for p in _hgemm_plans(gpu):
            if isinstance(p.grid, tuple):
                seen_2d = True
                assert p.ctas == math.prod(p.grid), p
            else:
                assert p.ctas == p.grid, p
    assert seen_2d


def test_auto_is_step_07_on_sm_90_only_and_fitted_elsewhere():
    """kernel="auto": step 07 on sm_90; step 06 elsewhere, its tile fitted to the GPU's shared memory a block
    (the 99 KB parts get the low-smem tile, the A100 / B200 the tuned one)."""
    for name, gpu in GPUS.items():
        p = tilefish.hgemm.plan(4096, 4096, 4096, gpu=gpu)
        if gpu.cc == 90:
            assert p.step == "07_wgmma_tma", name
        else:
            assert p.step == "06_rasterized", name
            assert p.config == (hg.TUNED if gpu.smem_per_block >= hg.TUNED["06_rasterized"].smem_bytes
                                else hg.TUNED_LOW_SMEM)["06_rasterized"], name


@pytest.mark.parametrize("name", [n for n, g in GPUS.items() if g.cc != 90])
def test_step_07_by_name_off_sm_90_raises(name):
    for kernel in ("07_wgmma_tma", hg.TUNED["07_wgmma_tma"]):
        with pytest.raises(ValueError, match="sm_90"):
            tilefish.hgemm.plan(4096, 4096, 4096, kernel=kernel, gpu=GPUS[name])


def test_a_configuration_larger_than_the_gpus_shared_memory_raises():
    big = hg.TUNED["06_rasterized"]  # 144 KB: more than the 99 KB parts give a block
    assert tilefish.hgemm.plan(4096, 4096, 4096, kernel=big, gpu=GPUS["A100"]).config == big
    with pytest.raises(ValueError, match="shared memory"):
        tilefish.hgemm.plan(4096, 4096, 4096, kernel=big, gpu=GPUS["RTX 4090"])


def test_plan_reports_source_and_label():
    h100, rtx = GPUS["H100"], GPUS["RTX 4090"]
    assert tilefish.hgemm.plan(4096, 4096, 4096, gpu=h100).source == "table"
    decode = tilefish.hgemm.plan(16, 4096, 4096, b_transposed=True, gpu=h100)
    assert decode.source == "rule" and decode.config == hg.WGMMA_NARROW
    assert tilefish.hgemm.plan(4096, 4096, 4096, gpu=rtx).source == "table"  # the low-smem table's tile
    given = hg.TUNED_SMALL["06_rasterized"]
    p = tilefish.hgemm.plan(100, 200, 64, kernel=given, gpu=rtx)
    assert p.source == "given" and p.config is given
    assert p.label == given.label() and p.step == "06_rasterized"
    s = tilefish.sgemm.plan(4096, 4096, 4096, gpu=h100)
    assert s.source == "table" and s.step == sg.AUTO_STEP and s.label == s.config.label()
    assert tilefish.sgemm.plan(64, 64, 64, kernel=sg.TUNED["05_blocktile_2d"], gpu=h100).source == "given"


def test_hgemm_plan_names_the_epilogue_and_layout_that_run():
    """N % 8 != 0 (b [N, K] only): step 07 stores C directly (no tensor map for C rows of odd length); the
    kernel variant carries the dtype and B layout; step 03's shared memory is that layout's."""
    h100 = GPUS["H100"]
    for kernel in ("auto", hg.TUNED["07_wgmma_tma"]):
        odd = tilefish.hgemm.plan(4096, 4097, 4096, b_transposed=True, kernel=kernel, gpu=h100)
        even = tilefish.hgemm.plan(4096, 4104, 4096, b_transposed=True, kernel=kernel, gpu=h100)
        assert even.config.TMA_STORE == 1 and odd.config.TMA_STORE == 0, kernel
        assert {**odd.config.params, "TMA_STORE": 1} == even.config.params, kernel
    bf = tilefish.hgemm.plan(64, 64, 64, dtype=torch.bfloat16, b_transposed=True, kernel="03_padded", gpu=h100)
    assert bf.kernel_spec == bf.config.spec(torch.bfloat16, True)
    kn = tilefish.hgemm.plan(64, 64, 64, kernel="03_padded", gpu=h100)
    assert max(bf.smem_bytes, kn.smem_bytes) == kn.config.smem_bytes and bf.smem_bytes != kn.smem_bytes


def test_sgemm_plan_falls_back_where_float4_cannot_run():
    h100 = GPUS["H100"]
    assert tilefish.sgemm.plan(256, 256, 256, gpu=h100).config.info.vectorized
    for kwargs in (dict(k=257), dict(n=258), dict(aligned=False)):
        args = dict(m=256, n=256, k=256, gpu=h100) | kwargs
        assert tilefish.sgemm.plan(**args).step == sg.FALLBACK, kwargs
    with pytest.raises(ValueError, match="aligned"):
        tilefish.sgemm.plan(256, 256, 256, kernel=sg.TUNED["09_pipelined"], aligned=False, gpu=h100)


def test_persistent_grid_takes_the_gpus_cluster_capacity():
    """Step 07 in clusters of 2: no more clusters than the GPU holds at once (GpuSpec.clusters)."""
    c2 = hg.HgemmConfig.of("07_wgmma_tma", BM=128, BN=256, STAGES=4, GROUP_M=8, CLUSTER=2, PINGPONG=0, TMA_STORE=0)
    assert tilefish.hgemm.plan(8192, 8192, 4096, kernel=c2, gpu=GPUS["H100"]).ctas == 2 * dict(GPUS["H100"].clusters)[2]
    fewer = GpuSpec("a cut-down sm_90", 132, 90, clusters=((2, 60),))
    p = tilefish.hgemm.plan(8192, 8192, 4096, kernel=c2, gpu=fewer)
    assert p.ctas == 120 and p.cluster == 2


def test_every_step_07_tile_takes_over_half_an_sm():
    """launch_grid's premise: GpuSpec.clusters (measured at one CTA an SM) is step 07's cluster capacity,
    since no two of its CTAs fit one SM's 228 KB."""
    for cfg in hg.variant_configs("07_wgmma_tma") + [hg.TUNED["07_wgmma_tma"], hg.WGMMA_MID, hg.WGMMA_NARROW,
                                                     hg.WGMMA_SHORT]:
        assert 2 * cfg.smem_bytes > 228 * 1024, cfg.label()


def test_plan_shared_memory_is_the_compiled_kernels():
    """smem_bytes is what the kernel takes: ptxas's static bytes (compiled here for sm_90, from the kernel
    cache when it holds them) plus the dynamic bytes the launcher asks for, for every step and layout."""
    from tilefish.runtime import compile_kernel

    h100, a100 = GPUS["H100"], GPUS["A100"]
    plans = [tilefish.hgemm.plan(m, 4096, 4096, b_transposed=nk, kernel=kernel, gpu=h100)
             for kernel in ("auto",) + hg.KERNELS for nk in (False, True) for m in (16, 4096)]
    plans += [tilefish.hgemm.plan(64, 64, 64, kernel="06_rasterized", gpu=a100)]
    plans += [tilefish.sgemm.plan(m, 4096, 4096, kernel=kernel, gpu=h100) for kernel in sg.KERNELS for m in (64, 4096)]
    seen = {}
    for p in plans:
        seen.setdefault(p.kernel_spec, p)
    assert len(seen) >= 25
    for spec, p in seen.items():
        static = compile_kernel(spec, "sm_90").resources.static_smem
        assert static + p.config.dynamic_smem == p.smem_bytes, (p.label, static, p.smem_bytes)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(m=0), ValueError, "positive int"), (dict(m=1.5), ValueError, "positive int"),
    (dict(n=True), ValueError, "positive int"), (dict(k=-8), ValueError, "positive int"),
    (dict(k=12), ValueError, "K % 8"), (dict(n=12), ValueError, "N % 8"),
    (dict(m=2**31), ValueError, "int32"), (dict(dtype=torch.float32), TypeError, "float16 or bfloat16"),
    (dict(b_transposed=1), TypeError, "b_transposed"), (dict(kernel="07_wgmma"), ValueError, "kernel must be"),
    (dict(kernel=hg.HgemmConfig("05_multistage", (128, 128, 32, 64, 24, 3))), ValueError, "cannot be instantiated"),
    (dict(gpu="H100"), TypeError, "GpuSpec"),
])
def test_hgemm_plan_rejects_bad_arguments(kwargs, error, match):
    """The op's errors, raised before the GPU is looked at (gpu=None here: no CUDA needed to be refused)."""
    args = dict(m=16, n=4096, k=4096, gpu=None) | kwargs
    with pytest.raises(error, match=match):
        tilefish.hgemm.plan(args.pop("m"), args.pop("n"), args.pop("k"), **args)


def test_hgemm_plan_takes_any_n_for_b_n_k():
    assert tilefish.hgemm.plan(16, 12, 4096, b_transposed=True, gpu=GPUS["A100"]).n == 12


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(m=0), ValueError, "positive int"), (dict(k="64"), ValueError, "positive int"),
    (dict(n=2**31), ValueError, "int32"), (dict(kernel="10_magic"), ValueError, "kernel must be"),
    (dict(kernel=sg.SgemmConfig("05_blocktile_2d", (128, 128, 8, 7, 8))), ValueError, "cannot be instantiated"),
    (dict(aligned=1), TypeError, "aligned"), (dict(gpu=132), TypeError, "GpuSpec"),
])
def test_sgemm_plan_rejects_bad_arguments(kwargs, error, match):
    args = dict(m=64, n=64, k=64, gpu=None) | kwargs
    with pytest.raises(error, match=match):
        tilefish.sgemm.plan(args.pop("m"), args.pop("n"), args.pop("k"), **args)


def test_the_public_names_are_callable_modules():
    """tilefish.hgemm / tilefish.sgemm call the op (CPU: the reference) and hold plan(), however imported."""
    import tilefish.hgemm as hgemm_module
    from tilefish import hgemm, sgemm

    assert hgemm is tilefish.hgemm is hgemm_module and callable(hgemm) and sgemm is tilefish.sgemm
    a, b = torch.randn(5, 24).half(), torch.randn(24, 9).half()
    assert torch.equal(tilefish.hgemm(a, b), hg.hgemm_reference(a, b))
    # b as [N, K]: the reference of that same call, bit for bit; against the [K, N] call only to rounding (the CPU
    # matmul may sum a transposed operand in another order: 1 fp16 ulp, seed 643569644)
    bt = b.t().contiguous()
    by_rows = hgemm(a, bt, b_transposed=True)
    assert torch.equal(by_rows, hg.hgemm_reference(a, bt, b_transposed=True))
    torch.testing.assert_close(by_rows, hg.hgemm_reference(a, b), rtol=2e-3, atol=2e-3)
    x, y, c = torch.randn(4, 6), torch.randn(6, 3), torch.randn(4, 3)
    want = sg.sgemm_reference(x, y, c, 2.0, 0.5)
    assert torch.equal(tilefish.sgemm(x, y, c.clone(), 2.0, 0.5), want)
    assert torch.equal(sgemm(x, y, c, alpha=2.0, beta=0.5, kernel="auto"), want)
    assert tilefish.hgemm.plan is not tilefish.sgemm.plan and tilefish.hgemm.GemmPlan is tilefish.sgemm.GemmPlan


# ------------------------------------------------------------------------------------------------ GPU --
class _Recorder:
    """Stands in for runtime.launch in an ops module: records what each launch asks for, then launches."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, kernel, grid, block, *args, smem=0, cluster=1):
        static = kernel.kernel.attributes.shared_size_bytes  # the driver's answer for the loaded kernel
        self.calls.append(dict(spec=kernel.spec, grid=grid, block=block, smem=smem + static, cluster=cluster,
                               kernel=kernel))
        return self.real(kernel, grid, block, *args, smem=smem, cluster=cluster)


def _recorded(monkeypatch, module):
    rec = _Recorder(module.launch)
    monkeypatch.setattr(module, "launch", rec)
    return rec


def _assert_plan_is_launch(p, rec, where):
    assert len(rec.calls) == 1, where
    call = rec.calls.pop()
    assert call["spec"] == p.kernel_spec, where
    assert call["grid"] == p.grid, where
    grid = call["grid"] if isinstance(call["grid"], tuple) else (call["grid"],)
    assert math.prod(grid) == p.ctas, where
    assert call["block"] == p.threads and call["cluster"] == p.cluster, where
    assert call["smem"] == p.smem_bytes, (where, call["smem"], p.smem_bytes)
    return call


@pytest.mark.gpu
def test_hgemm_plan_is_what_the_launcher_launches(monkeypatch):
    """On the GPU here: plan() (gpu=None: this GPU) names the kernel, grid, threads, cluster and shared
    memory (the loaded kernel's static bytes plus the dynamic ones) of the launch tilefish.hgemm makes."""
    rec = _recorded(monkeypatch, hg)
    spec = GpuSpec.current()
    kernels = _hgemm_kernels(spec)
    if spec.cc == 90:
        kernels += (hg.HgemmConfig.of("07_wgmma_tma", BM=128, BN=128, STAGES=5, GROUP_M=8, CLUSTER=2, PINGPONG=1,
                                      TMA_STORE=1),)
    for m, n, k in [(1, 8, 64), (33, 1000, 72), (1000, 4096, 256), (4096, 4096, 512), (300, 1001, 64)]:
        for b_nk in (False, True):
            if n % 8 and not b_nk:
                continue
            for kernel in kernels:
                dtype = torch.bfloat16 if m % 2 else torch.float16
                a = torch.randn(m, k, device="cuda", dtype=dtype)
                b = torch.randn(n, k, device="cuda", dtype=dtype) if b_nk else torch.randn(k, n, device="cuda",
                                                                                           dtype=dtype)
                p = tilefish.hgemm.plan(m, n, k, dtype=dtype, b_transposed=b_nk, kernel=kernel)
                tilefish.hgemm(a, b, kernel=kernel, b_transposed=b_nk)
                call = _assert_plan_is_launch(p, rec, (m, n, k, b_nk, p.label))
                if p.cluster > 1:  # the persistent grid never holds more clusters than the driver says fit
                    kern = call["kernel"]
                    assert p.ctas // p.cluster <= kern.max_active_clusters(p.cluster, p.threads,
                                                                           p.config.dynamic_smem), p.label


@pytest.mark.gpu
def test_sgemm_plan_is_what_the_launcher_launches(monkeypatch):
    """The same for tilefish.sgemm, aligned operands and an offset (unaligned) a."""
    rec = _recorded(monkeypatch, sg)
    for m, n, k in [(1, 8, 64), (33, 1000, 72), (1000, 4096, 256), (257, 130, 67)]:
        for aligned in (True, False):
            for kernel in ("auto",) + sg.KERNELS:
                a = torch.randn(m * k + (0 if aligned else 1), device="cuda")[(0 if aligned else 1):].view(m, k)
                b = torch.randn(k, n, device="cuda")
                p = tilefish.sgemm.plan(m, n, k, kernel=kernel, aligned=aligned)
                tilefish.sgemm(a, b, kernel=kernel)
                _assert_plan_is_launch(p, rec, (m, n, k, aligned, p.label))


@pytest.mark.gpu
def test_current_gpu_spec_is_the_device():
    from tilefish.runtime import device_info

    info, spec = device_info(), GpuSpec.current()
    assert (spec.sm_count, spec.cc, spec.smem_per_block) == (info.sm_count, info.cc, info.smem_per_block_optin)
