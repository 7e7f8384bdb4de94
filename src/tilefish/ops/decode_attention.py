"""Attention of one new token against a KV cache (a decode step), grouped-query heads reading K/V once:
validate -> plan (cluster size) -> launch kernels/attention/decode.cu on torch's current stream.

    out[b, 0, h] = softmax(scale * q[b, h, 0] . K[b, h // G]^T + mask[b]) V[b, h // G]    (G = heads / kv heads)

query [b, heads, 1, d], key / value [b, kv_heads, S, d] (a StaticCache's tensors, read in place), mask None,
a bool tensor (True = attend) or an additive one in the query's dtype, shaped [b or 1, 1, 1, S]. Returns
[b, 1, heads, d] contiguous: the layout transformers' attention functions return. Math in fp32, rounded once;
a row with no position left gives zeros, as torch's SDPA does. Layouts the kernel cannot read in place
(`kernel_reads`: rows not 16-byte aligned, a strided mask) go to torch's SDPA.

The plan (`plan_clusters`, one seam): on sm_90 the positions of a (batch, kv head) are split over a cluster of
C CTAs that combine through distributed shared memory (C = 8 / 4 / 2 while the grid stays within two CTAs an
SM and each CTA keeps at least half a tile); other GPUs run torch's SDPA (enable_gqa) instead, which this
kernel was not measured against there. Graph-safe: a call allocates only its output and never synchronizes.
"""
from __future__ import annotations

import functools
import math

import torch

from ..runtime import GpuSpec, KernelSpec, f32, get_kernel, i32, i64, launch_prepared, prepare_launch
from .w4a16.policy import resolve_policy

SOURCE = "attention/decode.cu"
DTYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
HEAD_DIMS = (64, 128)
GROUP_BOUNDS = (4, 8)   # kernel instantiations: query heads a kv head, at most
MAX_GROUPS = GROUP_BOUNDS[-1]
THREADS, TILE, STAGES = 256, 64, 3  # kernels/attention/decode.cu
CLUSTERS = (8, 4, 2)
MAX_GRID_YZ = 65535


@functools.lru_cache(maxsize=None)
def kernel_spec(dtype: torch.dtype, head_dim: int, group_bound: int) -> KernelSpec:
    return KernelSpec(SOURCE, f"decode_attention<{DTYPES[dtype]}, {head_dim}, {group_bound}>", hot=True)


def dispatch_specs(arch: str | None = None) -> list[KernelSpec]:
    """Every kernel decode_attention_impl launches (dtypes x head dims x group bounds), sm_80 and newer."""
    specs = [kernel_spec(dt, d, g) for dt in DTYPES for d in HEAD_DIMS for g in GROUP_BOUNDS]
    return [s for s in specs if arch is None or s.supports(arch)]


def group_bound(groups: int) -> int:
    return next(g for g in GROUP_BOUNDS if groups <= g)


def smem_bytes(head_dim: int, bound: int) -> int:
    """Dynamic shared memory of a CTA (kernels/attention/decode.cu): STAGES tiles of K and V rows (16-bit), a
    region the row groups' merge reuses (so the larger of the two), then the CTA's sums and two floats a head."""
    row_groups = THREADS // (head_dim // 8)
    region = max(STAGES * 2 * TILE * head_dim * 2, row_groups * bound * (head_dim + 2) * 4)
    return region + 4 * bound * head_dim + 8 * bound


