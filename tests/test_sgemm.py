"""SGEMM ladder: every step against a float64 reference on the GPU; CPU path, validation and
compile-all (sm_80, sm_90, no spills) on the CPU."""
from __future__ import annotations

import importlib
import math

import pytest
import torch

from tilefish.ops.sgemm import KERNELS, SgemmConfig, sgemm

ops = importlib.import_module("tilefish.ops.sgemm")  # the module, even if a package re-exports the function

from conftest import TOLERANCE, poison, rel_err

TOL = TOLERANCE[torch.float32]
# Any-shape cases (primes, 1, non-multiples of every tile), incl. the brief's list.
SHAPES = [(1, 1, 1), (7, 13, 29), (127, 255, 129), (1024, 1024, 1024), (333, 4096, 517), (2, 3, 1), (65, 1, 300)]
# Shapes on the vectorized fast path (K % 4 == N % 4 == 0) with partial tiles in M, N and K.
VEC_SHAPES = [(1, 4, 4), (5, 132, 68), (257, 260, 132), (130, 36, 1028), (129, 4, 8), (64, 64, 64)]


def _ref(a, b, c=None, alpha=1.0, beta=0.0):
    out = alpha * (a.double() @ b.double())
    if c is not None and beta != 0:
        out = out + beta * c.double()
    return out


def _rand(*shape, device="cuda", seed=None):
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else hash(shape) % 2**31)
    return torch.randn(*shape, device=device, generator=g)


def _check(out, ref):
    assert not torch.isnan(out).any(), "unwritten output elements (NaN poison survived)"
    err = rel_err(out, ref)
    assert err < TOL, f"relative error {err:.3g} >= {TOL}"


