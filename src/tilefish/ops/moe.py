"""The grouped expert op of mixture-of-experts layers: validate -> CPU reference or the CUDA launcher.

    y = moe_experts_impl(x, topk_ids, topk_weights, gate_up, down, "silu")

What it computes, for x [T, H], topk_ids [T, K], topk_weights [T, K], gate_up (E experts [2I, H]) and down
(E experts [H, I]), both ops/expert_weights.ExpertWeights:

    for every token t and slot j with e = topk_ids[t, j]:
        h    = x[t] @ dequant(gate_up[e])^T + gate_up_bias[e]      (fp32 accumulation)     [2I]
        gate = h[:I], up = h[I:]                                   (rows: gate first, then up)
        a    = act(gate, up), rounded to x.dtype                   (the second matmul's input)  [I]
        y[t] += topk_weights[t, j] * (a @ dequant(down[e])^T + down_bias[e])                   [H]
    y is summed in fp32 over the K slots and rounded once to x.dtype.

    act "silu":       silu(gate) * up                                     (Mixtral, Qwen-MoE, DeepSeek)
    act "swiglu_oai": g = min(gate, 7), u = clamp(up, -7, 7); (u + 1) * g * sigmoid(1.702 g)   (gpt-oss)

A slot may name any expert, several slots of one token the same one (each counts); experts no slot names
cost nothing. The order of the K-term sum is not specified (results may differ in the last fp32 bits).

Expert ids: int32 / int64 in [0, E). CPU inputs are checked (a ValueError naming the first bad id); a CUDA
call cannot raise on values without a device sync, so there an id outside [0, E) (negative, or E and above,
e.g. an expert-parallel "not mine" marker) is skipped: its slot contributes nothing and no memory outside
the weights is read.
"""
from __future__ import annotations

import torch

from .expert_weights import ExpertWeights
from .w4a16.layout import DTYPES

ACTIVATIONS = ("silu", "swiglu_oai")
SWIGLU_OAI_ALPHA = 1.702  # gpt-oss: glu = gate * sigmoid(alpha * gate)
SWIGLU_OAI_LIMIT = 7.0    # gpt-oss: gate clamped above at limit, up to [-limit, limit]
ID_DTYPES = (torch.int32, torch.int64)
ROUTING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def validate(x, topk_ids, topk_weights, gate_up, down, activation: str = "silu", gate_up_bias=None,
             down_bias=None) -> None:
    """Types, dtypes, shapes and devices of a moe_experts call (no values read): TypeError / ValueError
    naming the argument and the rule."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if not isinstance(w, ExpertWeights):
            raise TypeError(f"{name} must be a tilefish ExpertWeights, got {type(w).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise TypeError(f"x is {x.dtype} but gate_up's scales are {gate_up.dtype} and down's {down.dtype}; "
                        "convert the weights (ExpertWeights.to(dtype))")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden]; got shape {tuple(x.shape)}")
    hidden, experts = x.shape[1], gate_up.num_experts
    if down.num_experts != experts:
        raise ValueError(f"gate_up has {experts} experts but down has {down.num_experts}")
    if gate_up.k != hidden or down.n != hidden:
        raise ValueError(f"x has hidden size {hidden}; gate_up must be [E, 2I, H] and down [E, H, I] with H = "
                         f"{hidden}: got gate_up n={gate_up.n} k={gate_up.k}, down n={down.n} k={down.k}")
    if gate_up.n != 2 * down.k:
        raise ValueError(f"gate_up's n ({gate_up.n}) must be 2 x down's k (the intermediate size I = {down.k}): "
                         "gate rows, then up rows")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in ID_DTYPES:
        raise TypeError(f"topk_ids must be an int32 or int64 tensor, got {getattr(topk_ids, 'dtype', type(topk_ids))}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [tokens, K] with tokens = {x.shape[0]} (x's rows); got "
                         f"{tuple(topk_ids.shape)}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.dtype not in ROUTING_DTYPES:
        raise TypeError(f"topk_weights must be a float32 / float16 / bfloat16 tensor, got "
                        f"{getattr(topk_weights, 'dtype', type(topk_weights))}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}; got "
                         f"{tuple(topk_weights.shape)}")
    for name, bias, n in (("gate_up_bias", gate_up_bias, gate_up.n), ("down_bias", down_bias, down.n)):
        if bias is None:
            continue
        if not isinstance(bias, torch.Tensor) or bias.dtype != x.dtype or bias.shape != (experts, n):
            raise ValueError(f"{name} must be a {x.dtype} tensor [E, {n}] = {(experts, n)}; got "
                             f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
    tensors = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "gate_up": gate_up.packed,
               "down": down.packed, "gate_up_bias": gate_up_bias, "down_bias": down_bias}
    if len({t.device for t in tensors.values() if t is not None}) > 1:
        raise ValueError("all tensors must be on one device; got "
                         + ", ".join(f"{a} on {t.device}" for a, t in tensors.items() if t is not None))


def check_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Every id in [0, num_experts) (reads the values: the CPU path's check)."""
    bad = (topk_ids < 0) | (topk_ids >= num_experts)
    if bool(bad.any()):
        t, j = bad.nonzero()[0].tolist()
        raise ValueError(f"topk_ids[{t}, {j}] = {int(topk_ids[t, j])} is not an expert: ids must be in "
                         f"[0, {num_experts})")


