"""Converted models and the W4A16 layers' planned eager path on the GPU kernels."""
from __future__ import annotations

import copy

import pytest
import torch

import tilefish
from tilefish.convert import quantize_model
from tilefish.nn import W4A16Linear
from tilefish.ops import w4a16 as ops

from conftest import TOLERANCE, rel_err
from test_convert import _model

pytestmark = pytest.mark.gpu


def _layer(k, n, group, sym, dtype, bias, act_order, seed):
    torch.manual_seed(seed)
    w = tilefish.w4a16.quantize(torch.randn(n, k, device="cuda"), group, sym, dtype=dtype, clip_search=False)
    if act_order:
        w.perm = torch.randperm(k, device="cuda")
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    return W4A16Linear.from_weight(w, b), w, b


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,sym,bias,act_order", [(128, True, False, False), (64, False, True, True),
                                                      (-1, True, True, False), (32, False, False, True)])
def test_planned_call_equals_the_op(group, sym, bias, act_order, dtype):
    """The layer's planned launch computes exactly what the op computes, for every kernel family
    the dispatcher picks (m from 1 to 300), 2-D and 3-D inputs, on its first and later calls."""
    seed = 1000 + group
    layer, w, b = _layer(1024, 384, group, sym, dtype, bias, act_order, seed)
    for m in (1, 3, 8, 13, 16, 40, 128, 300):
        for shape in ((m, 1024), (1, m, 1024)):
            x = torch.randn(*shape, device="cuda", dtype=dtype)
            want = ops.matmul_impl(x, w, b)
            for _ in range(2):
                torch.full(want.shape, float("nan"), device="cuda", dtype=dtype)  # poison the allocator's block
                got = layer(x)
                assert got.shape == want.shape and torch.equal(got, want), (m, shape, seed)


def test_planned_call_falls_back_for_unusual_inputs():
    layer, w, b = _layer(512, 128, 128, True, torch.float16, True, False, 7)
    base = torch.randn(6, 520, device="cuda", dtype=torch.float16)
    strided = base[:, 4:516]                     # not contiguous, and 8 bytes off alignment
    want = ops.matmul_impl(strided.contiguous(), w, b)
    assert torch.equal(layer(strided), want)
    flat = torch.randn(6 * 512 + 4, device="cuda", dtype=torch.float16)[4:].view(6, 512)  # contiguous, misaligned
    assert torch.equal(layer(flat), ops.matmul_impl(flat.clone(), w, b))
    assert layer(torch.randn(0, 512, device="cuda", dtype=torch.float16)).shape == (0, 128)
    y32 = layer(flat.float())
    assert y32.dtype == torch.float32 and torch.equal(y32, layer(flat.clone()).float())
    with pytest.raises(ValueError, match="k=511"):
        layer(torch.randn(2, 511, device="cuda", dtype=torch.float16))


def test_plans_follow_the_layer_across_devices_and_streams():
    layer, w, b = _layer(512, 128, 64, False, torch.float16, True, False, 11)
    x = torch.randn(4, 512, device="cuda", dtype=torch.float16)
    want = layer(x)
    layer.cpu()
    assert rel_err(layer(x.cpu()), want.cpu()) < TOLERANCE[torch.float16]
    layer.cuda()
    assert torch.equal(layer(x), want)
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = [None, None]
    for _ in range(10):
        for i, s in enumerate(streams):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs[i] = layer(x)
        torch.cuda.synchronize()
        assert all(torch.equal(o, want) for o in outs)


def test_converted_model_in_a_cuda_graph_and_compiled():
    torch.manual_seed(3)
    model = _model().cuda()
    quantize_model(model)
    h = torch.randn(2, 1, 256, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        want = model(h)
        compiled = torch.compile(model, fullgraph=True)
        got = compiled(h)
        assert all(rel_err(a, b) < TOLERANCE[torch.float16] for a, b in zip(got, want))
        static = h.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(static)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                out = model(static)
        torch.cuda.current_stream().wait_stream(s)
        h2 = torch.randn_like(h)
        static.copy_(h2)
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, model(h2)))


def test_fused_equals_unfused_on_the_gpu():
    """Fusion keeps every column's values and scales; the fused launch may take another plan (k
    split) than each part's, so sums may round differently: equal within the kernel's tolerance."""
    torch.manual_seed(4)
    unfused = _model().cuda()
    fused = copy.deepcopy(unfused)
    quantize_model(unfused, fuse=False)
    quantize_model(fused)
    for m in (1, 16, 64):
        h = torch.randn(m, 256, device="cuda", dtype=torch.float16)
        with torch.no_grad():
            for a, b in zip(unfused(h), fused(h)):
                assert rel_err(b, a) < TOLERANCE[torch.float16]


def test_autograd_on_cuda_matches_cpu():
    layer, w, b = _layer(512, 192, 64, True, torch.float16, True, True, 13)
    x = torch.randn(5, 512, device="cuda", dtype=torch.float16, requires_grad=True)
    g = torch.randn(5, 192, device="cuda", dtype=torch.float16)
    layer(x).backward(g)
    dense = layer.weight.dequantize().float()
    assert rel_err(x.grad, g.float() @ dense) < TOLERANCE[torch.float16]
    x2 = x.detach().clone().requires_grad_()
    torch.compile(layer, fullgraph=True)(x2).backward(g)
    assert rel_err(x2.grad, x.grad) < TOLERANCE[torch.float16]


def test_hf_llama_converted_on_the_gpu():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                                   num_key_value_heads=2, head_dim=64, vocab_size=1000)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(cfg).half().cuda().eval()
    ids = torch.randint(0, 1000, (2, 11), device="cuda")
    model = copy.deepcopy(dense)
    quantize_model(model)
    with torch.no_grad():
        ref_cpu = copy.deepcopy(model).cpu()(ids.cpu()).logits
        got = model(ids).logits
    assert rel_err(got, ref_cpu.cuda()) < TOLERANCE[torch.float16] * 5  # fp16 activations through 2 layers


def test_quantize_model_peak_memory_is_one_layer_above_the_model():
    """A CPU model converted with device="cuda" goes to the GPU one layer at a time: the GPU's peak
    is the quantized layers plus one dense layer and its quantization temporaries, far below the
    dense model (64 layers here), and the converted layers end up on the GPU."""
    torch.manual_seed(5)
    layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(64)]).half()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    dense = 64 * 1024 * 1024 * 2
    report = quantize_model(layers, skip=(), device="cuda")
    torch.cuda.synchronize()
    peak, end = torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated() - start
    assert all(layer.packed.is_cuda for layer in layers)
    assert end == report.bytes_after and 0.25 < end / dense < 0.3
    assert peak < end + 0.5 * dense, (peak / dense, end / dense)   # one dense layer is 1/64 of the model
