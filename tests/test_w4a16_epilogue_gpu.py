"""The W4A16 kernels' fused epilogues (residual add, SiLU-gated) and programmatic dependent launch, on the GPU.

Each fused epilogue rounds the product to the dtype first, as the unfused PyTorch expression does, so under a
forced plan (the same sums in the same order) the residual epilogue must give `residual + y`'s bits from the
same kernel's plain output y, and the gated one `silu(gate) * up`'s within two ulps (its silu is fast fp32). Every kernel family and every place
a tile's final value is stored is covered: the mma.sync kernel (plain and swapped operands, k split fixup),
the skinny stream-K kernel (whole tiles, the finisher's and the consumers' fixups, the staged fixup), the wgmma
kernel (tiles, the global-workspace split, the DSMEM cluster split, stream-K). Outputs are poisoned, inputs
fresh and seeded (the seed is in every message)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tilefish import w4a16
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.reference import w4a16_epilogue, w4a16_matmul as ref_matmul

from conftest import TOLERANCE, capture, rel_err, ulp_distance

pytestmark = pytest.mark.gpu
hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                            reason="the wgmma and skinny kernels need sm_90")


def _case(k, n, group, sym, dtype, seed):
    """A weight scaled as a model's (outputs of unit-scale x about unit scale: silu(gate) * up and a chain of
    layers stay inside fp16's range)."""
    torch.manual_seed(seed)
    w = torch.randn(n, k, device="cuda") * (0.5 + torch.rand(()).item()) / k ** 0.5
    q = quantize_rtn(w, group, sym, scale_dtype=dtype, clip_search=False)
    return q, ops.pack(q)


def _poison(rows, cols, dtype):
    torch.full((rows, cols), float("nan"), device="cuda", dtype=dtype)


