"""tilefish.w4a16: FP16/BF16 activations x INT4 weights (GPTQ-style groups) on tensor cores.

    w = tilefish.w4a16.quantize(linear.weight, group_size=128)     # or from_gptq(...) / from_awq(...)
    y = tilefish.w4a16.matmul(x, w, bias)                          # x [..., k] fp16/bf16 -> [..., n]
    h = tilefish.w4a16.matmul(x, w, residual=h)                    # h + x @ W^T, the add in the epilogue
    a = tilefish.w4a16.matmul(x, interleave_gated(w_gate_up), gated=True)  # silu(gate) * up, [..., n / 2]
    p = tilefish.w4a16.plan(16, 4096, 4096, group_size=128)        # what a call launches (any GPU: gpu=GpuSpec(...))
"""
from __future__ import annotations

import torch

from .ops.w4a16 import W4A16Weight, Workspace, deinterleave_gated, interleave_gated, pack, unpack
from .ops.w4a16.plan import MatmulPlan, plan
from .quant import int4 as _int4

__all__ = ["W4A16Weight", "Workspace", "MatmulPlan", "plan", "quantize", "matmul", "from_gptq", "from_awq", "pack",
           "unpack", "interleave_gated", "deinterleave_gated"]


def quantize(w: torch.Tensor, group_size: int = 128, symmetric: bool = True, *,
             dtype: torch.dtype | None = None, clip_search: bool = True) -> W4A16Weight:
    """Round-to-nearest int4 of a weight [n, k] (an nn.Linear's), scales minimising each group's error.

    dtype: the activation dtype the weight will be used with (fp16 or bf16); default w.dtype
    (fp16 for an fp32 weight).
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise TypeError("w must be a 2-D tensor [out_features, in_features]")
    scale_dtype = dtype or (w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.float16)
    q = _int4.quantize_rtn(w, group_size=group_size, symmetric=symmetric, clip_search=clip_search,
                           scale_dtype=scale_dtype)
    return pack(q)


def from_gptq(qweight, qzeros, scales, g_idx=None, *, zero_convention: str = "v1",
              group_size: int | None = None, dtype: torch.dtype | None = None) -> W4A16Weight:
    """A GPTQ QuantLinear's tensors (qweight [k/8, n], qzeros [k/G, n/8], scales [k/G, n], g_idx [k]).

    zero_convention: "v1" (stored zero = true zero - 1, classic AutoGPTQ) or "v2" (stored = true zero).
    Act-order g_idx is handled by permuting k (the op gathers x's columns)."""
    w, perm = _int4.from_gptq(qweight, qzeros, scales, g_idx, zero_convention=zero_convention, group_size=group_size)
    if dtype is not None:
        w = w.to(scale_dtype=dtype)
    return pack(w, perm)


def from_awq(qweight, qzeros, scales, *, group_size: int, dtype: torch.dtype | None = None) -> W4A16Weight:
    """An AWQ WQLinear_GEMM's tensors (qweight [k, n/8] packed in the order 0,2,4,6,1,3,5,7, qzeros, scales)."""
    w = _int4.from_awq(qweight, qzeros, scales, group_size=group_size)
    if dtype is not None:
        w = w.to(scale_dtype=dtype)
    return pack(w)


def matmul(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None = None, *,
           workspace: Workspace | None = None, residual: torch.Tensor | None = None,
           gated: bool = False) -> torch.Tensor:
    """y = x @ dequant(w)^T (+ bias). x [..., k] fp16/bf16 (CUDA: the tensor-core kernel; CPU: reference).

    workspace: tile counters for the plans that split a tile between CTAs (small m), made once with
    `Workspace(device)` and passed to every call; without one such a call zero-fills fresh counters
    (one memset more). W4A16Linear owns its own.

    The fused epilogues (one launch, the same bits as the unfused PyTorch expression):
    - residual: a tensor shaped like y: returns `residual + y`.
    - gated: w holds a SiLU-gated MLP's gate and up projections in the gated column order
      (interleave_gated of [gate; up]): returns `silu(gate) * up`, [..., n / 2].
    Both are inference only: with a gradient wanted they raise (write the unfused expression).

    Autograd: gradients flow to x and bias (through the exactly dequantized weight), the same on CUDA,
    on CPU and under torch.compile; the 4-bit weight is frozen."""
    counters = None if workspace is None else _counters(workspace)
    if residual is None and gated is False:
        return matmul_with_counters(x, w, bias, counters)
    return matmul_epilogue(x, w, bias, counters, residual, gated)


def matmul_with_counters(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None,
                         counters: torch.Tensor | None, light_ahead: bool = False) -> torch.Tensor:
    """matmul with a layer's own tile counters (W4A16Linear), or None: eager calls run the op's
    implementation directly (less host time); under torch.compile, and where autograd must record
    the call, they go through the custom op. light_ahead: ops.w4a16.matmul_impl's."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            getattr(x, "requires_grad", False) or (bias is not None and bias.requires_grad))):
        from .ops import library

        return library.w4a16_matmul(x, w, bias, counters, light_ahead)
    from .ops.w4a16 import matmul_impl

    return matmul_impl(x, w, bias, workspace=counters, light_ahead=light_ahead)


def matmul_epilogue(x: torch.Tensor, w: W4A16Weight, bias: torch.Tensor | None, counters: torch.Tensor | None,
                    residual: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """matmul with a fused epilogue (residual or gated) and a layer's own tile counters, or None."""
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (x, bias, residual)):
        raise RuntimeError("the fused W4A16 epilogues (residual=, gated=) are inference only; where a gradient is "
                           "wanted write the unfused expression (residual + matmul(x, w), or silu(gate) * up)")
    if torch.compiler.is_compiling():
        from .ops.library import w4a16_matmul_epilogue_op

        return w4a16_matmul_epilogue_op(x, w.packed, w.scales, w.zeros, w.perm, bias, w.group_size, w.n, w.k,
                                        w.codebook, counters, residual, gated)
    from .ops.w4a16 import matmul_impl

    return matmul_impl(x, w, bias, workspace=counters, residual=residual, gated=gated)


def _counters(workspace) -> torch.Tensor:
    if not isinstance(workspace, Workspace):
        raise TypeError(f"workspace must be a tilefish.w4a16.Workspace, got {type(workspace).__name__}")
    return workspace.counters
