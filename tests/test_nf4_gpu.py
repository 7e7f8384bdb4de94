"""NF4 dequantization kernel on the GPU: bit-exact with bitsandbytes' arithmetic, every shape/blocksize/dtype."""
from __future__ import annotations

import pytest
import torch

import tilefish
from tilefish import nf4
from tilefish.reference import nf4_dequantize_f64, nf4_dequantize_fp32_chain

from conftest import poison, rel_err, ulp_distance

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SMALL_SHAPES = [(1, 1), (3, 65), (127, 4097), (1, 31), (2, 33), (5, 4099)]
BLOCKSIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096]


def _weight(shape, dtype=torch.bfloat16):
    return torch.randn(shape, device="cuda", dtype=torch.float32).mul_(torch.rand(()).item() * 3 + 0.1).to(dtype)


def _check(q, dtype):
    out = poison(torch.empty(q.shape, dtype=dtype, device="cuda"))
    nf4.dequantize(q, dtype, out=out)
    assert not torch.isnan(out).any(), "unwritten output elements"
    chain = nf4_dequantize_fp32_chain(q, dtype)
    # Bit-exact with bitsandbytes' fp32 arithmetic (multiply, add, multiply, each rounded to fp32).
    assert torch.equal(out.view(-1), chain.view(-1)), "differs from the fp32-chain reference"
    f64 = nf4_dequantize_f64(q, dtype)
    if dtype != torch.float32:
        # 16-bit output: within 1 ulp of the float64 formula rounded once (the fp32 intermediates
        # can move a value that sits near a rounding boundary by one ulp).
        assert ulp_distance(out.view(-1), f64.view(-1)).max().item() <= 1
    else:
        # fp32 output: the format's fp32 arithmetic rounds three times and p + offset can cancel,
        # so single elements may sit a few fp32 ulps from the float64 value; check the norm instead.
        assert rel_err(out, f64) < 1e-6
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("blocksize", BLOCKSIZES)
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_small_shapes(shape, blocksize, double_quant, dtype):
    q = nf4.quantize(_weight(shape), blocksize=blocksize, double_quant=double_quant)
    _check(q, dtype)


@pytest.mark.parametrize("shape", [(4096, 11008), (16384, 16384), (1000, 999)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_shapes(shape, dtype):
    q = nf4.quantize(_weight(shape), blocksize=64, double_quant=True)
    _check(q, dtype)


@pytest.mark.parametrize("blocksize", [32, 64, 4096])
def test_large_numel_every_blocksize_single(blocksize):
    q = nf4.quantize(_weight((4096, 4096 + 64)), blocksize=blocksize, double_quant=False)
    _check(q, torch.bfloat16)


def test_default_dtype_and_allocating_path():
    w = _weight((64, 128), torch.float16)
    q = nf4.quantize(w)
    out = nf4.dequantize(q)
    assert out.dtype == torch.float16 and out.shape == w.shape
    assert torch.equal(out, nf4_dequantize_fp32_chain(q, torch.float16))


def test_every_design_variant_is_exact():
    from tilefish.ops import nf4 as ops

    q = nf4.quantize(_weight((257, 1000)), blocksize=64, double_quant=True)
    ref = nf4_dequantize_fp32_chain(q, torch.bfloat16)
    for cfg in ops.variant_configs():
        out = poison(torch.empty(q.shape, dtype=torch.bfloat16, device="cuda"))
        ops.launch_dequantize(q, out, cfg)
        assert torch.equal(out, ref), cfg.label()


def test_matches_bitsandbytes():
    F = pytest.importorskip("bitsandbytes.functional")
    for dq in (True, False):
        for dtype in DTYPES:
            w = _weight((1024, 4096 + 32), dtype)
            packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=dq, quant_type="nf4")
            theirs = F.dequantize_4bit(packed, state)
            q = nf4.from_bnb(packed, state)
            ours = nf4.dequantize(q, dtype)
            assert ulp_distance(ours.view(-1), theirs.view(-1)).max().item() <= 1
            # and the other way: bitsandbytes dequantizing our quantization
            q2 = nf4.quantize(w, blocksize=64, double_quant=dq)
            p2, s2 = nf4.to_bnb(q2)
            assert ulp_distance(nf4.dequantize(q2, dtype).view(-1), F.dequantize_4bit(p2, s2).view(-1)).max().item() <= 1


def test_bad_inputs_raise_before_launch():
    q = nf4.quantize(_weight((64, 64)))
    with pytest.raises(TypeError, match="dtype"):
        nf4.dequantize(q, torch.int8)
    with pytest.raises(TypeError, match="dtype"):
        nf4.dequantize(q, torch.bfloat16, out=torch.empty(64, 64, dtype=torch.float16, device="cuda"))
    with pytest.raises(ValueError, match="elements"):
        nf4.dequantize(q, torch.bfloat16, out=torch.empty(64, 63, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="cpu|device"):
        nf4.dequantize(q, torch.bfloat16, out=torch.empty(64, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        nf4.dequantize(q, torch.bfloat16, out=torch.empty(64, 128, dtype=torch.bfloat16, device="cuda")[:, ::2])
    with pytest.raises(ValueError, match="aligned"):
        nf4.dequantize(q, torch.bfloat16, out=torch.empty(64 * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:])
    mixed = nf4.quantize(_weight((64, 64)))
    mixed.absmax_q = mixed.absmax_q.cpu()
    with pytest.raises(ValueError, match="device"):
        nf4.dequantize(mixed)
    bad = nf4.quantize(_weight((64, 64)))
    bad.codes = bad.codes[:-1]
    with pytest.raises(ValueError):
        nf4.dequantize(bad)
    with pytest.raises(TypeError):
        nf4.dequantize(torch.zeros(4, device="cuda"))


def test_cuda_graph_capture():
    q = nf4.quantize(_weight((333, 1024)))
    out = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        nf4.dequantize(q, out=out)  # warm-up: compile and load outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        nf4.dequantize(q, out=out)
    poison(out)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, nf4_dequantize_fp32_chain(q, torch.bfloat16))


def test_torch_compile_fullgraph():
    q = nf4.quantize(_weight((128, 256)))

    @torch.compile(fullgraph=True)
    def f(weight):
        return tilefish.nf4.dequantize(weight, torch.bfloat16) * 2

    got = f(q)
    assert torch.equal(got, nf4_dequantize_fp32_chain(q, torch.bfloat16) * 2)


def test_other_stream_and_repeatability():
    q = nf4.quantize(_weight((513, 2048)))
    ref = nf4.dequantize(q, torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        again = nf4.dequantize(q, torch.bfloat16)
    s.synchronize()
    assert torch.equal(ref, again)
