"""The fused NF4 matmul: prepare (a lossless repack into the W4A16 kernel layout), the decoder's
table, the CPU path, bad inputs; on the GPU every kernel family against bitsandbytes' exact
dequantization followed by a float64 matmul."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import tilefish
from tilefish import nf4
from tilefish.ops import w4a16 as w4ops
from tilefish.quant.nf4 import NF4_TABLE
from tilefish.reference import dense_matmul, nf4_dequantize_fp32_chain

from conftest import TOLERANCE, rel_err

DTYPES = [torch.float16, torch.bfloat16]
DEQUANT_CUH = Path(tilefish.__file__).parent / "kernels" / "w4a16" / "dequant.cuh"


def _weight(n, k, blocksize=64, double_quant=True, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (0.02 + 0.05 * torch.rand(n, 1, generator=g))
    return nf4.quantize(w.to(device=device, dtype=dtype), blocksize=blocksize, double_quant=double_quant)


def _reference(x, q, bias=None):
    dense = nf4_dequantize_fp32_chain(q, x.dtype)
    return dense_matmul(x.reshape(-1, q.shape[1]), dense, bias).reshape(*x.shape[:-1], q.shape[0])


# ---- CPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_decoder_byte_tables_are_the_nf4_table(dtype):
    """dequant.cuh's prmt tables: entries 0-7 in table A, 8-15 reversed in table B, low and high bytes
    of the NF4 values rounded to `dtype`."""
    text = DEQUANT_CUH.read_text()
    name = "__half" if dtype == torch.float16 else "__nv_bfloat16"
    body = re.search(r"struct NF4Bytes<" + re.escape(name) + r"> \{(.*?)\};", text, re.S).group(1)
    consts = {k: int(v, 16) for k, v in re.findall(r"(k\w+) = (0x[0-9a-fA-F]+)", body)}
    bits = [int(b) & 0xFFFF for b in torch.tensor(NF4_TABLE).to(dtype).view(torch.int16).tolist()]

    def word(entries, high):
        return sum(((bits[e] >> (8 if high else 0)) & 0xFF) << (8 * i) for i, e in enumerate(entries))

    for part, high in (("Lo", False), ("Hi", True)):
        assert consts[f"k{part}A0"] == word([0, 1, 2, 3], high)
        assert consts[f"k{part}A1"] == word([4, 5, 6, 7], high)
        assert consts[f"k{part}B0"] == word([15, 14, 13, 12], high)
        assert consts[f"k{part}B1"] == word([11, 10, 9, 8], high)


@pytest.mark.parametrize("blocksize", [32, 64, 128, 256, 1024, 4096])
@pytest.mark.parametrize("double_quant", [True, False])
def test_prepare_round_trips_bit_for_bit(blocksize, double_quant):
    q = _weight(192, 640, blocksize, double_quant, seed=blocksize)  # 640 is no multiple of 256 .. 4096
    p = nf4.prepare(q)
    assert p.kernel.codebook == "nf4" and p.kernel.group_size == min(blocksize, 128)
    back = p.to_nf4()
    assert torch.equal(back.codes, q.codes) and back.blocksize == q.blocksize and back.shape == q.shape
    for name in ("absmax", "absmax_q", "code2", "absmax2", "offset"):
        a, b = getattr(back, name), getattr(q, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocksize", [64, 256, 2048])
def test_kernel_layout_values_are_code_times_block_scale(dtype, blocksize):
    """What the kernels compute per element, NF4[code] x scale with the block scale rounded once to
    the activation dtype, is bitsandbytes' value up to that one rounding of the scale."""
    q = _weight(128, 384, blocksize, True, seed=7)
    p = nf4.prepare(q, dtype)
    exact = nf4_dequantize_fp32_chain(q, torch.float64)
    kern = p.kernel.dequantize(torch.float64)
    eps = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    assert ((kern - exact).abs() <= exact.abs() * eps * 1.0001).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_matmul_is_the_reference(dtype):
    q = _weight(64, 256, 64, True, dtype)
    p = nf4.prepare(q, dtype)
    x = torch.randn(2, 3, 256, dtype=dtype)
    bias = torch.randn(64, dtype=dtype)
    assert torch.equal(nf4.matmul(x, p, bias), _reference(x, q, bias))


def test_to_dtype_rebuilds_scales_from_the_block_scales():
    q = _weight(64, 256, 64, True, torch.float16)
    p16 = nf4.prepare(q, torch.float16)
    pb = p16.to(torch.bfloat16)
    assert pb.dtype == torch.bfloat16 and torch.equal(pb.kernel.scales, nf4.prepare(q, torch.bfloat16).kernel.scales)
    assert torch.equal(pb.kernel.packed, p16.kernel.packed)


