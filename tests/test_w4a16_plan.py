"""tilefish.w4a16.plan / tilefish.nf4.plan and tilefish.GpuSpec: the launch plans of described GPUs, on
the CPU (legal on that GPU, deterministic, no idle SMs at small m, no Hopper kernel off sm_90), and on
the GPU, the plan against what the launcher runs."""
from __future__ import annotations

import math

import pytest
import torch

import tilefish
from tilefish import GpuSpec

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
# (k, n): Llama-3 8B / 70B, Qwen2.5, Mistral, gpt-oss and odd weights no table holds
WEIGHTS = [(4096, 4096), (4096, 6144), (4096, 28672), (14336, 4096), (8192, 10240), (28672, 8192), (5120, 27648),
           (3584, 4608), (2880, 5760), (8192, 1280), (21760, 8192), (4096, 21504), (4096, 128256), (192, 320)]
MS = (1, 2, 3, 8, 9, 16, 17, 32, 33, 64, 100, 128, 256, 1000, 1024, 4096)
# (group_size, zero_points, codebook)
FORMATS = [(-1, False, "int4"), (-1, True, "int4"), (32, True, "int4"), (64, False, "int4"), (128, False, "int4"),
           (128, True, "int4"), (32, False, "nf4"), (64, False, "nf4"), (128, False, "nf4")]


def _plans(gpu):
    for dtype in (torch.float16, torch.bfloat16):
        for group, zp, codebook in FORMATS:
            for k, n in WEIGHTS:
                if group > 0 and k % group:
                    continue
                for m in MS:
                    yield tilefish.w4a16.plan(m, n, k, group_size=group, dtype=dtype, codebook=codebook,
                                              zero_points=zp, gpu=gpu), group, zp


@pytest.mark.parametrize("name", list(GPUS))
def test_every_plan_can_launch_on_that_gpu(name):
    """Shared memory within the GPU's limit per block (with the kernels' static bytes), the kernel
    exists there (wgmma / skinny: sm_90 only), its tiles fit n, its rows take m."""
    gpu = GPUS[name]
    count = 0
    for p, group, zp in _plans(gpu):
        count += 1
        assert p.smem_bytes == p.config.smem_bytes(group, zp) or p.cluster > 1, p
        assert p.smem_bytes + 64 <= gpu.smem_per_block, (name, p.label, p.smem_bytes, p.m, p.n, p.k, group, zp)
        if gpu.cc != 90:
            assert p.kernel == "mma.sync", (name, p.label)
        if p.kernel == "skinny":
            assert p.m <= p.config.mt
        if p.kernel == "mma.sync":
            assert p.n % p.config.bn == 0 and not (p.config.swap and p.m > 8)
        assert p.ctas >= 1 and p.slices >= 1 and p.workspace_bytes >= 0
    assert count > 3000


@pytest.mark.parametrize("name", ["H100", "RTX 4090", "B200"])
def test_plans_are_deterministic(name):
    first = [p for p, _, _ in _plans(GPUS[name])]
    again = [p for p, _, _ in _plans(GPUS[name])]
    assert first == again


@pytest.mark.parametrize("name", list(GPUS))
def test_small_m_plans_keep_the_sms_busy_on_large_weights(name):
    """At m <= 64 a weight of 4 MB or more is read at the bandwidth limit only with most SMs
    streaming it: no plan launches fewer CTAs than half the SMs there (the H100 m = 16 cliff was
    48 CTAs on 132 SMs, 2-3.5x slow)."""
    gpu = GPUS[name]
    for p, _, _ in _plans(gpu):
        if p.m <= 64 and p.n * p.k // 2 >= 4 << 20:
            assert p.ctas >= gpu.sm_count / 2, (name, p.label, p.ctas, p.m, p.n, p.k, p.source)


def test_nearby_configurations_bring_a_split_for_the_new_weight():
    """The H100's table holds neither weight; at m = 16 a neighbour's wgmma configuration is taken
    with a k split computed for this weight, which puts a CTA on nearly every SM (the cliff: the
    neighbour's tile without its split, 48 CTAs on 132 SMs)."""
    for k, n, dtype in [(4096, 12288, torch.float16), (21760, 8192, torch.bfloat16), (4096, 21504, torch.bfloat16)]:
        p = tilefish.w4a16.plan(16, n, k, group_size=128, dtype=dtype, gpu=GPUS["H100"])
        assert p.ctas >= 0.9 * GPUS["H100"].sm_count, (k, n, p.label, p.ctas, p.source)


