"""tilefish.moe: mixture-of-experts layers with 4-bit experts (int4 groups, NF4 or MXFP4) on one grouped op.

    gate_up = tilefish.moe.ExpertWeights.from_weights(w_gate_up, "int4")   # dense [E, 2I, H]: gate rows, then up
    down = tilefish.moe.ExpertWeights.from_weights(w_down, "int4")         # dense [E, H, I]
    y = tilefish.moe.moe_experts(x, topk_ids, topk_weights, gate_up, down, "silu")   # x [T, H] -> [T, H]

    tilefish.quantize_model(model) converts a transformers MoE model's experts modules too
    (tilefish.experts.QuantizedExperts); docs/moe.md has the design.
"""
from __future__ import annotations

import torch

from .ops.expert_weights import ExpertWeights
from .ops.moe import ACTIVATIONS, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

__all__ = ["ExpertWeights", "ACTIVATIONS", "SWIGLU_OAI_ALPHA", "SWIGLU_OAI_LIMIT", "moe_experts"]


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: ExpertWeights,
                down: ExpertWeights, activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, H] = sum over each token's K slots of topk_weights x down(act(gate_up(x))), in x's dtype.

    x [T, H] fp16 / bf16 (the weights' dtype); topk_ids [T, K] int32 / int64, expert ids in [0, E);
    topk_weights [T, K] fp32 / fp16 / bf16; gate_up: E experts [2I, H] (gate rows first, then up);
    down: E experts [H, I]; activation "silu" (Mixtral, Qwen-MoE) or "swiglu_oai" (gpt-oss: alpha 1.702,
    limit 7); gate_up_bias [E, 2I] / down_bias [E, H] or None, in x's dtype.

    The exact semantics (fp32 accumulation, the activation rounded to x's dtype) are in
    tilefish.ops.moe's docstring. CPU tensors run the float64 reference (tilefish.reference.moe_experts)
    and check the ids; on CUDA an id outside [0, E) is skipped (its slot adds nothing). No gradients (the
    experts are frozen; no backward is registered). Works under torch.compile(fullgraph=True) (a custom op)."""
    if torch.compiler.is_compiling():
        from .ops import library

        return library.moe_experts(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias)
    from .ops.moe import moe_experts_impl

    return moe_experts_impl(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias)
