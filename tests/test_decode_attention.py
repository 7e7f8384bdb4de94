"""tilefish.attention.decode_attention: one query token against a KV cache, grouped-query heads.

CPU: the op (the fp32 reference) against a float64 reference built from torch's SDPA with K/V repeated over the
groups, fp16 / bf16, head dims 64 / 128, groups 1 / 4 / 5 / 7 / 8, odd cache lengths, batch 1 and 3, masks
none / bool / bool broadcast over batch / additive (-inf, the dtype's min and finite biases), on the layouts
transformers passes (a transposed query view, a StaticCache's keys sliced to the positions); fully masked rows
give zeros; every validation error names its rule; which layouts the kernel reads in place; the cluster plan's
properties on described GPUs; the transformers routing predicate (on fake CUDA tensors); the grad route;
opcheck and fullgraph tracing of tilefish::decode_attention.

GPU (skipped without one): the kernel against the float64 reference for every cluster size (1 / 2 / 4 / 8 and
the plan's), the output allocator poisoned with NaN and the cache's unused tail NaN, bit-for-bit reruns (PDL on
and off); the SDPA fallback for a misaligned key; a CUDA graph replayed with new inputs; torch.compile
reduce-overhead; fully masked rows and single-position rows with clusters 1 and 8; transformers' forward routed.

Tolerance: the op computes in fp32 and rounds once to the output dtype. One rounding moves each element by at
most half an ulp, eps / 2 of it (norm-wise too, for any set of elements); the fp32 math adds about 1e-6. Every
(batch, head) row of the output must be within eps (twice the rounding) of the float64 result, relative.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tilefish
from conftest import capture, rel_err
from tilefish import attention
from tilefish.attention import decode_attention
from tilefish.ops import decode_attention as ops
from tilefish.ops import library
from tilefish.ops.decode_attention import (check_inputs, decode_attention_impl, decode_attention_reference,
                                           kernel_reads, plan_clusters)

DTYPES = (torch.float16, torch.bfloat16)
DTYPE_IDS = ("fp16", "bf16")
TOL = {dt: torch.finfo(dt).eps for dt in DTYPES}  # twice one rounding (the module docstring)
MASKS = ("none", "bool", "bool-broadcast", "additive")
SPARE = 5  # cache slots past the positions (NaN: never read) and mask entries past them


# ---- inputs and the float64 reference ------------------------------------------------------------------------------

def _mask(kind: str, b: int, s: int, dtype, device="cpu"):
    """[b or 1, 1, 1, s], the first s entries of a longer row (so its batch stride is not s), every row attending
    somewhere: bool with random holes, or additive in `dtype`: finite biases where kept, else -inf or the dtype's
    min (what transformers uses)."""
    if kind == "none":
        return None
    rows = 1 if kind == "bool-broadcast" else b
    keep = torch.rand(rows, 1, 1, s) > 0.3
    keep[torch.arange(rows), 0, 0, torch.randint(0, s, (rows,))] = True
    if kind == "additive":
        masked = torch.where(torch.rand(rows, 1, 1, s) < 0.5, float("-inf"), torch.finfo(dtype).min)
        values, out_dtype = torch.where(keep, 2 * torch.randn(rows, 1, 1, s), masked), dtype
    else:
        assert kind in ("bool", "bool-broadcast"), kind
        values, out_dtype = keep, torch.bool
    buf = torch.zeros(rows, 1, 1, s + SPARE, dtype=values.dtype)
    buf[..., :s] = values
    return buf.to(dtype=out_dtype, device=device)[..., :s]


def _inputs(b, heads, kv_heads, s, d, dtype, mask_kind="none", device="cpu"):
    """transformers' decode-step layouts with fresh random data (seeded by the test): the query a transposed view
    of [b, 1, heads, d]; key / value the first s positions of a StaticCache-like [b, kv_heads, s + SPARE, d]
    buffer whose unused tail is NaN (an op reading past s makes NaN); the mask from _mask."""
    q = torch.randn(b, 1, heads, d).to(dtype=dtype, device=device).transpose(1, 2)
    cache = torch.full((2, b, kv_heads, s + SPARE, d), float("nan"))
    cache[:, :, :, :s] = torch.randn(2, b, kv_heads, s, d)
    cache = cache.to(dtype=dtype, device=device)
    k, v = cache[0, :, :, :s], cache[1, :, :, :s]
    return q, k, v, _mask(mask_kind, b, s, dtype, device)


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _reference64(q, k, v, mask, scale=None):
    """torch's SDPA in float64 with K / V repeated over the groups and the mask broadcast: [b, 1, heads, d]."""
    groups = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    m = mask if mask is None or mask.dtype == torch.bool else mask.double()
    out = F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=m, scale=_scale(q, scale))
    return out.transpose(1, 2)