def test_consumer_gpus_fit_the_wide_tile_in_99_kb():
    """m > 16 on a wide weight: the 256-column mma.sync tile, in fewer stages where four do not fit
    99 KB (group 32 / 64, zero points, NF4), and four stages where the GPU has the room (A100)."""
    for name in ("RTX 3090", "RTX 4090", "L40S", "RTX 5090"):
        for group, zp, codebook in [(32, True, "int4"), (64, False, "nf4"), (128, True, "int4")]:
            p = tilefish.w4a16.plan(256, 28672, 4096, group_size=group, zero_points=zp, codebook=codebook,
                                    gpu=GPUS[name])
            assert p.config.bn == 256 and p.config.stages < 4 and p.smem_bytes <= 101376 - 64, (name, p.label)
    p = tilefish.w4a16.plan(256, 28672, 4096, group_size=32, zero_points=True, gpu=GPUS["A100"])
    assert p.config.bn == 256 and p.config.stages == 4


def test_nf4_plan_rejects_a_blocksize_bitsandbytes_does_not_make():
    for bad in (48, 0, "64", True):
        with pytest.raises(ValueError, match="blocksize"):
            tilefish.nf4.plan(16, 4096, 4096, blocksize=bad, gpu=GPUS["H100"])


def test_nf4_plan_is_the_w4a16_plan_of_its_scale_groups():
    gpu = GPUS["RTX 4090"]
    for blocksize, group in [(64, 64), (256, 128), (32, 32)]:
        assert tilefish.nf4.plan(32, 8192, 4096, blocksize=blocksize, gpu=gpu) == \
            tilefish.w4a16.plan(32, 8192, 4096, group_size=group, codebook="nf4", gpu=gpu)


def test_plan_reports_source_label_and_prediction():
    h100 = GPUS["H100"]
    tuned = tilefish.w4a16.plan(1, 4096, 4096, gpu=h100)  # a weight the shipped H100 table holds
    assert tuned.source == "table"
    modelled = tilefish.w4a16.plan(64, 14336, 4096, gpu=GPUS["H200"])
    assert modelled.source == "model" and modelled.kernel == "wgmma" and modelled.predicted_us > 0
    ruled = tilefish.w4a16.plan(64, 14336, 4096, gpu=GPUS["A100"])
    assert ruled.source == "rule" and ruled.predicted_us is None
    assert ruled.label.startswith(ruled.config.label())
    sk = tilefish.w4a16.plan(1, 4096, 14336, gpu=GPUS["H200"])
    assert sk.streamk and sk.label == f"{sk.config.label()}/c{sk.ctas}"


@pytest.mark.parametrize("kwargs, error", [
    (dict(m=0), ValueError), (dict(m=1.5), ValueError), (dict(n=100), ValueError), (dict(k=100), ValueError),
    (dict(dtype=torch.float32), TypeError), (dict(codebook="fp4"), ValueError),
    (dict(codebook="nf4", zero_points=True), ValueError), (dict(codebook="nf4", group_size=-1), ValueError),
    (dict(group_size=100), ValueError), (dict(gpu="H100"), TypeError),
])
def test_plan_rejects_bad_arguments(kwargs, error):
    args = dict(m=16, n=4096, k=4096, group_size=128, gpu=GPUS["H100"])
    args.update(kwargs)
    m, n, k = args.pop("m"), args.pop("n"), args.pop("k")
    with pytest.raises(error):
        tilefish.w4a16.plan(m, n, k, **args)


