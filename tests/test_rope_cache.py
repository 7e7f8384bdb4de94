"""tilefish.ops.rope_cache: the rotary embedding and StaticCache write of a Llama-family attention step in one op.

CPU: the op (the reference) equals transformers' apply_rotary_pos_emb followed by StaticLayer.update bit for bit
(q, keys, values and the length), fp16 and bf16, odd head counts and head dims, prompts and decode steps, a cos
row shared by the batch; positions past the cache are not written; every validation error names its rule; the
custom op passes opcheck and traces with fullgraph. GPU (skipped without one): the kernel against the same
transformers steps run eagerly on CUDA, bit for bit (both round every product and sum to the dtype), with the q
output poisoned and the caches filled with random values (what is not written must stay), batch 1-64, prompts
up to 2048 tokens (a grid of 1024 CTAs meeting at the length), many launches in a row, PDL on and off, the shared
W4A16 counters left at zero, a manual CUDA graph replayed, torch.compile (default, reduce-overhead).
With Qwen3's per-head q / k norms (q_norm / k_norm): bit for bit with Qwen3Attention's eager steps on the CPU, and
on CUDA within the norm's fp32 summation order (values and the length bit for bit).
"""
from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import StaticLayer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import capture, poison
from tilefish.ops import library
from tilefish.ops import rope_cache as ops
from tilefish.ops.w4a16 import layer_counters, make_layer_counters

DTYPES = (torch.float16, torch.bfloat16)


