"""NF4Linear (a bitsandbytes NF4 weight on the W4A16 kernels), W4A16Linear's codebook and quantize_model(method="nf4").

CPU tests run the reference path (the float64 product of what the kernels multiply); the GPU tests at the end run
the kernels. The yardstick is bitsandbytes' own dequantization (tilefish.reference.nf4_dequantize_fp32_chain, fp32
NF4 value times fp32 block absmax) and a float64 matmul. Random inputs are seeded per test with a fresh seed, which
every failing assertion prints.
"""
from __future__ import annotations

import copy
import json
import random
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import tilefish
from tilefish import nf4
from tilefish.convert import dequantize_model, fuse_projections, quantize_model
from tilefish.nn import FusedW4A16Linear, NF4Linear, W4A16Linear, W4A16Slice
from tilefish.quant.nf4 import NF4Weight, to_state_dict
from tilefish.reference import dense_matmul, nf4_dequantize_fp32_chain

from conftest import TOLERANCE, poison, rel_err
from test_convert import _model

QS_KEY = "weight.quant_state.bitsandbytes__nf4"
BNB_KEYS = {True: ["weight", "bias", "weight.absmax", "weight.quant_map", "weight.nested_absmax",
                   "weight.nested_quant_map", QS_KEY],
            False: ["weight", "bias", "weight.absmax", "weight.quant_map", QS_KEY]}
ACT_DTYPES = [torch.float16, torch.bfloat16]


def fresh_seed() -> int:
    """A seed drawn from `random`, which conftest seeds per test: reproducible from the test's seed."""
    return random.randrange(2**31)


def dense_linear(k=256, n=128, dtype=torch.float16, bias=True, seed=0, device="cpu") -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(device=device, dtype=dtype)


