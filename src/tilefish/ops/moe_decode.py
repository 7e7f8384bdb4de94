"""The decode path of the grouped expert op: kernels/moe/decode.cu's two launches for few tokens.

    launch = DecodeLaunch(T, K, dtype, ids.dtype, weights.dtype, gate_up, down, "silu", gate_up_bias, down_bias,
                          device_index, sm_count, counters)
    y = launch(x, ids, weights)

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
from .w4a16.workspace import StreamTurn

__all__ = ["DECODE_SOURCE", "DecodeLaunch", "DecodePlan", "decode_specs", "plan_decode", "routing_dtype",
           "takes_decode_path"]

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
# The down launch under programmatic dependent launch (sm_90+): its CTAs start while gate_up's last ones finish,
# read their expert id and prefetch their weight rows into L2, then wait for gate_up (decode.cu).
PROGRAMMATIC_DOWN_LAUNCH = True
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


@functools.lru_cache(maxsize=None)
def gate_up_spec(dtype: torch.dtype, group_size: int, zero_points: bool, codebook: str, activation: str,
                 id_dtype: torch.dtype) -> KernelSpec:
    group = 0 if group_size == -1 else group_size
    name = (f"moe_decode_gate_up<{DTYPES[dtype]}, {group}, {'true' if zero_points else 'false'}, "
            f"{ACTIVATION_CODES[activation]}, {ID_TYPES[id_dtype]}, "
            f"{GATE_UP_ROWS_BY_CODEBOOK.get(codebook, GATE_UP_ROWS_PER_BATCH)}>")
    return KernelSpec(DECODE_SOURCE, name, _defines(codebook), hot=True)


def routing_dtype(weights_dtype: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype the down kernel reads the routing weights in: fp32 or the activation dtype as given (a
    router's output is usually the latter); any other float dtype is converted to fp32 first."""
    return weights_dtype if weights_dtype in (torch.float32, dtype) else torch.float32


@functools.lru_cache(maxsize=None)
def down_spec(dtype: torch.dtype, group_size: int, zero_points: bool, codebook: str, id_dtype: torch.dtype,
              weights_dtype: torch.dtype = torch.float32) -> KernelSpec:
    """weights_dtype: the routing weights', fp32 or `dtype` (routing_dtype)."""
    if weights_dtype not in (torch.float32, dtype):
        raise ValueError(f"the down kernel reads fp32 or {dtype} routing weights, not {weights_dtype}")
    group = 0 if group_size == -1 else group_size
    name = (f"moe_decode_down<{DTYPES[dtype]}, {group}, {'true' if zero_points else 'false'}, "
            f"{ID_TYPES[id_dtype]}, {DOWN_ROWS_PER_BATCH}, "
            f"{'float' if weights_dtype == torch.float32 else DTYPES[dtype]}>")
    return KernelSpec(DECODE_SOURCE, name, _defines(codebook), hot=True)


def decode_specs(formats) -> list[KernelSpec]:
    """Every decode kernel over `formats` ((group_size, zero points, codebook) triples), both dtypes, both
    activations, both id dtypes and both routing dtypes."""
    specs = []
    for dt in DTYPES:
        for g, zp, cb in formats:
            for ids in ID_TYPES:
                specs += [gate_up_spec(dt, g, zp, cb, act, ids) for act in ACTIVATION_CODES]
                specs += [down_spec(dt, g, zp, cb, ids, r) for r in (torch.float32, dt)]
    return specs


# ---- the launches ----------------------------------------------------------------------------------------------