def _check(got, want, dtype, what: str, tol: float | None = None) -> None:
    """got against the float64 `want`: dtype, shape, contiguous, no NaN, and every (batch, head) row within tol
    (relative; a row whose reference is zero must be zero)."""
    tol = TOL[dtype] if tol is None else tol
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous(), \
        f"{what}: {got.dtype} {tuple(got.shape)} stride {got.stride()}"
    err = rel_err(got, want)                          # asserts no NaN too
    rows_got, rows_want = got.double().flatten(0, 2), want.flatten(0, 2)
    num, den = (rows_got - rows_want).norm(dim=-1), rows_want.norm(dim=-1)
    zero = den == 0
    assert torch.all(num[zero] == 0), f"{what}: rows whose reference is zero are not"
    worst = (num[~zero] / den[~zero]).max().item() if bool((~zero).any()) else 0.0
    assert worst <= tol, f"{what}: relative error {worst:.2e} in the worst (batch, head) row > {tol:.2e} " \
                         f"(all rows: {err:.2e})"


# ---- CPU: the reference path ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("groups", [1, 4, 5, 7, 8])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cpu_against_float64_sdpa(dtype, d, groups, mask_kind, seed):
    kv_heads = 2
    for b in (1, 3):
        for s in (1, 7, 100, 577):
            q, k, v, mask = _inputs(b, kv_heads * groups, kv_heads, s, d, dtype, mask_kind)
            scale = None if b == 1 else 0.7 / math.sqrt(d)
            what = f"b={b} S={s} scale={scale} (seed {seed})"
            got = decode_attention(q, k, v, mask, scale)
            _check(got, _reference64(q, k, v, mask, scale), dtype, what)
            assert torch.equal(got, decode_attention_reference(q, k, v, mask, _scale(q, scale))), what
            assert torch.equal(got, decode_attention_impl(q, k, v, mask, scale)), what


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cpu_fully_masked_row_gives_zeros(dtype, kind, seed):
    """Row 0 masks every position (zeros), row 1 keeps only the last one (weight 1: that V row exactly), row 2 is
    random; a broadcast mask that keeps nothing zeros everything."""
    b, kv_heads, groups, s, d = 3, 2, 4, 100, 64
    q, k, v, _ = _inputs(b, kv_heads * groups, kv_heads, s, d, dtype)
    keep = torch.rand(b, 1, 1, s) > 0.5
    keep[0] = False
    keep[1] = False
    keep[1, ..., -1] = True
    keep[2, ..., 3] = True
    mask = keep if kind == "bool" else torch.where(keep, torch.randn(b, 1, 1, s), float("-inf")).to(dtype)
    for fn in (decode_attention, decode_attention_impl):
        out = fn(q, k, v, mask)
        assert torch.equal(out[0], torch.zeros_like(out[0])), f"{fn.__name__} (seed {seed})"
        assert torch.equal(out[1, 0], v[1, :, -1].repeat_interleave(groups, 0)), f"{fn.__name__} (seed {seed})"
        _check(out[2:], _reference64(q[2:], k[2:], v[2:], mask[2:]), dtype, f"{fn.__name__} (seed {seed})")
    nothing = torch.zeros(1, 1, 1, s, dtype=torch.bool)
    assert torch.equal(decode_attention(q, k, v, nothing), torch.zeros(b, 1, kv_heads * groups, d, dtype=dtype))


def test_grad_route_is_the_differentiable_reference(seed):
    q, k, v, mask = _inputs(2, 8, 2, 33, 64, torch.bfloat16, "additive")
    q = q.detach().requires_grad_()
    out = decode_attention(q, k, v, mask)
    assert out.requires_grad
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all(), f"seed {seed}"
    with torch.no_grad():
        assert torch.equal(out.detach(), decode_attention(q, k, v, mask)), f"seed {seed}"
    with pytest.raises(ValueError, match="head dim"):  # the route checks its inputs too
        bad = torch.randn(2, 8, 1, 96, dtype=torch.bfloat16, requires_grad=True)
        decode_attention(bad, torch.randn(2, 2, 5, 96).bfloat16(), torch.randn(2, 2, 5, 96).bfloat16())


