"""The grouped expert op on the GPU (tilefish.ops.moe.launch_cuda) against the CPU reference
(tilefish.reference.moe_experts, float64): every codebook and dtype, odd token counts, experts no token
picks, one expert taking every token, ids outside [0, E) (skipped on CUDA), biases and gpt-oss's activation,
CUDA graphs, torch.compile, and a converted MoE model against its dense twin. All skip without a GPU."""
from __future__ import annotations

import copy

import pytest
import torch

import tilefish.moe as moe
from conftest import TOLERANCE, rel_err
from tilefish.ops.expert_weights import ExpertWeights

pytestmark = pytest.mark.gpu

DTYPES = (torch.float16, torch.bfloat16)
CODEBOOKS = {"int4": dict(group_size=128), "int4-asym-g32": dict(group_size=32, symmetric=False), "nf4": {},
             "mxfp4": {}}


def _weights(e, hidden, inter, dtype, codebook="int4", seed=0):
    """gate_up [E, 2I, H] and down [E, H, I] quantized on the CPU (the reference's copies) and moved."""
    gen = torch.Generator().manual_seed(seed)
    book = codebook.split("-")[0]
    options = dict(CODEBOOKS[codebook])
    if book == "int4":
        options["clip_search"] = False
    gate_up = ExpertWeights.from_weights(torch.randn(e, 2 * inter, hidden, generator=gen) * 0.05, book,
                                         dtype=dtype, **options)
    down = ExpertWeights.from_weights(torch.randn(e, hidden, inter, generator=gen) * 0.05, book, dtype=dtype,
                                      **options)
    return gate_up, down