# ------------------------------------------------------------------------------------ GPU --
class TestGPU:
    pytestmark = pytest.mark.gpu

    @pytest.mark.parametrize("shape", SHAPES + VEC_SHAPES, ids=lambda s: "x".join(map(str, s)))
    @pytest.mark.parametrize("step", KERNELS)
    def test_every_step(self, step, shape):
        m, n, k = shape
        a, b = _rand(m, k), _rand(k, n)
        c = poison(torch.empty(m, n, device="cuda"))
        out = sgemm(a, b, c, kernel=step)  # beta = 0: the NaN in c must not leak
        assert out is c
        _check(c, _ref(a, b))
        cfg = ops.select(m, n, ops.vector_ok(a, b, c), step)
        if ops.STEPS[step].vectorized and k % 4 == 0 and n % 4 == 0:
            assert cfg.step == step, "aligned fast-path shape must not fall back"
        elif ops.STEPS[step].vectorized:
            assert cfg.step == ops.FALLBACK

    @pytest.mark.parametrize("step", KERNELS)
    @pytest.mark.parametrize("alpha,beta", [(0.5, -1.5), (2.0, 1.0), (0.0, 0.75), (-1.0, 0.0)])
    def test_alpha_beta(self, step, alpha, beta):
        for m, n, k in [(129, 132, 68), (31, 45, 17)]:
            a, b = _rand(m, k), _rand(k, n)
            c = _rand(m, n, seed=7)
            c0 = c.clone()
            if beta == 0:
                c.fill_(float("nan"))
            out = sgemm(a, b, c, alpha=alpha, beta=beta, kernel=step)
            assert out is c
            _check(c, _ref(a, b, c0, alpha, beta))

    def test_beta_zero_ignores_nan_and_inf(self):
        a, b = _rand(200, 96), _rand(96, 300)
        c = torch.full((200, 300), float("inf"), device="cuda")
        c[::3] = float("nan")
        sgemm(a, b, c, alpha=1.0, beta=0.0)
        assert torch.isfinite(c).all()
        _check(c, _ref(a, b))

    @pytest.mark.parametrize("which", ["tuned", "small"])
    def test_tuned_configs_explicitly(self, which):
        table = ops.TUNED if which == "tuned" else ops.TUNED_SMALL
        for cfg in table.values():
            for m, n, k in [(257, 260, 132), (64, 128, 16)]:
                a, b = _rand(m, k), _rand(k, n)
                c = _rand(m, n, seed=3)
                c0 = c.clone()
                sgemm(a, b, c, alpha=1.25, beta=-0.5, kernel=cfg)
                _check(c, _ref(a, b, c0, 1.25, -0.5))

    def test_every_autotune_variant(self):
        """Every configuration the autotuner may pick is correct (compiles ~170 kernels on a cold cache)."""
        m, n, k = 260, 264, 136
        a, b = _rand(m, k), _rand(k, n)
        ref = _ref(a, b)
        for cfg in ops.variant_configs():
            c = poison(torch.empty(m, n, device="cuda"))
            ops.launch_config(cfg, a, b, c)
            torch.cuda.synchronize()
            assert not torch.isnan(c).any(), cfg.label()
            assert rel_err(c, ref) < TOL, cfg.label()

    def test_auto_picks_fast_path_and_small_grid(self):
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        big = ops.select(4096, 4096, True, "auto", sms)
        assert big == ops.TUNED[ops.AUTO_STEP]
        small = ops.select(256, 256, True, "auto", sms)
        assert small == ops.TUNED_SMALL.get(ops.AUTO_STEP, big)
        assert ops.select(4096, 4096, False, "auto", sms).step == ops.FALLBACK
        for shape in [(256, 256, 256), (2048, 2048, 2048), (1000, 1000, 1000)]:
            m, n, k = shape
            a, b = _rand(m, k), _rand(k, n)
            _check(sgemm(a, b), _ref(a, b))

    def test_non_contiguous_inputs(self):
        m, n, k = 100, 132, 64
        a_big = _rand(m, 2 * k)
        a = a_big[:, ::2]                      # strided columns
        b = _rand(n, k).t()                    # transposed view
        c_big = _rand(m, 2 * n, seed=5)
        c = c_big[:, 1::2]                     # non-contiguous output, updated in place
        c_before, untouched = c.clone(), c_big[:, 0::2].clone()
        out = sgemm(a, b, c, alpha=0.5, beta=2.0)
        assert out is c
        _check(c, _ref(a, b, c_before, 0.5, 2.0))
        assert torch.equal(c_big[:, 0::2], untouched), "wrote outside the view"
        c.fill_(float("nan"))                  # beta = 0 into a strided view: still ignores NaN
        sgemm(a, b, c, kernel="09_pipelined")
        _check(c, _ref(a, b))

    def test_misaligned_falls_back(self):
        m, n, k = 33, 64, 64
        buf = _rand(m * k + 1)
        a = buf[1:].view(m, k)                 # contiguous but 4 bytes off 16-byte alignment
        b = _rand(k, n)
        assert a.data_ptr() % 16
        c = poison(torch.empty(m, n, device="cuda"))
        assert ops.select(m, n, ops.vector_ok(a, b, c), "09_pipelined").step == ops.FALLBACK
        sgemm(a, b, c, kernel="09_pipelined")
        _check(c, _ref(a, b))
        with pytest.raises(ValueError, match="aligned"):
            sgemm(a, b, c, kernel=ops.TUNED["09_pipelined"])

    def test_empty_dimensions(self):
        a, b = _rand(5, 0), _rand(0, 7)
        assert torch.equal(sgemm(a, b), torch.zeros(5, 7, device="cuda"))
        c = torch.full((5, 7), float("nan"), device="cuda")
        assert torch.equal(sgemm(a, b, c), torch.zeros(5, 7, device="cuda"))
        c = torch.ones(5, 7, device="cuda")
        assert torch.equal(sgemm(a, b, c, beta=3.0), torch.full((5, 7), 3.0, device="cuda"))
        assert sgemm(_rand(0, 4), _rand(4, 8)).shape == (0, 8)

    def test_bad_inputs_raise_before_launch(self):
        a, b = _rand(8, 4), _rand(4, 8)
        with pytest.raises(TypeError, match="fp32|dtype"):
            sgemm(a.half(), b.half())
        with pytest.raises(ValueError, match="device"):
            sgemm(a, b.cpu())
        with pytest.raises(ValueError, match="device"):
            sgemm(a, b, torch.empty(8, 8))
        with pytest.raises(ValueError, match="shape"):
            sgemm(a, b, torch.empty(8, 9, device="cuda"))
        with pytest.raises(ValueError, match="overlap|share"):
            sq = _rand(8, 8)
            sgemm(sq, sq, sq)

    def test_cuda_graph_capture(self):
        a, b = _rand(300, 128), _rand(128, 260)
        c = torch.empty(300, 260, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            sgemm(a, b, c)  # compile and load outside the capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            sgemm(a, b, c)
        poison(c)
        g.replay()
        torch.cuda.synchronize()
        _check(c, _ref(a, b))

    def test_deterministic(self):
        a, b = _rand(513, 1000), _rand(1000, 257)
        for step in KERNELS:
            x = sgemm(a, b, kernel=step)
            y = sgemm(a, b, kernel=step)
            assert torch.equal(x, y), step


# ------------------------------------------------------------------------------------ CPU --
@pytest.mark.parametrize("shape", [(1, 1, 1), (7, 13, 29), (33, 5, 64)])
def test_cpu_reference_path(shape):
    m, n, k = shape
    a, b = _rand(m, k, device="cpu"), _rand(k, n, device="cpu")
    out = sgemm(a, b)
    assert out.dtype == torch.float32 and out.shape == (m, n) and out.device.type == "cpu"
    assert rel_err(out, _ref(a, b)) < 1e-7
    c = _rand(m, n, device="cpu", seed=1)
    c0 = c.clone()
    assert sgemm(a, b, c, alpha=0.5, beta=-2.0) is c
    assert rel_err(c, _ref(a, b, c0, 0.5, -2.0)) < 1e-7
    c.fill_(float("nan"))
    sgemm(a, b, c, beta=0.0)
    assert not torch.isnan(c).any()


def test_cpu_non_contiguous_and_every_kernel_name():
    a = _rand(20, 40, device="cpu")[:, ::2]
    b = _rand(30, 20, device="cpu").t()
    c_big = torch.zeros(20, 60)
    c = c_big[:, ::2]
    for step in ("auto",) + KERNELS:
        sgemm(a, b, c, kernel=step)
        assert rel_err(c, _ref(a, b)) < 1e-7
    assert torch.equal(c_big[:, 1::2], torch.zeros(20, 30))


def test_validation_errors_cpu():
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    with pytest.raises(TypeError, match="fp32"):
        sgemm(a.double(), b.double())
    with pytest.raises(TypeError, match="fp32"):
        sgemm(a, b.to(torch.bfloat16))
    with pytest.raises(TypeError, match="Tensor"):
        sgemm([[1.0]], b)
    with pytest.raises(ValueError, match="2-D"):
        sgemm(a.unsqueeze(0), b)
    with pytest.raises(ValueError, match="2-D"):
        sgemm(a, torch.randn(3))
    with pytest.raises(ValueError, match="inner"):
        sgemm(a, torch.randn(4, 5))
    with pytest.raises(ValueError, match="shape"):
        sgemm(a, b, torch.empty(5, 4))
    with pytest.raises(TypeError, match="dtype"):
        sgemm(a, b, torch.empty(4, 5, dtype=torch.float16))
    with pytest.raises(ValueError, match="beta"):
        sgemm(a, b, beta=1.0)
    with pytest.raises(TypeError, match="alpha"):
        sgemm(a, b, alpha="2")
    with pytest.raises(ValueError, match="kernel"):
        sgemm(a, b, kernel="10_tensor_cores")
    bad = SgemmConfig("09_pipelined", (128, 128, 4, 64, 32, 2, 4, 4, 3, 2))  # BK % 8 != 0
    with pytest.raises(ValueError, match="instantiated"):
        sgemm(a, b, kernel=bad)


def test_ladder_tables_are_consistent():
    assert KERNELS == ("01_naive", "02_coalesced", "03_smem_blocking", "04_blocktile_1d", "05_blocktile_2d",
                       "06_vectorized", "07_bank_conflict_free", "08_warptile", "09_pipelined")
    assert set(ops.TUNED) == set(KERNELS)
    for step, cfg in list(ops.TUNED.items()) + list(ops.TUNED_SMALL.items()):
        assert cfg.step == step and cfg.problem() is None, cfg.label()
    assert not ops.STEPS[ops.FALLBACK].vectorized
    specs = ops.dispatch_specs()
    assert len(specs) == len(set(specs))
    for s in specs:
        assert s.hot == (int(s.source.split("/")[1][:2]) >= 5), s.name
    variants = ops.variant_configs()
    assert {c.step for c in variants} == set(KERNELS)
    assert all(c.problem() is None for c in variants)
    assert all(cfg in variants for cfg in list(ops.TUNED.values()) + list(ops.TUNED_SMALL.values()))
    assert len(ops.variant_specs()) == len(variants)
    # round trip through the autotuner's record
    cfg = ops.TUNED["09_pipelined"]
    assert SgemmConfig.of(cfg.step, **cfg.params) == cfg and cfg.BM == cfg.params["BM"]


def _shapes(seed: int, count: int = 200) -> list[tuple[int, int]]:
    """Edge sizes and random ones (from the test's seed) up to 64k, for the dispatch properties."""
    import random

    rng = random.Random(seed)
    edges = [1, 2, 7, 31, 64, 127, 128, 129, 1000, 4096, 65537]
    return [(m, n) for m in edges for n in edges] + [(rng.randint(1, 1 << 16), rng.randint(1, 1 << 16))
                                                    for _ in range(count)]


SM_COUNTS = (1, 46, 84, 108, 132, 170)


def test_select_plans_are_legal_and_deterministic(seed):
    """Every plan `sgemm` can pick is one of the dispatchable, valid configurations of the step asked for
    (or of the fallback when the operands are not vectorizable), needs no vector access it was not allowed,
    and the same question gets the same answer."""
    specs = set(ops.dispatch_specs())
    for m, n in _shapes(seed):
        for sm in SM_COUNTS:
            for vec in (True, False):
                for kernel in ("auto", *KERNELS):
                    cfg = ops.select(m, n, vec, kernel, sm)
                    assert cfg.spec in specs and cfg.problem() is None, (m, n, sm, vec, kernel)
                    assert vec or not cfg.info.vectorized, (m, n, sm, kernel)
                    asked = ops.AUTO_STEP if kernel == "auto" else kernel
                    want = asked if vec or not ops.STEPS[asked].vectorized else ops.FALLBACK
                    assert cfg.step == want, (m, n, sm, vec, kernel)
                    assert ops.select(m, n, vec, kernel, sm) == cfg
                    assert cfg.grid(m, n) >= 1
    # an explicit configuration is taken as given, and refused only for operands it cannot read
    big = ops.TUNED[ops.AUTO_STEP]
    assert ops.select(64, 64, True, big, 132) is big
    with pytest.raises(ValueError, match="aligned"):
        ops.select(64, 64, False, big, 132)


def test_select_small_grid_choice_is_monotonic(seed):
    """The small-grid tile is taken exactly when the tuned tile would leave SMs idle (fewer blocks than
    SMs), so along growing m, growing n or shrinking SM count the plan switches from the small tile to the
    tuned one at most once and never back."""
    import random

    rng = random.Random(seed)
    for step, small in ops.TUNED_SMALL.items():
        big = ops.TUNED[step]
        assert small.grid(1024, 1024) > big.grid(1024, 1024), "the small-grid tile is the smaller tile"
        for _ in range(20):
            n, sm = rng.randint(1, 1 << 14), rng.choice(SM_COUNTS)
            picks = [ops.select(m, n, True, step, sm) for m in range(1, 1 << 14, 97)]
            assert set(picks) <= {small, big}
            switches = [i for i in range(1, len(picks)) if picks[i] != picks[i - 1]]
            assert len(switches) <= 1 and (not switches or picks[-1] == big), (step, n, sm)
            for m, cfg in zip(range(1, 1 << 14, 97), picks):
                assert (cfg == small) == (big.grid(m, n) < sm), (step, m, n, sm)
            m = rng.randint(1, 1 << 14)
            by_sm = [ops.select(m, n, True, step, s) for s in sorted(SM_COUNTS)]
            assert by_sm == sorted(by_sm, key=lambda c: c == small), (step, m, n)  # big first, then small
    # held out: a large square output fills any GPU; a 128 x 128 one does not
    assert ops.select(4096, 4096, True, "auto", 132) == ops.TUNED[ops.AUTO_STEP]
    assert ops.select(128, 128, True, "auto", 132) == ops.TUNED_SMALL[ops.AUTO_STEP]


def test_config_geometry():
    big = ops.TUNED["09_pipelined"]
    for m, n in ((1, 1), (4096, 4096), (1000, 77)):
        assert big.grid(m, n) == math.ceil(m / big.BM) * math.ceil(n / big.BN)
    assert ops.TUNED["01_naive"].threads == 1024 and ops.TUNED["09_pipelined"].threads == 256


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dispatch_specs_compile_without_spills(arch, compiled_cache):
    """Every sgemm kernel compiles (in the session's compile-all: conftest), none spills."""
    from tilefish.runtime import compile_kernel

    compiled_cache(arch)
    for spec in ops.dispatch_specs():
        ck = compile_kernel(spec, arch)
        assert ck.from_cache, f"{spec.name}: not compiled by compile-all for {arch}"
        r = ck.resources
        assert r.registers > 0, spec.name
        assert not r.spills and r.stack_bytes == 0, f"{spec.name} on {arch}: {r}"
    # the dynamic shared memory of step 09 fits the per-block opt-in limit of both archs
    for cfg in list(ops.TUNED.values()) + list(ops.TUNED_SMALL.values()):
        assert cfg.smem_bytes <= (163 if arch == "sm_80" else 227) * 1024, cfg.label()
