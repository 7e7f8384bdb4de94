"""HGEMM ladder (fp16/bf16; mma.sync steps 01-06, wgmma + TMA step 07 on sm_90): every step against
an fp32 reference on the GPU, both dtypes and both B layouts, odd shapes, NaN-poisoned outputs; CPU
path, validation, compile-all (sm_80, sm_90, no spills in hot steps) and SASS checks on the CPU
(LDSM in step 04, HGMMA / UTMALDG / setmaxnreg in step 07)."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tilefish.ops.hgemm import KERNELS, HgemmConfig, hgemm

ops = importlib.import_module("tilefish.ops.hgemm")  # the module, even if a package re-exports the function

from conftest import TOLERANCE, poison, rel_err

DTYPES = [torch.float16, torch.bfloat16]
# (M, N, K): M and N not multiples of any tile, K % 8 == 0 and N % 8 == 0 (b [K, N] needs both).
SHAPES = [(1, 8, 8), (17, 24, 40), (127, 264, 72), (1000, 1000, 1024), (16, 8, 16), (300, 136, 520),
          (129, 392, 64), (2, 4096, 256)]
# b [N, K] takes any N.
NK_SHAPES = [(5, 1, 8), (33, 23, 48), (130, 257, 96)]


def _rand(*shape, dtype=torch.float16, device="cuda", seed=0):
    g = torch.Generator(device=device)
    g.manual_seed(seed + 7919 * len(shape) + sum(shape))
    return torch.randn(*shape, device=device, generator=g).to(dtype)


def _ref(a, b, b_transposed=False):
    bf = b.double().t() if b_transposed else b.double()
    return a.double() @ bf


def _check(out, ref, dtype):
    assert out.dtype == dtype
    assert not torch.isnan(out).any(), "unwritten output elements (NaN poison survived)"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]}"


def _cc() -> int:
    p = torch.cuda.get_device_properties(0)
    return p.major * 10 + p.minor


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _skip_unless_runs(kernel) -> None:
    step = kernel.step if isinstance(kernel, HgemmConfig) else kernel
    if step in ops.STEPS and ops.STEPS[step].hopper and _cc() != 90:
        pytest.skip(f"{step} runs on sm_90 only")


def _run_poisoned(a, b, kernel, b_transposed):
    """Launch with a NaN-poisoned output buffer (the same cfg/launch path hgemm takes)."""
    m, k = a.shape
    n = b.shape[0] if b_transposed else b.shape[1]
    c = poison(torch.empty(m, n, dtype=a.dtype, device=a.device))
    cfg = ops.select(m, n, kernel, _sms(), _cc())
    ops.launch_config(cfg, a, b, c, b_transposed)
    return c


# ------------------------------------------------------------------------------------ GPU --
class TestGPU:
    pytestmark = pytest.mark.gpu

    @pytest.mark.parametrize("b_transposed", [False, True], ids=["kn", "nk"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
    @pytest.mark.parametrize("step", KERNELS + ("auto",))
    def test_every_step(self, step, dtype, b_transposed):
        _skip_unless_runs(step)
        shapes = SHAPES + (NK_SHAPES if b_transposed else [])
        for m, n, k in shapes:
            a = _rand(m, k, dtype=dtype)
            b = _rand(n, k, dtype=dtype, seed=1) if b_transposed else _rand(k, n, dtype=dtype, seed=1)
            c = _run_poisoned(a, b, step, b_transposed)
            _check(c, _ref(a, b, b_transposed), dtype)
            out = hgemm(a, b, kernel=step, b_transposed=b_transposed)
            assert out.shape == (m, n)
            _check(out, _ref(a, b, b_transposed), dtype)

    def test_every_variant(self):
        """Every configuration of the tuning space is correct (fp16, both layouts, partial tiles;
        compiles ~80 kernels on a cold cache; the dtype only changes the mma suffix)."""
        dtype = torch.float16
        m, n, k = 300, 520, 200
        a = _rand(m, k, dtype=dtype)
        for bt in (False, True):
            b = _rand(n, k, dtype=dtype, seed=1) if bt else _rand(k, n, dtype=dtype, seed=1)
            ref = _ref(a, b, bt)
            for cfg in ops.variant_configs(sm90=_cc() == 90):
                c = _run_poisoned(a, b, cfg, bt)
                _check(c, ref, dtype)

    @pytest.mark.parametrize("b_transposed", [False, True], ids=["kn", "nk"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
    def test_wgmma_persistent_and_ring_wrap(self, dtype, b_transposed):
        """Step 07 with more tiles than SMs (each block loops over several tiles, the stage ring
        wraps across tiles), a K tail that is not a multiple of 64, and every tile shape."""
        _skip_unless_runs("07_wgmma_tma")
        m, n, k = 2100, 2312, 1000  # 17 x 10 tiles of 128 x 256 > 132 SMs; 16 k stages, last partial
        a = _rand(m, k, dtype=dtype)
        b = _rand(n, k, dtype=dtype, seed=1) if b_transposed else _rand(k, n, dtype=dtype, seed=1)
        ref = _ref(a, b, b_transposed)
        for cfg in [ops.TUNED["07_wgmma_tma"], ops.TUNED_SMALL["07_wgmma_tma"], ops.WGMMA_SHORT, ops.WGMMA_NARROW,
                    HgemmConfig.of("07_wgmma_tma", BM=64, BN=64, STAGES=2, GROUP_M=3, CLUSTER=1, PINGPONG=0, TMA_STORE=0),
                    HgemmConfig.of("07_wgmma_tma", BM=128, BN=128, STAGES=3, GROUP_M=5, CLUSTER=2, PINGPONG=0, TMA_STORE=0),
                    HgemmConfig.of("07_wgmma_tma", BM=64, BN=256, STAGES=5, GROUP_M=8, CLUSTER=2, PINGPONG=0, TMA_STORE=0),
                    # ping-pong: stages fewer / more than k stages, odd tile counts per CTA, clusters
                    HgemmConfig.of("07_wgmma_tma", BM=128, BN=128, STAGES=6, GROUP_M=8, CLUSTER=1, PINGPONG=1, TMA_STORE=0),
                    HgemmConfig.of("07_wgmma_tma", BM=128, BN=128, STAGES=5, GROUP_M=8, CLUSTER=2, PINGPONG=1, TMA_STORE=0),
                    HgemmConfig.of("07_wgmma_tma", BM=64, BN=256, STAGES=5, GROUP_M=3, CLUSTER=2, PINGPONG=1, TMA_STORE=0),
                    HgemmConfig.of("07_wgmma_tma", BM=64, BN=64, STAGES=2, GROUP_M=3, CLUSTER=1, PINGPONG=1, TMA_STORE=0),
                    # TMA-store epilogue: M and N edges clipped by the TMA unit, every tile width
                    HgemmConfig.of("07_wgmma_tma", BM=64, BN=64, STAGES=2, GROUP_M=3, CLUSTER=1, PINGPONG=1, TMA_STORE=1),
                    HgemmConfig.of("07_wgmma_tma", BM=64, BN=128, STAGES=3, GROUP_M=3, CLUSTER=2, PINGPONG=0, TMA_STORE=1),
                    HgemmConfig.of("07_wgmma_tma", BM=128, BN=256, STAGES=3, GROUP_M=5, CLUSTER=1, PINGPONG=0, TMA_STORE=1),
                    HgemmConfig.of("07_wgmma_tma", BM=64, BN=256, STAGES=4, GROUP_M=3, CLUSTER=2, PINGPONG=1, TMA_STORE=1)]:
            _check(_run_poisoned(a, b, cfg, b_transposed), ref, dtype)
        # K smaller than one stage, and a single k stage
        pingpong = HgemmConfig.of("07_wgmma_tma", BM=128, BN=128, STAGES=6, GROUP_M=8, CLUSTER=2, PINGPONG=1, TMA_STORE=0)
        for k in (8, 64):
            a = _rand(300, k, dtype=dtype)
            b = _rand(n, k, dtype=dtype, seed=2) if b_transposed else _rand(k, n, dtype=dtype, seed=2)
            _check(_run_poisoned(a, b, "07_wgmma_tma", b_transposed), _ref(a, b, b_transposed), dtype)
            _check(_run_poisoned(a, b, pingpong, b_transposed), _ref(a, b, b_transposed), dtype)

    def test_wgmma_many_launches_changing_shapes(self):
        """Barrier phases and the persistent loop start fresh every launch: shapes change, results hold."""
        _skip_unless_runs("07_wgmma_tma")
        for i, (m, n, k) in enumerate([(128, 256, 64), (4096, 512, 72), (1, 8, 8), (777, 1000, 4104)] * 2):
            a, b = _rand(m, k, seed=i), _rand(k, n, seed=i + 1)
            _check(hgemm(a, b, kernel="07_wgmma_tma"), _ref(a, b), torch.float16)

    def test_tuned_small_and_large(self):
        a = _rand(64, 4096)
        b = _rand(4096, 256, seed=1)
        sms, cc = _sms(), _cc()
        auto = ops.auto_step(cc)
        small = ops.WGMMA_NARROW if auto == ops.AUTO_STEP_SM90 else ops.TUNED_SMALL[auto]  # m <= 64 on Hopper
        assert ops.select(64, 256, "auto", sms, cc) == small
        _check(hgemm(a, b), _ref(a, b), torch.float16)
        big = ops.select(4096, 4096, "auto", sms, cc)
        assert big == ops.TUNED[auto]

    def test_transposed_views_need_no_copy(self):
        w = _rand(136, 64, seed=3)         # nn.Linear weight [N, K]
        x = _rand(33, 64)
        _check(hgemm(x, w, b_transposed=True), _ref(x, w, True), torch.float16)
        _check(hgemm(x, w.t()), _ref(x, w, True), torch.float16)            # [K, N] view of [N, K]
        b = _rand(64, 136, seed=4)
        _check(hgemm(x, b.t(), b_transposed=True), _ref(x, b), torch.float16)  # [N, K] view of [K, N]
        _check(hgemm(x.t().contiguous().t(), b), _ref(x, b), torch.float16)    # strided a: copied

    def test_linear_matches_torch(self):
        lin = torch.nn.Linear(512, 1000, bias=False, device="cuda", dtype=torch.bfloat16)
        x = _rand(77, 512, dtype=torch.bfloat16)
        with torch.no_grad():
            ref = lin(x)
            out = hgemm(x, lin.weight, b_transposed=True)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16]

    def test_empty_and_k0(self):
        a = _rand(0, 64)
        b = _rand(64, 32)
        assert hgemm(a, b).shape == (0, 32)
        z = hgemm(_rand(5, 0), _rand(0, 16))
        assert z.shape == (5, 16) and (z == 0).all()

    def test_bad_inputs_raise_before_launch(self):
        a, b = _rand(16, 64), _rand(64, 32)
        with pytest.raises(ValueError, match="K % 8"):
            hgemm(_rand(16, 60), _rand(60, 32))
        with pytest.raises(ValueError, match="N % 8"):
            hgemm(a, _rand(64, 30))
        hgemm(a, _rand(30, 64), b_transposed=True)  # [N, K]: any N
        with pytest.raises(ValueError, match="16-byte aligned"):
            hgemm(_rand(16 * 64 + 1)[1:].view(16, 64), b)
        with pytest.raises(TypeError, match="same dtype"):
            hgemm(a, b.to(torch.bfloat16))
        with pytest.raises(ValueError, match="one device"):
            hgemm(a, b.cpu())
        with pytest.raises(ValueError, match="inner dimensions"):
            hgemm(a, b, b_transposed=True)

    def test_cuda_graph_capture(self):
        a, b = _rand(256, 512), _rand(512, 384, seed=1)
        hgemm(a, b)  # compile and load outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = hgemm(a, b)
        g.replay()
        torch.cuda.synchronize()
        _check(out, _ref(a, b), torch.float16)

    def test_deterministic(self):
        a, b = _rand(512, 1024), _rand(1024, 768, seed=1)
        x = hgemm(a, b)
        for _ in range(3):
            assert torch.equal(hgemm(a, b), x)


# ------------------------------------------------------------------------------------ CPU --
@pytest.mark.parametrize("b_transposed", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_reference_path(dtype, b_transposed):
    a = torch.randn(13, 24).to(dtype)
    b = (torch.randn(40, 24) if b_transposed else torch.randn(24, 40)).to(dtype)
    for kernel in KERNELS + ("auto",):
        out = hgemm(a, b, kernel=kernel, b_transposed=b_transposed)
        assert out.dtype == dtype and out.shape == (13, 40)
        ref = (a.float() @ (b.float().t() if b_transposed else b.float())).to(dtype)
        assert torch.equal(out, ref)
    # the CPU path has no alignment / multiple-of-8 rules
    assert hgemm(torch.randn(3, 5).half(), torch.randn(5, 7).half()).shape == (3, 7)


def test_wgmma_step_refuses_other_gpus():
    """Step 07 by name (or as a configuration) on a non-Hopper GPU is a ValueError of the decision the
    launcher takes before any launch; "auto" there is step 06."""
    for kernel in ("07_wgmma_tma", ops.TUNED["07_wgmma_tma"]):
        with pytest.raises(ValueError, match="sm_90"):
            ops.decide(4096, 4096, kernel, 108, 80, 163 << 10)
    assert ops.decide(4096, 4096, "06_rasterized", 108, 80, 163 << 10)[0].step == "06_rasterized"
    assert ops.decide(4096, 4096, "auto", 108, 80, 163 << 10)[0].step == "06_rasterized"


def test_validation_errors_cpu():
    a, b = torch.randn(4, 8).half(), torch.randn(8, 16).half()
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        hgemm(a.float(), b)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        hgemm(a, b.double())
    with pytest.raises(TypeError, match="same dtype"):
        hgemm(a, b.bfloat16())
    with pytest.raises(TypeError, match="torch.Tensor"):
        hgemm(a, [[1.0]])
    with pytest.raises(ValueError, match="2-D"):
        hgemm(a[None], b)
    with pytest.raises(ValueError, match="inner dimensions"):
        hgemm(a, torch.randn(9, 16).half())
    with pytest.raises(ValueError, match="inner dimensions"):
        hgemm(a, b, b_transposed=True)
    with pytest.raises(ValueError, match="kernel must be"):
        hgemm(a, b, kernel="07_wgmma")
    with pytest.raises(TypeError, match="b_transposed"):
        hgemm(a, b, b_transposed=1)
    with pytest.raises(ValueError, match="cannot be instantiated"):
        hgemm(a, b, kernel=HgemmConfig("05_multistage", (128, 128, 32, 64, 24, 3)))


def _shapes(seed: int, count: int = 150) -> list[tuple[int, int]]:
    """Edge sizes and random ones (from the test's seed) up to 64k, for the dispatch properties."""
    import random

    rng = random.Random(seed)
    edges = [1, 16, 63, 64, 65, 128, 256, 1000, 1024, 4096, 14336, 65536]
    return [(m, n) for m in edges for n in edges] + [(rng.randint(1, 1 << 16), rng.randint(1, 1 << 16))
                                                    for _ in range(count)]


GPUS = [(108, 80, 163 * 1024), (84, 86, 99 * 1024), (128, 89, 99 * 1024), (132, 90, 227 * 1024),
        (114, 90, 227 * 1024), (132, 90, None), (8, 80, None)]  # (SMs, compute capability, smem a block)


def test_select_plans_are_legal_and_deterministic(seed):
    """Every plan `hgemm` can pick: a dispatchable configuration (compiled by compile-all for both dtypes and
    B layouts) that is valid, of the step asked for (auto: step 07 on sm_90 only), within the GPU's
    shared memory where the step has a smaller tile to give, and the same answer to the same question."""
    specs = set(ops.dispatch_specs())
    for m, n in _shapes(seed):
        for sm, cc, smem in GPUS:
            for kernel in ("auto", *KERNELS):
                if kernel == "07_wgmma_tma" and cc != 90:
                    continue
                cfg = ops.select(m, n, kernel, sm, cc, smem)
                where = (m, n, kernel, sm, cc, smem)
                assert cfg.problem() is None, where
                assert all(cfg.spec(d, nk) in specs for d in DTYPES for nk in (False, True)), where
                assert cfg.step == (ops.auto_step(cc) if kernel == "auto" else kernel), where
                assert cfg.info.hopper == (cfg.step == "07_wgmma_tma") and (cc == 90 or not cfg.info.hopper)
                if smem is not None and cfg.step in ops.TUNED_LOW_SMEM:
                    assert cfg.smem_bytes <= smem, where
                assert ops.select.__wrapped__(m, n, kernel, sm, cc, smem) == cfg, where  # not just the cache


def test_select_small_outputs_take_smaller_tiles(seed):
    """Monotonic in the output size: along growing m (n fixed) the tile picked while the tuned tile would
    leave SMs idle is never larger than the tuned one and its height never shrinks (decode's 64 x 256 tile
    gives way to 64 x 128 above m = 64: the tile height is what grows with m); once the tuned tile fills the GPU it is the tuned tile (or, on sm_90,
    the 128 x 128 one where the persistent grid's last round would be emptier), never a small-grid tile."""
    import random

    rng = random.Random(seed)
    for sm, cc, smem in GPUS:
        step = ops.auto_step(cc)
        big = ops.TUNED[step]
        for _ in range(15):
            n = rng.randint(1, 1 << 15)
            prev = 0
            for m in sorted({rng.randint(1, 1 << 15) for _ in range(60)} | {1, 64, 65}):
                cfg = ops.select(m, n, "auto", sm, cc)
                if big.blocks(m, n) < sm:
                    assert cfg.tile[0] >= prev and cfg.tile[0] * cfg.tile[1] <= big.tile[0] * big.tile[1], (m, n, sm, cc)
                    prev = cfg.tile[0]
                    assert cfg.blocks(m, n) >= big.blocks(m, n), (m, n, sm, cc)
                    if step == "07_wgmma_tma" and m <= ops.NARROW_MAX_M:
                        assert cfg.tile[0] == 64, "decode: a single 64-row tile row"
                else:
                    assert cfg in (big, ops.WGMMA_MID), (m, n, sm, cc)


def test_select_wgmma_large_outputs_fill_the_last_round(seed):
    """sm_90, outputs that fill the GPU: of the 128 x 256 tile and the 128 x 128 one, the plan's tile wastes
    no more of the persistent grid's rounds (weighted by the tile's efficiency) than the other would."""
    import random

    rng = random.Random(seed)
    big, mid = ops.TUNED["07_wgmma_tma"], ops.WGMMA_MID
    for _ in range(300):
        m, n, sm = rng.randint(256, 1 << 15), rng.randint(256, 1 << 15), rng.choice((78, 114, 132))
        if big.blocks(m, n) < sm:
            continue
        cfg = ops.select(m, n, "auto", sm, 90)
        other = mid if cfg == big else big
        assert ops._round_efficiency(cfg, m, n, sm) >= ops._round_efficiency(other, m, n, sm), (m, n, sm)


def test_select_held_out_cases():
    """Cases the tuning recorded (docs/hgemm.md), not restated from the rules above."""
    assert ops.select(4096, 4096, "auto", 132, 80) == ops.TUNED["06_rasterized"]
    assert ops.select(4096, 4096, "auto", 132, 90) == ops.TUNED["07_wgmma_tma"]
    assert ops.select(4096, 4096, "auto", 84, 86, smem_limit=99 * 1024) == ops.TUNED_LOW_SMEM["06_rasterized"]
    assert ops.select(16, 4096, "auto", 132, 90) == ops.WGMMA_NARROW  # decode
    # 1024 x 14336: 448 tiles of 128 x 256 are 3.4 rounds of 132; the 128 x 128 tile wins
    assert ops.select(1024, 14336, "auto", 132, 90) == ops.WGMMA_MID


def test_configs_are_consistent():
    assert KERNELS == ("01_mma_naive", "02_block_ldmatrix", "03_padded", "04_swizzled",
                       "05_multistage", "06_rasterized", "07_wgmma_tma")
    assert set(ops.TUNED) == set(KERNELS)
    for cfg in list(ops.TUNED.values()) + list(ops.TUNED_SMALL.values()) + ops.variant_configs(sm90=True):
        assert cfg.problem() is None, cfg.label()
        if not cfg.info.hopper:
            assert cfg.smem_bytes <= 163 * 1024, cfg.label()  # fits A100 as well as H100/H200
        else:
            assert cfg.smem_bytes <= 227 * 1024, cfg.label()
    assert all(c.spec(torch.float16) in ops.dispatch_specs() for c in ops.TUNED_LOW_SMEM.values())
    assert ops.WGMMA_SHORT.tile == (64, 128) and ops.WGMMA_SHORT.spec(torch.bfloat16, True) in ops.dispatch_specs()
    assert ops.TUNED_SMALL["07_wgmma_tma"].PINGPONG == 1 and ops.WGMMA_NARROW.PINGPONG == 1
    # step 07: a persistent grid, one producer + BM/64 consumer warpgroups
    w = ops.TUNED["07_wgmma_tma"]
    assert w.grid(4096, 4096, 132) == 132 and w.grid(128, 256, 132) == w.CLUSTER
    assert w.grid(4096, 4096, 132, max_clusters=60) == 60 * w.CLUSTER
    assert w.threads == (w.BM // 64 + 1) * 128
    assert HgemmConfig.of("07_wgmma_tma", BM=64, BN=256, STAGES=5, GROUP_M=8, CLUSTER=1, PINGPONG=1, TMA_STORE=0).threads == 384
    assert w.grid(4096, 4096, 132) % w.CLUSTER == 0
    assert "multiple of 32" in HgemmConfig("05_multistage", (128, 128, 16, 64, 64, 4)).problem()
    assert HgemmConfig("07_wgmma_tma", (192, 256, 4, 8, 1, 0, 0)).problem() is not None
    assert HgemmConfig("07_wgmma_tma", (128, 256, 5, 8, 1, 0, 0)).problem() == "dynamic smem > 227 KB"
    assert HgemmConfig("07_wgmma_tma", (128, 64, 4, 8, 2, 0, 0)).problem() is not None
    assert "128 x 128" in HgemmConfig("07_wgmma_tma", (128, 256, 3, 8, 1, 1, 0)).problem()
    assert HgemmConfig("07_wgmma_tma", (128, 128, 6, 8, 1, 2, 0)).problem() is not None
    assert HgemmConfig("07_wgmma_tma", (128, 128, 6, 8, 1, 1, 2)).problem() is not None
    assert HgemmConfig("07_wgmma_tma", (128, 256, 4, 8, 1, 0)).problem() == "bad parameter list"
    # the TMA-store epilogue's staging (2 x 8 KB a consumer) counts against the 227 KB
    assert HgemmConfig("07_wgmma_tma", (64, 256, 5, 8, 1, 1, 1)).problem() == "dynamic smem > 227 KB"
    assert (HgemmConfig("07_wgmma_tma", (128, 256, 4, 8, 2, 0, 1)).smem_bytes
            == HgemmConfig("07_wgmma_tma", (128, 256, 4, 8, 2, 0, 0)).smem_bytes + 2 * 16384)
    assert ops.TUNED["07_wgmma_tma"].TMA_STORE == 1 and ops.WGMMA_MID.TMA_STORE == 1
    # N % 8 != 0 (no tensor map for C): the same configuration with the direct epilogue
    direct = ops._direct_store(ops.TUNED["07_wgmma_tma"])
    assert direct.TMA_STORE == 0 and {**direct.params, "TMA_STORE": 1} == ops.TUNED["07_wgmma_tma"].params
    assert direct.spec(torch.float16) in ops.dispatch_specs()
    # a cluster of 2 takes two vertically adjacent tiles: an odd tile-row count still fills whole clusters
    c2 = HgemmConfig.of("07_wgmma_tma", BM=128, BN=256, STAGES=4, GROUP_M=8, CLUSTER=2, PINGPONG=0, TMA_STORE=0)
    assert c2.grid(3 * 128, 256, 132) == 4 and c2.grid(128, 256, 132) == 2
    # step 06: a 1-D grouped grid with one block per output tile; step 05: a 2-D grid of tiles
    p6, p5 = ops.TUNED["06_rasterized"].params, ops.TUNED["05_multistage"].params
    assert ops.TUNED["06_rasterized"].grid(1000, 1000) == -(-1000 // p6["BM"]) * -(-1000 // p6["BN"])
    assert ops.TUNED["05_multistage"].grid(1000, 1000) == (-(-1000 // p5["BN"]), -(-1000 // p5["BM"]))
    specs = ops.dispatch_specs()
    assert len(specs) == len(set(specs))
    hot = {s.name.split("<")[0]: s.hot for s in specs}
    assert hot == {"hgemm_mma_naive": False, "hgemm_block_ldmatrix": False, "hgemm_padded": False,
                   "hgemm_swizzled": True, "hgemm_multistage": True, "hgemm_rasterized": True,
                   "hgemm_wgmma": True}
    wg = [s for s in specs if s.name.startswith("hgemm_wgmma")]
    assert wg and all(s.arch_specific and s.min_sm == 90 and s.target("sm_90") == "sm_90a" for s in wg)
    names = {s.name for s in specs}
    assert "hgemm_mma_naive<__nv_bfloat16, true>" in names
    # the tuning space: 128x128 / 128x256 / 256x128 tiles, BK 32 and 64, 3 and 4 stages
    labels = {c.short() for c in ops.variant_configs("05_multistage")}
    assert {"128x128x32 w64x32 s3", "128x256x64 w64x64 s3", "256x128x32 w64x64 s4"} <= labels


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEFISH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TILEFISH_CACHE", "1")
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dispatch_specs_compile_without_spills(arch, compiled_cache):
    """Every hgemm kernel compiles (in the session's compile-all: conftest) and no hot one spills."""
    from tilefish.runtime import compile_kernel

    compiled_cache(arch)
    for spec in ops.dispatch_specs(arch):
        if not spec.supports(arch):  # step 07 is sm_90a only
            continue
        ck = compile_kernel(spec, arch)
        assert ck.from_cache, f"{spec.name}: not compiled by compile-all for {arch}"
        r = ck.resources
        assert r.registers > 0, spec.name
        if spec.hot:
            assert not r.spills and r.stack_bytes == 0, f"{spec.name} on {arch}: {r}"


def _find_tool(name: str) -> str | None:
    try:
        import cuda.pathfinder as pf

        fn = getattr(pf, "find_nvidia_binary_utility", None)
        if fn is not None:
            p = fn(name)
            if p:
                return str(p)
    except Exception:
        pass
    try:
        import nvidia

        for base in map(Path, nvidia.__path__):
            for cand in base.glob(f"cu*/bin/{name}"):
                if os.access(cand, os.X_OK):
                    return str(cand)
    except Exception:
        pass
    return shutil.which(name)


def _sass(spec, tmp_path) -> str:
    """SASS text of a kernel compiled for sm_90 (cuobjdump, falling back to nvdisasm)."""
    from tilefish.runtime import compile_kernel

    cuobjdump, nvdisasm = _find_tool("cuobjdump"), _find_tool("nvdisasm")
    if not cuobjdump or not nvdisasm:
        pytest.skip("cuobjdump / nvdisasm not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    ck = compile_kernel(spec, "sm_90")
    cubin = tmp_path / f"k{abs(hash(spec))}.cubin"
    cubin.write_bytes(ck.cubin)
    env = dict(os.environ, PATH=f"{Path(nvdisasm).parent}:{os.environ.get('PATH', '')}")
    res = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env, timeout=120)
    sass = res.stdout
    if res.returncode != 0 or "MMA" not in sass:
        res = subprocess.run([nvdisasm, str(cubin)], capture_output=True, text=True, timeout=120)
        sass = res.stdout
    assert res.returncode == 0, res.stderr
    return sass


def test_wgmma_step_uses_hgmma_tma_sass(tmp_cache, tmp_path):
    """Step 07 multiplies with HGMMA (wgmma, fp32 accumulate) fed by UTMALDG (TMA) through mbarriers
    (SYNCS), reallocates registers (USETMAXREG), stores C with STSM + UTMASTG (TMA store) and has
    no mma.sync or ldmatrix left."""
    for dtype in DTYPES:
        for b_nk in (False, True):
            sass = _sass(ops.TUNED["07_wgmma_tma"].spec(dtype, b_nk), tmp_path)
            assert "HGMMA.64x256x16.F32" in sass, "expected wgmma m64n256k16 with fp32 accumulation"
            assert "UTMALDG.2D" in sass, "expected TMA 2-D tensor loads"
            assert "SYNCS" in sass, "expected mbarrier operations"
            assert "USETMAXREG" in sass, "expected setmaxnreg (warp specialization)"
            assert "HMMA" not in sass.replace("HGMMA", "") and "LDSM" not in sass
            # the TMA-store epilogue: stmatrix into the staging buffers, then TMA 2-D stores
            assert "STSM" in sass and "UTMASTG.2D" in sass, "expected stmatrix + TMA store epilogue"


def test_swizzled_step_uses_ldsm_sass(tmp_cache, tmp_path):
    """Step 04 reads its fragments with LDSM (ldmatrix) and never through plain LDS."""
    for b_nk in (False, True):
        sass = _sass(ops.TUNED["04_swizzled"].spec(torch.float16, b_nk), tmp_path)
        assert "HMMA.16816.F32" in sass, "expected mma.sync m16n8k16 with fp32 accumulation"
        ldsm = [ln for ln in sass.splitlines() if "LDSM" in ln]
        assert any(".M88.4" in ln for ln in ldsm), "A fragments: ldmatrix.x4"
        if b_nk:
            assert any(".M88.2" in ln and ".MT88" not in ln for ln in ldsm), "B [N, K]: ldmatrix.x2"
        else:
            assert any(".MT88.2" in ln for ln in ldsm), "B [K, N]: ldmatrix.x2.trans"
        assert not [ln for ln in sass.splitlines() if " LDS" in ln and "LDSM" not in ln], \
            "fragments must come from ldmatrix, not plain LDS"