_Q, _K = torch.ones(2, 8, 1, 64, dtype=torch.float16), torch.ones(2, 2, 9, 64, dtype=torch.float16)
_M = torch.ones(2, 1, 1, 9, dtype=torch.bool)
BAD = {  # name -> (exception, a distinctive part of the message, (query, key, value, mask, scale))
    "query not a tensor": (TypeError, "query must be a torch.Tensor", lambda: ([[1.0]], _K, _K, None, 0.1)),
    "query fp32": (TypeError, "float16 or bfloat16", lambda: (_Q.float(), _K.float(), _K.float(), None, None)),
    "key dtype": (TypeError, "key must have query's dtype", lambda: (_Q, _K.bfloat16(), _K, None, None)),
    "value dtype": (TypeError, "value must have query's dtype", lambda: (_Q, _K, _K.bfloat16(), None, None)),
    "query 3-D": (ValueError, "query must have 4 dimensions", lambda: (_Q[0], _K, _K, None, 0.1)),
    "key 3-D": (ValueError, "key must have 4 dimensions", lambda: (_Q, _K[0], _K[0], None, None)),
    "two query tokens": (ValueError, "one query token", lambda: (_Q.expand(2, 8, 2, 64), _K, _K, None, None)),
    "head dim 96": (ValueError, "head dim", lambda: (_Q.new_ones(2, 8, 1, 96), _K.new_ones(2, 2, 9, 96),
                                                     _K.new_ones(2, 2, 9, 96), None, None)),
    "key / value shapes": (ValueError, "key and value must be", lambda: (_Q, _K, _K[:, :, :5], None, None)),
    "key batch": (ValueError, "key and value must be", lambda: (_Q, _K[:1], _K[:1], None, None)),
    "key head dim": (ValueError, "key and value must be", lambda: (_Q, _K.new_ones(2, 2, 9, 128),
                                                                   _K.new_ones(2, 2, 9, 128), None, None)),
    "heads % kv heads": (ValueError, "multiple of kv heads", lambda: (_Q, _K.new_ones(2, 3, 9, 64),
                                                                      _K.new_ones(2, 3, 9, 64), None, None)),
    "9 groups": (ValueError, "at most 8 query heads", lambda: (_Q.new_ones(2, 9, 1, 64), _K[:, :1], _K[:, :1],
                                                               None, None)),
    "S = 0": (ValueError, "cache position", lambda: (_Q, _K[:, :, :0], _K[:, :, :0], None, None)),
    "mask 3-D": (ValueError, "mask must have 4 dimensions", lambda: (_Q, _K, _K, _M[0], None)),
    "mask positions": (ValueError, r"mask must be \[b or 1, 1, 1, S=9\]", lambda: (_Q, _K, _K, _M[..., :8], None)),
    "mask per head": (ValueError, r"mask must be \[b or 1", lambda: (_Q, _K, _K, _M.expand(2, 8, 1, 9), None)),
    "mask rows": (ValueError, r"mask must be \[b or 1", lambda: (_Q, _K, _K, _M.expand(2, 1, 2, 9), None)),
    "mask batch": (ValueError, r"mask must be \[b or 1", lambda: (_Q, _K, _K, _M[:1].expand(3, 1, 1, 9), None)),
    "mask fp32 for an fp16 query": (TypeError, "mask must be bool or query's dtype",
                                    lambda: (_Q, _K, _K, _M.float(), None)),
    "mask bf16 for an fp16 query": (TypeError, "mask must be bool or query's dtype",
                                    lambda: (_Q, _K, _K, _M.bfloat16(), None)),
    "mask int64": (TypeError, "mask must be bool or query's dtype", lambda: (_Q, _K, _K, _M.long(), None)),
    "mask not a tensor": (TypeError, "mask must be a torch.Tensor", lambda: (_Q, _K, _K, [[True] * 9], None)),
    "scale nan": (TypeError, "finite float", lambda: (_Q, _K, _K, None, float("nan"))),
    "scale inf": (TypeError, "finite float", lambda: (_Q, _K, _K, None, float("inf"))),
    "scale a tensor": (TypeError, "finite float", lambda: (_Q, _K, _K, None, torch.tensor(0.1))),
    "scale a bool": (TypeError, "finite float", lambda: (_Q, _K, _K, None, True)),
    "key device": (ValueError, "key is on meta", lambda: (_Q, _K.to("meta"), _K, None, None)),
    "mask device": (ValueError, "mask is on meta", lambda: (_Q, _K, _K, _M.to("meta"), None)),
    "query device": (ValueError, "CUDA or CPU", lambda: (_Q.to("meta"), _K.to("meta"), _K.to("meta"), None, None)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_naming_the_rule(case):
    exc, message, args = BAD[case]
    q, k, v, mask, scale = args()
    with pytest.raises(exc, match=message):
        decode_attention_impl(q, k, v, mask, scale)
    with pytest.raises(exc, match=message):
        check_inputs(q, k, v, mask, _scale(q, scale) if isinstance(q, torch.Tensor) else scale)
    if isinstance(q, torch.Tensor):  # the public function computes scale None from query.shape first
        with pytest.raises(exc, match=message):
            decode_attention(q, k, v, mask, scale)


def test_check_inputs_accepts_the_decode_layouts():
    q, k, v, mask = _inputs(3, 20, 4, 7, 128, torch.bfloat16, "additive")
    assert check_inputs(q, k, v, mask, 0.1) == (3, 20, 4, 7, 128)
    assert check_inputs(q, k, v, _mask("bool-broadcast", 3, 7, torch.bfloat16), 1) == (3, 20, 4, 7, 128)


def test_kernel_reads_layouts():
    """In place: transformers' layouts (a transposed query view, a StaticCache's sliced keys, a mask sliced from
    a longer row). Not: a last dimension that is not contiguous, row strides off 8 elements, a strided mask. (A
    misaligned start is checked on CUDA only: tests GPU.)"""
    q, k, v, mask = _inputs(2, 8, 2, 33, 64, torch.float16, "bool")
    assert kernel_reads(q, k, v, mask) and kernel_reads(q, k, v, None)
    assert kernel_reads(q, k, v, _mask("bool-broadcast", 2, 33, torch.float16))
    wide = torch.randn(2, 2, 33, 128, dtype=torch.float16)
    assert not kernel_reads(q, wide[..., ::2], v, mask)                           # d strided
    assert not kernel_reads(q, k, torch.randn(2, 2, 33, 68).half()[..., :64], mask)  # rows 68 elements apart
    assert not kernel_reads(torch.randn(2, 8, 1, 68).half()[..., :64], k, v, mask)  # heads 68 elements apart
    assert not kernel_reads(q, k, v, torch.ones(2, 1, 1, 66, dtype=torch.bool)[..., ::2])


def test_dispatch_specs_and_shared_memory():
    specs = ops.dispatch_specs()
    assert len(specs) == len(set(specs)) == len(ops.DTYPES) * len(ops.HEAD_DIMS) * len(ops.GROUP_BOUNDS)
    assert ops.dispatch_specs("sm_80") == ops.dispatch_specs("sm_90") == specs
    assert all(s.hot and not s.arch_specific for s in specs)
    assert [ops.group_bound(g) for g in range(1, 9)] == [4, 4, 4, 4, 8, 8, 8, 8]
    # where it launches: sm_90 (the plan) and sm_80 (clusters=1 given); sm_86 / sm_89 GPUs run torch's SDPA
    smallest = min(tilefish.GpuSpec("NVIDIA H100 80GB HBM3", 132, 90).smem_per_block,
                   tilefish.GpuSpec("NVIDIA A100-SXM4-80GB", 108, 80).smem_per_block)
    assert all(ops.smem_bytes(d, g) <= smallest for d in ops.HEAD_DIMS for g in ops.GROUP_BOUNDS)


# ---- CPU: the cluster plan on described GPUs -----------------------------------------------------------------------

def _gpus():
    return {
        "H100": tilefish.GpuSpec("NVIDIA H100 80GB HBM3", 132, 90),
        "H200": tilefish.GpuSpec("NVIDIA H200", 132, 90),
        "RTX 4090": tilefish.GpuSpec("NVIDIA GeForce RTX 4090", 128, 89),
        "A100": tilefish.GpuSpec("NVIDIA A100-SXM4-80GB", 108, 80),
    }


BATCHES, KV_HEADS = (1, 2, 3, 4, 8, 16, 33, 64, 256), (1, 2, 4, 8, 32)
POSITIONS = (1, 31, 32, 63, 64, 65, 127, 128, 255, 256, 257, 577, 2049, 131072)


@pytest.mark.parametrize("name", ["H100", "H200", "RTX 4090", "A100"])
def test_plan_clusters_properties(name):
    gpu = _gpus()[name]
    half_tile = ops.TILE // 2
    for b in BATCHES:
        for kv in KV_HEADS:
            for s in POSITIONS:
                c = plan_clusters(b, kv, s, gpu)
                what = f"{name}: b={b} kv={kv} S={s} -> {c}"
                if gpu.cc != 90:
                    assert c == 0, what                   # not this kernel: torch's SDPA
                    continue
                assert c in (1, 2, 4, 8), what
                if c > 1:
                    assert b * kv * c <= 2 * gpu.sm_count, what   # at most two CTAs an SM
                    chunk = -(-s // c)                            # the kernel's split of the positions
                    shares = [min(s, (r + 1) * chunk) - min(s, r * chunk) for r in range(c)]
                    assert chunk >= half_tile and sum(shares) == s, what
                    assert min(shares) >= half_tile - (c - 1) > 0, what  # the last CTA may get a few fewer
                # the largest such C: every larger one breaks a rule
                for bigger in (2, 4, 8):
                    if bigger > c:
                        assert b * kv * bigger > 2 * gpu.sm_count or s < bigger * half_tile, what
                # fewer CTAs for a bigger batch, no fewer for a longer cache
                if b > 1:
                    assert plan_clusters(b - 1, kv, s, gpu) >= c, what
                assert plan_clusters(b, kv, s + 1, gpu) >= c, what


def test_plan_clusters_examples():
    gpus = _gpus()
    h100, h200 = gpus["H100"], gpus["H200"]
    assert plan_clusters(1, 8, 576, h100) > 1            # a small grid: split the positions
    assert plan_clusters(64, 8, 576, h100) == 1          # 512 CTAs already >= 2 x 132 SMs
    assert plan_clusters(1, 8, 1, h100) == 1             # nothing to split
    assert plan_clusters(1, 8, 2 * ops.TILE - 1, h100) < 4
    assert all(plan_clusters(b, kv, s, h100) == plan_clusters(b, kv, s, h200)
               for b in BATCHES for kv in KV_HEADS for s in POSITIONS)
    assert all(plan_clusters(1, 8, 576, gpus[n]) == 0 for n in ("RTX 4090", "A100"))


# ---- CPU: routing, custom op, tracing ------------------------------------------------------------------------------

def test_decodes_routing_predicate(monkeypatch):
    """attention._decodes on shapes / dtypes only: a decode step on (fake) CUDA tensors is taken; each rule
    broken, and CPU tensors, are not."""
    pytest.importorskip("transformers")
    from torch._subclasses.fake_tensor import FakeTensorMode

    def call(q, k, v, mask, dropout=0.0, is_causal=None, **kwargs):
        return attention._decodes(None, q, k, v, mask, dropout, is_causal, kwargs)

    b, heads, kv, s, d = 3, 32, 8, 11, 128
    q, k, v, mask = _inputs(b, heads, kv, s, d, torch.float16, "bool")
    assert not call(q, k, v, mask)                        # CPU tensors: the CUDA kernel's predicate says no
    assert not call(q, k, v, None)

    with FakeTensorMode():
        def t(*shape, dtype=torch.float16):
            return torch.empty(*shape, dtype=dtype, device="cuda")

        q, k, v = t(b, heads, 1, d), t(b, kv, s, d), t(b, kv, s, d)
        bool_mask, add_mask = t(b, 1, 1, s, dtype=torch.bool), t(b, 1, 1, s)
        assert q.is_cuda
        # taken
        assert call(q, k, v, bool_mask)
        assert call(q, k, v, add_mask)
        assert call(q, k, v, None)
        assert call(q, k, v, t(1, 1, 1, s, dtype=torch.bool))                     # broadcast over batch
        assert call(q, k, v, bool_mask, position_ids=t(1, 1), cache_position=t(1), use_cache=True)
        assert call(q, k, v, bool_mask, output_attentions=False, s_aux=None)
        assert call(t(b, heads, 1, d, dtype=torch.bfloat16), t(b, kv, s, d, dtype=torch.bfloat16),
                    t(b, kv, s, d, dtype=torch.bfloat16), t(b, 1, 1, s, dtype=torch.bfloat16))
        assert call(t(b, 64, 1, 64), t(b, 8, s, 64), t(b, 8, s, 64), bool_mask)   # 8 groups, d 64
        # not taken
        assert not call(t(b, heads, 2, d), k, v, bool_mask)                       # t > 1
        assert not call(t(b, heads, 2, d), k, v, t(b, 1, 2, s, dtype=torch.bool))
        assert not call(q, k, v, t(b, heads, 1, s, dtype=torch.bool))             # a per-head mask
        assert not call(q, k, v, t(b, 1, 2, s, dtype=torch.bool))                 # mask rows
        assert not call(q, k, v, t(b, 1, 1, s + 1, dtype=torch.bool))             # mask length
        assert not call(q, k, v, bool_mask, dropout=0.1)
        assert not call(q, k, v, None, is_causal=True)
        assert not call(t(b, heads, 1, 96), t(b, kv, s, 96), t(b, kv, s, 96), bool_mask)  # head dim 96
        f32 = dict(dtype=torch.float32)
        assert not call(t(b, heads, 1, d, **f32), t(b, kv, s, d, **f32), t(b, kv, s, d, **f32), bool_mask)
        assert not call(q, k.float(), v, bool_mask)                               # mixed dtypes
        assert not call(q, k, v, t(b, 1, 1, s, dtype=torch.float32))              # fp32 mask, fp16 query
        assert not call(t(b, 9 * kv, 1, d), k, v, bool_mask)                      # 9 groups
        assert not call(t(b, 30, 1, d), k, v, bool_mask)                          # heads % kv heads
        assert not call(q, k, v, bool_mask, output_attentions=True)
        assert not call(q, k, v, bool_mask, s_aux=t(heads))
        with torch.enable_grad():
            assert not call(q.requires_grad_(), k, v, bool_mask)
        q = q.detach()
        monkeypatch.setattr(attention, "DECODE_KERNEL", False)
        assert not call(q, k, v, bool_mask)


@pytest.mark.parametrize("mask_kind", MASKS)
def test_custom_op_opcheck_on_cpu(mask_kind):
    q, k, v, mask = _inputs(3, 20, 4, 37, 64, torch.bfloat16, mask_kind)
    torch.library.opcheck(library.decode_attention_op, (q, k, v, mask, 0.125))


def test_fullgraph_trace_on_cpu(seed):
    """torch.compile(fullgraph=True) of a function calling decode_attention: its graph holds
    tilefish::decode_attention (no break), and aot_eager (no C++ compiler needed) gives the eager bits."""
    def step(q, k, v, mask):
        out = decode_attention(q, k, v, mask)
        return out.reshape(out.shape[0], 1, -1) * 2

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            for mask_kind in ("bool", "additive", "none"):
                q, k, v, mask = _inputs(2, 16, 4, 19, 64, torch.float16, mask_kind)
                want = step(q, k, v, mask)
                got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, mask)
                assert torch.equal(got, want), f"{mask_kind} (seed {seed})"
                torch._dynamo.reset()
                assert torch.equal(torch.compile(step, fullgraph=True, backend=recording)(q, k, v, mask), want)
                targets = [str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"]
                assert any("tilefish.decode_attention" in t for t in targets), targets
                torch._dynamo.reset()
    finally:
        torch._dynamo.reset()


# ---- GPU: the kernel -----------------------------------------------------------------------------------------------

def _hopper() -> bool:
    return tilefish.GpuSpec.current().cc == 90


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """While the test runs, torch.empty's floating-point CUDA tensors start as NaN: the op's output, allocated
    fresh by each call, cannot pass with elements the kernel left unwritten (stale memory from an earlier,
    correct call). Returns the count of such allocations, so a test can see its output was one of them."""
    real = torch.empty
    made = [0]

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        if t.is_cuda and t.is_floating_point():
            t.fill_(float("nan"))
            made[0] += 1
        return t

    monkeypatch.setattr(torch, "empty", empty)
    return made


GPU_CASES = [  # dtype, head dim, groups, kv heads, positions, batch, mask: each value of each, a few crossed
    (torch.float16, 128, 4, 8, 577, 1, "bool"),          # Llama-3-8B's decode step
    (torch.bfloat16, 128, 4, 4, 2049, 16, "additive"),
    (torch.float16, 64, 1, 4, 1, 3, "none"),
    (torch.bfloat16, 64, 5, 2, 31, 1, "bool-broadcast"),
    (torch.float16, 128, 7, 1, 64, 3, "additive"),
    (torch.bfloat16, 128, 8, 2, 65, 16, "bool"),
    (torch.float16, 64, 8, 4, 2049, 1, "none"),
    (torch.bfloat16, 64, 7, 3, 577, 3, "bool"),
    (torch.float16, 128, 5, 2, 31, 16, "bool-broadcast"),
    (torch.bfloat16, 128, 1, 8, 1, 1, "additive"),
    (torch.float16, 64, 4, 2, 65, 3, "additive"),
    (torch.bfloat16, 64, 1, 1, 64, 16, "none"),
    (torch.float16, 128, 8, 1, 2049, 3, "bool-broadcast"),
    (torch.bfloat16, 128, 5, 4, 577, 1, "none"),
]


def _case_id(case):
    dtype, d, groups, kv, s, b, mask = case
    return f"{DTYPE_IDS[DTYPES.index(dtype)]}-d{d}-g{groups}-kv{kv}-S{s}-b{b}-{mask}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[_case_id(c) for c in GPU_CASES])
def test_kernel_against_float64(case, seed, cuda, poisoned_outputs):
    """Every cluster size given explicitly and the plan's: within the rounding bound, bit for bit on a rerun and
    with PDL off; the plan's call is the explicit call with its C, and the public function is that call."""
    dtype, d, groups, kv, s, b, mask_kind = case
    q, k, v, mask = _inputs(b, kv * groups, kv, s, d, dtype, mask_kind, cuda)
    scale = None if b != 3 else 0.05
    want = _reference64(q, k, v, mask, scale)
    hopper = _hopper()
    plan = plan_clusters(b, kv, s, tilefish.GpuSpec.current())
    assert kernel_reads(q, k, v, mask)
    results = {}
    for clusters in (1, 2, 4, 8, None):
        what = f"clusters={clusters} (plan {plan}; seed {seed})"
        if clusters is not None and clusters > 1 and not hopper:
            with pytest.raises(ValueError, match="sm_90"):
                decode_attention_impl(q, k, v, mask, scale, clusters=clusters)
            continue
        before = poisoned_outputs[0]
        got = decode_attention_impl(q, k, v, mask, scale, clusters=clusters, pdl=True)
        if clusters is not None or plan > 0:            # the kernel's path (else torch's SDPA)
            assert poisoned_outputs[0] > before, "the output was not allocated by torch.empty: poisoning missed it"
        _check(got, want, dtype, what)
        again = decode_attention_impl(q, k, v, mask, scale, clusters=clusters, pdl=True)
        no_pdl = decode_attention_impl(q, k, v, mask, scale, clusters=clusters, pdl=False)
        assert got.data_ptr() != again.data_ptr()       # a fresh output each call
        assert torch.equal(got, again) and torch.equal(got, no_pdl), f"{what}: not deterministic"
        results[clusters] = got
    if plan > 0:
        assert torch.equal(results[None], results[plan]), f"the plan's call differs from clusters={plan}"
    assert torch.equal(decode_attention(q, k, v, mask, scale), results[None]), f"seed {seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_misaligned_key_falls_back_to_sdpa(dtype, seed, cuda):
    """A key starting 2 bytes past a 16-byte boundary (d contiguous) and a strided mask: decode_attention serves
    them through torch's SDPA (twice the bound: SDPA's own math); explicit clusters refuse them."""
    b, kv, groups, s, d = 3, 4, 4, 577, 128
    q, k, v, mask = _inputs(b, kv * groups, kv, s, d, dtype, "bool", cuda)
    flat = torch.empty(k.numel() + 1, dtype=dtype, device=cuda)
    k_off = flat[1:].view(k.shape)
    k_off.copy_(k)
    assert k_off.data_ptr() % 16 and k_off.stride(-1) == 1 and not kernel_reads(q, k_off, v, mask)
    want = _reference64(q, k, v, mask)
    _check(decode_attention(q, k_off, v, mask), want, dtype, f"misaligned key (seed {seed})", 2 * TOL[dtype])
    for clusters in (1, 2):
        with pytest.raises(ValueError, match="kernel_reads"):
            decode_attention_impl(q, k_off, v, mask, clusters=clusters)
    wide = torch.zeros(b, 1, 1, 2 * s, dtype=torch.bool, device=cuda)
    wide[..., ::2] = mask
    strided = wide[..., ::2]
    assert torch.equal(strided, mask) and not kernel_reads(q, k, v, strided)
    _check(decode_attention(q, k, v, strided), want, dtype, f"strided mask (seed {seed})", 2 * TOL[dtype])
    with pytest.raises(ValueError, match="kernel_reads"):
        decode_attention_impl(q, k, v, strided, clusters=1)


@pytest.mark.gpu
@pytest.mark.parametrize("b, kv, s", [(1, 8, 577), (16, 8, 2049)])
def test_cuda_graph_replayed_with_new_inputs(b, kv, s, seed, cuda):
    """Captured once, replayed after the query, the cache and the mask change in place: the new inputs' result
    (bit for bit the eager call's, and within the bound of the float64 reference)."""
    dtype, groups, d = torch.bfloat16, 4, 128
    q, k, v, mask = _inputs(b, kv * groups, kv, s, d, dtype, "additive", cuda)
    graph, got = capture(lambda: decode_attention(q, k, v, mask))
    for _ in range(2):
        nq, nk, nv, nmask = _inputs(b, kv * groups, kv, s, d, dtype, "additive", cuda)
        for old, new in ((q, nq), (k, nk), (v, nv), (mask, nmask)):
            old.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, decode_attention_impl(nq, nk, nv, nmask)), f"seed {seed}"
        _check(got, _reference64(nq, nk, nv, nmask), dtype, f"replay (seed {seed})")


@pytest.mark.gpu
def test_torch_compile_reduce_overhead(seed, cuda):
    """torch.compile(fullgraph=True, mode="reduce-overhead") of a decode step: the custom op runs the eager call's
    kernel and plan, so the bits are the eager ones; three calls with new inputs (CUDA graph trees record late)."""
    torch._dynamo.reset()
    b, kv, groups, s, d, dtype = 4, 8, 4, 577, 128, torch.float16

    def step(q, k, v, mask):
        out = decode_attention(q, k, v, mask)
        return out.reshape(out.shape[0], 1, -1) * 2

    f = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    try:
        with torch.no_grad():
            for _ in range(3):
                q, k, v, mask = _inputs(b, kv * groups, kv, s, d, dtype, "bool", cuda)
                got = f(q, k, v, mask).clone()
                want = step(q, k, v, mask)
                assert torch.equal(got, want), f"relative error {rel_err(got, want):.2e} (seed {seed})"
                _check(got.view(b, 1, kv * groups, d) / 2, _reference64(q, k, v, mask), dtype, f"seed {seed}")
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("clusters", [1, 8])
@pytest.mark.parametrize("s", [1, 33, 577])
def test_fully_masked_and_single_position_rows(s, clusters, seed, cuda, poisoned_outputs):
    """Row 0 masks everything (zeros), row 1 keeps only the last position and row 2 only the first (weight 1: that
    V row exactly), row 3 is random. With 8 CTAs some see only masked positions and, at S 1 and 33, some none."""
    if clusters > 1 and not _hopper():
        pytest.skip("clusters > 1 need sm_90")
    b, kv, groups, d, dtype = 4, 2, 4, 64, torch.float16
    for kind in ("bool", "additive"):
        q, k, v, _ = _inputs(b, kv * groups, kv, s, d, dtype, "none", cuda)
        keep = torch.rand(b, 1, 1, s) > 0.5
        keep[:3] = False
        keep[1, ..., -1] = True
        keep[2, ..., 0] = True
        keep[3, ..., int(torch.randint(0, s, ()))] = True
        mask = keep if kind == "bool" else torch.where(keep, torch.randn(b, 1, 1, s), float("-inf")).to(dtype)
        mask = mask.to(cuda)
        out = decode_attention_impl(q, k, v, mask, clusters=clusters)
        what = f"{kind} (seed {seed})"
        assert torch.equal(out[0], torch.zeros_like(out[0])), what
        assert torch.equal(out[1, 0], v[1, :, -1].repeat_interleave(groups, 0)), what
        assert torch.equal(out[2, 0], v[2, :, 0].repeat_interleave(groups, 0)), what
        _check(out[3:], _reference64(q[3:], k[3:], v[3:], mask[3:]), dtype, what)


@pytest.mark.gpu
def test_transformers_forward_routes_decode_steps(seed, cuda, monkeypatch):
    """gqa_sdpa_attention_forward sends a CUDA decode step to decode_attention (the same bits); with
    DECODE_KERNEL off, the folded SDPA path gives the same result within the bound."""
    pytest.importorskip("transformers")
    b, kv, groups, s, d, dtype = 3, 8, 4, 577, 128, torch.bfloat16
    q, k, v, mask = _inputs(b, kv * groups, kv, s, d, dtype, "bool", cuda)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    extra = dict(position_ids=torch.tensor([[s - 1]], device=cuda), use_cache=True)
    assert attention._decodes(module, q, k, v, mask, 0.0, None, extra)
    kw = dict(scaling=d ** -0.5, **extra)
    got, weights = attention.gqa_sdpa_attention_forward(module, q, k, v, mask, **kw)
    assert weights is None and torch.equal(got, decode_attention(q, k, v, mask, d ** -0.5)), f"seed {seed}"
    monkeypatch.setattr(attention, "DECODE_KERNEL", False)
    folded, _ = attention.gqa_sdpa_attention_forward(module, q, k, v, mask, **kw)
    _check(folded, _reference64(q, k, v, mask), dtype, f"folded (seed {seed})", 2 * TOL[dtype])