def test_gpu_spec_defaults_and_checks():
    assert GpuSpec("x", 82, 86).smem_per_block == 101376
    assert GpuSpec("x", 132, 90).smem_per_block == 232448 and GpuSpec("x", 132, 90).clusters
    assert GpuSpec("x", 108, 80).clusters == ()
    assert GpuSpec("x", 100, 86, smem_per_block=65536).smem_per_block == 65536
    for bad in [dict(cc=75), dict(cc=95), dict(sm_count=0), dict(sm_count=True), dict(name=""),
                dict(smem_per_block=1024)]:
        with pytest.raises(ValueError):
            GpuSpec(**{**dict(name="x", sm_count=10, cc=86), **bad})


@pytest.mark.gpu
def test_plan_is_what_the_launcher_runs():
    """On the GPU here: plan() names the configuration, launches, CTAs, shared memory and scratch of
    the launches LaunchPlan.build makes for the same call, under the default policy and with the
    DSMEM split off (the CPU twin with a described GPU: test_w4a16_policy.py)."""
    from tilefish.ops.w4a16 import LaunchPlan, LaunchPolicy

    dev = torch.device("cuda")
    for k, n in [(4096, 4096), (4096, 12288), (14336, 4096), (5760, 2880)]:
        for group, zp in [(128, False), (-1, False), (32, True)]:
            w = tilefish.w4a16.quantize(torch.randn(n, k, device=dev, dtype=torch.float16), group, symmetric=not zp,
                                        clip_search=False)
            for m, policy in [(m, policy) for m in (1, 8, 16, 33, 64, 256, 1024)
                              for policy in (LaunchPolicy(), LaunchPolicy(dsmem_split=False))]:
                p = tilefish.w4a16.plan(m, n, k, group_size=group, zero_points=zp, policy=policy)
                lp = LaunchPlan.build(w, None, m, dev, policy=policy)
                assert lp.config == p.config and len(lp.launches) == len(p.launches), (m, n, k, group, p.label)
                ctas = 0
                for (_, config, *_), launch in zip(lp.launches, p.launches):
                    grid = config.grid if isinstance(config.grid, tuple) else (config.grid,)
                    cluster = config.cluster if isinstance(config.cluster, tuple) else (config.cluster or 1,)
                    ctas += math.prod(grid) * math.prod(cluster)
                    assert math.prod(grid) * math.prod(cluster) == math.prod(launch.grid), (m, n, k, group, p.label)
                    assert math.prod(cluster) == launch.cluster, (m, n, k, group, p.label)
                    assert config.shmem_size == p.smem_bytes, (m, n, k, group, p.label)
                assert ctas == p.ctas, (m, n, k, group, p.label, ctas)
                assert 4 * lp.partials + 4 * lp.tiles == p.workspace_bytes, (m, n, k, group, p.label)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["RTX 3090", "RTX 4090", "RTX 5090", "A100"])
def test_other_gpus_plans_compute_the_right_product_here(name):
    """The mma.sync plans of a described GPU (fitted to its shared memory) run on this GPU against
    the float64 reference, output poisoned: every format whose tile changed on the 99 KB parts."""
    from conftest import TOLERANCE, rel_err
    from tilefish.ops import w4a16 as ops
    from tilefish.quant.int4 import quantize_rtn
    from tilefish.reference import w4a16_matmul as ref_matmul

    gen = torch.Generator(device="cuda").manual_seed(20261126)
    for k, n, group, zp, dtype in [(1024, 8192, 32, True, torch.float16), (2048, 8192, 64, False, torch.bfloat16),
                                   (1152, 8192, 128, True, torch.bfloat16), (4096, 1536, -1, True, torch.float16)]:
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.5
        q = quantize_rtn(w, group, not zp, scale_dtype=dtype, clip_search=False)
        p = ops.pack(q)
        for m in (1, 9, 17, 64, 200):
            plan = tilefish.w4a16.plan(m, n, k, group_size=group, dtype=dtype, zero_points=zp, gpu=GPUS[name])
            x = torch.randn(m, k, device="cuda", dtype=dtype, generator=gen)
            ref = ref_matmul(x, q)
            torch.full((m, n), float("nan"), device="cuda", dtype=dtype)  # poison the allocator's next block
            out = ops.matmul_impl(x, p, cfg=plan.config, slices=plan.slices)
            assert rel_err(out, ref) < TOLERANCE[dtype], (name, plan.label, m, n, k, group, zp)
