"""tilefish.ops.rope_attention: a decode step's rotary embedding, StaticCache write and attention in one op.

CPU: the op (its reference) writes the cache and the length as rope_cache does (bit for bit) and its output is
transformers' eager attention (SDPA over the whole cache with the mask) of the rotated query, in fp32; every
validation error names its rule and leaves the cache and length as they were; the plan's chunks are whole
tiles that keep the grid near two CTAs an SM; the custom op passes opcheck and traces with fullgraph.
GPU (skipped without one): the kernel against the float64 attention of the rotated query over the cache written
by transformers' eager steps (keys, values and length bit for bit), output poisoned, fp16 / bf16, head dims 64 /
128, 1-16 query heads a kv head, batch 1-33, caches of 64-2048 slots, bool / additive / no mask with padded and
fully masked rows, the new position at the first and last slot and past the cache, chunks from one tile (many
CTAs combining) to the whole cache, the cluster combine (sm_90+) against the combine through L2 bit for bit, the
early K/V copies on and off, many steps in a row leaving the counters at zero, a manual CUDA graph replayed,
torch.compile (default, reduce-overhead). With Qwen3's per-head q / k norms: on the CPU Qwen3Attention's eager
steps then the attention; on the GPU the cache rope_cache's kernel writes, bit for bit, and the float64 attention
of its q.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import capture, poison
from test_rope_cache import _copy, _head_norms, _norm_args, _step, _transformers
from tilefish import GpuSpec
from tilefish.reference import rope_cache as rope_cache_reference
from tilefish.ops import library
from tilefish.ops import rope_attention as ops
from tilefish.ops.w4a16 import LaunchPolicy, launch_policy, layer_counters, make_layer_counters

DTYPES = (torch.float16, torch.bfloat16)
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}  # P rounded to the dtype before P V, out rounded once


def _mask(kind, b, slots, length, dtype, device, generator):
    """None, or a [b, 1, 1, S] mask attending positions <= length with ~20% of them masked (a padded prompt),
    bool or additive (0 / -inf, and small finite biases)."""
    if kind == "none":
        return None
    keep = torch.arange(slots)[None, :] <= length
    keep = keep & (torch.rand(b, slots, generator=generator) > 0.2)
    keep[:, min(length, slots - 1)] = True
    if kind == "bool":
        return keep[:, None, None, :].to(device)
    bias = torch.randn(b, slots, generator=generator) * 0.5
    add = torch.where(keep, bias, torch.tensor(float("-inf")))
    return add[:, None, None, :].to(dtype).to(device)


def _attention64(q, keys, values, mask, scale, kv_heads):
    """The attention of q [b, 1, heads, d] over the cache with the mask, in float64: [b, 1, heads, d]."""
    b, _, heads, d = q.shape
    groups = heads // kv_heads
    qd = q.double().reshape(b, kv_heads, groups, d)
    scores = torch.einsum("bkgd,bksd->bkgs", qd, keys.double()) * scale
    if mask is not None:
        m = mask.reshape(mask.shape[0], 1, 1, -1)
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.double()
    empty = torch.isneginf(scores).all(-1, keepdim=True)
    w = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return torch.einsum("bkgs,bksd->bkgd", w, values.double()).reshape(b, 1, heads, d)


def _want(qkv, cos, sin, layer, heads, kv_heads, mask, scale, rope=None):
    """The reference rotary and cache write (transformers' eager ops, positions past the cache not written; or
    `rope`, a function of (qkv, cos, sin, keys, values, length) returning q) on a copy, then the attention in
    float64: (out [b, 1, heads, d] float64, the copy)."""
    twin = _copy(layer)
    rope = rope or (lambda *a: rope_cache_reference(*a, heads, kv_heads))
    q = rope(qkv, cos, sin, twin.keys, twin.values, twin.cumulative_length)
    return _attention64(q, twin.keys, twin.values, mask, scale, kv_heads), twin


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# -------------------------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_cpu_reference_is_rope_cache_then_sdpa(dtype, mask_kind):
    seed = 3
    torch.manual_seed(seed)
    b, heads, kv_heads, d, slots = 2, 8, 2, 64, 40
    qkv, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, dtype)
    length = int(layer.cumulative_length)
    mask = _mask(mask_kind, b, slots, length, dtype, "cpu", torch.Generator().manual_seed(seed))
    scale = 1 / math.sqrt(d)
    want, _ = _want(qkv, cos, sin, layer, heads, kv_heads, mask, scale)
    twin = _copy(layer)
    _transformers(qkv, cos, sin, twin, heads, kv_heads)
    got = ops.rope_attention(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, mask, scale,
                             heads, kv_heads)
    assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values), f"seed {seed}"
    assert torch.equal(layer.cumulative_length, twin.cumulative_length)
    assert _rel(got, want) < TOL[dtype] / 4, f"seed {seed}"  # rounded once from fp32


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_reference_with_head_norms_is_qwen3s_steps_then_sdpa(dtype):
    seed = 4
    torch.manual_seed(seed)
    b, heads, kv_heads, d, slots = 2, 8, 2, 64, 40
    norms = _head_norms(d, dtype, seed=seed)
    qkv, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, dtype)
    mask = _mask("bool", b, slots, int(layer.cumulative_length), dtype, "cpu", torch.Generator().manual_seed(seed))
    twin = _copy(layer)
    with torch.no_grad():  # Qwen3Attention's eager steps, then the float64 attention
        q, _, _ = _transformers(qkv, cos, sin, twin, heads, kv_heads, norms)
    want = _attention64(q.transpose(1, 2), twin.keys, twin.values, mask, 0.125, kv_heads)
    got = ops.rope_attention(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, mask, 0.125, heads,
                             kv_heads, **_norm_args(norms))
    assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values), f"seed {seed}"
    assert torch.equal(layer.cumulative_length, twin.cumulative_length)
    assert _rel(got, want) < TOL[dtype] / 4, f"seed {seed}"  # rounded once from fp32


def test_validation_names_the_rule_and_writes_nothing():
    torch.manual_seed(0)
    qkv, cos, sin, layer = _step(2, 1, 8, 2, 64, 32, torch.float16)
    mask = torch.ones(2, 1, 1, 32, dtype=torch.bool)
    cases = [
        (dict(qkv=torch.cat([qkv, qkv], 1)), ValueError, "one new token"),
        (dict(mask=torch.ones(2, 1, 2, 32, dtype=torch.bool)), ValueError, "mask must be"),
        (dict(mask=torch.ones(2, 1, 1, 32, dtype=torch.float32)), TypeError, "mask must be bool"),
        (dict(mask=[1, 2]), TypeError, "mask must be a torch.Tensor"),
        (dict(scale=float("inf")), TypeError, "scale must be a finite float"),
        (dict(heads=8, kv_heads=3), ValueError, "kv_heads"),
        (dict(cos=cos.float()), TypeError, "cos must have qkv's dtype"),
        (dict(q_norm=torch.ones(64, dtype=torch.bfloat16)), TypeError, "q_norm must have qkv's dtype"),
        (dict(k_norm=torch.ones(1, 64, dtype=torch.float16)), ValueError, "k_norm must be one weight a head dim"),
        (dict(norm_eps=float("inf")), ValueError, "norm_eps"),
    ]
    for change, error, words in cases:
        args = dict(qkv=qkv, cos=cos, sin=sin, keys=layer.keys, values=layer.values, length=layer.cumulative_length,
                    mask=mask, scale=0.125, heads=8, kv_heads=2)
        args.update(change)
        keys, values, length = layer.keys.clone(), layer.values.clone(), layer.cumulative_length.clone()
        with pytest.raises(error, match=words):
            ops.rope_attention(**args)
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert torch.equal(layer.cumulative_length, length)
    odd = _step(1, 1, 4, 2, 80, 16, torch.float16)
    with pytest.raises(ValueError, match="head dim must be one of"):
        ops.rope_attention(*odd[:3], odd[3].keys, odd[3].values, odd[3].cumulative_length, None, 0.1, 4, 2)
    many = _step(1, 1, 34, 2, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="query heads a kv head"):
        ops.rope_attention(*many[:3], many[3].keys, many[3].values, many[3].cumulative_length, None, 0.1, 34, 2)


@pytest.mark.parametrize("max_splits", [None, ops.MAX_CLUSTER_SPLITS, ops.HOPPER_CLUSTER_SPLITS, 3])
@pytest.mark.parametrize("batch,kv_heads,slots,sms", [(1, 8, 576, 132), (1, 8, 2048, 132), (16, 8, 576, 132),
                                                      (64, 8, 2048, 132), (1, 1, 64, 82), (3, 4, 100, 28)])
def test_plan_takes_whole_tiles_near_two_ctas_an_sm(batch, kv_heads, slots, sms, max_splits):
    chunk = ops.plan_chunk(batch, kv_heads, slots, sms, max_splits)
    tiles = -(-slots // ops.TILE)
    assert chunk % ops.TILE == 0 and ops.TILE <= chunk <= tiles * ops.TILE
    splits = -(-slots // chunk)
    ctas = batch * kv_heads * splits
    # at most about two CTAs an SM, unless every (sequence, kv head) already has a single chunk
    assert ctas <= 2 * sms + batch * kv_heads or chunk == tiles * ops.TILE
    assert max_splits is None or splits <= max_splits
    # one tile fewer a chunk would pass two CTAs an SM or the split limit (the chunk is the smallest that fits)
    if chunk > ops.TILE:
        finer = -(-slots // (chunk - ops.TILE))
        assert batch * kv_heads * finer > 2 * sms or (max_splits is not None and finer > max_splits)


@pytest.mark.parametrize("gpu", [GpuSpec("NVIDIA H200", 132, 90), GpuSpec("NVIDIA B200", 148, 100),
                                 GpuSpec("NVIDIA GeForce RTX 5090", 170, 120),
                                 GpuSpec("NVIDIA A100-SXM4-80GB", 108, 80),
                                 GpuSpec("NVIDIA GeForce RTX 4090", 128, 89)],
                         ids=lambda g: g.name)
def test_the_split_combines_in_a_cluster_only_where_every_cluster_fits(gpu):
    """On sm_90 and newer a split of 2 to max_cluster_splits chunks (16 on sm_90, whose clusters may exceed the
    portable 8; 8 elsewhere) combines in a cluster when the grid stays within the plan's two CTAs an SM; one chunk
    needs no combine, and a larger split, a fuller grid or an older GPU combine through L2. The plans of the decode
    steps routed to the kernel (Llama-3-8B's 8 kv heads, caches up to the routing's limit) split at most that many
    ways, at batch 1-4 every split combines in a cluster, and on sm_90 a batch-1 cache of up to 1,024 slots is one
    64-position tile a CTA."""
    clusters = gpu.cc >= 90
    most = ops.max_cluster_splits(gpu)
    assert ops.uses_clusters(gpu) == clusters
    assert ops.combine_in_cluster(gpu, 1, 8, 5) == clusters
    assert ops.combine_in_cluster(gpu, 1, 8, 16) == (gpu.cc == 90)
    assert not ops.combine_in_cluster(gpu, 1, 8, 1)
    assert not ops.combine_in_cluster(gpu, 1, 8, most + 1)
    assert not ops.combine_in_cluster(gpu, 16, 8, -(-(2 * gpu.sm_count + 1) // (16 * 8)))
    for batch in (1, 2, 4, 8, 16) if clusters else ():
        for slots in range(64, ops.MAX_FUSED_SLOTS + 1, 64):
            chunk = ops.plan_chunk(batch, 8, slots, gpu.sm_count, most)
            splits = -(-slots // chunk)
            assert splits <= most, (batch, slots)
            assert batch > 4 or splits == 1 or ops.combine_in_cluster(gpu, batch, 8, splits), (batch, slots)
            if gpu.cc == 90 and batch == 1:
                assert chunk == ops.TILE, slots


def test_decode_steps_past_1024_slots_route_where_a_cta_streams_few_tiles():
    """The routing past 1,024 slots (Llama-3-8B's 8 kv heads): on a described H200 a step goes to rope_attention
    while a CTA streams at most 4 tiles in a split of at most 16 chunks (batch 1-2 up to 4,096 slots, batch 4 up to
    2,112; not batch 1 at 8,192, batch 4 at 4,096, batch 8 at 2,112, nor above 16 sequences at any length); with
    the wide clusters off, on a GPU without clusters, or where the driver cannot hold a wider split's clusters at
    once, the wider chunks or many-way L2 combines that follow keep those steps on rope_cache + SDPA. Up to 1,024
    slots every batch of at most 16 routes, whatever the GPU."""
    h200 = ops.decode_limits(GpuSpec("NVIDIA H200", 132, 90))

    def routes(batch, slots, limits=h200):
        return ops.routes_decode_step(batch, 8, slots, lambda: limits)

    for batch, slots in ((1, 1088), (1, 2112), (1, 4096), (2, 1088), (2, 4096), (4, 1088), (4, 2112)):
        assert routes(batch, slots), (batch, slots)
    for batch, slots in ((1, 8192), (1, 16384), (2, 16384), (4, 4096), (8, 2112), (8, 4096), (16, 1088)):
        assert not routes(batch, slots), (batch, slots)
    assert all(routes(b, s) for b in (1, 2, 4, 8, 16) for s in (64, 576, 1024))
    assert not routes(17, 64)
    with launch_policy(LaunchPolicy(wide_clusters=False)):
        portable = ops.decode_limits(GpuSpec("NVIDIA H200", 132, 90))
    assert not routes(1, 4096, portable) and not routes(1, 2112, portable)
    crowded = h200._replace(wide_resident=(7,) * (h200.cluster_splits - ops.MAX_CLUSTER_SPLITS))
    assert not routes(1, 4096, crowded)  # 8 sequence-heads, room for 7 clusters of 16: the portable plan
    a100 = ops.decode_limits(GpuSpec("NVIDIA A100-SXM4-80GB", 108, 80))
    assert not routes(1, 2112, a100) and not routes(1, 4096, a100) and routes(1, 1024, a100)


def test_the_routing_limits_are_asked_for_only_past_1024_slots():
    def never():
        raise AssertionError("asked for the GPU's limits")

    assert ops.routes_decode_step(1, 8, 1024, never) and not ops.routes_decode_step(17, 8, 4096, never)


def test_wide_clusters_off_keeps_the_portable_split_on_sm_90():
    """LaunchPolicy(wide_clusters=False) plans an H200's batch-1 576-slot cache as before the non-portable sizes:
    at most 8 chunks (5 of two tiles), every split still one cluster; other GPUs plan the same either way."""
    h200, b200 = GpuSpec("NVIDIA H200", 132, 90), GpuSpec("NVIDIA B200", 148, 100)
    wide = -(-576 // ops.plan_chunk(1, 8, 576, 132, ops.max_cluster_splits(h200)))
    with launch_policy(LaunchPolicy(wide_clusters=False)):
        narrow = -(-576 // ops.plan_chunk(1, 8, 576, 132, ops.max_cluster_splits(h200)))
        assert not ops.combine_in_cluster(h200, 1, 8, 9) and ops.combine_in_cluster(h200, 1, 8, narrow)
        assert ops.max_cluster_splits(b200) == 8
    assert (wide, narrow) == (9, 5)
    assert ops.combine_in_cluster(h200, 1, 8, 9) and ops.max_cluster_splits(b200) == 8


def test_custom_op_opcheck_and_fullgraph_trace():
    torch.manual_seed(1)
    qkv, cos, sin, layer = _step(2, 1, 8, 2, 64, 32, torch.float16)
    mask = torch.ones(2, 1, 1, 32, dtype=torch.bool)
    torch.library.opcheck(library.rope_attention_op, (qkv, cos, sin, layer.keys, layer.values,
                                                      layer.cumulative_length, mask, 0.125, 8, 2, None, False),
                          test_utils=("test_schema", "test_faketensor"))
    norms = _norm_args(_head_norms(64, torch.float16))
    torch.library.opcheck(library.rope_attention_op, (qkv, cos, sin, layer.keys, layer.values,
                                                      layer.cumulative_length, mask, 0.125, 8, 2, None, False,
                                                      norms["q_norm"], norms["k_norm"], norms["norm_eps"]),
                          test_utils=("test_schema", "test_faketensor"))
    f = torch.compile(lambda *a: ops.rope_attention(*a), fullgraph=True, backend="eager")
    out = f(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, mask, 0.125, 8, 2)
    assert out.shape == (2, 1, 8, 64)


# -------------------------------------------------------------------------------------------------------- GPU

@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    make_layer_counters(device)
    return device


def _run(shape, dtype, seed, cuda, mask_kind="bool", start=None, chunk=None, early_kv=False, counters=None,
         cluster=None):
    b, heads, kv_heads, d, slots = shape
    torch.manual_seed(seed)
    qkv, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, dtype, device=cuda, start=start)
    length = int(layer.cumulative_length)
    mask = _mask(mask_kind, b, slots, length, dtype, cuda, torch.Generator().manual_seed(seed))
    scale = 1 / math.sqrt(d)
    want, twin = _want(qkv, cos, sin, layer, heads, kv_heads, mask, scale)
    poison(torch.empty((b, 1, heads, d), dtype=dtype, device=cuda))  # freed: the output's allocation reuses it
    got = ops.rope_attention_impl(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, mask, scale,
                                  heads, kv_heads, counters, early_kv=early_kv, chunk=chunk, cluster=cluster)
    torch.cuda.synchronize()
    where = (f"seed {seed}, shape {shape}, {dtype}, mask {mask_kind}, L {length}, chunk {chunk}, early {early_kv}, "
             f"cluster {cluster}")
    assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values), where
    assert torch.equal(layer.cumulative_length, twin.cumulative_length), where
    assert not got.isnan().any(), where
    assert _rel(got, want) < TOL[dtype], f"{where}: {_rel(got, want):.2e}"
    counters = layer_counters(cuda) if counters is None else counters
    assert int(counters[: 1 + b * kv_heads].abs().sum()) == 0, where
    return got


SHAPES = [(1, 32, 8, 128, 576), (1, 32, 8, 128, 2048), (2, 8, 8, 64, 64), (3, 12, 4, 128, 100),
          (16, 32, 8, 128, 576), (5, 16, 1, 64, 300), (33, 4, 2, 64, 129), (1, 64, 8, 128, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_kernel_matches_float64_attention_and_transformers_cache(dtype, shape, mask_kind, cuda):
    for seed in (0, 1):
        _run(shape, dtype, seed, cuda, mask_kind)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_head_norms_write_rope_caches_bits_and_match_float64_attention(dtype, shape, cuda):
    """Qwen3's per-head q / k norms: the cache rope_attention writes is the one rope_cache's kernel writes, bit for
    bit (one summation order for the norm, rotary.cuh), and the output is the float64 attention of rope_cache's
    q over it; early copies, one-tile chunks and the whole cache in one chunk alike."""
    b, heads, kv_heads, d, slots = shape
    from tilefish.ops import rope_cache as rope_cache_ops

    for seed, (chunk, early_kv) in enumerate(((None, True), (64, False), (-(-slots // 64) * 64, False))):
        torch.manual_seed(seed)
        norms = _norm_args(_head_norms(d, dtype, cuda, seed))
        qkv, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, dtype, device=cuda)
        mask = _mask("bool", b, slots, int(layer.cumulative_length), dtype, cuda, torch.Generator().manual_seed(seed))
        want, twin = _want(qkv, cos, sin, layer, heads, kv_heads, mask, 0.1,
                           rope=lambda *a: rope_cache_ops.rope_cache_impl(*a, heads, kv_heads, **norms))
        poison(torch.empty((b, 1, heads, d), dtype=dtype, device=cuda))
        got = ops.rope_attention_impl(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, mask, 0.1,
                                      heads, kv_heads, **norms, early_kv=early_kv, chunk=chunk)
        torch.cuda.synchronize()
        where = f"seed {seed}, shape {shape}, {dtype}, chunk {chunk}, early {early_kv}"
        assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values), where
        assert torch.equal(layer.cumulative_length, twin.cumulative_length), where
        assert _rel(got, want) < TOL[dtype], f"{where}: {_rel(got, want):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 128, 4096])
@pytest.mark.parametrize("early_kv", [False, True])
def test_chunks_and_early_copies(chunk, early_kv, cuda):
    for seed, shape in enumerate(SHAPES[:5]):
        _run(shape, torch.float16, seed, cuda, "bool", chunk=chunk, early_kv=early_kv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cluster_combine_gives_the_l2_combines_bits(dtype, cuda):
    """On sm_90 and newer a split of 2 to max_cluster_splits chunks is one cluster that combines its partials
    through distributed shared memory: the same bits as the combine through L2 over the same chunks (both sum in
    split order), with chunks past the length fully masked and masked rows; and both within the float64
    reference's tolerance. On sm_90, clusters of 9-16 (non-portable sizes) too."""
    if torch.cuda.get_device_capability(cuda) < (9, 0):
        pytest.skip("thread-block clusters need sm_90")
    cases = [((1, 32, 8, 128, 576), 128), ((3, 12, 4, 128, 100), 64), ((2, 8, 8, 64, 512), 64),
             ((5, 16, 1, 64, 300), 64), ((1, 64, 8, 128, 1024), 128), ((8, 32, 8, 128, 192), 64),
             ((1, 32, 8, 128, 576), 64), ((2, 8, 4, 64, 1000), 64), ((1, 16, 2, 128, 700), 64)]
    gpu = GpuSpec.current(cuda)
    cases = [(shape, chunk) for shape, chunk in cases if -(-shape[-1] // chunk) <= ops.max_cluster_splits(gpu)]
    for seed, (shape, chunk) in enumerate(cases):
        assert ops.combine_in_cluster(gpu, shape[0], shape[2], -(-shape[-1] // chunk))  # the cluster path runs
        for mask_kind in ("bool", "additive", "none"):
            l2, cluster = (_run(shape, dtype, 40 + seed, cuda, mask_kind, chunk=chunk, cluster=c)
                           for c in (False, True))
            assert torch.equal(l2, cluster), f"seed {40 + seed}, shape {shape}, chunk {chunk}, mask {mask_kind}"


@pytest.mark.gpu
@pytest.mark.parametrize("start", ["first", "tile_edge", "last", "past"])
def test_new_position_at_the_edges_and_past_the_cache(start, cuda):
    slots = 576
    at = {"first": 0, "tile_edge": 127, "last": slots - 1, "past": slots + 3}[start]
    for seed, chunk in enumerate((64, None)):
        _run((2, 32, 8, 128, slots), torch.bfloat16, seed, cuda, "none" if start == "past" else "bool", start=at,
             chunk=chunk)


@pytest.mark.gpu
def test_a_fully_masked_row_gives_zeros(cuda):
    torch.manual_seed(5)
    b, heads, kv_heads, d, slots = 3, 8, 2, 64, 200
    qkv, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, torch.float16, device=cuda, start=50)
    mask = torch.ones(b, 1, 1, slots, dtype=torch.bool, device=cuda)
    mask[1] = False
    out = ops.rope_attention_impl(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, mask, 0.125,
                                  heads, kv_heads, chunk=64)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0


@pytest.mark.gpu
def test_many_steps_in_a_row_and_own_counters(cuda):
    """Eight decode steps on one cache (each launch reads the length the last one wrote), early copies off as
    the op's default is for back-to-back calls, then with owned counters."""
    torch.manual_seed(7)
    b, heads, kv_heads, d, slots = 2, 32, 8, 128, 96
    _, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, torch.float16, device=cuda, start=40)
    twin = _copy(layer)
    for step in range(8):
        qkv = torch.randn(b, 1, (heads + 2 * kv_heads) * d, device=cuda).to(torch.float16)
        mask = (torch.arange(slots, device=cuda) <= int(twin.cumulative_length))[None, None, None, :]
        want, twin_after = _want(qkv, cos, sin, twin, heads, kv_heads, mask, 0.1)
        got = ops.rope_attention_impl(qkv, cos, sin, layer.keys, layer.values, layer.cumulative_length, mask, 0.1,
                                      heads, kv_heads, chunk=64)
        assert _rel(got, want) < TOL[torch.float16], f"step {step}"
        twin = twin_after
    assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.cumulative_length, twin.cumulative_length)
    assert int(layer_counters(cuda)[:17].abs().sum()) == 0
    own = torch.zeros(20, dtype=torch.int32, device=cuda)
    _run((b, heads, kv_heads, d, slots), torch.float16, 9, cuda, counters=own, chunk=64)
    with pytest.raises(ValueError, match="the counters hold"):
        _run((b, heads, kv_heads, d, slots), torch.float16, 9, cuda, counters=own[:5])


@pytest.mark.gpu
@pytest.mark.parametrize("sharing", ["alone", "time-sliced"])
def test_programmatic_launch_chain_reads_what_the_launches_ahead_wrote(sharing, cuda, request):
    """norm -> rope_attention eight times with nothing between the launches: each rope_attention reads the q/k/v
    the norm ahead of it just wrote and the length and cache rows the rope_attention before that wrote, also while
    other processes share the GPU. With programmatic dependent launch the outputs, keys, values and length equal
    the same launches without it, bit for bit."""
    from tilefish.ops import norm as norm_ops

    if sharing == "time-sliced":
        request.getfixturevalue("time_sliced_gpu")
    torch.manual_seed(11)
    b, heads, kv_heads, d, slots = 2, 32, 8, 128, 96
    _, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, torch.float16, device=cuda, start=40)
    sources = [torch.randn(b, 1, (heads + 2 * kv_heads) * d, device=cuda).to(torch.float16) for _ in range(8)]
    weight = (1 + 0.3 * torch.randn(sources[0].shape[-1], device=cuda)).to(torch.float16)
    mask = torch.ones(b, 1, 1, slots, dtype=torch.bool, device=cuda)
    counters = torch.zeros(1 + b * kv_heads, dtype=torch.int32, device=cuda)  # owned: no other launch uses them

    def steps(pdl):
        cache = _copy(layer)
        torch.cuda.synchronize()
        outs = []
        for src in sources:
            qkv = norm_ops.rms_norm_impl(src, weight, 1e-5, pdl=pdl)
            outs.append(ops.rope_attention_impl(qkv, cos, sin, cache.keys, cache.values, cache.cumulative_length,
                                                mask, 0.1, heads, kv_heads, counters, chunk=64, pdl=pdl))
        torch.cuda.synchronize()
        return outs, cache

    want, want_cache = steps(False)
    for i in range(3):
        got, cache = steps(True)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"round {i}: outputs differ"
        assert torch.equal(cache.keys, want_cache.keys) and torch.equal(cache.values, want_cache.values), f"round {i}"
        assert torch.equal(cache.cumulative_length, want_cache.cumulative_length), f"round {i}"
    assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
def test_manual_cuda_graph_replays_advance_the_cache(cuda):
    torch.manual_seed(8)
    b, heads, kv_heads, d, slots = 1, 32, 8, 128, 576
    qkv, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, torch.float16, device=cuda, start=100)
    mask = torch.ones(b, 1, 1, slots, dtype=torch.bool, device=cuda)
    twin = _copy(layer)
    graph, out = capture(lambda: ops.rope_attention(qkv, cos, sin, layer.keys, layer.values,
                                                    layer.cumulative_length, mask, 0.1, heads, kv_heads,
                                                    early_kv=True))
    want, twin = _want(qkv, cos, sin, twin, heads, kv_heads, mask, 0.1)  # the warm-up call ran; capturing does not
    for _ in range(2):
        want, twin = _want(qkv, cos, sin, twin, heads, kv_heads, mask, 0.1)
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, want) < TOL[torch.float16]
    assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.cumulative_length, twin.cumulative_length)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile(mode, cuda):
    torch.manual_seed(9)
    b, heads, kv_heads, d, slots = 2, 32, 8, 128, 256
    qkv, cos, sin, layer = _step(b, 1, heads, kv_heads, d, slots, torch.bfloat16, device=cuda, start=30)
    mask = torch.ones(b, 1, 1, slots, dtype=torch.bool, device=cuda)
    twin = _copy(layer)
    f = torch.compile(lambda x: ops.rope_attention(x, cos, sin, layer.keys, layer.values, layer.cumulative_length,
                                                   mask, 0.1, heads, kv_heads, early_kv=True) * 2,
                      mode=mode, fullgraph=True)
    for step in range(3):
        want, twin = _want(qkv, cos, sin, twin, heads, kv_heads, mask, 0.1)
        got = f(qkv).clone()
        torch.cuda.synchronize()
        assert _rel(got, want * 2) < TOL[torch.bfloat16], f"step {step}"
    assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.cumulative_length, twin.cumulative_length)
    torch._dynamo.reset()
