"""A decode step's attention from the fused q/k/v projection's output, in one launch: the rotary embedding, the
StaticCache write and the attention over the cache (kernels/attention/rope_attention.cu; CPU: the reference).

    out = rope_attention(qkv, cos, sin, keys, values, length, mask, scale, heads, kv_heads)   # [B, 1, heads, D]

is rope_cache (ops/rope_cache.py: rope(q), rope(k) and v written at position `length`, length += 1; with q_norm /
k_norm, Qwen3's per-head RMSNorm ahead of the rotary) followed by
SDPA of rope(q) over the whole cache with `mask` (bool, True = attend, or additive in qkv's dtype; [B or 1, 1, 1,
S]; None attends every slot), grouped-query heads reading K/V once: what transformers' sdpa attention computes
for one new token. keys / values / length come out bit for bit rope_cache's; out is within the rounding of
attention kernels (P is rounded to the activation dtype before its product with V, as flash attention does).

The plan (`plan_chunk`, one seam): positions are split into chunks of whole 64-position tiles so the launch
has about two CTAs an SM (batch 1, a 512-slot cache, 8 kv heads: 8 chunks of 64, 64 CTAs). On sm_90 and newer
(`uses_clusters`) a (sequence, kv head) takes at most `max_cluster_splits` chunks, launched as one thread-block
cluster that combines its partials through distributed shared memory; otherwise (and for a larger split asked
through `chunk`) the CTAs combine through L2, the last to arrive on its counter writing the output.
Scratch: fp32 partials allocated per call; the counters (1 + batch x kv heads int32, left at zero) are the W4A16
layers' shared ones (ops/w4a16/workspace.py, taken in turn by streams) where they suffice. Graph-safe: no host
synchronization, nothing kept across calls.

`early_kv` (default False): the kernel issues its first K/V tile copies before it waits for the kernel ahead
(programmatic dependent launch, sm_90), which is what starting early buys. That is safe only when nothing that
may still be running writes the cache rows below `length`, the mask or cos / sin: true in a model's decode step,
where the cache was last written by this layer's previous step and torch kernels (the embedding, the rotary
table, the mask) start every step, none of which overlaps a later kernel; not for back-to-back calls on one cache.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import torch

from ..reference import rope_cache as rope_cache_reference
from ..runtime import GpuSpec, KernelSpec, f32, get_kernel, i32, i64, launch_prepared, prepare_launch
from .rope_cache import _rows, check_head_norms, check_inputs as rope_cache_checks, norm_args, norm_weights
from .w4a16.policy import resolve_policy
from .w4a16.workspace import StreamTurn, check_counters, layer_counters, new_counters

SOURCE = "attention/rope_attention.cu"
DTYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
HEAD_DIMS = (64, 128)
MAX_GROUPS = 16  # query heads a kv head: the rows of one mma.m16n8k16 tile
THREADS, TILE = 128, 64  # kernels/attention/rope_attention.cu
MAX_GRID_YZ = 65535
MAX_CLUSTER_SPLITS = 8  # the portable cluster size
HOPPER_CLUSTER_SPLITS = 16  # sm_90's non-portable limit; the kernel's combine holds this many (its MAX_CLUSTER)
# The fused forward routes a decode step here (decoder.FusedAttention) when routes_decode_step says so. Measured
# against rope_cache + the attention function, a Llama-3-8B-shaped model (8 kv heads), 8 layers, H200
# (scripts/profile_e2e.py, -ropecache against -allslots):
# - up to 1,024 slots, batches 1-16 (bench/results/h200/ab/e2e_profile_rope_attention_by_cache.txt): even to 3 us a
#   layer faster;
# - past it (e2e_profile_rope_attention_routing_cluster16.txt, with the 16-chunk clusters): 1.2-6.9 us a layer
#   faster wherever a CTA streams at most 4 tiles and a split has at most 16 chunks (batch 1-2 up to 4,096 slots,
#   batch 4 up to 2,112); from 8 tiles a CTA on it was 1.4-31 us a layer slower at 9 of 11 points (a CTA's tiles
#   stream one after another through a 2-stage ring, slower than cuDNN's kernel), and so was a 33-way L2 combine
#   of 1-tile chunks at batch 1, 2,112 slots (+2.9). Batches above 16 were not measured.
MAX_FUSED_BATCH = 16
MAX_FUSED_SLOTS = 1024
MAX_ROUTED_CHUNK = 4 * TILE
MAX_ROUTED_SPLITS = HOPPER_CLUSTER_SPLITS


class DecodeLimits(NamedTuple):
    """What the plan of a decode step depends on besides its shape: the GPU's SM count, the most chunks a
    (sequence, kv head) takes as one cluster (0: the GPU combines through L2), and how many clusters of
    MAX_CLUSTER_SPLITS + 1 .. cluster_splits CTAs the driver holds at once (empty: all it is asked for)."""
    sm_count: int
    cluster_splits: int
    wide_resident: tuple[int, ...] = ()


def decode_limits(gpu: GpuSpec, wide_resident: tuple[int, ...] = ()) -> DecodeLimits:
    """A GPU's DecodeLimits under the active launch policy (a described GPU: every cluster fits)."""
    return DecodeLimits(gpu.sm_count, max_cluster_splits(gpu) if uses_clusters(gpu) else 0, wide_resident)