def _step(b, t, heads, kv_heads, d, slots, dtype, device="cpu", start=None, cos_batch=None):
    """qkv, cos, sin (like LlamaRotaryEmbedding's: a rotation per position), and a StaticLayer filled with
    random K/V whose length is `start` (random below slots - t when None)."""
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * d).mul_(3).to(dtype)
    positions = torch.randint(0, 4096, (cos_batch or b, t)).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.cat((positions[..., None] * inv,) * 2, dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    layer = StaticLayer(slots)
    k0 = torch.randn(b, kv_heads, 1, d, dtype=dtype)
    layer.lazy_initialization(k0, k0)
    layer.keys.normal_()
    layer.values.normal_()
    begin = int(torch.randint(0, max(slots - t, 0) + 1, ()).item()) if start is None else start
    layer.cumulative_length.fill_(begin)
    move = (lambda x: x.to(device))
    layer.keys, layer.values, layer.cumulative_length = map(move, (layer.keys, layer.values, layer.cumulative_length))
    layer.device = torch.device(device)
    return move(qkv), move(cos), move(sin), layer


def _transformers(qkv, cos, sin, layer, heads, kv_heads, norms=None):
    """What LlamaAttention.forward does from its projections to the attention (the eager ops); with norms
    (q_norm, k_norm: transformers' Qwen3RMSNorm modules), what Qwen3Attention.forward does."""
    b, t, _ = qkv.shape
    d = layer.keys.shape[-1]
    q, k, v = (p.reshape(b, t, -1, d) for p in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    q, k, v = (p.transpose(1, 2) for p in (q, k, v))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    keys, values = layer.update(k, v)
    return q, keys, values


def _copy(layer):
    twin = StaticLayer(layer.max_cache_len)
    twin.keys, twin.values = layer.keys.clone(), layer.values.clone()
    twin.cumulative_length, twin.device, twin.is_initialized = layer.cumulative_length.clone(), layer.device, True
    return twin


def _head_norms(d, dtype, device="cpu", seed=0, eps=1e-6):
    """Qwen3's q_norm and k_norm: transformers' Qwen3RMSNorm over the head dim, weights drawn around 1."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(seed)
    norms = []
    for _ in range(2):
        norm = Qwen3RMSNorm(d, eps=eps)
        norm.weight.data = 1 + 0.5 * torch.randn(d, generator=g)
        norms.append(norm.to(device=device, dtype=dtype))
    return norms


def _norm_args(norms):
    return dict(q_norm=norms[0].weight.detach(), k_norm=norms[1].weight.detach(), norm_eps=norms[0].variance_epsilon)


SHAPES = [  # b, t, heads, kv_heads, d, slots
    (1, 1, 32, 8, 128, 576), (3, 1, 12, 2, 64, 40), (2, 7, 8, 8, 80, 64), (1, 33, 28, 4, 128, 96),
    (4, 5, 6, 3, 256, 16), (16, 1, 32, 8, 128, 520),
]


# ---- CPU: the reference path ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}t{}h{}kv{}d{}S{}".format(*s))
def test_cpu_equals_transformers_rotary_and_cache_update(dtype, shape, seed):
    b, t, heads, kv_heads, d, slots = shape
    for cos_batch in (None, 1):
        qkv, cos, sin, layer = _step(b, t, heads, kv_heads, d, slots, dtype, cos_batch=cos_batch)
        twin = _copy(layer)
        q_want, keys_want, values_want = _transformers(qkv, cos, sin, twin, heads, kv_heads)
        q = ops.rope_cache(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, heads, kv_heads)
        assert q.shape == (b, t, heads, d) and q.is_contiguous()
        assert torch.equal(q.transpose(1, 2), q_want), f"seed {seed}"
        assert torch.equal(layer.keys, keys_want) and torch.equal(layer.values, values_want), f"seed {seed}"
        assert torch.equal(layer.cumulative_length, twin.cumulative_length), f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}t{}h{}kv{}d{}S{}".format(*s))
def test_cpu_head_norms_equal_transformers_qwen3_steps(dtype, shape, seed):
    """q_norm / k_norm: Qwen3Attention's q_norm(q), k_norm(k), rotary and cache update, bit for bit."""
    b, t, heads, kv_heads, d, slots = shape
    norms = _head_norms(d, dtype, seed=seed)
    qkv, cos, sin, layer = _step(b, t, heads, kv_heads, d, slots, dtype)
    twin = _copy(layer)
    with torch.no_grad():
        q_want, keys_want, values_want = _transformers(qkv, cos, sin, twin, heads, kv_heads, norms)
    q = ops.rope_cache(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, heads, kv_heads,
                       **_norm_args(norms))
    assert torch.equal(q.transpose(1, 2), q_want), f"seed {seed}"
    assert torch.equal(layer.keys, keys_want) and torch.equal(layer.values, values_want), f"seed {seed}"
    assert torch.equal(layer.cumulative_length, twin.cumulative_length), f"seed {seed}"


def test_cpu_positions_past_the_cache_are_not_written(seed):
    qkv, cos, sin, layer = _step(2, 6, 4, 2, 32, 10, torch.float16, start=7)
    keys, values = layer.keys.clone(), layer.values.clone()
    q = ops.rope_cache(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, 4, 2)
    twin = _copy(_step(2, 6, 4, 2, 32, 16, torch.float16, start=7)[3])  # a cache with room for all six
    twin.keys[:, :, :10], twin.values[:, :, :10] = keys, values
    q_want, keys_want, values_want = _transformers(qkv, cos, sin, twin, 4, 2)
    assert torch.equal(q.transpose(1, 2), q_want)
    assert torch.equal(layer.keys, keys_want[:, :, :10]) and torch.equal(layer.values, values_want[:, :, :10])
    assert layer.cumulative_length.item() == 13  # the length advances as transformers' counter would


def test_validation_names_the_rule():
    qkv, cos, sin, layer = _step(2, 3, 4, 2, 32, 16, torch.float16)
    k, v, n = layer.keys, layer.values, layer.cumulative_length
    cases = [
        (dict(qkv=qkv.float()), TypeError, "float16 or bfloat16"),
        (dict(kv_heads=3), ValueError, "kv heads"),
        (dict(heads=5), ValueError, "divide heads"),
        (dict(heads=0), ValueError, "positive int"),
        (dict(qkv=qkv[..., :-32]), ValueError, r"qkv must be \[B"),
        (dict(qkv=qkv[:1]), ValueError, r"qkv must be \[B"),
        (dict(cos=cos[:, :2]), ValueError, "cos must be"),
        (dict(sin=sin.float()), TypeError, "sin must have qkv's dtype"),
        (dict(keys=k.transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "contiguous"),
        (dict(values=v[:, :1]), ValueError, "one shape"),
        (dict(length=n.int()), TypeError, "int64"),
        (dict(length=torch.zeros(2, dtype=torch.long)), TypeError, "one-element"),
        (dict(qkv=None), TypeError, "torch.Tensor"),
        (dict(q_norm=torch.ones(32)), TypeError, "q_norm must have qkv's dtype"),
        (dict(k_norm=torch.ones(16, dtype=torch.float16)), ValueError, r"k_norm must be one weight a head dim"),
        (dict(k_norm=[1.0] * 32), TypeError, "k_norm must be a torch.Tensor or None"),
        (dict(q_norm=torch.ones(32, dtype=torch.float16), norm_eps=-1e-6), ValueError, "norm_eps"),
        (dict(norm_eps=float("nan")), ValueError, "norm_eps"),
    ]
    for change, err, match in cases:
        args = dict(qkv=qkv, cos=cos, sin=sin, keys=k, values=v, length=n, heads=4, kv_heads=2)
        args.update(change)
        before = (k.clone(), v.clone(), n.clone())
        with pytest.raises(err, match=match):
            ops.rope_cache(**args)
        assert all(torch.equal(a, b) for a, b in zip(before, (k, v, n))), f"{change}: changed before raising"
    odd = _step(1, 1, 2, 1, 24, 4, torch.float16)  # head dim 24: halves of 12, not whole 8-element chunks
    with pytest.raises(ValueError, match="multiple of 16"):
        ops.rope_cache(odd[0], odd[1], odd[2], odd[3].keys, odd[3].values, odd[3].cumulative_length, 2, 1)


def test_custom_op_opcheck_and_fullgraph_trace():
    qkv, cos, sin, layer = _step(2, 3, 4, 2, 32, 16, torch.bfloat16)
    torch.library.opcheck(library.rope_cache_op, (qkv, cos, sin, layer.keys, layer.values,
                                                  layer.cumulative_length, 4, 2, None))
    norms = _norm_args(_head_norms(32, torch.bfloat16))
    torch.library.opcheck(library.rope_cache_op, (qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length,
                                                  4, 2, None, norms["q_norm"], norms["k_norm"], norms["norm_eps"]))
    twin = _copy(layer)

    def attention_step(qkv, cos, sin, keys, values, length):
        return ops.rope_cache(qkv, cos, sin, keys, values, length, 4, 2) * 2

    torch._dynamo.reset()
    got = torch.compile(attention_step, backend="aot_eager", fullgraph=True)(
        qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length)
    want = attention_step(qkv, cos, sin, twin.keys, twin.values, twin.cumulative_length)
    torch._dynamo.reset()
    assert torch.equal(got, want) and torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values)
    assert torch.equal(layer.cumulative_length, twin.cumulative_length)


# ---- GPU: the kernel -----------------------------------------------------------------------------------------------

def _run_and_check(shape, dtype, seed, cuda, cos_batch=None, start=None, pdl=True, counters=None):
    b, t, heads, kv_heads, d, slots = shape
    qkv, cos, sin, layer = _step(b, t, heads, kv_heads, d, slots, dtype, cuda, start, cos_batch)
    twin = _copy(layer)
    q_want, keys_want, values_want = _transformers(qkv, cos, sin, twin, heads, kv_heads)
    poison(torch.empty((b, t, heads, d), dtype=dtype, device=cuda))  # freed: q's allocation of that size reuses it
    q = ops.rope_cache_impl(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, heads, kv_heads,
                            counters, pdl=pdl)
    torch.cuda.synchronize()
    assert torch.equal(q.transpose(1, 2), q_want), f"q, seed {seed}"
    assert torch.equal(layer.keys, keys_want), f"keys, seed {seed}"
    assert torch.equal(layer.values, values_want), f"values, seed {seed}"
    assert torch.equal(layer.cumulative_length, twin.cumulative_length), f"length, seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(64, 1, 32, 8, 128, 520), (1, 2048, 32, 8, 128, 2560),
                                            (2, 300, 40, 8, 128, 512)],
                         ids=lambda s: "b{}t{}h{}kv{}d{}S{}".format(*s))
