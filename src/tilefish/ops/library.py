"""torch.library registrations: every op's schema and fake (meta) implementation in one place.

Eager calls go straight to the ops' Python implementations (lower host overhead); under
torch.compile, and where autograd must record the call, the public functions route through these
custom ops, so fullgraph tracing works and backward is the same everywhere.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _nf4_weight(codes, absmax, absmax_q, code2, absmax2, offset, shape, blocksize, dtype):
    from ..quant.nf4 import NF4Weight

    return NF4Weight(codes=codes, shape=torch.Size(shape), dtype=dtype, blocksize=blocksize, absmax=absmax,
                     absmax_q=absmax_q, code2=code2, absmax2=absmax2, offset=offset)


@torch.library.custom_op("tilefish::nf4_dequantize", mutates_args=())
def nf4_dequantize_op(codes: Tensor, absmax: Optional[Tensor], absmax_q: Optional[Tensor], code2: Optional[Tensor],
                      absmax2: Optional[Tensor], offset: Optional[Tensor], shape: list[int], blocksize: int,
                      dtype: torch.dtype) -> Tensor:
    from .nf4 import dequantize_impl

    return dequantize_impl(_nf4_weight(codes, absmax, absmax_q, code2, absmax2, offset, shape, blocksize, dtype), dtype)


@nf4_dequantize_op.register_fake
def _(codes, absmax, absmax_q, code2, absmax2, offset, shape, blocksize, dtype):
    return codes.new_empty(shape, dtype=dtype)


@torch.library.custom_op("tilefish::nf4_dequantize_out", mutates_args=("out",))
def nf4_dequantize_out_op(codes: Tensor, absmax: Optional[Tensor], absmax_q: Optional[Tensor],
                          code2: Optional[Tensor], absmax2: Optional[Tensor], offset: Optional[Tensor],
                          shape: list[int], blocksize: int, out: Tensor) -> None:
    from .nf4 import dequantize_impl

    dequantize_impl(_nf4_weight(codes, absmax, absmax_q, code2, absmax2, offset, shape, blocksize, out.dtype),
                    out.dtype, out)


@nf4_dequantize_out_op.register_fake
def _(codes, absmax, absmax_q, code2, absmax2, offset, shape, blocksize, out):
    return None


def nf4_dequantize(q, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    fields = (q.codes, q.absmax, q.absmax_q, q.code2, q.absmax2, q.offset, list(q.shape), q.blocksize)
    if out is None:
        return nf4_dequantize_op(*fields, dtype)
    nf4_dequantize_out_op(*fields, out)
    return out


def _w4a16_weight(packed, scales, zeros, perm, group_size, n, k, codebook):
    from .w4a16 import W4A16Weight

    return W4A16Weight(packed, scales, zeros, group_size, n, k, perm, codebook)


@torch.library.custom_op("tilefish::w4a16_matmul", mutates_args=())
def w4a16_matmul_op(x: Tensor, packed: Tensor, scales: Tensor, zeros: Optional[Tensor], perm: Optional[Tensor],
                    bias: Optional[Tensor], group_size: int, n: int, k: int, codebook: str,
                    counters: Optional[Tensor] = None, light_ahead: bool = False) -> Tensor:
    # counters: the caller's tile counters (ops/w4a16/workspace.py). Not a mutated argument: every
    # launch leaves them zero, as it found them. light_ahead: ops.w4a16.matmul_impl's.
    from .w4a16 import matmul_impl

    return matmul_impl(x, _w4a16_weight(packed, scales, zeros, perm, group_size, n, k, codebook), bias,
                       workspace=counters, light_ahead=light_ahead)


@w4a16_matmul_op.register_fake
def _(x, packed, scales, zeros, perm, bias, group_size, n, k, codebook, counters=None, light_ahead=False):
    return x.new_empty(*x.shape[:-1], n)


def _w4a16_setup_context(ctx, inputs, output):
    x, packed, scales, zeros, perm, bias, group_size, n, k, codebook, counters, light_ahead = inputs
    ctx.save_for_backward(packed, scales, zeros, perm)
    ctx.group_size, ctx.n, ctx.k, ctx.codebook = group_size, n, k, codebook


def _w4a16_backward(ctx, grad):
    """Gradients reach x (grad @ W, W dequantized exactly in fp32) and the bias; the 4-bit weight is frozen."""
    packed, scales, zeros, perm = ctx.saved_tensors
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        dense = _w4a16_weight(packed, scales, zeros, perm, ctx.group_size, ctx.n, ctx.k,
                              ctx.codebook).dequantize(torch.float32)
        grad_x = (grad.float() @ dense).to(grad.dtype)   # columns in the weight's (act-order permuted) k order
        if perm is not None:
            grad_x = grad_x.index_select(-1, torch.argsort(perm))
    if ctx.needs_input_grad[5]:
        grad_bias = grad.reshape(-1, ctx.n).sum(0)
    return grad_x, None, None, None, None, grad_bias, None, None, None, None, None, None


w4a16_matmul_op.register_autograd(_w4a16_backward, setup_context=_w4a16_setup_context)


def w4a16_matmul(x: Tensor, w, bias: Tensor | None = None, counters: Tensor | None = None,
                 light_ahead: bool = False) -> Tensor:
    return w4a16_matmul_op(x, w.packed, w.scales, w.zeros, w.perm, bias, w.group_size, w.n, w.k, w.codebook,
                           counters, light_ahead)


@torch.library.custom_op("tilefish::w4a16_matmul_epilogue", mutates_args=())
def w4a16_matmul_epilogue_op(x: Tensor, packed: Tensor, scales: Tensor, zeros: Optional[Tensor],
                             perm: Optional[Tensor], bias: Optional[Tensor], group_size: int, n: int, k: int,
                             codebook: str, counters: Optional[Tensor], residual: Optional[Tensor],
                             gated: bool) -> Tensor:
    # The matmul with a fused epilogue (ops.w4a16.validate_epilogue): inference only, no autograd (the
    # fused forwards that call it take the unfused path where a gradient is wanted).
    from .w4a16 import matmul_impl

    return matmul_impl(x, _w4a16_weight(packed, scales, zeros, perm, group_size, n, k, codebook), bias,
                       workspace=counters, residual=residual, gated=gated)


@w4a16_matmul_epilogue_op.register_fake
def _(x, packed, scales, zeros, perm, bias, group_size, n, k, codebook, counters, residual, gated):
    return x.new_empty(*x.shape[:-1], n // 2 if gated else n)


def _expert_weights(packed, scales, zeros, group_size, n, k, codebook):
    from .expert_weights import ExpertWeights

    return ExpertWeights(packed, scales, zeros, group_size, n, k, codebook)


@torch.library.custom_op("tilefish::moe_experts", mutates_args=())
def moe_experts_op(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_packed: Tensor, gate_up_scales: Tensor,
                   gate_up_zeros: Optional[Tensor], down_packed: Tensor, down_scales: Tensor,
                   down_zeros: Optional[Tensor], gate_up_bias: Optional[Tensor], down_bias: Optional[Tensor],
                   gate_up_group: int, down_group: int, gate_up_codebook: str, down_codebook: str, intermediate: int,
                   activation: str) -> Tensor:
    # No autograd: the expert weights are frozen and no backward is registered (inference only).
    from .moe import moe_experts_impl

    hidden = x.shape[-1]
    gate_up = _expert_weights(gate_up_packed, gate_up_scales, gate_up_zeros, gate_up_group, 2 * intermediate, hidden,
                              gate_up_codebook)
    down = _expert_weights(down_packed, down_scales, down_zeros, down_group, hidden, intermediate, down_codebook)
    return moe_experts_impl(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias)


@moe_experts_op.register_fake
def _(x, topk_ids, topk_weights, gate_up_packed, gate_up_scales, gate_up_zeros, down_packed, down_scales, down_zeros,
      gate_up_bias, down_bias, gate_up_group, down_group, gate_up_codebook, down_codebook, intermediate, activation):
    return x.new_empty(x.shape)


def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up, down, activation: str,
                gate_up_bias: Tensor | None = None, down_bias: Tensor | None = None) -> Tensor:
    return moe_experts_op(x, topk_ids, topk_weights, gate_up.packed, gate_up.scales, gate_up.zeros, down.packed,
                          down.scales, down.zeros, gate_up_bias, down_bias, gate_up.group_size, down.group_size,
                          gate_up.codebook, down.codebook, down.k, activation)


@torch.library.custom_op("tilefish::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # No autograd registered (an inference op): tilefish.norm.rms_norm sends calls that need gradients to the
    # pure-torch reference instead of this op.
    from .norm import rms_norm_impl

    return rms_norm_impl(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("tilefish::add_rms_norm", mutates_args=())
def add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    # (h, out): h = x + residual (the decoder's next residual), out = RMSNorm(h); both fresh tensors.
    from .norm import rms_norm_impl

    return rms_norm_impl(x, weight, eps, residual)


@add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("tilefish::rope_cache", mutates_args=("keys", "values", "length"))
def rope_cache_op(qkv: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, length: Tensor, heads: int,
                  kv_heads: int, counters: Optional[Tensor] = None, q_norm: Optional[Tensor] = None,
                  k_norm: Optional[Tensor] = None, norm_eps: float = 1e-6) -> Tensor:
    # q [B, T, heads, D]; keys / values / length written in place. counters: scratch the kernel leaves at zero
    # (the W4A16 convention), so not declared mutated. q_norm / k_norm: Qwen3's per-head norm weights, or None.
    from .rope_cache import rope_cache_impl

    return rope_cache_impl(qkv, cos, sin, keys, values, length, heads, kv_heads, counters, q_norm, k_norm, norm_eps)


@rope_cache_op.register_fake
def _(qkv, cos, sin, keys, values, length, heads, kv_heads, counters=None, q_norm=None, k_norm=None, norm_eps=1e-6):
    return qkv.new_empty((qkv.shape[0], qkv.shape[1], heads, keys.shape[-1]))


@torch.library.custom_op("tilefish::rope_attention", mutates_args=("keys", "values", "length"))
def rope_attention_op(qkv: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, length: Tensor,
                      mask: Optional[Tensor], scale: float, heads: int, kv_heads: int,
                      counters: Optional[Tensor] = None, early_kv: bool = False, q_norm: Optional[Tensor] = None,
                      k_norm: Optional[Tensor] = None, norm_eps: float = 1e-6) -> Tensor:
    # out [B, 1, heads, D]; keys / values / length written in place; counters left at zero (not mutated).
    from .rope_attention import rope_attention_impl

    return rope_attention_impl(qkv, cos, sin, keys, values, length, mask, scale, heads, kv_heads, counters,
                               q_norm, k_norm, norm_eps, early_kv=early_kv)


@rope_attention_op.register_fake
def _(qkv, cos, sin, keys, values, length, mask, scale, heads, kv_heads, counters=None, early_kv=False, q_norm=None,
      k_norm=None, norm_eps=1e-6):
    return qkv.new_empty((qkv.shape[0], 1, heads, keys.shape[-1]))