@torch.compiler.assume_constant_result
def device_decode_limits(index: int, dtype: torch.dtype, head_dim: int) -> DecodeLimits:
    """The present GPU's DecodeLimits for this build, with the driver's cluster answer; a constant to
    torch.compile (the launch policy as it stands when the step is traced)."""
    gpu = GpuSpec.current(index)
    limits = decode_limits(gpu)
    if limits.cluster_splits <= MAX_CLUSTER_SPLITS:
        return limits
    return limits._replace(wide_resident=_wide_resident(index, dtype, head_dim, limits.cluster_splits))


@functools.lru_cache(maxsize=None)
def _wide_resident(index: int, dtype: torch.dtype, head_dim: int, cap: int) -> tuple[int, ...]:
    kern = get_kernel(kernel_spec(dtype, head_dim), index)
    return tuple(kern.max_active_clusters(n, THREADS, smem_bytes(head_dim))
                 for n in range(MAX_CLUSTER_SPLITS + 1, cap + 1))


def split_chunk(batch: int, kv_heads: int, slots: int, limits: DecodeLimits) -> int:
    """plan_chunk under the GPU's cluster cap, or the portable cap where the driver cannot hold a wider split's
    clusters all at once (one seam: the launch and the routing plan alike)."""
    cap = limits.cluster_splits or None
    chunk = plan_chunk(batch, kv_heads, slots, limits.sm_count, cap)
    splits = -(-slots // chunk)
    if cap is not None and splits > MAX_CLUSTER_SPLITS and limits.wide_resident and (
            limits.wide_resident[splits - MAX_CLUSTER_SPLITS - 1] < batch * kv_heads):
        chunk = plan_chunk(batch, kv_heads, slots, limits.sm_count, MAX_CLUSTER_SPLITS)
    return chunk


def routes_decode_step(batch: int, kv_heads: int, slots: int, limits: Callable[[], DecodeLimits]) -> bool:
    """Whether the fused forward takes this kernel for a decode step of `batch` sequences over a `slots`-slot
    cache, rather than rope_cache + the attention function (the measured rule above). limits: the GPU's
    DecodeLimits, asked for only past MAX_FUSED_SLOTS."""
    if batch > MAX_FUSED_BATCH:
        return False
    if slots <= MAX_FUSED_SLOTS:
        return True
    chunk = split_chunk(batch, kv_heads, slots, limits())
    return chunk <= MAX_ROUTED_CHUNK and -(-slots // chunk) <= MAX_ROUTED_SPLITS


@functools.lru_cache(maxsize=None)
def kernel_spec(dtype: torch.dtype, head_dim: int, head_norm: bool = False) -> KernelSpec:
    """head_norm: the build that applies Qwen3's per-head q / k norms (the other runs none of that code)."""
    return KernelSpec(SOURCE, f"rope_attention<{DTYPES[dtype]}, {head_dim}, {'true' if head_norm else 'false'}>",
                      hot=True)


def dispatch_specs(arch: str | None = None) -> list[KernelSpec]:
    """Every kernel rope_attention can launch (dtypes x head dims x head norms), sm_80 and newer."""
    specs = [kernel_spec(dt, d, hn) for dt in DTYPES for d in HEAD_DIMS for hn in (False, True)]
    return [s for s in specs if arch is None or s.supports(arch)]


def smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of a CTA: the 2-stage K/V ring, Q's 16 rows, the new k and v rows (16-bit)."""
    return (4 * TILE + 16 + 2) * head_dim * 2


def plan_chunk(batch: int, kv_heads: int, slots: int, sm_count: int, max_splits: int | None = None) -> int:
    """Positions a CTA takes (whole 64-position tiles): the fewest tiles that keep the grid within about two
    CTAs an SM, so small batches spread each cache over many CTAs and large ones need no combine, and at most
    `max_splits` chunks a cache (None: no limit)."""
    tiles = -(-slots // TILE)
    per_cta = max(1, -(-batch * kv_heads * tiles // (2 * sm_count)))
    if max_splits is not None:
        per_cta = max(per_cta, -(-tiles // max_splits))
    return min(tiles, per_cta) * TILE


def max_cluster_splits(gpu: GpuSpec) -> int:
    """The most chunks a (sequence, kv head) takes as one cluster on this GPU: sm_90 launches clusters of up to 16
    CTAs once a kernel allows non-portable sizes (so a 513-1,024-slot cache is one tile a CTA at batch 1-2);
    elsewhere, or with the active launch policy's wide_clusters off, the portable 8."""
    return HOPPER_CLUSTER_SPLITS if gpu.cc == 90 and resolve_policy(None).wide_clusters else MAX_CLUSTER_SPLITS


def uses_clusters(gpu: GpuSpec) -> bool:
    """Whether split caches combine through distributed shared memory in clusters on this GPU (sm_90 and newer),
    so the plan keeps a split within max_cluster_splits (combine_in_cluster decides each launch)."""
    return gpu.cc >= 90


def combine_in_cluster(gpu: GpuSpec, batch: int, kv_heads: int, splits: int) -> bool:
    """Whether a launch of `splits` chunks a (sequence, kv head) runs each split as one cluster: on a GPU that
    uses clusters, 2..max_cluster_splits chunks, and a grid within the plan's two CTAs an SM. Past that the
    clusters (placed a GPC at a time) did not all fit beside each other where the CTAs alone did: batch 16,
    2,112 slots, 384 CTAs in clusters of 3 took 1,397 us a step (8 layers, H200) against 1,199 through L2."""
    return (uses_clusters(gpu) and 1 < splits <= max_cluster_splits(gpu)
            and batch * kv_heads * splits <= 2 * gpu.sm_count)


def supports(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether the kernel takes this attention's shape (the fused forward's routing asks before calling)."""
    return head_dim in HEAD_DIMS and kv_heads >= 1 and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUPS


def check_inputs(qkv, cos, sin, keys, values, length, mask, scale, heads, kv_heads) -> tuple[int, int, int]:
    """(B, D, S), or a TypeError / ValueError naming the broken rule (the same rules on CPU and CUDA)."""
    if isinstance(qkv, torch.Tensor) and qkv.dim() == 3 and qkv.shape[1] != 1:
        raise ValueError(f"rope_attention: one new token a sequence (qkv [B, 1, width]), got {qkv.shape[1]} tokens")
    b, _, d, slots = rope_cache_checks(qkv, cos, sin, keys, values, length, heads, kv_heads)  # their messages
    if not supports(d, heads, kv_heads):
        raise ValueError(f"rope_attention: head dim must be one of {HEAD_DIMS} (got {d}) and at most {MAX_GROUPS} "
                         f"query heads a kv head (got {heads} on {kv_heads})")
    if b > MAX_GRID_YZ or kv_heads > MAX_GRID_YZ:
        raise ValueError(f"rope_attention: batch and kv heads must be at most {MAX_GRID_YZ}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"rope_attention: mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype not in (torch.bool, qkv.dtype):
            raise TypeError(f"rope_attention: mask must be bool or qkv's dtype {qkv.dtype}, got {mask.dtype}")
        if mask.dim() != 4 or mask.shape[0] not in (1, b) or tuple(mask.shape[1:3]) != (1, 1) or mask.shape[3] != slots:
            raise ValueError(f"rope_attention: mask must be [B = {b} or 1, 1, 1, S = {slots}], got {tuple(mask.shape)}")
        if mask.device != qkv.device:
            raise ValueError(f"rope_attention: mask is on {mask.device}, qkv on {qkv.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"rope_attention: scale must be a finite float, got {scale!r}")
    return b, d, slots


def reference(qkv, cos, sin, keys, values, length, mask, scale, heads, kv_heads, q_norm=None, k_norm=None,
              norm_eps=1e-6) -> torch.Tensor:
    """The definition on any device: rope_cache's reference, then the attention in fp32, rounded once."""
    q = rope_cache_reference(qkv, cos, sin, keys, values, length, heads, kv_heads, q_norm, k_norm,
                             norm_eps)  # [B, 1, heads, D]
    b, _, _, d = q.shape
    groups = heads // kv_heads
    scores = torch.einsum("bkgd,bksd->bkgs", q.float().reshape(b, kv_heads, groups, d), keys.float()) * scale
    if mask is not None:
        m = mask.reshape(mask.shape[0], 1, 1, -1)
        scores = scores.masked_fill(~m, float("-inf")) if mask.dtype == torch.bool else scores + m.float()
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # nothing left: zeros, as torch's SDPA
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    out = torch.einsum("bkgs,bksd->bkgd", weights, values.float())
    return out.reshape(b, 1, heads, d).to(qkv.dtype)


def rope_attention_impl(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor, length: torch.Tensor, mask: torch.Tensor | None, scale: float,
                        heads: int, kv_heads: int, counters: torch.Tensor | None = None,
                        q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                        norm_eps: float = 1e-6, *, early_kv: bool = False, chunk: int | None = None,
                        pdl: bool | None = None, cluster: bool | None = None) -> torch.Tensor:
    """out [B, 1, heads, D]; keys, values and length updated in place (module docstring). counters: owned int32
    counters (1 + B x kv_heads are used), else the W4A16 layers' of the device where they suffice, else fresh
    zeroed ones. q_norm / k_norm: the per-head norms' weights ([D], Qwen3) or None. chunk: positions a CTA takes
    (a multiple of 64; tests), else plan_chunk's. pdl: programmatic dependent launch (None: the active W4A16
    launch policy's). cluster: False keeps the combine in L2 and the plan without the cluster's split limit;
    None / True (True needs sm_90 or newer): where combine_in_cluster says so."""
    b, d, slots = check_inputs(qkv, cos, sin, keys, values, length, mask, scale, heads, kv_heads)
    check_head_norms("rope_attention", qkv, d, q_norm, k_norm, norm_eps)
    if qkv.is_cpu:
        return reference(qkv, cos, sin, keys, values, length, mask, float(scale), heads, kv_heads, q_norm, k_norm,
                         float(norm_eps))
    gpu = GpuSpec.current(qkv.device)
    if gpu.cc < 80:
        raise ValueError(f"rope_attention needs an sm_80 or newer GPU (mma.sync, cp.async); {qkv.device} is "
                         f"sm_{gpu.cc}")
    groups = heads // kv_heads
    if cluster is None:
        cluster = uses_clusters(gpu)
    elif not isinstance(cluster, bool):
        raise TypeError(f"rope_attention: cluster must be True, False or None, got {cluster!r}")
    elif cluster and gpu.cc < 90:
        raise ValueError(f"rope_attention: a cluster combine needs sm_90 or newer; {qkv.device} is sm_{gpu.cc}")
    # the last CTA of a split combine keeps every split's max and sum a head in the ring's shared memory
    max_splits = (4 * TILE * d * 2 // 4 - groups) // (2 * groups)
    kern = get_kernel(kernel_spec(qkv.dtype, d, q_norm is not None or k_norm is not None), qkv.get_device())
    if chunk is None:
        limits = device_decode_limits(qkv.get_device(), qkv.dtype, d) if cluster else DecodeLimits(gpu.sm_count, 0)
        chunk = max(split_chunk(b, kv_heads, slots, limits), -(-slots // (max_splits * TILE)) * TILE)
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < TILE or chunk % TILE:
        raise ValueError(f"rope_attention: chunk must be a positive multiple of {TILE}, got {chunk!r}")
    elif -(-slots // chunk) > max_splits:
        raise ValueError(f"rope_attention: chunk {chunk} splits {slots} positions {-(-slots // chunk)} ways; at most "
                         f"{max_splits} fit the combine's shared memory (head dim {d}, {groups} query heads a kv head)")
    qkv, cos, sin = qkv.contiguous(), _rows(cos), _rows(sin)
    q_norm, k_norm = norm_weights(q_norm, k_norm)
    if qkv.data_ptr() % 16:
        qkv = qkv.clone()
    if cos.stride() != sin.stride():
        cos, sin = _rows(cos.contiguous()), _rows(sin.contiguous())
    if mask is not None and mask.stride(3) != 1 and mask.shape[3] > 1:
        mask = mask.contiguous()
    splits = -(-slots // chunk)
    in_cluster = cluster and combine_in_cluster(gpu, b, kv_heads, splits)
    index = qkv.get_device()
    need = 1 + b * kv_heads
    if counters is None:
        counters = layer_counters(qkv.device)
        if counters is not None and counters.numel() < need:
            counters = None
    if counters is None:
        counters = new_counters(qkv.device, need)
    check_counters(counters, qkv.device)
    if counters.numel() < need:
        raise ValueError(f"rope_attention: the counters hold {counters.numel()} slots, the launch needs {need}")
    if pdl is None:
        pdl = resolve_policy(None).programmatic
    out = torch.empty((b, 1, heads, d), dtype=qkv.dtype, device=qkv.device)
    partials = torch.empty(b * kv_heads * splits * groups * (d + 2) if splits > 1 and not in_cluster else 1,
                           dtype=torch.float32, device=qkv.device)
    cfg = prepare_launch(kern, (splits, kv_heads, b), THREADS, smem=smem_bytes(d), cluster=splits if in_cluster else 1,
                         pdl=pdl)
    if mask is None:
        kind, mask_ptr, mask_sb = 0, 0, 0
    else:
        kind = 1 if mask.dtype == torch.bool else 2
        mask_ptr, mask_sb = mask.data_ptr(), (mask.stride(0) if mask.shape[0] > 1 else 0)
    batch_stride = 0 if cos.shape[0] == 1 else cos.stride(0)
    with StreamTurn(counters, index) as counters_ptr:
        launch_prepared(kern, cfg, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
                        length.data_ptr(), counters_ptr, mask_ptr, i32(kind), i64(mask_sb), out.data_ptr(),
                        partials.data_ptr(), i32(heads), i32(kv_heads), i32(slots), i32(chunk), i64(batch_stride),
                        f32(float(scale) * math.log2(math.e)), i32(1 if early_kv else 0), i32(1 if in_cluster else 0),
                        *norm_args(q_norm, k_norm, norm_eps))
    return out


def rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   length: torch.Tensor, mask: torch.Tensor | None, scale: float, heads: int, kv_heads: int,
                   early_kv: bool = False, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   norm_eps: float = 1e-6) -> torch.Tensor:
    """rope_attention_impl eagerly; under torch.compile the custom op tilefish::rope_attention (keys, values and
    length declared mutated), with the W4A16 layers' counters where the device has them."""
    if torch.compiler.is_compiling():
        from . import library

        return library.rope_attention_op(qkv, cos, sin, keys, values, length, mask, float(scale), heads, kv_heads,
                                          layer_counters(qkv.device), early_kv, q_norm, k_norm, float(norm_eps))
    return rope_attention_impl(qkv, cos, sin, keys, values, length, mask, scale, heads, kv_heads, None, q_norm,
                               k_norm, norm_eps, early_kv=early_kv)
