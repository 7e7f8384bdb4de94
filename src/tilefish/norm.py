"""tilefish.norm: the RMSNorm of Llama-family decoders, optionally after the residual add before it.

    out = tilefish.norm.rms_norm(x, layer.input_layernorm.weight, eps)          # LlamaRMSNorm(x)
    h, out = tilefish.norm.rms_norm(attn_out, layer.post_attention_layernorm.weight, eps, residual)
                                                                                # h = attn_out + residual
"""
from __future__ import annotations

import torch

__all__ = ["rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """transformers' LlamaRMSNorm of x, or of h = x + residual (then returns (h, out): h is the decoder's next
    residual); out = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype), in fp32 and in that op order.

    x [..., cols] fp16 / bf16 of any layout (the kernel reads a contiguous, aligned copy of a tensor that is not),
    cols a multiple of 8 up to 32768; weight [cols]
    and residual (x's shape) in x's dtype, on x's device; eps a finite float >= 0. Anything else raises a
    TypeError / ValueError naming the rule. CUDA runs one kernel (tilefish.ops.norm: programmatic dependent
    launch on sm_90+); CPU runs the reference, bit for bit transformers'. Works in CUDA graphs and under
    torch.compile(fullgraph=True) (custom ops tilefish::rms_norm / tilefish::add_rms_norm).

    Autograd: the kernel has none (an inference op). With grad enabled and x, weight or residual requiring
    grad, the call runs the differentiable pure-torch reference instead (LlamaRMSNorm's own ops, on any
    device): run inference under torch.no_grad() / torch.inference_mode() to get the kernel."""
    if torch.is_grad_enabled() and (getattr(x, "requires_grad", False) or getattr(weight, "requires_grad", False)
                                    or getattr(residual, "requires_grad", False)):
        from .ops.norm import check_inputs, rms_norm_reference

        if not torch.compiler.is_compiling():  # FakeTensors have no data pointer to check
            check_inputs(x, weight, eps, residual)
        return rms_norm_reference(x, weight, eps, residual)
    if torch.compiler.is_compiling():
        from .ops import library

        if residual is None:
            return library.rms_norm_op(x, weight, float(eps))
        return library.add_rms_norm_op(x, residual, weight, float(eps))
    from .ops.norm import rms_norm_impl

    return rms_norm_impl(x, weight, eps, residual)
