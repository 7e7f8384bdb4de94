"""The decode path of the grouped expert op: kernels/moe/decode.cu's two launches for few tokens.

    y = decode_experts(x, ids, weights, gate_up, down, "silu", gate_up_bias, down_bias, counters)

computes the op of ops/moe.py as one-row GEMVs per slot (s = t * K + j on expert ids[s]): no sorting, the
activation in the first launch's epilogue, the routing weights and each token's K-slot sum in the second's
(the kernel's header has the design). ops/moe_kernels.grouped_experts_cuda calls it when takes_decode_path
says so: each slot reads its expert's weights on its own, so the path pays off while few slots share an
expert (at one token on any MoE model, up to a few tokens on models of many experts).

Plan (plan_decode, a function of the shapes and the SM count only, never of routing values: graph-safe):
a unit is one 64-column strip of a slot's (down: a token's) output over a slice of k16 rows; slices cut k
so that about UNITS_PER_SM units run per SM, never finer than one batch of rows per warp.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..runtime import KernelSpec, get_kernel, i32, launch_prepared, prepare_launch
from .w4a16.configs import CODEBOOK_DEFINES
from .w4a16.layout import DTYPES

__all__ = ["DECODE_SOURCE", "DecodePlan", "decode_experts", "decode_specs", "plan_decode", "takes_decode_path"]

DECODE_SOURCE = "moe/decode.cu"
ACTIVATION_CODES = {"silu": 0, "swiglu_oai": 1}  # gated.cuh's ACT
ID_TYPES = {torch.int32: "int", torch.int64: "long long"}
WARPS = 8                   # decode.cu's kWarps
GATE_UP_ROWS_PER_BATCH = 4  # RW of the gate_up kernel: 2 strips x 4 k16 rows x 512 B in flight a warp
# NF4's decoder needs more registers: with 4 rows its gate_up kernel spills (groups 64 / 128, 128 registers),
# so it takes 2 (the plan's slices stay multiples of 4 rows, so of 2).
GATE_UP_ROWS_BY_CODEBOOK = {"nf4": 2}
DOWN_ROWS_PER_BATCH = 8     # RW of the down kernel: 1 strip x 8 rows
UNITS_PER_SM = 4            # the k slices aim at this many CTAs a SM (two run at once: __launch_bounds__)
# The path's domain, from forced runs of both paths on the H100 (scripts/experiments/moe_paths.py, docs/moe.md):
# the decode path ran 1.03-1.26x the grouped path's speed with int4 up to 16 slots where few slots share an
# expert (Qwen3-30B-A3B 1-2 tokens, gpt-oss 1-4, Mixtral 1-2), and fell behind from 32 slots or where experts
# are shared (Mixtral at 4 tokens: 0.84x).
DECODE_MAX_SLOTS = 16
DECODE_MAX_SHARING = 1.25   # slots per expected active expert


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
    """Launch sizes: k16 rows per slice and slices of each kernel; the workspace floats and tile counters a k
    split needs (0: none)."""

    gate_up_rows: int
    gate_up_slices: int
    down_rows: int
    down_slices: int
    workspace_floats: int
    counters: int


def _slices(units: int, k_rows: int, rows_per_batch: int, sm_count: int) -> tuple[int, int]:
    """(rows per slice, slices): about UNITS_PER_SM x sm_count CTAs over `units` units of k_rows k16 rows,
    a slice at least one batch per warp and a multiple of rows_per_batch (the kernel's batches stay aligned to
    scale groups)."""
    most = -(-k_rows // (WARPS * rows_per_batch))
    slices = max(1, min(most, round(UNITS_PER_SM * sm_count / max(units, 1))))
    rows = -(-k_rows // slices)
    rows = -(-rows // rows_per_batch) * rows_per_batch
    return rows, -(-k_rows // rows)


@functools.lru_cache(maxsize=1024)
def plan_decode(tokens: int, topk: int, hidden: int, inter: int, sm_count: int) -> DecodePlan:
    """The decode launches of x [tokens, hidden] through top-`topk` experts of intermediate size `inter` on a GPU
    of sm_count SMs."""
    slots = tokens * topk
    g_rows, g_slices = _slices(slots * (inter // 64), hidden // 16, GATE_UP_ROWS_PER_BATCH, sm_count)
    d_rows, d_slices = _slices(tokens * (hidden // 64) * topk, inter // 16, DOWN_ROWS_PER_BATCH, sm_count)
    gate_up_ws = slots * (inter // 64) * g_slices * 128 if g_slices > 1 else 0
    down_parts = topk * d_slices
    down_ws = tokens * (hidden // 64) * down_parts * 64 if down_parts > 1 else 0
    counters = max(slots * (inter // 64) if g_slices > 1 else 0, tokens * (hidden // 64) if down_parts > 1 else 0)
    return DecodePlan(g_rows, g_slices, d_rows, d_slices, max(gate_up_ws, down_ws), counters)


# ---- kernel specs ----------------------------------------------------------------------------------------------

def _defines(codebook: str) -> tuple[tuple[str, str], ...]:
    return ((CODEBOOK_DEFINES[codebook], "1"),) if codebook != "int4" else ()


def gate_up_spec(dtype: torch.dtype, group_size: int, zero_points: bool, codebook: str, activation: str,
                 id_dtype: torch.dtype) -> KernelSpec:
    group = 0 if group_size == -1 else group_size
    name = (f"moe_decode_gate_up<{DTYPES[dtype]}, {group}, {'true' if zero_points else 'false'}, "
            f"{ACTIVATION_CODES[activation]}, {ID_TYPES[id_dtype]}, "
            f"{GATE_UP_ROWS_BY_CODEBOOK.get(codebook, GATE_UP_ROWS_PER_BATCH)}>")
    return KernelSpec(DECODE_SOURCE, name, _defines(codebook), hot=True)


def down_spec(dtype: torch.dtype, group_size: int, zero_points: bool, codebook: str,
              id_dtype: torch.dtype) -> KernelSpec:
    group = 0 if group_size == -1 else group_size
    name = (f"moe_decode_down<{DTYPES[dtype]}, {group}, {'true' if zero_points else 'false'}, "
            f"{ID_TYPES[id_dtype]}, {DOWN_ROWS_PER_BATCH}>")
    return KernelSpec(DECODE_SOURCE, name, _defines(codebook), hot=True)


def decode_specs(formats) -> list[KernelSpec]:
    """Every decode kernel over `formats` ((group_size, zero points, codebook) triples), both dtypes, both
    activations and both id dtypes."""
    specs = []
    for dt in DTYPES:
        for g, zp, cb in formats:
            for ids in ID_TYPES:
                specs += [gate_up_spec(dt, g, zp, cb, act, ids) for act in ACTIVATION_CODES]
                specs.append(down_spec(dt, g, zp, cb, ids))
    return specs


# ---- the launches ----------------------------------------------------------------------------------------------

_kernels: dict[tuple[KernelSpec, int], object] = {}


def _kernel(spec: KernelSpec, index: int):
    kern = _kernels.get((spec, index))
    if kern is None:
        kern = _kernels[(spec, index)] = get_kernel(spec, index)
    return kern


def decode_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up, down, activation: str,
                   gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, plan: DecodePlan,
                   counter_ptr: int, index: int) -> torch.Tensor:
    """y [T, H] on the current stream. Arguments as grouped_experts_cuda has checked and prepared them: x
    contiguous and 16-byte aligned, ids contiguous, weights fp32 [T * K], gate_up / down StackedFormats,
    contiguous biases or None; counter_ptr: plan.counters zeroed int32 counters (0 when plan.counters is 0),
    left zero."""
    tokens, hidden = x.shape
    topk, experts, inter = ids.shape[1], gate_up.num_experts, down.k
    slots, dtype, dev = tokens * topk, x.dtype, x.device
    ws = torch.empty(plan.workspace_floats, dtype=torch.float32, device=dev) if plan.workspace_floats else None
    ws_ptr = 0 if ws is None else ws.data_ptr()
    act = torch.empty(slots, inter, dtype=dtype, device=dev)
    y = torch.empty(tokens, hidden, dtype=dtype, device=dev)
    k1 = _kernel(gate_up_spec(dtype, gate_up.group_size, gate_up.zeros is not None, gate_up.codebook, activation,
                              ids.dtype), index)
    k2 = _kernel(down_spec(dtype, down.group_size, down.zeros is not None, down.codebook, ids.dtype), index)
    launch_prepared(k1, prepare_launch(k1, (slots, inter // 64, plan.gate_up_slices), WARPS * 32),
                    x.data_ptr(), ids.data_ptr(), gate_up.packed.data_ptr(), gate_up.scales.data_ptr(),
                    0 if gate_up.zeros is None else gate_up.zeros.data_ptr(),
                    0 if gate_up_bias is None else gate_up_bias.data_ptr(), act.data_ptr(), ws_ptr, counter_ptr,
                    i32(topk), i32(experts), i32(hidden), i32(inter), i32(plan.gate_up_rows))
    launch_prepared(k2, prepare_launch(k2, (tokens, hidden // 64, topk * plan.down_slices), WARPS * 32),
                    act.data_ptr(), ids.data_ptr(), weights.data_ptr(), down.packed.data_ptr(),
                    down.scales.data_ptr(), 0 if down.zeros is None else down.zeros.data_ptr(),
                    0 if down_bias is None else down_bias.data_ptr(), y.data_ptr(), ws_ptr, counter_ptr,
                    i32(topk), i32(experts), i32(hidden), i32(inter), i32(plan.down_rows), i32(plan.down_slices))
    return y
