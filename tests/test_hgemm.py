"""HGEMM ladder (fp16/bf16, mma.sync): every step against an fp32 reference on the GPU, both dtypes
and both B layouts, odd shapes, NaN-poisoned outputs; CPU path, validation, compile-all (sm_80,
sm_90, no spills in hot steps) and a SASS check (LDSM in step 04) on the CPU."""
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


def _run_poisoned(a, b, kernel, b_transposed):
    """Launch with a NaN-poisoned output buffer (the same cfg/launch path hgemm takes)."""
    m, k = a.shape
    n = b.shape[0] if b_transposed else b.shape[1]
    c = poison(torch.empty(m, n, dtype=a.dtype, device=a.device))
    cfg = ops.select(m, n, kernel, torch.cuda.get_device_properties(a.device).multi_processor_count)
    ops.launch_config(cfg, a, b, c, b_transposed)
    return c


# ------------------------------------------------------------------------------------ GPU --
class TestGPU:
    pytestmark = pytest.mark.gpu

    @pytest.mark.parametrize("b_transposed", [False, True], ids=["kn", "nk"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
    @pytest.mark.parametrize("step", KERNELS + ("auto",))
    def test_every_step(self, step, dtype, b_transposed):
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
            for cfg in ops.variant_configs():
                c = _run_poisoned(a, b, cfg, bt)
                _check(c, ref, dtype)

    def test_tuned_small_and_large(self):
        a = _rand(64, 4096)
        b = _rand(4096, 256, seed=1)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert ops.select(64, 256, "auto", sms) == ops.TUNED_SMALL[ops.AUTO_STEP]
        _check(hgemm(a, b), _ref(a, b), torch.float16)
        big = ops.select(4096, 4096, "auto", sms)
        assert big == ops.TUNED[ops.AUTO_STEP]

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


def test_configs_are_consistent():
    assert KERNELS == ("01_mma_naive", "02_block_ldmatrix", "03_padded", "04_swizzled",
                       "05_multistage", "06_rasterized")
    assert set(ops.TUNED) == set(KERNELS)
    for cfg in list(ops.TUNED.values()) + list(ops.TUNED_SMALL.values()) + ops.variant_configs():
        assert cfg.problem() is None, cfg.label()
        assert cfg.smem_bytes <= 163 * 1024, cfg.label()  # fits A100 as well as H100/H200
    assert ops.select(4096, 4096, "auto", 132).step == ops.AUTO_STEP
    assert ops.select(16, 4096, "auto", 132) == ops.TUNED_SMALL[ops.AUTO_STEP]
    # step 06: a 1-D grouped grid with one block per output tile; step 05: a 2-D grid of tiles
    p6, p5 = ops.TUNED["06_rasterized"].params, ops.TUNED["05_multistage"].params
    assert ops.TUNED["06_rasterized"].grid(1000, 1000) == -(-1000 // p6["BM"]) * -(-1000 // p6["BN"])
    assert ops.TUNED["05_multistage"].grid(1000, 1000) == (-(-1000 // p5["BN"]), -(-1000 // p5["BM"]))
    specs = ops.dispatch_specs()
    assert len(specs) == len(set(specs))
    hot = {s.name.split("<")[0]: s.hot for s in specs}
    assert hot == {"hgemm_mma_naive": False, "hgemm_block_ldmatrix": False, "hgemm_padded": False,
                   "hgemm_swizzled": True, "hgemm_multistage": True, "hgemm_rasterized": True}
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
def test_dispatch_specs_compile_without_spills(arch, tmp_cache):
    from tilefish.runtime import compile_kernel

    for spec in ops.dispatch_specs():
        r = compile_kernel(spec, arch).resources
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


def test_swizzled_step_uses_ldsm_sass(tmp_cache, tmp_path):
    """Step 04 reads its fragments with LDSM (ldmatrix) and never through plain LDS."""
    from tilefish.runtime import compile_kernel

    cuobjdump, nvdisasm = _find_tool("cuobjdump"), _find_tool("nvdisasm")
    if not cuobjdump or not nvdisasm:
        pytest.skip("cuobjdump / nvdisasm not installed (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    for b_nk in (False, True):
        spec = ops.TUNED["04_swizzled"].spec(torch.float16, b_nk)
        ck = compile_kernel(spec, "sm_90")
        cubin = tmp_path / f"step4_{int(b_nk)}.cubin"
        cubin.write_bytes(ck.cubin)
        env = dict(os.environ, PATH=f"{Path(nvdisasm).parent}:{os.environ.get('PATH', '')}")
        res = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env, timeout=120)
        sass = res.stdout
        if res.returncode != 0 or "LDSM" not in sass and "HMMA" not in sass:
            res = subprocess.run([nvdisasm, str(cubin)], capture_output=True, text=True, timeout=120)
            sass = res.stdout
        assert res.returncode == 0, res.stderr
        assert "HMMA.16816.F32" in sass, "expected mma.sync m16n8k16 with fp32 accumulation"
        ldsm = [ln for ln in sass.splitlines() if "LDSM" in ln]
        assert any(".M88.4" in ln for ln in ldsm), "A fragments: ldmatrix.x4"
        if b_nk:
            assert any(".M88.2" in ln and ".MT88" not in ln for ln in ldsm), "B [N, K]: ldmatrix.x2"
        else:
            assert any(".MT88.2" in ln for ln in ldsm), "B [K, N]: ldmatrix.x2.trans"
        assert not [ln for ln in sass.splitlines() if " LDS" in ln and "LDSM" not in ln], \
            "fragments must come from ldmatrix, not plain LDS"