def plan_clusters(batch: int, kv_heads: int, positions: int, gpu: GpuSpec) -> int:
    """CTAs a (batch, kv head) is split over: 0 = not this kernel (torch's SDPA instead: not sm_90), else the
    largest C of 8 / 4 / 2 with batch x kv_heads x C <= 2 x SMs and S >= C x TILE / 2 (about half a tile a CTA), or 1."""
    if gpu.cc != 90:
        return 0
    for c in CLUSTERS:
        if batch * kv_heads * c <= 2 * gpu.sm_count and positions >= c * (TILE // 2):
            return c
    return 1


def _check(t, name: str, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"decode_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"decode_attention: {name} must have {dims} dimensions, got shape {tuple(t.shape)}")


def _aligned(t: torch.Tensor, strides) -> bool:
    """16-byte rows: the last dimension contiguous, the other strides and the data pointer in 8 elements."""
    return t.stride(-1) == 1 and all(s % 8 == 0 for s in strides) and (t.is_cpu or t.data_ptr() % 16 == 0)


def check_inputs(query, key, value, mask, scale) -> tuple[int, int, int, int, int]:
    """(batch, heads, kv_heads, positions, head_dim), or a TypeError / ValueError naming the broken rule."""
    _check(query, "query", 4)
    _check(key, "key", 4)
    _check(value, "value", 4)
    if query.dtype not in DTYPES:
        raise TypeError(f"decode_attention: query must be float16 or bfloat16, got {query.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise TypeError(f"decode_attention: {name} must have query's dtype {query.dtype}, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"decode_attention: {name} is on {t.device}, query on {query.device}")
    if not (query.is_cuda or query.is_cpu):
        raise ValueError(f"decode_attention runs on CUDA or CPU tensors, not {query.device}")
    b, heads, t, d = query.shape
    if t != 1:
        raise ValueError(f"decode_attention: one query token (query [b, heads, 1, d]), got {t} tokens")
    if key.shape != value.shape or key.shape[0] != b or key.shape[3] != d:
        raise ValueError(f"decode_attention: key and value must be [b={b}, kv_heads, S, d={d}], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    kv_heads, positions = key.shape[1], key.shape[2]
    if d not in HEAD_DIMS:
        raise ValueError(f"decode_attention: head dim must be one of {HEAD_DIMS}, got {d}")
    if kv_heads < 1 or heads % kv_heads or heads // kv_heads > MAX_GROUPS:
        raise ValueError(f"decode_attention: heads ({heads}) must be a multiple of kv heads ({kv_heads}), at most "
                         f"{MAX_GROUPS} query heads a kv head")
    if positions < 1 or b < 1:
        raise ValueError(f"decode_attention: needs at least one batch row and one cache position, got b={b}, "
                         f"S={positions}")
    if b > MAX_GRID_YZ or kv_heads > MAX_GRID_YZ:
        raise ValueError(f"decode_attention: batch and kv heads must be at most {MAX_GRID_YZ}")
    if mask is not None:
        _check(mask, "mask", 4)
        if mask.dtype not in (torch.bool, query.dtype):
            raise TypeError(f"decode_attention: mask must be bool or query's dtype {query.dtype}, got {mask.dtype}")
        if mask.device != query.device:
            raise ValueError(f"decode_attention: mask is on {mask.device}, query on {query.device}")
        if mask.shape[0] not in (1, b) or mask.shape[1:3] != (1, 1) or mask.shape[3] != positions:
            raise ValueError(f"decode_attention: mask must be [b or 1, 1, 1, S={positions}], got {tuple(mask.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"decode_attention: scale must be a finite float, got {scale!r}")
    return b, heads, kv_heads, positions, d


def kernel_reads(query, key, value, mask) -> bool:
    """Whether the kernel can read the tensors in place: 16-byte rows of q / K / V (last dimension contiguous,
    other strides in multiples of 8 elements, aligned starts) and the mask's positions contiguous. Other layouts
    are served by torch's SDPA."""
    ok = _aligned(query, (query.stride(0), query.stride(1))) and all(_aligned(t, t.stride()[:3]) for t in (key, value))
    return ok and (mask is None or mask.stride(3) == 1 or mask.shape[3] == 1)


def decode_attention_reference(query, key, value, mask, scale) -> torch.Tensor:
    """The definition in fp32 on any device: [b, 1, heads, d] in query's dtype."""
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    q = query.float().reshape(b, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("bhgd,bhsd->bhgs", q, key.float()) * scale
    if mask is not None:
        m = mask.reshape(mask.shape[0], 1, 1, -1)
        scores = scores.masked_fill(~m, float("-inf")) if mask.dtype == torch.bool else scores + m.float()
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # a row with nothing left: zeros (NaN inputs stay NaN)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    out = torch.einsum("bhgs,bhsd->bhgd", weights, value.float())
    return out.reshape(b, 1, heads, d).to(query.dtype)


def _sdpa(query, key, value, mask, scale) -> torch.Tensor:
    # torch's cuDNN attention fails on a tensor whose start is not 16-byte aligned (H200, torch 2.11): copy those
    query, key, value, mask = (t.clone() if t is not None and t.data_ptr() % 16 else t for t in (query, key, value, mask))
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                           enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


def decode_attention_impl(query, key, value, mask=None, scale: float | None = None, *, clusters: int | None = None,
                          pdl: bool | None = None) -> torch.Tensor:
    """The op (module docstring). scale None: 1 / sqrt(d). clusters: the plan's C unless given (1, 2, 4 or 8; C > 1
    needs sm_90), for tests. pdl None: the active W4A16 launch policy's `programmatic`."""
    if scale is None and isinstance(query, torch.Tensor) and query.dim() == 4:
        scale = 1.0 / math.sqrt(query.shape[-1])
    b, heads, kv_heads, positions, d = check_inputs(query, key, value, mask, scale)
    if query.is_cpu:
        return decode_attention_reference(query, key, value, mask, float(scale))
    gpu = GpuSpec.current(query.device)
    if clusters is None:
        clusters = plan_clusters(b, kv_heads, positions, gpu)
        if clusters == 0 or not kernel_reads(query, key, value, mask):
            return _sdpa(query, key, value, mask, float(scale))
    elif not kernel_reads(query, key, value, mask):
        raise ValueError("decode_attention: clusters given, but the kernel cannot read these layouts (kernel_reads)")
    elif clusters not in (1,) + CLUSTERS or (clusters > 1 and gpu.cc != 90):
        raise ValueError(f"decode_attention: clusters must be 1, 2, 4 or 8 (more than 1 only on sm_90), got {clusters}")
    if pdl is None:
        pdl = resolve_policy(None).programmatic
    groups = heads // kv_heads
    bound = group_bound(groups)
    if smem_bytes(d, bound) > gpu.smem_per_block:
        raise ValueError(f"decode_attention: the kernel for head dim {d} and {groups} query heads a kv head needs "
                         f"{smem_bytes(d, bound)} bytes of shared memory, more than this GPU's {gpu.smem_per_block}")
    out = torch.empty(b, 1, heads, d, dtype=query.dtype, device=query.device)
    kern = get_kernel(kernel_spec(query.dtype, d, bound), query.get_device())
    cfg = prepare_launch(kern, (clusters, kv_heads, b), THREADS, smem=smem_bytes(d, bound), cluster=clusters, pdl=pdl)
    if mask is None:
        kind, mask_ptr, mask_sb = 0, 0, 0
    else:
        kind = 1 if mask.dtype == torch.bool else 2
        mask_ptr, mask_sb = mask.data_ptr(), (mask.stride(0) if mask.shape[0] > 1 else 0)
    launch_prepared(kern, cfg, query.data_ptr(), i64(query.stride(0)), i64(query.stride(1)),
                    key.data_ptr(), i64(key.stride(0)), i64(key.stride(1)), i64(key.stride(2)),
                    value.data_ptr(), i64(value.stride(0)), i64(value.stride(1)), i64(value.stride(2)),
                    mask_ptr, i32(kind), i64(mask_sb), out.data_ptr(), i32(positions), i32(groups),
                    f32(float(scale) * math.log2(math.e)))
    return out