def test_kernel_equals_transformers_on_cuda(dtype, shape, seed, cuda):
    for cos_batch in (None, 1):
        _run_and_check(shape, dtype, seed, cuda, cos_batch)


def _ulp_close(got, want, dtype, where):
    """Within the head norm's reordered fp32 sum: a last-bit difference in a few elements, not more."""
    diff = (got.double() - want.double()).norm() / want.double().norm()
    differing = (got != want).double().mean().item()
    assert diff < {torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype] and differing < 0.02, \
        f"{where}: relative error {diff:.2e}, {differing:.2%} of the elements differ"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(64, 1, 32, 8, 128, 520), (2, 300, 40, 8, 128, 512)],
                         ids=lambda s: "b{}t{}h{}kv{}d{}S{}".format(*s))
def test_kernel_head_norms_match_transformers_qwen3_on_cuda(dtype, shape, seed, cuda):
    """Qwen3's steps run eagerly on CUDA (q_norm, k_norm, rotary, cache update): values and the length bit for
    bit; q and the keys within the norm's fp32 sum order (the kernel's is fixed, rotary.cuh; torch's is its own)."""
    b, t, heads, kv_heads, d, slots = shape
    norms = _head_norms(d, dtype, cuda, seed)
    qkv, cos, sin, layer = _step(b, t, heads, kv_heads, d, slots, dtype, cuda)
    twin = _copy(layer)
    with torch.no_grad():
        q_want, keys_want, values_want = _transformers(qkv, cos, sin, twin, heads, kv_heads, norms)
    poison(torch.empty((b, t, heads, d), dtype=dtype, device=cuda))
    q = ops.rope_cache_impl(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, heads, kv_heads,
                            **_norm_args(norms))
    torch.cuda.synchronize()
    where = f"seed {seed}, shape {shape}, {dtype}"
    _ulp_close(q.transpose(1, 2), q_want, dtype, f"q, {where}")
    _ulp_close(layer.keys, keys_want, dtype, f"keys, {where}")
    assert torch.equal(layer.values, values_want) and torch.equal(layer.cumulative_length, twin.cumulative_length)