def _check_epilogues(x, q, p, seed, bias=None, **plan):
    """The plain output, then each epilogue under the same plan: the unfused expression's bits, and the
    float64 reference within the dtype's tolerance."""
    m, dtype = x.shape[0], x.dtype
    where = f"seed {seed}, m {m}, plan {plan.get('cfg').label() if plan.get('cfg') else 'dispatcher'} {plan}"
    y = ops.matmul_impl(x, p, bias, **plan)
    residual = torch.randn(m, p.n, device="cuda", dtype=dtype)
    _poison(m, p.n, dtype)
    got = ops.matmul_impl(x, p, bias, residual=residual, **plan)
    assert torch.equal(got, residual + y), f"residual epilogue differs from residual + y ({where})"
    ref = ref_matmul(x, q, bias)
    assert rel_err(got, residual + ref) < TOLERANCE[dtype], where
    _poison(m, p.n // 2, dtype)  # any weight reads as a gated one: its columns alternate 8 "gate", 8 "up"
    got = ops.matmul_impl(x, p, bias, gated=True, **plan)
    want = w4a16_epilogue(y, gated=True)
    assert got.shape == (m, p.n // 2)
    # the kernel's silu is fast fp32 (epilogue.cuh): its 16-bit silu may sit an ulp from torch's, and the
    # product then up to two (an ulp at the bottom of the silu's binade is two at the top of the product's)
    ulps = ulp_distance(got, want)
    assert not torch.isnan(got).any(), f"gated epilogue: unwritten outputs ({where})"
    assert ulps.max() <= 2 and (ulps > 0).float().mean() < 0.01, \
        f"gated epilogue: {(ulps > 0).sum().item()} of {got.numel()} outputs differ from silu(gate) * up, " \
        f"at most {ulps.max().item()} ulp ({where})"
    assert rel_err(got, w4a16_epilogue(ref, gated=True)) < 2 * TOLERANCE[dtype], where


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_sync_every_config_and_split(dtype):
    q, p = _case(1024, 256, 128, False, dtype, seed=1)
    for m in (1, 5, 37):
        torch.manual_seed(100 + m)
        x = torch.randn(m, 1024, device="cuda", dtype=dtype)
        bias = torch.randn(256, device="cuda", dtype=dtype) if m % 2 else None
        for cfg in ops.CONFIGS:
            if cfg.swap and m > 8:
                continue
            for slices in (1, 3):
                _check_epilogues(x, q, p, 100 + m, bias, cfg=cfg, slices=slices)


@hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_skinny_every_config_fixups_and_staged(dtype):
    q, p = _case(2048, 512, 128, True, dtype, seed=2)
    for cfg in ops.SKINNY_CONFIGS + [dataclasses.replace(c, staged=True) for c in ops.SKINNY_CONFIGS]:
        for m in sorted({1, 3, cfg.mt}):
            torch.manual_seed(200 + m)
            x = torch.randn(m, 2048, device="cuda", dtype=dtype)
            for ctas in (None, 1, 7, 41):
                _check_epilogues(x, q, p, 200 + m, None, cfg=cfg, ctas=ctas)


@hopper
@pytest.mark.parametrize("group,sym", [(-1, False), (128, True), (32, False)])
def test_hopper_tiles_splits_clusters_and_stream_k(group, sym):
    q, p = _case(2048, 512, group, sym, torch.float16, seed=3)
    for cfg in ops.HOPPER_CONFIGS:
        for m in (1, cfg.mt + 5):
            torch.manual_seed(300 + m)
            x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
            bias = torch.randn(512, device="cuda", dtype=torch.float16)
            grids = (None, 1, 7) if cfg.streamk else (1, 2, 4)  # 2 and 4 slices: clusters where they fit
            for g in grids:
                kw = {"ctas": g} if cfg.streamk else {"slices": g}
                _check_epilogues(x, q, p, 300 + m, bias, cfg=cfg, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dispatcher_decode_shapes(dtype):
    """The plans a decoder's projections get, m = 1 .. 64, against the unfused expression."""
    for k, n in ((4096, 4096), (4096, 28672), (14336, 4096)):
        q, p = _case(k, n, 128, True, dtype, seed=k + n)
        for m in (1, 4, 16, 64):
            torch.manual_seed(m)
            _check_epilogues(torch.randn(m, k, device="cuda", dtype=dtype), q, p, m)


@hopper
@pytest.mark.parametrize("sharing", ["alone", "time-sliced"])
def test_programmatic_launch_chain_same_bits_eager_and_graph(sharing, request):
    """A chain of W4A16 launches (each reading the one before, the residual epilogues what the one or two
    before wrote) with and without programmatic dependent launch, eagerly and in a CUDA graph, also while
    other processes share the GPU: the same bits every time (each kernel waits for the one ahead before
    reading x or the residual, through L2, or writing anything, whatever streams its weights early)."""
    if sharing == "time-sliced":
        request.getfixturevalue("time_sliced_gpu")
    dtype = torch.float16
    shapes = [(4096, 6144), (6144, 4096), (4096, 28672), (14336, 4096)]
    weights = [_case(k, n, 128, True, dtype, seed=i)[1] for i, (k, n) in enumerate(shapes)]
    weights[2] = w4a16.interleave_gated(weights[2])
    ws = w4a16.Workspace("cuda")

    def chain(x):
        h = w4a16.matmul(x, weights[0], workspace=ws)
        h = w4a16.matmul(h, weights[1], workspace=ws, residual=x)
        g = w4a16.matmul(h, weights[2], workspace=ws, gated=True)
        return w4a16.matmul(g, weights[3], workspace=ws, residual=h)

    for m in (1, 16, 256):  # the skinny kernels, and the wgmma kernel's residual epilogue
        torch.manual_seed(m)
        x = torch.randn(m, 4096, device="cuda", dtype=dtype)
        outs = {}
        for pdl in (False, True):
            with ops.launch_policy(ops.LaunchPolicy(programmatic=pdl)):
                outs[pdl] = chain(x)
                graph, captured = capture(lambda: chain(x))
                for _ in range(3):
                    graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(captured, outs[pdl]), f"m {m}, programmatic {pdl}: graph replay differs"
        assert torch.equal(outs[False], outs[True]), f"m {m}: programmatic launch changed the result"
        assert int(ws.counters.abs().sum()) == 0


def test_bad_epilogue_arguments():
    q, p = _case(256, 128, 128, True, torch.float16, seed=5)
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="residual must be a torch.float16 tensor of shape \\(4, 128\\)"):
        w4a16.matmul(x, p, residual=torch.zeros(4, 64, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="residual must be"):
        w4a16.matmul(x, p, residual=torch.zeros(4, 128, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="no residual"):
        w4a16.matmul(x, p, residual=torch.zeros(4, 128, device="cuda", dtype=torch.float16), gated=True)
    with pytest.raises(TypeError, match="gated must be True or False"):
        w4a16.matmul(x, p, gated=1)
    with pytest.raises(RuntimeError, match="inference only"):
        w4a16.matmul(x.requires_grad_(), p, residual=torch.zeros(4, 128, device="cuda", dtype=torch.float16))


@hopper
@pytest.mark.parametrize("group,sym,dtype", [(128, True, torch.float16), (-1, False, torch.bfloat16),
                                             (32, False, torch.float16)])
def test_skinny_cluster_split_every_epilogue(group, sym, dtype):
    """The skinny kernel's cluster split ("/x<S>": a tile's k in S CTAs of one cluster, 8-row tiles), clusters
    of 2 to 16 (16 is sm_90's non-portable size), m from 1 to 8, k with a half stage, and a bias on odd m."""
    for k in (2048, 1984) if group != 128 else (2048,):  # 1984: a half last stage (k % 128 == 64)
        q, p = _case(k, 512, group, sym, dtype, seed=k)
        for cfg, slices in ((ops.SkinnyConfig(8, 4, 1, 3, 2), 16), (ops.SkinnyConfig(8, 2, 2, 6, 2), 8),
                            (ops.SkinnyConfig(8, 1, 4, 12, 2), 4), (ops.SkinnyConfig(8, 4, 1, 3, 2), 2),
                            (ops.SkinnyConfig(8, 4, 1, 3, 2), 5)):
            for m in sorted({1, 3, cfg.mt}):
                seed = 500 + k + m
                torch.manual_seed(seed)
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                bias = torch.randn(512, device="cuda", dtype=dtype) if m % 2 else None
                _check_epilogues(x, q, p, seed, bias, cfg=cfg, slices=slices)