def test_opcheck_w4a16_op_nf4_codebook_on_the_cpu_reference():
    from tilefish.ops import library

    p = nf4.prepare(_weight(64, 128, 64, False, torch.float16), torch.float16).kernel
    x = torch.randn(3, 128, dtype=torch.float16)
    torch.library.opcheck(library.w4a16_matmul_op, (x, p.packed, p.scales, p.zeros, p.perm, None, p.group_size, p.n,
                                                    p.k, p.codebook))


def test_autograd_reaches_x_and_bias():
    q = _weight(64, 128, 64, True, torch.float32)
    p = nf4.prepare(q, torch.float16)
    x = torch.randn(3, 128, dtype=torch.float16, requires_grad=True)
    bias = torch.randn(64, dtype=torch.float16, requires_grad=True)
    nf4.matmul(x, p, bias).float().sum().backward()
    dense = p.kernel.dequantize(torch.float32)
    assert torch.allclose(x.grad.float(), dense.sum(0).expand(3, -1), rtol=1e-2, atol=1e-2)
    assert torch.equal(bias.grad, torch.full_like(bias, 3))


def test_bad_inputs_are_clear_errors():
    q = _weight(64, 128, 64)
    with pytest.raises(ValueError, match="tile n .* by 64"):
        nf4.prepare(_weight(96, 128, 64))
    with pytest.raises(ValueError, match="k \\(in_features\\) by 64"):
        nf4.prepare(_weight(64, 96, 32))
    with pytest.raises(ValueError, match="k % 128 == 0 .*blocksize 256"):
        nf4.prepare(_weight(64, 192, 256))  # scale group min(256, 128) = 128 does not divide k
    assert nf4.prepare(_weight(64, 192, 64)).kernel.k == 192  # k % 64 with a 64-wide group: tileable
    with pytest.raises(ValueError, match="2-D weight"):
        nf4.prepare(nf4.quantize(torch.randn(2, 64, 128), blocksize=64))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        nf4.prepare(q, torch.float32)
    with pytest.raises(TypeError, match="NF4Weight"):
        nf4.prepare(torch.randn(64, 128))
    with pytest.raises(TypeError, match="prepare"):
        nf4.matmul(torch.randn(1, 128, dtype=torch.bfloat16), q)
    p = nf4.prepare(q)
    with pytest.raises(TypeError, match="bfloat16"):
        nf4.matmul(torch.randn(1, 128, dtype=torch.float16), p)
    with pytest.raises(ValueError, match="k=129"):
        nf4.matmul(torch.randn(1, 129, dtype=torch.bfloat16), p)
    big = nf4.quantize(torch.randn(64, 128) * 1e5, blocksize=64, double_quant=False)
    with pytest.raises(ValueError, match="does not fit torch.float16"):
        nf4.prepare(big, torch.float16)
    nf4.prepare(big, torch.bfloat16)  # bf16 has the range


def test_dispatch_takes_the_tall_tile_for_nf4_above_128_rows():
    """The NF4 decode is paid once per tile for all its rows: above 128 rows on Hopper the 256-row
    wgmma tile, where the int4 dispatcher's model may take shorter tiles."""
    for m in (129, 256, 1000):
        assert w4ops.choose_config(m, 8192, 8192, 132, 90, 64, codebook="nf4") == w4ops.NF4_TALL_TILE
    assert w4ops.choose_config(64, 8192, 8192, 132, 90, 64, codebook="nf4") == \
        w4ops.choose_config(64, 8192, 8192, 132, 90, 64)
    assert w4ops.choose_config(256, 8192, 8192, 108, 80, 64, codebook="nf4") == \
        w4ops.choose_config(256, 8192, 8192, 108, 80, 64)  # sm_80: the mma.sync kernel


# ---- GPU ---------------------------------------------------------------------------------------------------------

MS = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100, 128, 257, 1024, 4096]


def _poison_allocator(rows, cols, dtype):
    torch.full((rows, cols), float("nan"), device="cuda", dtype=dtype)


def _check(x, q, p, bias=None, seed=None, **kw):
    ref = _reference(x, q, bias)
    _poison_allocator(x.numel() // q.shape[1], q.shape[0], x.dtype)
    out = w4ops.matmul_impl(x, p.kernel, bias, **kw) if kw else nf4.matmul(x, p, bias)
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = rel_err(out, ref)
    assert err < TOLERANCE[x.dtype], f"rel err {err}, m={x.numel() // q.shape[1]}, seed={seed}, {kw}"
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocksize,double_quant", [(32, True), (64, True), (64, False), (128, True), (256, False),
                                                    (4096, True)])