def _routing(tokens, e, k, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    return ids, torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(dtype)


def _poison_allocator(rows, cols, dtype):
    """A NaN block of the output's size in the caching allocator: an output row the kernel does not write
    shows up as NaN (rel_err rejects NaN)."""
    torch.full((rows, cols), float("nan"), device="cuda", dtype=dtype)


def _check(x, ids, w, gate_up, down, activation="silu", gb=None, db=None):
    want = moe.moe_experts(x, ids, w, gate_up, down, activation, gb, db)        # CPU reference
    cuda = [t.cuda() if t is not None else None for t in (x, ids, w, gb, db)]
    _poison_allocator(x.shape[0], x.shape[1], x.dtype)
    got = moe.moe_experts(cuda[0], cuda[1], cuda[2], gate_up.to("cuda"), down.to("cuda"), activation, cuda[3],
                          cuda[4])
    assert got.device.type == "cuda" and got.dtype == x.dtype and got.shape == x.shape
    assert rel_err(got.cpu(), want) < TOLERANCE[x.dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codebook", list(CODEBOOKS))
@pytest.mark.parametrize("tokens", [1, 7, 33, 256])
def test_against_the_reference(dtype, codebook, tokens):
    e, hidden, inter = 8, 256, 128
    gate_up, down = _weights(e, hidden, inter, dtype, codebook)
    x = torch.randn(tokens, hidden, dtype=dtype)
    ids, w = _routing(tokens, e, 2, seed=tokens)
    _check(x, ids, w, gate_up, down)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt_oss_activation_and_biases(dtype):
    e, hidden, inter = 4, 256, 256
    gate_up, down = _weights(e, hidden, inter, dtype, "mxfp4")
    x = torch.randn(19, hidden, dtype=dtype) * 4                  # past the clamp at 7
    ids, w = _routing(19, e, 4, dtype=dtype)
    gb, db = torch.randn(e, 2 * inter, dtype=dtype), torch.randn(e, hidden, dtype=dtype)
    _check(x, ids, w, gate_up, down, "swiglu_oai", gb, db)


def test_idle_experts_one_expert_for_every_token_and_repeats():
    gate_up, down = _weights(16, 256, 128, torch.bfloat16)
    x = torch.randn(65, 256, dtype=torch.bfloat16)
    ids = torch.full((65, 2), 5)                                  # 15 experts idle, expert 5 picked twice a token
    _check(x, ids, torch.rand(65, 2), gate_up, down)
    ids[:, 1] = torch.arange(65) % 3                              # only experts 0, 1, 2, 5 used
    _check(x, ids.to(torch.int32), torch.rand(65, 2, dtype=torch.bfloat16), gate_up, down)


def test_ids_outside_the_experts_are_skipped_on_cuda():
    """A CUDA call cannot raise on values: an id < 0 or >= E contributes nothing (ops/moe.py)."""
    gate_up, down = _weights(4, 256, 128, torch.float16)
    x = torch.randn(6, 256, dtype=torch.float16)
    ids, w = _routing(6, 4, 2)
    bad = ids.clone()
    bad[1, 0], bad[3, 1] = 4, -1
    masked = w.clone()
    masked[1, 0] = masked[3, 1] = 0
    want = moe.moe_experts(x, ids, masked, gate_up, down)
    got = moe.moe_experts(x.cuda(), bad.cuda(), w.cuda(), gate_up.to("cuda"), down.to("cuda"))
    assert rel_err(got.cpu(), want) < TOLERANCE[torch.float16]


def test_empty_inputs():
    gate_up, down = _weights(4, 256, 128, torch.float16)
    g, d = gate_up.to("cuda"), down.to("cuda")
    x = torch.randn(0, 256, device="cuda", dtype=torch.float16)
    ids = torch.zeros(0, 2, dtype=torch.int64, device="cuda")
    assert moe.moe_experts(x, ids, ids.float(), g, d).shape == (0, 256)


def test_cuda_graph():
    gate_up, down = _weights(8, 256, 128, torch.bfloat16)
    g, d = gate_up.to("cuda"), down.to("cuda")
    x = torch.randn(9, 256, device="cuda", dtype=torch.bfloat16)
    ids, w = (t.cuda() for t in _routing(9, 8, 2))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe.moe_experts(x, ids, w, g, d)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = moe.moe_experts(x, ids, w, g, d)
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(torch.randn_like(x))
    new_ids, new_w = _routing(9, 8, 2, seed=1)
    ids.copy_(new_ids)                                            # the routing changes between replays
    w.copy_(new_w)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out.cpu(), moe.moe_experts(x.cpu(), new_ids, new_w, gate_up, down)) < TOLERANCE[torch.bfloat16]


def test_torch_compile_fullgraph():
    gate_up, down = _weights(8, 256, 128, torch.float16)
    g, d = gate_up.to("cuda"), down.to("cuda")
    f = torch.compile(lambda x, ids, w: moe.moe_experts(x, ids, w, g, d) * 2, fullgraph=True)
    x = torch.randn(5, 256, dtype=torch.float16)
    ids, w = _routing(5, 8, 2)
    got = f(x.cuda(), ids.cuda(), w.cuda())
    assert rel_err(got.cpu(), moe.moe_experts(x, ids, w, gate_up, down).float() * 2) < TOLERANCE[torch.float16]


def test_quantized_experts_keep_launches_per_call_signature(monkeypatch):
    """QuantizedExperts' eager calls build their launches once per call signature, on the decode path and the
    grouped one, and give the reference's result for fresh inputs of it, for other signatures (more tokens, int32
    ids, bf16 routing weights, a non-contiguous x, token counts that take the grouped path), after .half() (new
    tensors, new launches) and replayed in a CUDA graph with new routing."""
    from tilefish.experts import QuantizedExperts
    from tilefish.ops import moe_kernels

    builds = []
    experts_launch = moe_kernels.experts_launch
    monkeypatch.setattr(moe_kernels, "experts_launch", lambda *a, **k: builds.append(1) or experts_launch(*a, **k))
    gate_up, down = _weights(32, 256, 128, torch.bfloat16, seed=3)
    layer = QuantizedExperts(gate_up.to("cuda"), down.to("cuda"), "silu")

    def check(tokens, k, seed, dtype=torch.bfloat16, ids_dtype=torch.int64, routing=torch.float32, wide=False):
        full = torch.randn(tokens, 512 if wide else 256, generator=torch.Generator().manual_seed(seed)).to(dtype)
        x, xg = (full[:, ::2], full.cuda()[:, ::2]) if wide else (full, full.cuda())
        ids, w = _routing(tokens, 32, k, seed, routing)
        _poison_allocator(tokens, 256, dtype)
        got = layer(xg, ids.to(ids_dtype).cuda(), w.cuda())
        want = moe.moe_experts(x, ids, w, gate_up.to(dtype), down.to(dtype))
        assert got.dtype == dtype and rel_err(got.cpu(), want) < TOLERANCE[dtype], (tokens, k, seed)

    for seed in range(3):  # one signature: one build
        check(1, 2, seed)
    assert len(builds) == 1
    check(3, 2, 3)
    check(1, 2, 4, ids_dtype=torch.int32)
    check(1, 2, 5, routing=torch.bfloat16)
    check(1, 2, 6, wide=True)                # x[:, ::2]: the first signature's launch, x copied first
    check(17, 2, 7)                          # 34 slots: the grouped path
    check(17, 2, 11)                         # ... its kept launch
    assert len(builds) == 5
    check(17, 2, 12, routing=torch.bfloat16)  # bf16 routing weights: a signature of its own
    assert len(builds) == 6
    layer.half()
    check(1, 2, 8, dtype=torch.float16)
    check(17, 2, 13, dtype=torch.float16, ids_dtype=torch.int32)
    assert len(builds) == 8

    for tokens, seed in ((1, 9), (17, 14)):  # the decode path's launches and the grouped path's
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.float16)
        ids, w = (t.cuda() for t in _routing(tokens, 32, 2, seed=seed))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(x, ids, w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                out = layer(x, ids, w)
        torch.cuda.current_stream().wait_stream(s)
        new_ids, new_w = _routing(tokens, 32, 2, seed=seed + 1)
        x.copy_(torch.randn_like(x))
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        want = moe.moe_experts(x.cpu(), new_ids, new_w, gate_up.to(torch.float16), down.to(torch.float16))
        assert rel_err(out.cpu(), want) < TOLERANCE[torch.float16], tokens


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_converted_model_against_its_dense_twin(family):
    from moe_families import build_moe

    from tilefish.convert import dequantize_model, quantize_model

    model = build_moe(family, dtype=torch.bfloat16).cuda()
    if family == "gpt_oss":
        quantize_model(model, "mxfp4")
    else:
        quantize_model(model, clip_search=False)
    twin = copy.deepcopy(model)
    dequantize_model(twin)
    ids = torch.randint(3, 256, (2, 17), device="cuda")
    with torch.no_grad():
        assert rel_err(model(ids).logits, twin(ids).logits) < 2e-2   # bf16 model, rounding through two layers
    out = model.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 9)