def reference(x: torch.Tensor, q: NF4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """bitsandbytes' weight exactly (fp32), a float64 matmul, one rounding to x's dtype."""
    w = nf4_dequantize_fp32_chain(q, torch.float32)
    return dense_matmul(x.reshape(-1, q.shape[1]), w, bias).reshape(*x.shape[:-1], q.shape[0])


def assert_same(a: NF4Weight, b: NF4Weight) -> None:
    """Bit for bit: metadata and every tensor."""
    assert (tuple(a.shape), a.dtype, a.blocksize, a.double_quant) == (tuple(b.shape), b.dtype, b.blocksize,
                                                                      b.double_quant)
    for f in ("codes", "absmax", "absmax_q", "code2", "absmax2", "offset"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x.cpu().reshape(-1), y.cpu().reshape(-1)), f


def assert_same_state(a: dict, b: dict) -> None:
    def plain(t):  # a bitsandbytes Params4bit (a Parameter subclass) as a plain CPU tensor
        return (t.data if isinstance(t, nn.Parameter) else t).detach().cpu()

    assert list(a) == list(b)
    for k in a:
        x, y = plain(a[k]), plain(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k


def layer_tensors(layer: nn.Module) -> dict:
    return {n: (t, t.detach().clone()) for n, t in list(layer.named_buffers()) + list(layer.named_parameters())}


def assert_layer_unchanged(layer: nn.Module, before: dict, attrs: tuple) -> None:
    now = dict(list(layer.named_buffers()) + list(layer.named_parameters()))
    assert now.keys() == before.keys()
    for name, (t, value) in before.items():
        assert now[name] is t and torch.equal(t, value), name
    assert (layer.blocksize, layer.orig_dtype, layer.group_size) == attrs


# ------------------------------------------------------------------------------------------------------------
# construction: the bitsandbytes weight kept bit for bit, the kernel tensors as prepare() makes them


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("blocksize", [32, 64, 128, 256, 4096])
def test_from_linear_keeps_the_bnb_weight(blocksize, double_quant, weight_dtype):
    lin = dense_linear(dtype=weight_dtype, seed=blocksize)
    layer = NF4Linear.from_linear(lin, blocksize=blocksize, double_quant=double_quant)
    q = nf4.quantize(lin.weight.detach(), blocksize, double_quant)
    act = weight_dtype if weight_dtype != torch.float32 else torch.float16
    assert_same(layer.to_nf4(), q)
    p = nf4.prepare(q, act)
    assert torch.equal(layer.packed, p.kernel.packed) and torch.equal(layer.scales, p.kernel.scales)
    assert layer.scales.dtype == act and layer.weight.dtype == act and layer.bias.dtype == act
    assert layer.codebook == "nf4" and layer.weight4.codebook == "nf4" and layer.group_size == min(blocksize, 128)
    assert (layer.blocksize, layer.double_quant, layer.orig_dtype) == (blocksize, double_quant, weight_dtype)
    assert layer.zeros is None and layer.perm is None
    assert (layer.absmax is None) == double_quant and (layer.absmax_q is not None) == double_quant


def test_from_nf4_shares_the_block_scales_and_takes_dtype():
    q = nf4.quantize(torch.randn(192, 384), 64, True)
    bias = torch.randn(192)
    layer = NF4Linear.from_nf4(q, bias, dtype=torch.bfloat16)
    assert layer.absmax_q is q.absmax_q and layer.absmax2 is q.absmax2  # shared, not copied
    assert layer.scales.dtype == torch.bfloat16 and torch.equal(layer.bias, bias.bfloat16())
    assert layer.in_features == 384 and layer.out_features == 192 and layer.orig_dtype == torch.float32
    assert_same(layer.to_nf4(), q)
    assert NF4Linear.from_nf4(q).bias is None


def test_placeholder_layer_is_a_consistent_zero_weight():
    for dq in (True, False):
        layer = NF4Linear(256, 128, bias=False, blocksize=128, double_quant=dq, dtype=torch.bfloat16)
        assert layer.weight.dequantize().abs().sum() == 0 and layer.weight4.dequantize().abs().sum() == 0
        q = layer.to_nf4()
        assert torch.equal(tilefish.reference.nf4_absmax(q), torch.ones(256))
        assert torch.equal(nf4.prepare(q, torch.bfloat16).kernel.scales, layer.scales)


def test_repr_and_weight_info():
    lin = dense_linear()
    layer = NF4Linear.from_linear(lin, blocksize=128, double_quant=False)
    assert "codebook=nf4" in repr(layer) and "blocksize=128" in repr(layer) and "double_quant=False" in repr(layer)
    info = layer.weight
    assert info.shape == lin.weight.shape and info.size(0) == 128 and info.dtype == torch.float16
    assert info.device == lin.weight.device and not info.is_cuda and "nf4" in repr(info)
    q = nf4.quantize(lin.weight.detach(), 128, False)
    assert torch.equal(info.dequantize(), nf4_dequantize_fp32_chain(q, torch.float16))  # bitsandbytes' exactly
    assert torch.equal(info.dequantize(torch.float32), nf4_dequantize_fp32_chain(q, torch.float32))


# ------------------------------------------------------------------------------------------------------------
# forward (CPU reference path) against bitsandbytes' weight


@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("blocksize,double_quant", [(64, True), (32, False), (256, True), (4096, False)])
def test_forward_matches_the_bnb_weight(blocksize, double_quant, dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(192, 512, generator=gen) * (0.02 + torch.rand((), generator=gen))
    q = nf4.quantize(w.to(dtype), blocksize, double_quant)
    bias = torch.randn(192, generator=gen).to(dtype)
    layer = NF4Linear.from_nf4(q, bias)
    for m in (1, 3, 16, 33):
        for shape in ((m, 512), (2, m, 512)):
            x = torch.randn(shape, generator=gen).to(dtype)
            y = layer(x)
            assert y.shape == shape[:-1] + (192,) and y.dtype == dtype
            err = rel_err(y, reference(x, q, bias))
            assert err < TOLERANCE[dtype], f"seed {seed}, m {m}, shape {shape}: rel err {err:.3g}"


def test_fp32_inputs_are_cast_in_and_out():
    seed = fresh_seed()
    torch.manual_seed(seed)
    layer = NF4Linear.from_linear(dense_linear(dtype=torch.float32))
    x = torch.randn(3, 256)
    y = layer(x)
    assert y.dtype == torch.float32 and torch.equal(y, layer(x.half()).float()), f"seed {seed}"


def _grad_case():
    seed = fresh_seed()
    torch.manual_seed(seed)
    layer = NF4Linear.from_linear(dense_linear(dtype=torch.bfloat16))
    x = torch.randn(3, 256, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(3, 128)
    layer(x).float().backward(g)
    return seed, layer, x, g


def test_autograd_reaches_the_input():
    seed, layer, x, g = _grad_case()
    dense = layer.weight4.dequantize(torch.float32)  # what the kernels multiply by
    assert rel_err(x.grad, g @ dense) < TOLERANCE[torch.bfloat16], f"seed {seed}"
    assert not any(t.requires_grad for t in layer.buffers())


def test_autograd_under_torch_compile():
    seed, layer, x, g = _grad_case()
    x2 = x.detach().clone().requires_grad_()
    torch.compile(layer, fullgraph=True, backend="aot_eager")(x2).float().backward(g)
    assert torch.equal(x2.grad, x.grad), f"seed {seed}"


# ------------------------------------------------------------------------------------------------------------
# bitsandbytes state dicts: written exactly, read back bit for bit, checked


@pytest.mark.parametrize("double_quant", [True, False])
def test_state_dict_is_bitsandbytes_linear4bit(double_quant):
    lin = dense_linear(dtype=torch.bfloat16)
    layer = NF4Linear.from_linear(lin, blocksize=64, double_quant=double_quant)
    sd = layer.state_dict()
    assert list(sd) == BNB_KEYS[double_quant]
    q = nf4.quantize(lin.weight.detach(), 64, double_quant)
    want = to_state_dict(q, "weight")
    want = {"weight": want.pop("weight"), "bias": lin.bias.detach(), **want}
    assert_same_state(sd, want)
    assert sd["weight"].dtype == torch.uint8 and sd["weight"].shape == (128 * 256 // 2, 1)
    meta = json.loads(bytes(sd[QS_KEY].tolist()))
    assert meta["shape"] == [128, 256] and meta["dtype"] == "bfloat16" and meta["quant_type"] == "nf4"
    # a parent module prefixes the keys, as torch does
    parent = nn.Sequential(layer)
    assert list(parent.state_dict()) == [f"0.{k}" for k in BNB_KEYS[double_quant]]


@pytest.mark.parametrize("target", ["same", "other-blocksize", "single-level", "bf16", "no-bias-in-dict"])
def test_load_state_dict_round_trip(target):
    src = NF4Linear.from_linear(dense_linear(seed=1), blocksize=64, double_quant=True)
    sd = src.state_dict()
    layer = {"same": lambda: NF4Linear.from_linear(dense_linear(seed=2)),
             "other-blocksize": lambda: NF4Linear(256, 128, blocksize=256),
             "single-level": lambda: NF4Linear(256, 128, double_quant=False),
             "bf16": lambda: NF4Linear(256, 128, dtype=torch.bfloat16),
             "no-bias-in-dict": lambda: NF4Linear(256, 128, bias=False)}[target]()
    if target == "no-bias-in-dict":
        del sd["bias"]
    packed = layer.packed
    result = layer.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    assert_same(layer.to_nf4(), src.to_nf4())
    assert (layer.blocksize, layer.group_size, layer.double_quant) == (64, 64, True)
    assert layer.packed is packed  # same shape: written in place (pointers, e.g. captured graphs, stay valid)
    out = layer.state_dict()
    if target == "no-bias-in-dict":
        sd = {k: v for k, v in src.state_dict().items() if k != "bias"}
    if target == "bf16":  # the bias in the layer's dtype, like nn.Linear's copy
        assert torch.equal(out.pop("bias"), sd.pop("bias").bfloat16())
    assert_same_state(out, sd)
    if target == "bf16":  # kernel scales made for the layer's dtype from the exact block scales
        assert torch.equal(layer.scales, nf4.prepare(src.to_nf4(), torch.bfloat16).kernel.scales)
    else:
        x = torch.randn(4, 256, dtype=torch.float16)
        want = NF4Linear.from_nf4(src.to_nf4(), None if target == "no-bias-in-dict" else src.bias)(x)
        assert torch.equal(layer(x), want)


def test_state_dict_through_safetensors_and_from_state_dict(tmp_path):
    from safetensors.torch import load_file, save_file

    layer = NF4Linear.from_linear(dense_linear(dtype=torch.float32), blocksize=128)
    model = nn.ModuleDict({"proj": layer})
    save_file(model.state_dict(), str(tmp_path / "m.safetensors"))
    sd = load_file(str(tmp_path / "m.safetensors"))
    for prefix in ("proj.", "proj"):
        again = NF4Linear.from_state_dict(sd, prefix)
        assert_same(again.to_nf4(), layer.to_nf4())
        assert torch.equal(again.bias, layer.bias) and again.scales.dtype == torch.float16
    fresh = nn.ModuleDict({"proj": NF4Linear(256, 128)})
    fresh.load_state_dict(sd)
    assert_same_state(fresh.state_dict(), model.state_dict())
    assert NF4Linear.from_state_dict(sd, "proj", dtype=torch.bfloat16).scales.dtype == torch.bfloat16


def _json(sd, **changes):
    meta = json.loads(bytes(sd[QS_KEY].tolist()))
    meta.update(changes)
    sd[QS_KEY] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)


def _corrupt_json(sd):
    sd[QS_KEY] = torch.tensor(list(b'{"quant_type": "nf4", '), dtype=torch.uint8)


def _fp4_key(sd):
    sd["weight.quant_state.bitsandbytes__fp4"] = sd.pop(QS_KEY)


def _bad_quant_map(sd):
    sd["weight.quant_map"] = sd["weight.quant_map"] * 2


LOAD_ERRORS = {
    # change to a valid state dict: what the RuntimeError names
    "missing absmax": (lambda sd: sd.pop("weight.absmax"), ["weight.absmax"]),
    "missing quant state": (lambda sd: sd.pop(QS_KEY), ["bitsandbytes__nf4"]),
    "missing nested map": (lambda sd: sd.pop("weight.nested_quant_map"), ["nested_quant_map"]),
    "JSON shape": (lambda sd: _json(sd, shape=[256, 128]), ["shape", "[128, 256]"]),
    "JSON blocksize": (lambda sd: _json(sd, blocksize=100), ["blocksize"]),
    "corrupt JSON": (_corrupt_json, ["JSON"]),
    "fp4": (_fp4_key, ["fp4"]),
    "not the NF4 table": (_bad_quant_map, ["quant_map"]),
    "packed bytes": (lambda sd: sd.update(weight=sd["weight"][:-2]), ["codes"]),
    "bias shape": (lambda sd: sd.update(bias=torch.zeros(64)), ["bias", "(128,)"]),
    "another layer's shape": (lambda sd: sd.update(NF4Linear.from_linear(dense_linear(256, 192)).state_dict()),
                              ["shape"]),
}


@pytest.mark.parametrize("case", LOAD_ERRORS)
def test_load_state_dict_errors_leave_the_layer_unchanged(case):
    change, needles = LOAD_ERRORS[case]
    layer = NF4Linear.from_linear(dense_linear(seed=3))
    sd = NF4Linear.from_linear(dense_linear(seed=4)).state_dict()
    change(sd)
    before, attrs = layer_tensors(layer), (layer.blocksize, layer.orig_dtype, layer.group_size)
    with pytest.raises(RuntimeError) as info:
        layer.load_state_dict(sd)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert_layer_unchanged(layer, before, attrs)


def test_load_state_dict_missing_and_unexpected_keys():
    layer = NF4Linear.from_linear(dense_linear(seed=3))
    before, attrs = layer_tensors(layer), (layer.blocksize, layer.orig_dtype, layer.group_size)
    with pytest.raises(RuntimeError, match="Missing key"):
        layer.load_state_dict({})
    result = layer.load_state_dict({}, strict=False)
    assert set(result.missing_keys) == set(BNB_KEYS[True]) and not result.unexpected_keys
    assert_layer_unchanged(layer, before, attrs)
    # a layer with a key missing loads nothing, strict or not (here: the bias alone would not)
    assert layer.load_state_dict({"bias": torch.ones(128)}, strict=False).missing_keys == BNB_KEYS[True][:1] + \
        BNB_KEYS[True][2:]
    w4 = W4A16Linear.from_linear(dense_linear()).state_dict()  # kernel-layout keys are not bitsandbytes'
    with pytest.raises(RuntimeError, match="Missing key"):
        layer.load_state_dict(w4)
    assert_layer_unchanged(layer, before, attrs)
    # unexpected keys are reported (an error when strict), as torch does for any module
    sd = layer.state_dict()
    sd["weight.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="Unexpected key.*weight.extra"):
        NF4Linear(256, 128).load_state_dict(sd)
    other = NF4Linear(256, 128)
    assert other.load_state_dict(sd, strict=False).unexpected_keys == ["weight.extra"]
    assert_same(other.to_nf4(), layer.to_nf4())


# ------------------------------------------------------------------------------------------------------------
# .to(): the block scales only move; a new activation dtype rebuilds the kernel scales from them


def test_to_dtype_rebuilds_kernel_scales_from_the_exact_block_scales():
    lin = dense_linear(dtype=torch.float32)
    layer = NF4Linear.from_linear(lin)
    q = nf4.quantize(lin.weight.detach(), 64, True)
    layer.to(torch.bfloat16)
    assert torch.equal(layer.scales, nf4.prepare(q, torch.bfloat16).kernel.scales)
    assert layer.bias.dtype == torch.bfloat16 and layer.absmax2.dtype == torch.float32
    assert_same(layer.to_nf4(), q)
    layer.half()  # back: from the block scales again, not the bf16 scales (which would round twice)
    assert torch.equal(layer.scales, nf4.prepare(q, torch.float16).kernel.scales)
    assert_same(layer.to_nf4(), q)
    before, attrs = layer_tensors(layer), (layer.blocksize, layer.orig_dtype, layer.group_size)
    for other in (lambda: layer.float(), lambda: layer.to(torch.float64), lambda: layer.double()):
        assert other() is layer  # another dtype keeps the kernel dtype (W4A16Linear does the same)
        assert_layer_unchanged(layer, before, attrs)
    layer.to("cpu", torch.float16)
    assert_layer_unchanged(layer, before, attrs)
    assert copy.deepcopy(layer).state_dict().keys() == layer.state_dict().keys()


def test_to_dtype_inside_a_model():
    model = nn.Sequential(NF4Linear.from_linear(dense_linear(dtype=torch.float32)), nn.LayerNorm(128))
    q = model[0].to_nf4()
    model.to(torch.bfloat16)
    assert model[1].weight.dtype == torch.bfloat16 and model[0].scales.dtype == torch.bfloat16
    assert_same(model[0].to_nf4(), q)


# ------------------------------------------------------------------------------------------------------------
# other constructors and bad arguments


def _fake_linear4bit(q: NF4Weight, bias=None, compute_dtype=None, **over):
    """What NF4Linear.from_bnb reads off a bitsandbytes Linear4bit: .weight (a Params4bit: the packed uint8
    [numel/2, 1] tensor carrying .quant_state), .bias, .compute_dtype. Field names as bitsandbytes'."""
    state2 = (SimpleNamespace(absmax=q.absmax2, code=q.code2, blocksize=256, dtype=torch.float32)
              if q.double_quant else None)
    qs = SimpleNamespace(absmax=q.absmax_q if q.double_quant else q.absmax, shape=q.shape,
                         code=torch.tensor(nf4.NF4_TABLE, dtype=torch.float32), dtype=q.dtype, blocksize=q.blocksize,
                         quant_type="nf4", offset=q.offset, state2=state2, nested=q.double_quant)
    for k, v in over.items():
        setattr(qs, k, v)
    weight = nn.Parameter(q.codes.view(-1, 1).clone(), requires_grad=False)
    weight.quant_state = qs
    return SimpleNamespace(weight=weight, bias=bias, compute_dtype=compute_dtype, in_features=q.shape[1],
                           out_features=q.shape[0])


@pytest.mark.parametrize("double_quant", [True, False])
def test_from_bnb_duck_typed(double_quant):
    q = nf4.quantize(torch.randn(128, 256, dtype=torch.bfloat16), 64, double_quant)
    bias = nn.Parameter(torch.randn(128))
    layer = NF4Linear.from_bnb(_fake_linear4bit(q, bias, compute_dtype=torch.bfloat16))
    assert_same(layer.to_nf4(), q)
    assert layer.scales.dtype == torch.bfloat16 and torch.equal(layer.bias, bias.detach().bfloat16())
    # compute_dtype fp32 (bitsandbytes' default): the weight's dtype when 16-bit; dtype= overrides
    assert NF4Linear.from_bnb(_fake_linear4bit(q, compute_dtype=torch.float32)).scales.dtype == torch.bfloat16
    assert NF4Linear.from_bnb(_fake_linear4bit(q), dtype=torch.float16).scales.dtype == torch.float16


def test_from_bnb_rejects():
    q = nf4.quantize(torch.randn(128, 256), 64, True)
    unquantized = SimpleNamespace(weight=nn.Parameter(torch.randn(128, 256)), bias=None)
    with pytest.raises(ValueError, match="quant_state"):
        NF4Linear.from_bnb(unquantized)
    with pytest.raises(ValueError, match="fp4"):
        NF4Linear.from_bnb(_fake_linear4bit(q, quant_type="fp4"))
    odd = nf4.quantize(torch.randn(100, 256), 64, True)
    with pytest.raises(ValueError, match="tile n"):
        NF4Linear.from_bnb(_fake_linear4bit(odd))


@pytest.mark.parametrize("k,n", [(256, 100), (200, 128), (192, 128)])
def test_shapes_the_kernels_cannot_tile(k, n):
    """n % 64 and k % 64 (the default blocksize 64's scale group is 64 too): 100 and 200 are
    refused with the rule; k = 192, an odd number of 64-wide k steps, tiles."""
    if (k, n) == (192, 128):  # an odd number of 64-wide k steps tiles (issue 29): no error
        NF4Linear(k, n)
        return
    rule = re.escape("tile n (out_features) by 64 and k (in_features) by 64") + ".*" + re.escape(f"got n={n}, k={k}")
    with pytest.raises(ValueError, match=rule):
        NF4Linear.from_linear(nn.Linear(k, n))
    with pytest.raises(ValueError, match=rule):
        NF4Linear(k, n)
    with pytest.raises(ValueError, match=rule):
        NF4Linear.from_nf4(nf4.quantize(torch.randn(n, k)))


def test_bad_arguments():
    with pytest.raises(ValueError, match="blocksize"):
        NF4Linear(256, 128, blocksize=100)
    with pytest.raises(TypeError, match="float16 or torch.bfloat16"):
        NF4Linear(256, 128, dtype=torch.float32)
    with pytest.raises(TypeError, match="float16 or torch.bfloat16"):
        NF4Linear.from_linear(nn.Linear(256, 128), dtype=torch.float32)
    with pytest.raises(TypeError, match="NF4Weight"):
        NF4Linear.from_nf4(torch.zeros(3))
    with pytest.raises(TypeError, match="from_nf4"):
        NF4Linear.from_weight(tilefish.w4a16.quantize(torch.randn(128, 256)))
    inf = nn.Linear(256, 128)
    with torch.no_grad():
        inf.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        NF4Linear.from_linear(inf)
    with pytest.raises(ValueError, match="bitsandbytes nf4"):
        NF4Linear.from_state_dict({"weight": torch.zeros(4)})


# ------------------------------------------------------------------------------------------------------------
# W4A16Linear's codebook


def test_w4a16_linear_codebook():
    q = nf4.quantize(torch.randn(128, 256), 64, False)
    p = nf4.prepare(q, torch.float16)
    bias = torch.randn(128, dtype=torch.float16)
    w = W4A16Linear.from_weight(p.kernel, bias)
    assert w.codebook == "nf4" and w.weight4.codebook == "nf4" and "codebook=nf4" in repr(w)
    x = torch.randn(5, 256, dtype=torch.float16)
    assert torch.equal(w(x), NF4Linear.from_nf4(q, bias)(x))  # the same kernel tensors, the same path
    assert torch.equal(w(x), tilefish.w4a16.matmul(x, p.kernel, bias))
    fresh = W4A16Linear(256, 128, group_size=64, codebook="nf4")
    fresh.load_state_dict(w.state_dict())
    assert torch.equal(fresh(x), w(x))
    assert "codebook=int4" in repr(W4A16Linear(256, 128))
    with pytest.raises(ValueError, match="codebook must be one of"):
        W4A16Linear(256, 128, codebook="fp4")
    with pytest.raises(ValueError, match="no zero points"):
        W4A16Linear(256, 128, codebook="nf4", symmetric=False)
    with pytest.raises(ValueError, match="group scales"):
        W4A16Linear(256, 128, codebook="nf4", group_size=-1)
    with pytest.raises(ValueError, match="codebook 'int4'"):
        W4A16Linear(256, 128, group_size=64)._set(p.kernel, None)
    zeros = dict(w.state_dict(), zeros=torch.full((4, 128), 8.0, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="no zero points"):
        fresh.load_state_dict(zeros)


# ------------------------------------------------------------------------------------------------------------
# quantize_model(method="nf4"), fusion, dequantize_model


def test_quantize_model_nf4_report():
    model = _model()
    report = quantize_model(model, "nf4", fuse=False, skip=("lm_head",))
    assert len(report.converted) == 14
    assert all(type(model.get_submodule(n)) is NF4Linear for n in report.converted)
    assert report.converted["layers.0.self_attn.k_proj"] == "NF4 blocksize 64 double-quant 256->64"
    assert report.skipped["lm_head"] == "in skip" and isinstance(model.lm_head, nn.Linear)
    assert "tile n (out_features) by 64" in report.skipped["odd"] and isinstance(model.odd, nn.Linear)
    assert 0.25 < report.bytes_after / report.bytes_before < 0.35  # 4 bits + a fp16 scale per 64 + bnb scales
    again = quantize_model(model, "nf4")
    assert not again.converted and set(again.skipped.values()) >= {"already NF4"}


def test_quantize_model_nf4_matches_per_layer_conversion():
    model = _model(bias=True)
    want = NF4Linear.from_linear(model.layers[1].mlp.up_proj, blocksize=128, double_quant=False,
                                 dtype=torch.bfloat16)
    report = quantize_model(model, method="nf4", blocksize=128, double_quant=False, dtype=torch.bfloat16, fuse=False)
    got = model.layers[1].mlp.up_proj
    assert_same(got.to_nf4(), want.to_nf4())
    assert_same_state(got.state_dict(), want.state_dict())
    assert report.converted["layers.1.mlp.up_proj"] == "NF4 blocksize 128 256->384"


@pytest.mark.parametrize("bias", [False, True])
def test_fused_nf4_equals_unfused(bias):
    unfused, fused = _model(bias=bias), _model(bias=bias)
    quantize_model(unfused, "nf4", fuse=False)
    report = quantize_model(fused, "nf4")
    assert set(report.fused) == {f"layers.{i}.{g}" for i in range(2) for g in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
    qkv = fused.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, FusedW4A16Linear) and qkv.codebook == "nf4" and "codebook=nf4" in repr(qkv)
    assert isinstance(fused.layers[0].self_attn.k_proj, W4A16Slice)
    assert type(fused.layers[0].self_attn.o_proj) is NF4Linear
    assert set(qkv.state_dict()) == {"packed", "scales"} | ({"bias"} if bias else set())  # tilefish's layout
    seed = fresh_seed()
    torch.manual_seed(seed)
    h = torch.randn(2, 3, 256, dtype=torch.float16)
    for a, b in zip(unfused(h), fused(h)):
        assert torch.equal(a, b), f"seed {seed}"  # the same codes and kernel scales, each output rounded once
    again = quantize_model(fused, "nf4")
    assert not again.converted and not again.fused


def test_mixed_codebooks_stay_unfused():
    model = _model()
    attn = model.layers[0].self_attn
    attn.q_proj = W4A16Linear.from_linear(attn.q_proj, group_size=64)
    attn.k_proj, attn.v_proj = NF4Linear.from_linear(attn.k_proj), NF4Linear.from_linear(attn.v_proj)
    report = fuse_projections(model)
    assert "codebooks" in report.unfused["layers.0.self_attn.q_proj, layers.0.self_attn.k_proj, "
                                         "layers.0.self_attn.v_proj"]
    attn.q_proj = NF4Linear.from_linear(nn.Linear(256, 256).half(), blocksize=32)  # group 32 against 64
    report = fuse_projections(model)
    assert "group sizes" in report.unfused["layers.0.self_attn.q_proj, layers.0.self_attn.k_proj, "
                                           "layers.0.self_attn.v_proj"]


def test_quantize_model_rejects_arguments_of_the_other_method():
    for kw in ({"group_size": 64}, {"symmetric": False}, {"clip_search": False}):
        with pytest.raises(ValueError, match="does not apply to method='nf4'"):
            quantize_model(_model(), "nf4", **kw)
    for kw in ({"blocksize": 128}, {"double_quant": False}):
        with pytest.raises(ValueError, match="does not apply to method='w4a16'"):
            quantize_model(_model(), **kw)
    with pytest.raises(ValueError, match=r"blocksize must be one of \(32, 64"):
        quantize_model(_model(), "nf4", blocksize=100)
    with pytest.raises(TypeError, match="double_quant must be a bool"):
        quantize_model(_model(), "nf4", double_quant="yes")
    with pytest.raises(ValueError, match=r"method must be one of \('w4a16', 'nf4', 'mxfp4'\)"):
        quantize_model(_model(), "fp4")
    with pytest.raises(TypeError, match="dtype"):
        quantize_model(_model(), "nf4", dtype=torch.float32)
    model = _model()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError):
        quantize_model(model, "nf4", group_size=32)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # checked before any change


def test_dequantize_model_nf4():
    model = _model(bias=True)
    quantize_model(model, "nf4", fuse=False, lm_head="quantize")
    q = model.layers[0].mlp.down_proj.to_nf4()
    seed = fresh_seed()
    torch.manual_seed(seed)
    h = torch.randn(2, 3, 256, dtype=torch.float16)
    want = model(h)
    assert dequantize_model(model) == 15   # 14 decoder projections and lm_head
    assert not any(isinstance(m, (W4A16Linear, W4A16Slice)) for m in model.modules())
    down = model.layers[0].mlp.down_proj
    assert type(down) is nn.Linear and torch.equal(down.weight, nf4_dequantize_fp32_chain(q, torch.float16))
    for a, b in zip(want, model(h)):
        assert rel_err(b, a) < TOLERANCE[torch.float16], f"seed {seed}"
    fused = _model(bias=True)
    quantize_model(fused, "nf4", lm_head="dense")
    want = fused(h)
    assert dequantize_model(fused) == 14 and not hasattr(fused.layers[0].self_attn, "qkv_proj")
    for a, b in zip(want, fused(h)):
        assert rel_err(b, a) < TOLERANCE[torch.float16], f"seed {seed}"


def test_nf4_model_compiles_fullgraph():
    model = _model()
    quantize_model(model, "nf4")
    h = torch.randn(2, 3, 256, dtype=torch.float16)
    with torch.no_grad():
        want = model(h)
        got = torch.compile(model, fullgraph=True, backend="eager")(h)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_hf_llama_quantize_nf4():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, vocab_size=320)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(cfg).half().eval()
    model = copy.deepcopy(dense)
    report = quantize_model(model, "nf4", lm_head="dense")
    assert len(report.fused) == 4 and len(report.converted) == 14 and "lm_head" in report.skipped
    ids = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        assert rel_err(model(ids).logits, dense(ids).logits) < 0.3  # 4-bit weights of a random model


# ------------------------------------------------------------------------------------------------------------
# GPU: the kernels (run on the device)


def _poison_allocator(shape, dtype):
    """A NaN block of the output's size, freed at once: the layer's torch.empty output reuses it, so an
    element the kernel leaves unwritten is NaN (rel_err rejects NaN)."""
    poison(torch.empty(shape, device="cuda", dtype=dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("blocksize,double_quant", [(64, True), (32, False), (256, True)])
def test_cuda_matches_the_bnb_weight(blocksize, double_quant, dtype):
    seed = fresh_seed()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k, n = 1024, 384
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    q = nf4.quantize(w.to(dtype), blocksize, double_quant)
    bias = torch.randn(n, device="cuda", generator=gen).to(dtype)
    layer = NF4Linear.from_nf4(q, bias)
    for m in (1, 3, 16, 33, 257):
        for shape in ((m, k), (1, m, k)):
            x = torch.randn(shape, device="cuda", generator=gen).to(dtype)
            want = reference(x, q, bias)
            op = tilefish.w4a16.matmul(x, layer.weight4, layer.bias)
            for call in range(2):  # the first call plans, the second launches the plan
                _poison_allocator(want.shape, dtype)
                y = layer(x)
                assert y.shape == want.shape and y.dtype == dtype
                err = rel_err(y, want)
                assert err < TOLERANCE[dtype], f"seed {seed}, m {m}, shape {shape}, call {call}: rel err {err:.3g}"
                assert torch.equal(y, op), f"seed {seed}, m {m}: the planned call differs from the op"


@pytest.mark.gpu
def test_cuda_layer_moves_and_keeps_the_bnb_weight():
    lin = dense_linear(512, 256, dtype=torch.bfloat16)
    layer = NF4Linear.from_linear(lin)
    q = layer.to_nf4()
    layer.cuda()
    assert layer.packed.is_cuda and layer.absmax_q.is_cuda and layer.absmax2.dtype == torch.float32
    assert_same(layer.to_nf4(), q)
    x = torch.randn(7, 512, device="cuda", dtype=torch.bfloat16)
    assert rel_err(layer(x), reference(x, q.to("cuda"), layer.bias)) < TOLERANCE[torch.bfloat16]
    layer.half()
    assert torch.equal(layer.scales, nf4.prepare(q.to("cuda"), torch.float16).kernel.scales)
    assert torch.equal(layer.weight.dequantize(), nf4_dequantize_fp32_chain(q, torch.float16).cuda())
    assert_same_state(layer.state_dict(), NF4Linear.from_nf4(q, lin.bias, torch.float16).state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 33])
def test_cuda_graph(m):
    seed = fresh_seed()
    torch.manual_seed(seed)
    layer = NF4Linear.from_linear(dense_linear(2048, 256, dtype=torch.bfloat16, device="cuda"))
    q = layer.to_nf4()
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x)  # warm-up outside the capture: compile, load, plan
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = layer(x)
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(torch.randn_like(x))
    poison(out)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(x, q, layer.bias)) < TOLERANCE[torch.bfloat16], f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ACT_DTYPES)
def test_torch_compile_fullgraph(dtype):
    seed = fresh_seed()
    torch.manual_seed(seed)
    layer = NF4Linear.from_linear(dense_linear(512, 128, dtype=dtype, device="cuda"))
    q = layer.to_nf4()
    f = torch.compile(lambda x: layer(x) * 2, fullgraph=True)
    for m in (1, 5, 33):
        x = torch.randn(m, 512, device="cuda", dtype=dtype)
        assert rel_err(f(x), reference(x, q, layer.bias).float() * 2) < TOLERANCE[dtype], f"seed {seed}, m {m}"


@pytest.mark.gpu
@pytest.mark.parametrize("double_quant", [True, False])
def test_from_bnb_with_bitsandbytes(double_quant):
    """A real bitsandbytes Linear4bit, quantized by bitsandbytes on the GPU: the same weight bit for bit, the
    same state dict, and bitsandbytes loads ours back."""
    bnb = pytest.importorskip("bitsandbytes")
    dense = dense_linear(512, 256, dtype=torch.float16, seed=5)
    theirs = bnb.nn.Linear4bit(512, 256, bias=True, compute_dtype=torch.float16, compress_statistics=double_quant,
                               quant_type="nf4")
    theirs.weight = bnb.nn.Params4bit(data=dense.weight.detach().clone(), requires_grad=False, quant_type="nf4",
                                      compress_statistics=double_quant, blocksize=64)
    theirs.bias = nn.Parameter(dense.bias.detach().clone(), requires_grad=False)
    theirs = theirs.to("cuda")  # bitsandbytes quantizes here
    layer = NF4Linear.from_bnb(theirs)
    q = nf4.from_bnb(theirs.weight, theirs.weight.quant_state)
    assert_same(layer.to_nf4(), q)
    assert layer.packed.is_cuda and layer.scales.dtype == torch.float16
    assert_same_state(layer.state_dict(), theirs.state_dict())
    x = torch.randn(9, 512, device="cuda", dtype=torch.float16)
    want = reference(x, q, layer.bias)
    with torch.no_grad():
        assert rel_err(layer(x), want) < TOLERANCE[torch.float16]
        assert rel_err(theirs(x), want) < 2 * TOLERANCE[torch.float16]  # bitsandbytes itself, for scale
    sd = layer.state_dict()
    param = bnb.nn.Params4bit.from_prequantized(data=sd["weight"], device="cuda", quantized_stats={
        k: v for k, v in sd.items() if k.startswith("weight.")})
    got = bnb.functional.dequantize_4bit(param.data, param.quant_state)
    assert torch.equal(got, nf4_dequantize_fp32_chain(q, torch.float16))