@pytest.mark.parametrize("k,n", [(128, 64), (640, 192), (1024, 320)])
def test_every_m(k, n, blocksize, double_quant, dtype):
    seed = hash((k, n, blocksize, double_quant)) % 1000
    q = _weight(n, k, blocksize, double_quant, dtype, "cuda", seed)
    p = nf4.prepare(q, dtype)
    torch.manual_seed(seed)
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
        _check(x, q, p, bias, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 28672), (14336, 4096), (8192, 8192), (28672, 8192)])
def test_llama_shapes(k, n, dtype):
    q = _weight(n, k, 64, True, dtype, "cuda", k + n)
    p = nf4.prepare(q, dtype)
    torch.manual_seed(k)
    for m in (1, 4, 16, 33, 64, 257, 1024):
        _check(torch.randn(m, k, device="cuda", dtype=dtype), q, p, seed=k)


@pytest.mark.gpu
def test_every_kernel_configuration():
    """Each family's whole design space with NF4 codes (the dispatcher picks among these)."""
    dtype = torch.float16
    q = _weight(512, 1024, 64, True, dtype, "cuda", 3)
    p = nf4.prepare(q, dtype)
    cc = torch.cuda.get_device_capability()
    for m in (5, 37):
        x = torch.randn(m, 1024, device="cuda", dtype=dtype)
        for cfg in w4ops.CONFIGS:
            if not (cfg.swap and m > 8) and 512 % cfg.bn == 0:
                _check(x, q, p, cfg=cfg)
        if cc[0] != 9:
            continue
        for cfg in w4ops.HOPPER_CONFIGS:
            if 512 % cfg.bn == 0:
                _check(x, q, p, cfg=cfg)
        for cfg in w4ops.SKINNY_CONFIGS + [dataclasses.replace(c, staged=True) for c in w4ops.SKINNY_CONFIGS]:
            if m <= cfg.mt and 512 % cfg.bn == 0:
                _check(x, q, p, cfg=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [64, 192, 832, 2880])
def test_k_multiple_of_64_every_family(k):
    """k % 128 == 64 (an odd number of 64-wide k steps): the mma.sync kernel's half last tile and the
    skinny kernel's half last stage with NF4 codes, split / stream-K grids, blocksize 64 (group 64)."""
    dtype, n = torch.bfloat16, 256
    seed = 1000 + k
    q = _weight(n, k, 64, True, dtype, "cuda", seed)
    p = nf4.prepare(q, dtype)
    torch.manual_seed(seed)
    hopper = torch.cuda.get_device_capability()[0] == 9
    for m in (1, 5, 33):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        _check(x, q, p, seed=seed)
        for cfg in (w4ops.GemmConfig(1, 2, 4, 4), w4ops.GemmConfig(1, 2, 4, 4, True, True)):
            if not (cfg.swap and m > 8):
                for slices in (1, 2, 3):
                    _check(x, q, p, seed=seed, cfg=cfg, slices=slices)
        if not hopper:
            continue
        for cfg in (w4ops.HopperConfig(64, 2, 1, 8), w4ops.HopperConfig(64, 2, 2, 6, True)):
            _check(x, q, p, seed=seed, cfg=cfg, **({"ctas": 7} if cfg.streamk else {"slices": 2}))
        for cfg in (w4ops.SkinnyConfig(8, 4, 1, 3, 2), w4ops.SkinnyConfig(16, 2, 2, 6, 2, staged=True)):
            if m <= cfg.mt:
                for ctas in (None, 3, 7):
                    _check(x, q, p, seed=seed, cfg=cfg, ctas=ctas)


@pytest.mark.gpu
def test_cuda_graph_and_compile():
    dtype = torch.bfloat16
    q = _weight(256, 512, 64, True, dtype, "cuda", 11)
    p = nf4.prepare(q, dtype)
    for m in (1, 16, 300):
        x = torch.randn(m, 512, device="cuda", dtype=dtype)
        ref = _reference(x, q)
        nf4.matmul(x, p)  # compile + plan outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            y = nf4.matmul(x, p)
        x.copy_(torch.randn_like(x))
        ref = _reference(x, q)
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(y, ref) < TOLERANCE[dtype]
    f = torch.compile(lambda x: nf4.matmul(x, p) * 2, fullgraph=True)
    x = torch.randn(9, 512, device="cuda", dtype=dtype)
    assert rel_err(f(x), 2 * _reference(x, q)) < TOLERANCE[dtype]


@pytest.mark.gpu
def test_prepare_on_the_gpu_matches_the_cpu():
    q = _weight(192, 640, 256, True, torch.bfloat16, "cpu", 5)
    a, b = nf4.prepare(q), nf4.prepare(q.to("cuda"))
    assert torch.equal(a.kernel.packed, b.kernel.packed.cpu()) and torch.equal(a.kernel.scales, b.kernel.scales.cpu())
