"""The rotary embedding and KV-cache write of a Llama-family attention step, from the fused q/k/v projection's
output: validate -> launch kernels/attention/rope_cache.cu on torch's current stream (CPU: reference.rope_cache).

    q = rope_cache(qkv, cos, sin, keys, values, length, heads, kv_heads)      # [B, T, heads, D]

does what transformers' Llama / Mistral / Qwen2 attention does between its projections and the attention
(apply_rotary_pos_emb on q and k, then StaticLayer.update: k and v written into the cache at positions
length + arange(T), length += T), in one launch instead of four compiled kernels (rotary q, rotary k + cache
write, cache write of v, the length's add). With q_norm / k_norm (each a [D] weight, and norm_eps) it is Qwen3's
step: every q / k head RMS-normalized (Qwen3RMSNorm's rounding) before its rotary, two kernels fewer again. The
kernel rounds each product and sum to the activation dtype as transformers' eager rotary does, so q, keys and
values come out bit for bit as the eager path's (compiled, inductor rounds once per element instead; with the
head norms, within the norm's fp32 summation order, which differs from torch's). Positions at or past the cache's
end (S) are not written; transformers' index_copy_ would stop on a device-side assert there (generate() checks the
cache size before it gets there).

The length is read and advanced on the GPU (no host synchronization: graph-safe): every CTA reads it, and the
last CTA to finish advances it, meeting at one int32 counter of the W4A16 layers' shared tile counters
(ops/w4a16/workspace.py), which every kernel leaves at zero, held in turn by streams (StreamTurn). Launched
with programmatic dependent launch where the W4A16 launch policy says so (sm_90+), so its CTAs are resident
when the q/k/v GEMM ahead of it ends.
"""
from __future__ import annotations

import functools
import math

import torch

from ..reference import rope_cache as rope_cache_reference
from ..runtime import KernelSpec, f32, get_kernel, i32, i64, launch_prepared, prepare_launch
from .w4a16.policy import resolve_policy
from .w4a16.workspace import StreamTurn, check_counters, layer_counters, new_counters

SOURCE = "attention/rope_cache.cu"
DTYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
THREADS = 256
MAX_CTAS = 1024  # grid-stride beyond: a prefill's units spread over ~8 CTAs an SM
HEAD_DIM_MULTIPLE = 16  # 8-element (16-byte) chunks of each half of a rotated head


@functools.lru_cache(maxsize=None)
def kernel_spec(dtype: torch.dtype, head_norm: bool = False) -> KernelSpec:
    """head_norm: the build that applies Qwen3's per-head q / k norms (the other runs none of that code)."""
    return KernelSpec(SOURCE, f"rope_cache<{DTYPES[dtype]}, {'true' if head_norm else 'false'}>", hot=True)


def dispatch_specs(arch: str | None = None) -> list[KernelSpec]:
    """Every kernel rope_cache can launch: one per dtype and head-norm choice, the same on every arch (sm_80 and
    newer)."""
    specs = [kernel_spec(dt, hn) for dt in DTYPES for hn in (False, True)]
    return [s for s in specs if arch is None or s.supports(arch)]


def _same_device(t: torch.Tensor, x: torch.Tensor) -> bool:
    return t.is_cuda == x.is_cuda and t.get_device() == x.get_device()