class DecodeLaunch:
    """The decode path's two launches for one call signature (tokens, K, dtypes, the weights, the device),
    decided once: the plan, both kernels and launch configurations, and every argument but x, the ids, the
    routing weights, the outputs and the scratch. grouped_experts_cuda builds one a call; QuantizedExperts
    keeps one per signature, so an eager call only allocates and launches.

    Scratch: the activations a [S, I] and the k-split slots (plan.workspace_floats) share one allocation a
    call; the tile counters are the owner's `counters` when they have room (taken in turn by streams,
    workspace.py), else fresh zeros a call."""

    __slots__ = ("plan", "tokens", "hidden", "dtype", "weights_dtype", "device", "x_shape", "ids_shape", "id_dtype",
                 "kernels", "configs", "gate_up_weight", "gate_up_sizes", "down_weight", "down_sizes", "ws_offset",
                 "scratch_bytes", "counters", "keep")

    def __init__(self, tokens: int, topk: int, dtype: torch.dtype, id_dtype: torch.dtype,
                 weights_dtype: torch.dtype, gate_up, down, activation: str, gate_up_bias: torch.Tensor | None,
                 down_bias: torch.Tensor | None, index: int, sm_count: int, counters: torch.Tensor | None):
        """Arguments as grouped_experts_cuda has checked them: gate_up / down StackedFormats and the biases
        contiguous on device `index`; weights_dtype fp32 or dtype (routing_dtype); counters owned tile
        counters or None."""
        experts, hidden, inter = gate_up.num_experts, gate_up.k, down.k
        slots = tokens * topk
        self.plan = plan = plan_decode(tokens, topk, hidden, inter, sm_count)
        self.tokens, self.hidden, self.dtype, self.weights_dtype = tokens, hidden, dtype, weights_dtype
        self.device = torch.device("cuda", index)
        self.x_shape, self.ids_shape, self.id_dtype = (tokens, hidden), (tokens, topk), id_dtype
        self.kernels = (
            get_kernel(gate_up_spec(dtype, gate_up.group_size, gate_up.zeros is not None, gate_up.codebook,
                                 activation, id_dtype), index),
            get_kernel(down_spec(dtype, down.group_size, down.zeros is not None, down.codebook, id_dtype,
                              weights_dtype), index))
        self.configs = (prepare_launch(self.kernels[0], (slots, inter // 64, plan.gate_up_slices), WARPS * 32),
                        prepare_launch(self.kernels[1], (tokens, hidden // 64, topk * plan.down_slices),
                                       WARPS * 32, pdl=PROGRAMMATIC_DOWN_LAUNCH))
        sizes = (i32(topk), i32(experts), i32(hidden), i32(inter))
        self.gate_up_weight, self.gate_up_sizes = _pointers(gate_up, gate_up_bias), (*sizes, i32(plan.gate_up_rows))
        self.down_weight = _pointers(down, down_bias)
        self.down_sizes = (*sizes, i32(plan.down_rows), i32(plan.down_slices))
        act_bytes = slots * inter * dtype.itemsize
        self.ws_offset = -(-act_bytes // 256) * 256  # the fp32 slots start on their own 256-byte line
        self.scratch_bytes = self.ws_offset + 4 * plan.workspace_floats
        self.counters = counters if plan.counters and counters is not None and \
            plan.counters <= counters.numel() else None
        self.keep = (gate_up, down, gate_up_bias, down_bias)  # what the pointers point into

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """y [T, H] on the current stream, for x [T, H], ids [T, K] and routing weights [T, K] of the shapes,
        dtypes and device the launch was built for (the weights in any float dtype: another than the launch's
        is converted; other shapes, dtypes or devices are a ValueError). Non-contiguous or misaligned inputs are
        copied first."""
        x, ids = launch_inputs(self, "decode", x, ids, weights)
        if weights.dtype != self.weights_dtype:
            weights = weights.to(self.weights_dtype)
        weights = weights.contiguous()
        y = torch.empty(self.tokens, self.hidden, dtype=self.dtype, device=self.device)
        scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=self.device)
        act = scratch.data_ptr()
        ws = act + self.ws_offset if self.plan.workspace_floats else 0
        pointers = (x.data_ptr(), ids.data_ptr(), weights.data_ptr(), act, y.data_ptr(), ws)
        if not self.plan.counters:
            self._enqueue(*pointers, 0)
        elif self.counters is None:
            fresh = torch.zeros(self.plan.counters, dtype=torch.int32, device=self.device)  # held until enqueued
            self._enqueue(*pointers, fresh.data_ptr())
        else:
            with StreamTurn(self.counters, self.device.index) as counters:
                self._enqueue(*pointers, counters)
        return y

    def _enqueue(self, x: int, ids: int, weights: int, act: int, y: int, ws: int, counters: int) -> None:
        (k1, k2), (c1, c2) = self.kernels, self.configs
        launch_prepared(k1, c1, x, ids, *self.gate_up_weight, act, ws, counters, *self.gate_up_sizes)
        launch_prepared(k2, c2, act, ids, weights, *self.down_weight, y, ws, counters, *self.down_sizes)


def launch_inputs(launch, path: str, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """x and ids as a kept launch of `path` ("decode" / "grouped") reads them: checked against its signature
    (x_shape, dtype, ids_shape, id_dtype, device; float routing weights of ids' shape), a ValueError otherwise; x
    copied where it is not contiguous or 16-byte aligned (the kernels read its rows in 16-byte pieces), ids
    where not contiguous."""
    if x.shape != launch.x_shape or x.dtype != launch.dtype or ids.shape != launch.ids_shape or \
            ids.dtype != launch.id_dtype or weights.shape != launch.ids_shape or not weights.is_floating_point() or \
            x.device != launch.device or ids.device != launch.device or weights.device != launch.device:
        raise ValueError(f"this {path} launch takes x {launch.dtype} {launch.x_shape}, ids {launch.id_dtype} and "
                         f"float weights {launch.ids_shape} on {launch.device}; got x {x.dtype} {tuple(x.shape)} on "
                         f"{x.device}, ids {ids.dtype} {tuple(ids.shape)} on {ids.device}, weights "
                         f"{weights.dtype} {tuple(weights.shape)} on {weights.device}")
    if x.data_ptr() % 16 or not x.is_contiguous():
        x = x.contiguous()
        if x.data_ptr() % 16:
            x = x.clone()
    return x, ids.contiguous()


def _pointers(w, bias: torch.Tensor | None) -> tuple[int, int, int, int]:
    """packed, scales, zeros, bias: the kernels' weight arguments."""
    return (w.packed.data_ptr(), w.scales.data_ptr(), 0 if w.zeros is None else w.zeros.data_ptr(),
            0 if bias is None else bias.data_ptr())
