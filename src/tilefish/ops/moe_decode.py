"""The decode path of the grouped expert op: kernels/moe/decode.cu's one launch for few tokens.

    y = decode_experts(x, ids, weights, gate_up, down, "silu", gate_up_bias, down_bias, plan, sync_ptr, index)

computes the op of ops/moe.py as one-row GEMVs per slot (s = t * K + j on expert ids[s]): no sorting, the
activation in the gate_up units' epilogue, the routing weights and each token's K-slot sum in the down units',
all in one launch of persistent CTAs taking units in a fixed order (the kernel's header has the design).
ops/moe_kernels.grouped_experts_cuda calls it when takes_decode_path says so: each slot reads its expert's
weights on its own, so the path pays off while few slots share an expert (one token on any MoE model, a few
tokens on models of many experts).

Plan (plan_decode: a function of the shapes and the SM count only, never of routing values, so graph-safe):
a unit is one 64-column strip of a slot's (down: a token's) output over one batch of k16 rows per warp
(gate_up 8 x 4 rows, down 8 x 8); the grid is min(units, CTAS_PER_SM x SMs).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..runtime import KernelSpec, get_kernel, i32, launch_prepared, prepare_launch
from .w4a16.configs import CODEBOOK_DEFINES
from .w4a16.layout import DTYPES

__all__ = ["DECODE_SOURCE", "DecodePlan", "decode_experts", "decode_spec", "decode_specs", "plan_decode",
           "takes_decode_path"]

DECODE_SOURCE = "moe/decode.cu"
ACTIVATION_CODES = {"silu": 0, "swiglu_oai": 1}  # gated.cuh's ACT
ID_TYPES = {torch.int32: "int", torch.int64: "long long"}
WARPS = 8                   # decode.cu's kWarps
GATE_UP_ROWS = WARPS * 4    # k16 rows of a gate_up unit (kGateUpRows a warp)
DOWN_ROWS = WARPS * 8       # k16 rows of a down unit (kDownRows a warp)
CTAS_PER_SM = 2             # decode.cu's __launch_bounds__
# The path's domain: while each slot's expert is rarely another slot's, reading weights per slot costs
# little more than per expert (a repeat within one launch is mostly an L2 hit).
DECODE_MAX_SLOTS = 64
DECODE_MAX_SHARING = 1.5    # slots per expected active expert


def takes_decode_path(tokens: int, topk: int, experts: int) -> bool:
    """True when the decode kernels serve a call of `tokens` tokens, top-`topk` of `experts`: at most
    DECODE_MAX_SLOTS slots, each expert expected to serve at most DECODE_MAX_SHARING of them (uniform routing)."""
    slots = tokens * topk
    if topk >= experts:
        active = float(experts)
    else:
        active = experts * (1.0 - (1.0 - topk / experts) ** tokens)
    return slots <= DECODE_MAX_SLOTS and slots <= DECODE_MAX_SHARING * active


class DecodePlan(NamedTuple):
    """One launch: its CTAs, the units of each kind and their k slices, and the scratch: fp32 workspace floats of
    each kind's split sums (0: none) and int32 sync words (the kernel's header has their layout)."""

    ctas: int
    gate_up_units: int
    gate_up_slices: int
    down_units: int
    down_slices: int
    gate_up_workspace: int
    down_workspace: int
    sync_words: int


@functools.lru_cache(maxsize=1024)
def plan_decode(tokens: int, topk: int, hidden: int, inter: int, sm_count: int) -> DecodePlan:
    """The decode launch of x [tokens, hidden] through top-`topk` experts of intermediate size `inter` on a GPU
    of sm_count SMs (decode.cu's Shape computes the same units)."""
    slots = tokens * topk
    gu_strips, d_strips = inter // 64, hidden // 64
    gu_slices, d_slices = -(-(hidden // 16) // GATE_UP_ROWS), -(-(inter // 16) // DOWN_ROWS)
    gu_units, d_units = slots * gu_strips * gu_slices, tokens * d_strips * topk * d_slices
    gu_ws = slots * gu_strips * gu_slices * 128 if gu_slices > 1 else 0
    d_ws = tokens * d_strips * topk * d_slices * 64 if topk * d_slices > 1 else 0
    return DecodePlan(min(gu_units + d_units, CTAS_PER_SM * sm_count), gu_units, gu_slices, d_units, d_slices,
                      gu_ws, d_ws, 2 + slots + slots * gu_strips + tokens * d_strips)


# ---- kernel specs ----------------------------------------------------------------------------------------------

def decode_spec(dtype: torch.dtype, gate_up_format: tuple[int, bool], down_format: tuple[int, bool],
                codebook: str, activation: str, id_dtype: torch.dtype) -> KernelSpec:
    """The decode kernel of these (group size, zero points) formats of gate_up and down, one codebook."""
    (gg, gz), (dg, dz) = gate_up_format, down_format
    flag = lambda b: "true" if b else "false"  # noqa: E731
    name = (f"moe_decode<{DTYPES[dtype]}, {0 if gg == -1 else gg}, {flag(gz)}, {0 if dg == -1 else dg}, {flag(dz)}, "
            f"{ACTIVATION_CODES[activation]}, {ID_TYPES[id_dtype]}>")
    return KernelSpec(DECODE_SOURCE, name, ((CODEBOOK_DEFINES[codebook], "1"),) if codebook != "int4" else (),
                      hot=True)


def decode_specs(formats) -> list[KernelSpec]:
    """The decode kernels of both projections in one of `formats` ((group_size, zero points, codebook)), both
    dtypes, both activations and both id dtypes (other pairings of one codebook compile when first used)."""
    return [decode_spec(dt, (g, zp), (g, zp), cb, act, ids)
            for dt in DTYPES for g, zp, cb in formats for act in ACTIVATION_CODES for ids in ID_TYPES]


# ---- the launches ----------------------------------------------------------------------------------------------

_kernels: dict[tuple[KernelSpec, int], object] = {}


def _kernel(spec: KernelSpec, index: int):
    kern = _kernels.get((spec, index))
    if kern is None:
        kern = _kernels[(spec, index)] = get_kernel(spec, index)
    return kern


def decode_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down, activation: str,
                   gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, plan: DecodePlan, sync_ptr: int,
                   index: int) -> torch.Tensor:
    """y [T, H] on the current stream. Arguments as grouped_experts_cuda has checked and prepared them: x
    contiguous and 16-byte aligned, ids contiguous, weights fp32 [T * K], gate_up / down StackedFormats of one
    codebook, contiguous biases or None; sync_ptr: plan.sync_words zeroed int32 words, left zero."""
    tokens, hidden = x.shape
    topk, experts, inter = ids.shape[1], gate_up.num_experts, down.k
    dev = x.device
    ws = torch.empty(plan.gate_up_workspace + plan.down_workspace, dtype=torch.float32, device=dev)
    act = torch.empty(tokens * topk, inter, dtype=x.dtype, device=dev)
    y = torch.empty(tokens, hidden, dtype=x.dtype, device=dev)
    kern = _kernel(decode_spec(x.dtype, (gate_up.group_size, gate_up.zeros is not None),
                               (down.group_size, down.zeros is not None), gate_up.codebook, activation, ids.dtype),
                   index)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    launch_prepared(kern, prepare_launch(kern, plan.ctas, WARPS * 32),
                    x.data_ptr(), ids.data_ptr(), weights.data_ptr(),
                    gate_up.packed.data_ptr(), gate_up.scales.data_ptr(), ptr(gate_up.zeros), ptr(gate_up_bias),
                    down.packed.data_ptr(), down.scales.data_ptr(), ptr(down.zeros), ptr(down_bias),
                    act.data_ptr(), y.data_ptr(), ws.data_ptr(), ws.data_ptr() + 4 * plan.gate_up_workspace, sync_ptr,
                    i32(tokens), i32(topk), i32(experts), i32(hidden), i32(inter))
    return y