@pytest.mark.gpu
def test_kernel_positions_past_the_cache_and_pdl_off(seed, cuda):
    for start in (13, 16, 20):  # some, then none of the 6 tokens fit a 16-slot cache
        qkv, cos, sin, layer = _step(3, 6, 8, 2, 64, 16, torch.float16, cuda, start)
        keys, values = layer.keys.clone(), layer.values.clone()
        q = ops.rope_cache_impl(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, 8, 2, pdl=False)
        ref = _step(3, 6, 8, 2, 64, 32, torch.float16, cuda, start)[3]
        ref.keys[:, :, :16], ref.values[:, :, :16] = keys, values
        q_want, keys_want, values_want = _transformers(qkv, cos, sin, ref, 8, 2)
        assert torch.equal(q.transpose(1, 2), q_want), f"seed {seed}"
        assert torch.equal(layer.keys, keys_want[:, :, :16]) and torch.equal(layer.values, values_want[:, :, :16])
        assert layer.cumulative_length.item() == start + 6


@pytest.mark.gpu
def test_many_launches_advance_the_length_and_leave_the_counters_zero(seed, cuda):
    b, heads, kv_heads, d, slots = 64, 32, 8, 128, 600  # 112 CTAs a launch meet at the length
    qkv, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, torch.bfloat16, cuda, start=0)
    make_layer_counters(qkv.device)
    counters = layer_counters(qkv.device)
    assert counters is not None
    twin = _copy(layer)
    for step in range(40):
        qkv.normal_()
        q = ops.rope_cache(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, heads, kv_heads)
        q_want, _, _ = _transformers(qkv, cos, sin, twin, heads, kv_heads)
        assert torch.equal(q.transpose(1, 2), q_want), f"step {step}, seed {seed}"
    torch.cuda.synchronize()
    assert layer.cumulative_length.item() == 40
    assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values), f"seed {seed}"
    assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
def test_own_counters_and_a_manual_cuda_graph(seed, cuda):
    counters = torch.zeros(4, dtype=torch.int32, device=cuda)
    _run_and_check((5, 3, 16, 4, 128, 64), torch.float16, seed, cuda, counters=counters)
    assert int(counters.abs().sum()) == 0
    qkv, cos, sin, layer = _step(2, 1, 16, 4, 128, 64, torch.float16, cuda, start=5)
    twin = _copy(layer)
    graph, q = capture(lambda: ops.rope_cache(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length,
                                              16, 4))
    layer.keys.copy_(twin.keys)  # undo the warm-up and capture calls' writes
    layer.values.copy_(twin.values)
    layer.cumulative_length.copy_(twin.cumulative_length)
    for _ in range(3):
        qkv.normal_()
        graph.replay()
        torch.cuda.synchronize()
        q_want, _, _ = _transformers(qkv, cos, sin, twin, 16, 4)
        assert torch.equal(q.transpose(1, 2), q_want), f"seed {seed}"
    assert torch.equal(layer.keys, twin.keys) and layer.cumulative_length.item() == 8


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile(mode, seed, cuda):
    torch._dynamo.reset()
    qkv, cos, sin, layer = _step(2, 1, 16, 4, 128, 64, torch.bfloat16, cuda, start=3)
    torch._dynamo.mark_static_address(layer.keys)
    torch._dynamo.mark_static_address(layer.values)
    torch._dynamo.mark_static_address(layer.cumulative_length)
    twin = _copy(layer)

    def attention_step(qkv, cos, sin, layer):
        q = ops.rope_cache(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, 16, 4)
        return q.transpose(1, 2) * 2  # exact: the comparison below stays bit for bit

    f = torch.compile(attention_step, fullgraph=True, mode=mode)
    with torch.no_grad():
        for _ in range(4):  # reduce-overhead records on a later call
            qkv.normal_()
            got = f(qkv, cos, sin, layer).clone()
            q_want, _, _ = _transformers(qkv, cos, sin, twin, 16, 4)
            assert torch.equal(got, q_want * 2), f"seed {seed}"
    torch.cuda.synchronize()
    assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values), f"seed {seed}"
    assert layer.cumulative_length.item() == 7
    torch._dynamo.reset()