def moe_experts_impl(x, topk_ids, topk_weights, gate_up: ExpertWeights, down: ExpertWeights,
                     activation: str = "silu", gate_up_bias=None, down_bias=None) -> torch.Tensor:
    """The op (module docstring): CPU tensors run reference.moe_experts, CUDA ones launch_cuda."""
    validate(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias)
    if x.device.type == "cpu":
        from ..reference import moe_experts

        check_ids(topk_ids, gate_up.num_experts)
        return moe_experts(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias)
    if x.device.type != "cuda":
        raise ValueError(f"the expert op runs on CUDA or CPU tensors, not {x.device}")
    if x.shape[0] == 0 or topk_ids.shape[1] == 0:
        return torch.zeros_like(x)
    return launch_cuda(x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), _contiguous(gate_up),
                       _contiguous(down), activation, _maybe_contiguous(gate_up_bias), _maybe_contiguous(down_bias))


def launch_cuda(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: ExpertWeights,
                down: ExpertWeights, activation: str, gate_up_bias: torch.Tensor | None,
                down_bias: torch.Tensor | None) -> torch.Tensor:
    """The CUDA grouped expert kernel(s): returns y [T, H] in x.dtype (module docstring), on the current
    stream, allocating only through torch (CUDA graphs), never synchronizing.

    Called with validated arguments: every tensor on one CUDA device and contiguous, T >= 1, K >= 1;
    x fp16 / bf16 [T, H]; topk_ids int32 / int64 [T, K] (ids outside [0, E) are skipped, not read);
    topk_weights fp32 / fp16 / bf16 [T, K]; gate_up [E, 2I, H] and down [E, H, I] in x.dtype, each with its
    own group size and codebook; the biases None or x.dtype [E, 2I] / [E, H]. A k split sums through
    the tile counters the layers of the device share (made when a layer moves there), else fresh ones."""
    from .moe_kernels import grouped_experts_cuda
    from .w4a16.workspace import layer_counters

    return grouped_experts_cuda(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias,
                                counters=layer_counters(x.device))


def _contiguous(w: ExpertWeights) -> ExpertWeights:
    if w.packed.is_contiguous() and w.scales.is_contiguous() and (w.zeros is None or w.zeros.is_contiguous()):
        return w
    return ExpertWeights(w.packed.contiguous(), w.scales.contiguous(), _maybe_contiguous(w.zeros), w.group_size,
                         w.n, w.k, w.codebook)


def _maybe_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()
