"""Slow, exact pure-torch implementations of every op: the ground truth for tests and the CPU path of the ops.

One section per op family. Functions accept CPU or GPU tensors and favour obviously-correct arithmetic over
speed or memory.
"""
from __future__ import annotations

import torch


def _round_f64_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float64 ``x`` once, to nearest-even, to ``dtype``.

    torch converts float64 to float16/bfloat16 through float32, which rounds twice. Rounding to float32 *to odd*
    first makes the second rounding land where a single one would: float32 keeps at least p + 2 bits of both
    16-bit formats (p = 11 and 8).
    """
    if dtype == torch.float64:
        return x
    y = x.to(torch.float32)
    if dtype == torch.float32:
        return y
    # round to odd: truncate toward zero, then force the last mantissa bit to 1 when inexact
    y = torch.where(y.double().abs() > x.abs(), torch.nextafter(y, torch.zeros_like(y)), y)
    inexact = (y.double() != x).to(torch.int32)
    return (y.view(torch.int32) | inexact).view(torch.float32).to(dtype)


# ---------------------------------------------------------------------------------------------------------------------
# NF4 (bitsandbytes-compatible; format in tilefish.quant.nf4)
# ---------------------------------------------------------------------------------------------------------------------

def _nf4_indices(q) -> torch.Tensor:
    """The 4-bit codes as int64, padded with 0 to [nblocks, blocksize] (element order: high nibble first)."""
    c = q.codes
    idx = torch.stack((c >> 4, c & 0xF), dim=1).reshape(-1)[: q.numel].long()
    return torch.nn.functional.pad(idx, (0, q.nblocks * q.blocksize - q.numel)).view(q.nblocks, q.blocksize)


def _nf4_groups(q) -> torch.Tensor:
    from .quant.nf4 import NESTED_BLOCKSIZE

    return torch.arange(q.nblocks, device=q.codes.device) // NESTED_BLOCKSIZE


def nf4_absmax(q) -> torch.Tensor:
    """Decoded per-block absmax, fp32 [nblocks], in bitsandbytes' order of fp32 operations.

    Double quant: ``code2[absmax_q] * absmax2[b // 256]`` rounded to fp32, then ``+ offset`` rounded to fp32
    (two separate torch ops, so never fused into an FMA). Single level: ``absmax`` itself.
    """
    if not q.double_quant:
        return q.absmax.float()
    scale = q.code2[q.absmax_q.long()] * q.absmax2[_nf4_groups(q)]
    return scale + q.offset.reshape(())


def nf4_dequantize_fp32_chain(q, dtype: torch.dtype | None = None) -> torch.Tensor:
    """bitsandbytes' dequantize_4bit arithmetic exactly: fp32 absmax (``nf4_absmax``), ``NF4[code] * absmax``
    in fp32, then one cast to ``dtype`` (default: the weight's dtype). Returns shape ``q.shape``."""
    from .quant.nf4 import nf4_table

    dtype = q.dtype if dtype is None else dtype
    vals = nf4_table(q.codes.device)[_nf4_indices(q)]
    out = (vals * nf4_absmax(q)[:, None]).reshape(-1)[: q.numel]
    return out.to(dtype).reshape(q.shape)


def nf4_dequantize_f64(q, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The NF4 formula in float64 throughout, rounded once to ``dtype`` (default: the weight's dtype).

    Every fp32 input is exact in float64, so this is the exact value of the format up to the single final
    rounding: the yardstick for how far any fp32 evaluation order may drift (within an ulp of ``dtype``).
    """
    from .quant.nf4 import nf4_table

    dtype = q.dtype if dtype is None else dtype
    if q.double_quant:
        absmax = (q.code2.double()[q.absmax_q.long()] * q.absmax2.double()[_nf4_groups(q)]
                  + q.offset.double().reshape(()))
    else:
        absmax = q.absmax.double()
    vals = nf4_table(q.codes.device).double()[_nf4_indices(q)]
    out = (vals * absmax[:, None]).reshape(-1)[: q.numel]
    return _round_f64_to(out, dtype).reshape(q.shape)


# ----------------------------------------------------------------------------------------------------------------
# W4A16

def dense_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w^T (+ bias) in float64, one cast to x.dtype (w [n, k] any float dtype, exact in float64)."""
    y = x.to(torch.float64) @ w.to(torch.float64).t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(x.dtype)


def w4a16_matmul(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias): dequantize in fp32 (exact), matmul in float64, one cast to x.dtype.

    `w` is a tilefish.quant.int4.Int4Weight; x is [..., k] (already permuted for act-order weights).
    """
    wf = w.dequantize(torch.float64)
    y = x.to(torch.float64) @ wf.t()
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(x.dtype)


def w4a16_epilogue(y: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """The W4A16 kernels' fused epilogues (kernels/w4a16/epilogue.cuh) written as the unfused PyTorch forward,
    in y's dtype: `residual + y`; or, for a gated weight (columns alternating ops.w4a16 GATED_BLOCK gate and up
    columns), `silu(gate) * up`."""
    if gated:
        from .ops.w4a16.layout import split_gated

        gate, up = split_gated(y)
        return torch.nn.functional.silu(gate) * up
    return y if residual is None else residual + y


# ----------------------------------------------------------------------------------------------------------------
# Mixture of experts (the op's definition: ops/moe.py)

def moe_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate, up) of the expert op, in gate's dtype: "silu" silu(gate) * up; "swiglu_oai" (gpt-oss)
    (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g) with g = min(gate, 7)."""
    from .ops.moe import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "swiglu_oai":
        g = gate.clamp(max=SWIGLU_OAI_LIMIT)
        u = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        return (u + 1) * g * torch.sigmoid(SWIGLU_OAI_ALPHA * g)
    raise ValueError(f"unknown activation {activation!r}")


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up, down,
                activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The grouped expert op (ops/moe.py), expert by expert as transformers' experts modules loop: only the
    experts some slot names are dequantized (float64, exact); both matmuls, the activation and the weighted
    sum in float64; the activation rounded once to x.dtype (what the second matmul reads) and the result
    rounded once to x.dtype. Ids are taken as valid (the op checks them)."""
    tokens, hidden = x.shape
    inter = down.k
    out = torch.zeros(tokens, hidden, dtype=torch.float64, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = x[token].double() @ gate_up.expert(e).dequantize(torch.float64).t()
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].double()
        a = _round_f64_to(moe_activation(h[:, :inter], h[:, inter:], activation), x.dtype).double()
        y = a @ down.expert(e).dequantize(torch.float64).t()
        if down_bias is not None:
            y = y + down_bias[e].double()
        out.index_add_(0, token, y * topk_weights[token, slot].double()[:, None])
    return _round_f64_to(out, x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# RMSNorm (transformers' LlamaRMSNorm; the op in tilefish.ops.norm)

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """LlamaRMSNorm.forward's op order in plain torch, after `h = x + residual` when residual is given: bit for
    bit transformers' on the same device, and differentiable. Returns out, or (h, out) with a residual."""
    h = x if residual is None else x + residual
    h32 = h.to(torch.float32)
    variance = h32.pow(2).mean(-1, keepdim=True)
    out = weight * (h32 * torch.rsqrt(variance + eps)).to(h.dtype)
    return out if residual is None else (h, out)


# ----------------------------------------------------------------------------------------------------------------
# Rotary embedding + KV-cache write of a Llama-family attention step (the op in tilefish.ops.rope_cache)

def head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The RMSNorm of each head (last dim) in transformers' Qwen3RMSNorm op order: fp32 x * rsqrt(mean(x^2) + eps),
    rounded to x's dtype, times the weight."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               length: torch.Tensor, heads: int, kv_heads: int, q_norm: torch.Tensor | None = None,
               k_norm: torch.Tensor | None = None, norm_eps: float = 1e-6) -> torch.Tensor:
    """transformers' attention step between the q/k/v projection and the attention, on the fused projection's
    output qkv [B, T, (heads + 2 kv_heads) D]: apply_rotary_pos_emb's op order on q and k (bit for bit on the
    same device), then StaticLayer.update's write of k and v into keys / values [B, kv_heads, S, D] at positions
    length + arange(T) and length += T; positions >= S are not written. Returns q as [B, T, heads, D] (transpose
    dims 1 and 2 for transformers' query). q_norm / k_norm ([D], optional): each q / k head goes through
    head_norm first, as Qwen3's attention does."""
    b, t, _ = qkv.shape
    d = keys.shape[-1]
    q, k, v = qkv.view(b, t, heads + 2 * kv_heads, d).split([heads, kv_heads, kv_heads], dim=2)
    if q_norm is not None:
        q = head_norm(q, q_norm, norm_eps)
    if k_norm is not None:
        k = head_norm(k, k_norm, norm_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate_half(x):
        return torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)

    q = (q * c) + (rotate_half(q) * s)
    k = (k * c) + (rotate_half(k) * s)
    positions = torch.arange(t, device=keys.device) + length
    length.add_(t)
    kept = positions < keys.shape[2]
    keys[:, :, positions[kept]] = k[:, :, kept]
    values[:, :, positions[kept]] = v[:, :, kept]
    return q.transpose(1, 2).contiguous()