def check_inputs(qkv, cos, sin, keys, values, length, heads, kv_heads) -> tuple[int, int, int, int]:
    """(B, T, D, S), or a TypeError / ValueError naming the broken rule (the same rules on CPU and CUDA)."""
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin), ("keys", keys), ("values", values), ("length", length)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rope_cache: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, v in (("heads", heads), ("kv_heads", kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"rope_cache: {name} must be a positive int, got {v!r}")
    if qkv.dtype not in DTYPES:
        raise TypeError(f"rope_cache: qkv must be float16 or bfloat16, got {qkv.dtype}")
    if not (qkv.is_cuda or qkv.is_cpu):
        raise ValueError(f"rope_cache runs on CUDA or CPU tensors, not {qkv.device}")
    if keys.dim() != 4 or values.shape != keys.shape:
        raise ValueError(f"rope_cache: keys and values must be [B, kv_heads, S, D] of one shape, got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")
    b, kvh, slots, d = keys.shape
    if kvh != kv_heads or heads % kv_heads:
        raise ValueError(f"rope_cache: the caches hold {kvh} kv heads; kv_heads = {kv_heads} must equal it and "
                         f"divide heads = {heads}")
    if d % HEAD_DIM_MULTIPLE or d == 0:
        raise ValueError(f"rope_cache: the head dim ({d}) must be a positive multiple of {HEAD_DIM_MULTIPLE}")
    if qkv.dim() != 3 or qkv.shape[0] != b or qkv.shape[2] != (heads + 2 * kv_heads) * d:
        width = (heads + 2 * kv_heads) * d
        raise ValueError(f"rope_cache: qkv must be [B = {b}, T, (heads + 2 kv_heads) x D = {width}] (the caches' "
                         f"batch and head dim), got {tuple(qkv.shape)}")
    t = qkv.shape[1]
    for name, c in (("cos", cos), ("sin", sin)):
        if c.dtype != qkv.dtype:
            raise TypeError(f"rope_cache: {name} must have qkv's dtype {qkv.dtype}, got {c.dtype}")
        if c.dim() != 3 or c.shape[0] not in (1, b) or c.shape[1:] != (t, d):
            raise ValueError(f"rope_cache: {name} must be [B or 1, T = {t}, D = {d}], got {tuple(c.shape)}")
    if sin.shape != cos.shape:
        raise ValueError(f"rope_cache: cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    for name, c in (("keys", keys), ("values", values)):
        if c.dtype != qkv.dtype:
            raise TypeError(f"rope_cache: {name} must have qkv's dtype {qkv.dtype}, got {c.dtype}")
        if not c.is_contiguous():
            raise ValueError(f"rope_cache: {name} must be contiguous (it is written in place)")
    if length.dtype != torch.int64 or length.numel() != 1:
        raise TypeError(f"rope_cache: length must be a one-element int64 tensor (cumulative_length), got "
                        f"{length.dtype} with {length.numel()} elements")
    for name, c in (("cos", cos), ("sin", sin), ("keys", keys), ("values", values), ("length", length)):
        if not _same_device(c, qkv):
            raise ValueError(f"rope_cache: {name} is on {c.device}, qkv on {qkv.device}: they must share a device")
    if qkv.is_cuda and (keys.data_ptr() % 16 or values.data_ptr() % 16):
        raise ValueError("rope_cache: keys and values must be 16-byte aligned (the kernel writes 16-byte vectors)")
    return b, t, d, slots


def check_head_norms(op: str, qkv, d: int, q_norm, k_norm, norm_eps) -> None:
    """The optional per-head norm weights: each None or a [D] tensor of qkv's dtype on its device, and a finite,
    non-negative eps (a TypeError / ValueError naming the rule)."""
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is None:
            continue
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor or None, got {type(w).__name__}")
        if w.dtype != qkv.dtype:
            raise TypeError(f"{op}: {name} must have qkv's dtype {qkv.dtype}, got {w.dtype}")
        if w.dim() != 1 or w.shape[0] != d:
            raise ValueError(f"{op}: {name} must be one weight a head dim, [D = {d}], got {tuple(w.shape)}")
        if not _same_device(w, qkv):
            raise ValueError(f"{op}: {name} is on {w.device}, qkv on {qkv.device}: they must share a device")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not math.isfinite(norm_eps) \
            or norm_eps < 0:
        raise ValueError(f"{op}: norm_eps must be a finite float >= 0, got {norm_eps!r}")


def norm_weights(q_norm, k_norm) -> tuple:
    """The weights as the kernels read them (16-byte vectors: a unit-stride, aligned copy where not)."""
    return tuple(None if w is None else _rows(w) for w in (q_norm, k_norm))


def norm_args(q_norm, k_norm, norm_eps) -> tuple:
    """The kernels' (q_norm, k_norm, eps) arguments from norm_weights' tensors (null where absent)."""
    return (0 if q_norm is None else q_norm.data_ptr(), 0 if k_norm is None else k_norm.data_ptr(),
            f32(float(norm_eps)))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride along its last dim and 16-byte aligned rows: the kernel's 16-byte loads (a copy where not)."""
    if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t


def rope_cache_impl(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, length: torch.Tensor, heads: int, kv_heads: int,
                    counters: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
                    k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6, *,
                    pdl: bool | None = None) -> torch.Tensor:
    """q [B, T, heads, D]; keys, values and length updated in place (module docstring). CPU -> the reference,
    CUDA -> the kernel. counters: owned int32 counters (one is used), else the W4A16 layers' of the device, else
    a fresh zeroed one. q_norm / k_norm: the per-head norms' weights ([D]) or None. pdl: programmatic dependent
    launch (None: the active W4A16 launch policy's)."""
    b, t, d, slots = check_inputs(qkv, cos, sin, keys, values, length, heads, kv_heads)
    check_head_norms("rope_cache", qkv, d, q_norm, k_norm, norm_eps)
    if qkv.is_cpu:
        return rope_cache_reference(qkv, cos, sin, keys, values, length, heads, kv_heads, q_norm, k_norm,
                                    float(norm_eps))
    qkv, cos, sin = qkv.contiguous(), _rows(cos), _rows(sin)
    q_norm, k_norm = norm_weights(q_norm, k_norm)
    if qkv.data_ptr() % 16:
        qkv = qkv.clone()
    if cos.stride() != sin.stride():  # the kernel takes one set of strides for both
        cos, sin = _rows(cos.contiguous()), _rows(sin.contiguous())
    q = torch.empty((b, t, heads, d), dtype=qkv.dtype, device=qkv.device)
    if b * t == 0:
        return q
    index = qkv.get_device()
    if counters is None:
        counters = layer_counters(qkv.device)
    if counters is None:
        counters = new_counters(qkv.device, 1)
    check_counters(counters, qkv.device)
    if pdl is None:
        pdl = resolve_policy(None).programmatic
    units = b * t * ((heads + kv_heads) * (d // 16) + kv_heads * (d // 8))
    kern = get_kernel(kernel_spec(qkv.dtype, q_norm is not None or k_norm is not None), index)
    cfg = prepare_launch(kern, min(-(-units // THREADS), MAX_CTAS), THREADS, pdl=pdl)
    batch_stride = 0 if cos.shape[0] == 1 else cos.stride(0)
    with StreamTurn(counters, index) as arrivals:
        launch_prepared(kern, cfg, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), keys.data_ptr(),
                        values.data_ptr(), length.data_ptr(), arrivals, i32(b), i32(t), i32(heads), i32(kv_heads),
                        i32(d), i32(slots), i64(batch_stride), i64(cos.stride(1)),
                        *norm_args(q_norm, k_norm, norm_eps))
    return q


def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               length: torch.Tensor, heads: int, kv_heads: int, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6) -> torch.Tensor:
    """rope_cache_impl eagerly; under torch.compile the custom op tilefish::rope_cache (keys, values and length
    declared mutated), with the W4A16 layers' counters where the device has them."""
    if torch.compiler.is_compiling():
        from . import library

        return library.rope_cache_op(qkv, cos, sin, keys, values, length, heads, kv_heads,
                                     layer_counters(qkv.device), q_norm, k_norm, float(norm_eps))
    return rope_cache_impl(qkv, cos, sin, keys, values, length, heads, kv_heads, None, q_norm, k_norm, norm_eps)
