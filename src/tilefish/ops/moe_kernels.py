"""The grouped expert GEMMs of mixture-of-experts layers on CUDA: the launches behind ops/moe.py's CUDA path.

    y = grouped_experts_cuda(x, topk_ids, topk_weights, gate_up, down, "silu", gate_up_bias, down_bias, counters)

computes ops/moe.py's op (y[t] = sum_j w[t, j] * down_e(act(gate_up_e(x[t]))), e = ids[t, j]) in five launches
on the current stream, S = T * K slots:

  1. moe/align.cu      sorts the slots by expert and cuts each expert's rows into blocks of <= BM rows: the block
                       table (max_blocks entries, unused ones -1), sorted_slot / sorted_token.
  2. w4a16/gemm.cu     -D TF_W4A16_GROUPED (blockIdx.x = block table entry): h [S, 2I] = x[sorted_token] @ gate_up_e^T
                       (+ bias), rows in sorted order.
  3. moe/act.cu        a [S, I] = act(gate, up) in fp32, rounded to x.dtype.
  4. w4a16/gemm.cu     grouped again: rows of a in sorted order, each written to its slot's row t*K + j of
                       out [S, H], times topk_weights[t, j] (fp32, after the bias, before the rounding).
  5. moe/combine.cu    y[t] = sum_j out[t*K + j] in fp32, slot order, rounded once.

Few tokens (ops/moe_decode.takes_decode_path) take the decode path instead: two launches, no sorting
(ops/moe_decode.py).

Every launch size is a function of (T, K, E, the shapes, the GPU) only, never of the routing values: the plan
(plan_grouped) holds the grids, so the op can be captured in a CUDA graph and replayed with new routing in the
captured input buffers. An expert id outside [0, E) is dropped by the alignment (its slot adds nothing; no
memory outside the tensors is touched for any id value).

Configuration (plan_grouped): the rows an active expert is expected to get, S / (expected active experts),
pick the mma.sync tile like the dense dispatcher picks it from m: <= 8 rows the swap configuration (blocks of 8
rows), <= 16 16-row tiles, else 32-row tiles; the column tile is the widest of 256 / 128 / 64 dividing n
(gpt-oss' 2880 = 45 x 64); the k split puts about two CTAs an SM on the expected active blocks
(dispatch.choose_slices); the shared memory is fitted to the GPU (dispatch.fit_mma_smem).

Scratch (ops/w4a16/workspace.py's rules): the index lists, h, a, out and fp32 partials are one allocation from
torch's caching allocator per call and die with it; a k split's tile counters are the caller's `counters` (zero,
and left zero by the fixup) when they have room, else fresh zeroed ones.

GroupedLaunch holds a call signature's launches (as moe_decode.DecodeLaunch does the decode path's): the op builds
one a call, QuantizedExperts keeps one per signature (experts_launch), so its eager calls only allocate and launch.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import NamedTuple

import torch

from ..runtime import KernelSpec, device_info, get_kernel, i32, i64, launch_prepared, prepare_launch
from ..runtime.device import SMEM_PER_BLOCK_BY_CC
from .moe_decode import DecodeLaunch, decode_specs, launch_inputs, routing_dtype, takes_decode_path
from .w4a16.configs import THREADS, GemmConfig, kernel_spec
from .w4a16.dispatch import NF4_GROUPS, choose_slices, fit_mma_smem
from .w4a16.layout import BK, CODEBOOKS, DTYPES, MXFP4_GROUP, TABLE_CODEBOOKS, check_shape
from .w4a16.workspace import StreamTurn, check_counters

__all__ = ["ACTIVATION_CODES", "GROUPED_DEFINE", "MAX_EXPERTS", "Alignment", "GroupedGemm", "GroupedLaunch",
           "GroupedPlan",
           "StackedFormat", "act_spec", "align_experts", "align_spec", "check_grouped_args", "combine_spec",
           "experts_launch", "expected_active_experts", "grouped_config", "grouped_experts_cuda", "grouped_gemm_spec",
           "kernel_specs", "max_blocks", "plan_grouped", "stacked_format"]

GROUPED_DEFINE = "TF_W4A16_GROUPED"
ALIGN_SOURCE, ACT_SOURCE, COMBINE_SOURCE = "moe/align.cu", "moe/act.cu", "moe/combine.cu"
ACTIVATION_CODES = {"silu": 0, "swiglu_oai": 1}  # moe/act.cu's ACT template argument
ID_TYPES = {torch.int32: "int", torch.int64: "long long"}
# The alignment keeps 3E + 1 ints of shared memory: 2048 experts stay under the 48 KB a launch gets
# without opting in (the largest MoE models have 512).
MAX_EXPERTS = 2048
SWAP_BLOCK_ROWS = 8     # a swap-mode block takes 8 rows (gemm.cu: x^T is the 8-column B operand)
EPILOGUE_THREADS = 128  # act.cu / combine.cu: 8 columns a thread


class StackedFormat(NamedTuple):
    """What the kernels need of one stacked projection (ExpertWeights, or a dict / object with these fields)."""

    packed: torch.Tensor          # int32 [E, n/64, 8k]
    scales: torch.Tensor          # [E, groups, n], the activation dtype
    zeros: torch.Tensor | None    # like scales, or None (symmetric)
    n: int
    k: int
    group_size: int
    codebook: str

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def groups(self) -> int:
        return 1 if self.group_size == -1 else self.k // self.group_size


def stacked_format(w, name: str = "weight") -> StackedFormat:
    """A StackedFormat from an ExpertWeights-like object or a dict with packed, scales, zeros, n, k, group_size,
    codebook (optional, "int4"); a missing field is a TypeError naming it."""
    get = w.get if isinstance(w, dict) else lambda key, default=None: getattr(w, key, default)
    missing = [f for f in ("packed", "scales", "n", "k", "group_size") if get(f) is None]
    if missing:
        raise TypeError(f"{name} must be an ExpertWeights or a dict of packed, scales, zeros, n, k, group_size, "
                        f"codebook; it has no {', '.join(missing)}")
    return StackedFormat(get("packed"), get("scales"), get("zeros"), int(get("n")), int(get("k")),
                         int(get("group_size")), get("codebook", "int4") or "int4")


# ---- the plan (pure functions of numbers: tested on the CPU) ---------------------------------------------------

def expected_active_experts(tokens: int, topk: int, experts: int) -> float:
    """Experts with at least one slot, expected under uniform routing (each token's K ids distinct):
    E (1 - (1 - K/E)^T); K for one token, min(S, E) at most."""
    if topk >= experts:
        return float(experts)
    return experts * (1.0 - (1.0 - topk / experts) ** tokens)


def max_blocks(slots: int, experts: int, block_m: int) -> int:
    """Block table entries that hold any routing: the sum over experts of ceil(rows / BM) is at most
    S / BM + (experts with rows) (1 - 1/BM) <= ceil(S / BM) + min(E, S)."""
    return -(-slots // block_m) + min(experts, slots)


def grouped_config(rows_per_expert: float, n: int) -> GemmConfig:
    """The mma.sync configuration of a grouped GEMM whose active experts get about rows_per_expert rows, over
    n columns (n % 64 == 0): the tile height as the dense dispatcher picks it from m (<= 8 rows: swapped
    operands, weights in a register ring; <= 16: 16-row tiles; else 32-row tiles), the widest column tile of
    256 / 128 / 64 dividing n (the dense dispatcher's configurations of that height and width)."""
    wn = 4 if n % 256 == 0 else 2 if n % 128 == 0 else 1
    if rows_per_expert <= SWAP_BLOCK_ROWS:
        return {4: GemmConfig(1, 4, 2, 3, swap=True, breg=True), 2: GemmConfig(1, 2, 4, 6, swap=True, breg=True),
                1: GemmConfig(1, 1, 8, 4, swap=True, breg=True)}[wn]
    if rows_per_expert <= 16:
        return {4: GemmConfig(1, 4, 2, 4), 2: GemmConfig(1, 2, 4, 4, breg=True), 1: GemmConfig(1, 1, 8, 4)}[wn]
    return GemmConfig(2, wn, 8 // wn, 4)


def block_rows_of(cfg: GemmConfig) -> int:
    """Rows of one block table entry for cfg: 8 in swap mode, else the tile height."""
    return SWAP_BLOCK_ROWS if cfg.swap else cfg.bm


class GroupedGemm(NamedTuple):
    """One grouped GEMM's launch: configuration, k split, dynamic shared memory, column tiles, and the scratch it
    needs (fp32 partial sums, tile counters; both 0 without a k split). Grid (max_blocks, n_tiles, slices)."""

    config: GemmConfig
    slices: int
    smem: int
    n_tiles: int
    partial_floats: int
    tile_counters: int


class GroupedPlan(NamedTuple):
    """The launches of one grouped expert call: rows a block table entry takes (block_m), the table's length,
    and the two GEMMs (gate_up: n = 2I, k = H; down: n = H, k = I)."""

    block_m: int
    max_blocks: int
    gate_up: GroupedGemm
    down: GroupedGemm


def _gemm_plan(cfg: GemmConfig, blocks: int, expected_blocks: int, n: int, k: int, group: int, zero_points: bool,
               sm_count: int, smem_limit: int | None) -> GroupedGemm:
    cfg = fit_mma_smem(cfg, group, zero_points, smem_limit)
    n_tiles = n // cfg.bn
    slices = max(1, min(choose_slices(expected_blocks * n_tiles, -(-k // BK), sm_count), 65535))
    split = slices > 1
    tiles = blocks * n_tiles
    return GroupedGemm(cfg, slices, cfg.smem_bytes(group, zero_points), n_tiles,
                       tiles * slices * cfg.bm * cfg.bn if split else 0, tiles if split else 0)


@functools.lru_cache(maxsize=1024)
def plan_grouped(tokens: int, topk: int, experts: int, hidden: int, inter: int,
                 gate_up_format: tuple[int, bool], down_format: tuple[int, bool], sm_count: int,
                 smem_limit: int | None = None) -> GroupedPlan:
    """The plan of a call with x [tokens, hidden], K = topk, E = experts, gate_up [E, 2 inter, hidden] and
    down [E, hidden, inter] of formats (group_size, zero points) on a GPU of sm_count SMs and smem_limit bytes
    of shared memory per block (None: no limit). Cached; depends on no routing value.

    The k split: on the H100 (bf16, CUDA graphs) it came within 0-9% of the best of 20 forced splits (gate_up
    x1-4, down x1-8) on six decode shapes (gpt-oss E 32 / 128 at T 1 / 4 / 16, Mixtral T 1, Qwen3-30B T 1)."""
    slots = tokens * topk
    active = expected_active_experts(tokens, topk, experts)
    rows = slots / active
    cfg1, cfg2 = grouped_config(rows, 2 * inter), grouped_config(rows, hidden)
    block_m = block_rows_of(cfg1)  # the same height for both (one block table): it depends on rows only
    blocks = max_blocks(slots, experts, block_m)
    expected_blocks = max(1, round(active * math.ceil(rows / block_m)))
    return GroupedPlan(block_m, blocks,
                       _gemm_plan(cfg1, blocks, expected_blocks, 2 * inter, hidden, *gate_up_format, sm_count,
                                  smem_limit),
                       _gemm_plan(cfg2, blocks, expected_blocks, hidden, inter, *down_format, sm_count, smem_limit))


# ---- kernel specs ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)  # pure, and asked for on every call
def grouped_gemm_spec(dtype: torch.dtype, cfg: GemmConfig, group_size: int, zero_points: bool,
                      codebook: str = "int4") -> KernelSpec:
    """The mma.sync kernel of cfg and this weight format, built grouped (gemm.cu's TF_W4A16_GROUPED)."""
    spec = kernel_spec(dtype, cfg, group_size, zero_points, codebook)
    return replace(spec, defines=spec.defines + ((GROUPED_DEFINE, "1"),))


@functools.lru_cache(maxsize=None)
def align_spec(id_dtype: torch.dtype) -> KernelSpec:
    return KernelSpec(ALIGN_SOURCE, f"moe_align<{ID_TYPES[id_dtype]}>", hot=True)


@functools.lru_cache(maxsize=None)
def act_spec(dtype: torch.dtype, activation: str) -> KernelSpec:
    return KernelSpec(ACT_SOURCE, f"moe_act<{DTYPES[dtype]}, {ACTIVATION_CODES[activation]}>", hot=True)


@functools.lru_cache(maxsize=None)
def combine_spec(dtype: torch.dtype, id_dtype: torch.dtype) -> KernelSpec:
    return KernelSpec(COMBINE_SOURCE, f"moe_combine<{DTYPES[dtype]}, {ID_TYPES[id_dtype]}>", hot=True)


# Every weight format a stacked projection may have: (group_size, zero points, codebook).
FORMATS = ([(g, zp, "int4") for g in (-1, 32, 64, 128) for zp in (False, True)]
           + [(g, False, "nf4") for g in NF4_GROUPS] + [(MXFP4_GROUP, False, "mxfp4")])


def kernel_specs(arch: str | None = None) -> list[KernelSpec]:
    """Every KernelSpec grouped_experts_cuda can launch on a GPU of `arch` ("sm_80"; None: any GPU): the
    alignment, activation and combine kernels, and the grouped GEMMs of every grouped_config, fitted to the
    arch's shared memory, in every weight format and dtype."""
    cc = None if arch is None else int(arch.removeprefix("sm_").rstrip("a"))
    limits = ({SMEM_PER_BLOCK_BY_CC.get(cc)} if cc is not None else set(SMEM_PER_BLOCK_BY_CC.values()) | {None})
    base = {grouped_config(rows, n) for rows in (1, 16, 64) for n in (64, 128, 256)}
    configs = sorted({fit_mma_smem(c, g, zp, lim) for c in base for lim in limits for g, zp, _ in FORMATS},
                     key=lambda c: c.label())
    specs = [align_spec(t) for t in ID_TYPES]
    specs += [act_spec(dt, a) for dt in DTYPES for a in ACTIVATION_CODES]
    specs += [combine_spec(dt, t) for dt in DTYPES for t in ID_TYPES]
    specs += [grouped_gemm_spec(dt, c, g, zp, cb) for dt in DTYPES for c in configs for g, zp, cb in FORMATS]
    specs += decode_specs(FORMATS)
    return list(dict.fromkeys(specs))


# ---- validation ------------------------------------------------------------------------------------------------

def _check_format(w: StackedFormat, name: str, dtype: torch.dtype, device: torch.device) -> None:
    check_shape(w.n, w.k, w.group_size)
    if w.codebook not in CODEBOOKS or (w.codebook in TABLE_CODEBOOKS and w.zeros is not None) or \
            (w.codebook == "nf4" and w.group_size == -1) or (w.codebook == "mxfp4" and w.group_size != MXFP4_GROUP):
        raise ValueError(f"{name}: codebook {w.codebook!r} with group_size {w.group_size} and "
                         f"{'zero points' if w.zeros is not None else 'no zero points'}: the kernels take int4 (any "
                         f"group, zero points or not), nf4 (groups {NF4_GROUPS}) or mxfp4 (group {MXFP4_GROUP}), "
                         "the table codebooks without zero points")
    if not isinstance(w.packed, torch.Tensor) or w.packed.dtype != torch.int32 or w.packed.dim() != 3 or \
            w.packed.shape[1:] != (w.n // 64, 8 * w.k):
        raise ValueError(f"{name}.packed must be int32 [E, n/64, 8k] = [E, {w.n // 64}, {8 * w.k}]; got "
                         f"{getattr(w.packed, 'dtype', type(w.packed).__name__)} "
                         f"{tuple(getattr(w.packed, 'shape', ()))}")
    experts = w.packed.shape[0]
    for part, t in (("scales", w.scales), ("zeros", w.zeros)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != (experts, w.groups, w.n):
            raise ValueError(f"{name}.{part} must be {dtype} [E, groups, n] = {(experts, w.groups, w.n)}; got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    for part, t in (("packed", w.packed), ("scales", w.scales), ("zeros", w.zeros)):
        if t is None:
            continue
        if t.device != device:
            raise ValueError(f"{name}.{part} is on {t.device}, x on {device}")
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name}.{part} must be contiguous and 16-byte aligned (expert e's tensors start at "
                             "e x the elements of one expert)")


def check_grouped_args(x, topk_ids, topk_weights, gate_up: StackedFormat, down: StackedFormat, activation: str,
                       gate_up_bias, down_bias, counters) -> None:
    """Types, dtypes, shapes, devices and layouts of a grouped_experts_cuda call (no value read): a TypeError /
    ValueError naming the argument, before any launch."""
    if not isinstance(x, torch.Tensor) or x.dtype not in DTYPES or x.dim() != 2:
        raise TypeError(f"x must be a float16 / bfloat16 tensor [T, H]; got {getattr(x, 'dtype', type(x).__name__)} "
                        f"{tuple(getattr(x, 'shape', ()))}")
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation must be one of {tuple(ACTIVATION_CODES)}, got {activation!r}")
    tokens, hidden = x.shape
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype not in ID_TYPES or topk_ids.dim() != 2 or \
            topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids must be int32 / int64 [T, K] with T = {tokens}; got "
                         f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)} "
                         f"{tuple(getattr(topk_ids, 'shape', ()))}")
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point() or \
            topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must be a floating tensor of topk_ids' shape {tuple(topk_ids.shape)}; got "
                         f"{getattr(topk_weights, 'dtype', type(topk_weights).__name__)} "
                         f"{tuple(getattr(topk_weights, 'shape', ()))}")
    _check_format(gate_up, "gate_up", x.dtype, x.device)
    _check_format(down, "down", x.dtype, x.device)
    experts = gate_up.num_experts
    if down.num_experts != experts:
        raise ValueError(f"gate_up has {experts} experts, down {down.num_experts}")
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"{experts} experts: the alignment kernel takes 1 to {MAX_EXPERTS}")
    if gate_up.k != hidden or down.n != hidden or gate_up.n != 2 * down.k:
        raise ValueError(f"shapes: x [T, H = {hidden}] needs gate_up [E, 2I, H] and down [E, H, I]; got gate_up "
                         f"n={gate_up.n} k={gate_up.k}, down n={down.n} k={down.k}")
    for name, bias, n in (("gate_up_bias", gate_up_bias, gate_up.n), ("down_bias", down_bias, down.n)):
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dtype != x.dtype
                                 or bias.shape != (experts, n)):
            raise ValueError(f"{name} must be a {x.dtype} tensor [E, {n}] = {(experts, n)}; got "
                             f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("gate_up_bias", gate_up_bias),
                    ("down_bias", down_bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if counters is not None:
        check_counters(counters, x.device)
    if x.device.type != "cuda":
        raise ValueError(f"grouped_experts_cuda runs on CUDA tensors; x is on {x.device} (the CPU path is "
                         "reference.moe_experts)")


# ---- the launches ----------------------------------------------------------------------------------------------

class Alignment(NamedTuple):
    """moe/align.cu's outputs (views of one int32 allocation; its header has the meanings): sorted_slot and
    sorted_token [S] (rows past meta[0] unwritten), block_expert / block_start / block_rows [max_blocks],
    meta [2] = (sorted rows, blocks used)."""

    sorted_slot: torch.Tensor
    sorted_token: torch.Tensor
    block_expert: torch.Tensor
    block_start: torch.Tensor
    block_rows: torch.Tensor
    meta: torch.Tensor


def align_experts(topk_ids: torch.Tensor, experts: int, block_m: int, blocks: int | None = None) -> Alignment:
    """Launch the alignment of contiguous CUDA topk_ids [T, K] (int32 / int64) for `experts` experts into blocks of
    at most block_m rows and a table of `blocks` entries (None: max_blocks(S, E, block_m); fewer may drop rows).
    No value is read on the host."""
    if topk_ids.dtype not in ID_TYPES or topk_ids.dim() != 2 or not topk_ids.is_contiguous() or not topk_ids.is_cuda:
        raise ValueError("topk_ids must be a contiguous int32 / int64 CUDA tensor [T, K]")
    if not 1 <= experts <= MAX_EXPERTS or block_m < 1:
        raise ValueError(f"experts must be in [1, {MAX_EXPERTS}] and block_m >= 1; got {experts}, {block_m}")
    tokens, topk = topk_ids.shape
    slots = tokens * topk
    blocks = max_blocks(slots, experts, block_m) if blocks is None else blocks
    buf = torch.empty(_alignment_ints(slots, blocks), dtype=torch.int32, device=topk_ids.device)
    index = topk_ids.device.index if topk_ids.device.index is not None else torch.cuda.current_device()
    kern, config, sizes = _align_launch(topk_ids.dtype, index, slots, topk, experts, block_m, blocks)
    al = _alignment(buf, slots, blocks)
    launch_prepared(kern, config, topk_ids.data_ptr(), *sizes, *(p.data_ptr() for p in al))
    return al


def _alignment_sizes(slots: int, blocks: int) -> list[int]:
    """The int32 lengths of the Alignment's parts, in order (the one statement of its layout)."""
    return [slots, slots, blocks, blocks, blocks, 2]


def _alignment_ints(slots: int, blocks: int) -> int:
    return sum(_alignment_sizes(slots, blocks))


def _alignment(buf: torch.Tensor, slots: int, blocks: int) -> Alignment:
    """The Alignment views of buf (int32, at least _alignment_ints(slots, blocks) long)."""
    return Alignment(*buf[:_alignment_ints(slots, blocks)].split(_alignment_sizes(slots, blocks)))


def _align_launch(id_dtype: torch.dtype, index: int, slots: int, topk: int, experts: int, block_m: int,
                  blocks: int):
    """moe/align.cu's kernel, launch configuration and size arguments (then ids and the Alignment's pointers)."""
    kern = get_kernel(align_spec(id_dtype), index)
    threads = 256 if max(slots, experts) <= 2048 else 1024
    return (kern, prepare_launch(kern, 1, threads, 4 * (3 * experts + 1)),
            (i32(slots), i32(topk), i32(experts), i32(block_m), i32(blocks)))


def _gemm_args(w: StackedFormat, bias: torch.Tensor | None) -> tuple:
    """A grouped GEMM's weight arguments (before the output) and its per-expert strides (after the row lists)."""
    per_expert = w.groups * w.n  # elements of one expert's scales / zero points
    return ((w.packed.data_ptr(), w.scales.data_ptr(), 0 if w.zeros is None else w.zeros.data_ptr(),
             0 if bias is None else bias.data_ptr()),
            (i64(w.n // 64 * 8 * w.k), i64(per_expert), i64(per_expert), i64(w.n)))


def _threads(vectors: int) -> int:
    """Threads of an act / combine block over `vectors` 8-column vectors: whole warps, at most 128."""
    return min(EPILOGUE_THREADS, 32 * -(-vectors // 32))


def _aligned_up(n: int, to: int = 256) -> int:
    return -(-n // to) * to


class GroupedLaunch:
    """The grouped path's five launches (module docstring) for one call signature (tokens, K, dtypes, the
    weights, the device), decided once: the plan, the kernels and launch configurations, every argument but the
    inputs, the output and the scratch, and the scratch's layout. grouped_experts_cuda builds one a call;
    QuantizedExperts keeps one per signature, so an eager call allocates its output and one scratch block, casts
    the routing weights to fp32 where they are not, and launches.

    Scratch, one allocation a call, 256-byte aligned parts: the alignment's int32 lists, h [S, 2I] whose memory
    out [S, H] reuses once the activation has read it, a [S, I], and the fp32 partials of a k split (the two GEMMs
    run one after the other on the stream, so they share them). Tile counters: the owner's `counters` when they
    have room (taken in turn by streams, workspace.py), else fresh zeros a call."""

    __slots__ = ("plan", "tokens", "topk", "experts", "hidden", "inter", "dtype", "id_dtype", "device", "x_shape",
                 "ids_shape", "align", "gemms", "act", "combine", "offsets", "scratch_bytes", "counter_ints", "counters",
                 "keep")

    def __init__(self, tokens: int, topk: int, dtype: torch.dtype, id_dtype: torch.dtype, gate_up: StackedFormat,
                 down: StackedFormat, activation: str, gate_up_bias: torch.Tensor | None,
                 down_bias: torch.Tensor | None, index: int, counters: torch.Tensor | None):
        """Arguments as grouped_experts_cuda has checked them (the biases contiguous on device `index`)."""
        info = device_info(index)
        experts, hidden, inter = gate_up.num_experts, gate_up.k, down.k
        slots = tokens * topk
        self.plan = plan = plan_grouped(tokens, topk, experts, hidden, inter,
                                        (gate_up.group_size, gate_up.zeros is not None),
                                        (down.group_size, down.zeros is not None), info.sm_count,
                                        info.smem_per_block_optin)
        self.tokens, self.topk, self.experts, self.hidden, self.inter = tokens, topk, experts, hidden, inter
        self.dtype, self.id_dtype, self.device = dtype, id_dtype, torch.device("cuda", index)
        self.x_shape, self.ids_shape = (tokens, hidden), (tokens, topk)
        self.align = _align_launch(id_dtype, index, slots, topk, experts, plan.block_m, plan.max_blocks)
        self.gemms = []
        for g, w, bias in ((plan.gate_up, gate_up, gate_up_bias), (plan.down, down, down_bias)):
            kern = get_kernel(grouped_gemm_spec(dtype, g.config, w.group_size, w.zeros is not None, w.codebook), index)
            head, strides = _gemm_args(w, bias)
            self.gemms.append((kern, prepare_launch(kern, (plan.max_blocks, g.n_tiles, g.slices), THREADS, g.smem),
                               head, (i32(w.n), i32(w.k), i32(g.slices)), strides, g.tile_counters > 0))
        kern, threads = get_kernel(act_spec(dtype, activation), index), _threads(inter // 8)
        self.act = (kern, prepare_launch(kern, (slots, -(-inter // (8 * threads)), 1), threads))
        kern, threads = get_kernel(combine_spec(dtype, id_dtype), index), _threads(hidden // 8)
        self.combine = (kern, prepare_launch(kern, (tokens, -(-hidden // (8 * threads)), 1), threads))
        # scratch: alignment ints | h, then out | a | fp32 partials
        h_bytes = slots * max(2 * inter, hidden) * dtype.itemsize
        parts = [4 * _alignment_ints(slots, plan.max_blocks), h_bytes, slots * inter * dtype.itemsize,
                 4 * max(plan.gate_up.partial_floats, plan.down.partial_floats)]
        self.offsets = [0]
        for size in parts[:-1]:
            self.offsets.append(self.offsets[-1] + _aligned_up(size))
        self.scratch_bytes = self.offsets[-1] + parts[-1]
        self.counter_ints = need = max(plan.gate_up.tile_counters, plan.down.tile_counters)  # 0: no k split
        self.counters = counters if need and counters is not None and need <= counters.numel() else None
        self.keep = (gate_up, down, gate_up_bias, down_bias)  # what the pointers point into

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """y [T, H] on the current stream, for x [T, H], ids [T, K] and float routing weights [T, K] of the
        shapes, dtypes and device the launch was built for (other ones are a ValueError). Non-contiguous or
        misaligned inputs are copied first."""
        x, ids = launch_inputs(self, "grouped", x, ids, weights)
        row_scale = weights.reshape(-1).to(torch.float32).contiguous()  # indexed by slot t*K + j
        y = torch.empty(self.tokens, self.hidden, dtype=self.dtype, device=self.device)
        scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=self.device)
        base = scratch.data_ptr()
        pointers = (x.data_ptr(), ids.data_ptr(), row_scale.data_ptr(), y.data_ptr(),
                    *(base + offset for offset in self.offsets))
        if not self.counter_ints:
            self._enqueue(*pointers, 0)
        elif self.counters is None:
            fresh = torch.zeros(self.counter_ints, dtype=torch.int32, device=self.device)  # held until enqueued
            self._enqueue(*pointers, fresh.data_ptr())
        else:
            with StreamTurn(self.counters, self.device.index) as counters:
                self._enqueue(*pointers, counters)
        return y

    def _enqueue(self, x: int, ids: int, row_scale: int, y: int, align: int, h: int, act: int, partials: int,
                 counters: int) -> None:
        slots = self.tokens * self.topk
        parts = [align]  # the Alignment's parts' addresses, in its order
        for size in _alignment_sizes(slots, self.plan.max_blocks)[:-1]:
            parts.append(parts[-1] + 4 * size)
        sorted_slot, sorted_token, *block_lists, meta = parts
        block_lists = tuple(block_lists)
        kern, config, sizes = self.align
        launch_prepared(kern, config, ids, *sizes, sorted_slot, sorted_token, *block_lists, meta)

        def gemm(which: int, a: int, rows: int, src_rows: int, dst_rows: int, scale: int) -> None:
            kern, config, head, sizes, strides, split = self.gemms[which]
            launch_prepared(kern, config, a, *head, h, partials if split else 0, counters if split else 0, i32(rows),
                            *sizes, 0, i32(0),  # no fused epilogue (residual, gated): a grouped build ignores them
                            *block_lists, src_rows, dst_rows, scale, *strides)

        gemm(0, x, self.tokens, sorted_token, 0, 0)  # h [S, 2I], rows in sorted order
        kern, config = self.act
        launch_prepared(kern, config, h, act, i32(self.inter), meta)
        gemm(1, act, slots, 0, sorted_slot, row_scale)  # out [S, H] (h's memory), each row at its slot
        kern, config = self.combine
        launch_prepared(kern, config, h, ids, y, i32(self.topk), i32(self.hidden), i32(self.experts))


def grouped_experts_cuda(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up, down,
                         activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                         down_bias: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                         path: str | None = None) -> torch.Tensor:
    """y [T, H] in x.dtype (module docstring), launched on the current stream without a sync.

    x: fp16 / bf16 [T, H] on a CUDA device (a non-contiguous or misaligned x is copied first).
    topk_ids: int32 / int64 [T, K]; ids outside [0, E) are dropped (their slots add nothing).
    topk_weights: float [T, K] (fp32 used as is, other dtypes converted to fp32 first).
    gate_up, down: ExpertWeights (or dicts of packed, scales, zeros, n, k, group_size, codebook): gate_up
        [E, 2I, H] (gate rows, then up rows), down [E, H, I], x.dtype scales, contiguous, 16-byte aligned.
    activation: "silu" or "swiglu_oai". gate_up_bias [E, 2I] / down_bias [E, H] in x.dtype, or None.
    counters: int32 tile counters the caller owns (workspace.new_counters / layer_counters; zero, left zero), or
        None: a k split then zero-fills fresh ones.
    path: "decode" (ops/moe_decode.py's two launches), "grouped" (the five above), or None: decode where
        moe_decode.takes_decode_path says so (a function of T, K and E only)."""
    gate_up, down = stacked_format(gate_up, "gate_up"), stacked_format(down, "down")
    check_grouped_args(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias, counters)
    if path not in (None, "decode", "grouped"):
        raise ValueError(f"path must be None, 'decode' or 'grouped'; got {path!r}")
    tokens, topk = topk_ids.shape
    if tokens * topk == 0:
        return torch.zeros_like(x)
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if path == "decode" or (path is None and takes_decode_path(tokens, topk, gate_up.num_experts)):
        return _decode_launch(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias,
                              counters, index, device_info(index).sm_count)(x, topk_ids, topk_weights)
    return _grouped_launch(x, topk_ids, gate_up, down, activation, gate_up_bias, down_bias, counters,
                           index)(x, topk_ids, topk_weights)


def _grouped_launch(x, topk_ids, gate_up: StackedFormat, down: StackedFormat, activation: str, gate_up_bias,
                    down_bias, counters, index: int) -> GroupedLaunch:
    biases = [None if b is None else b.contiguous() for b in (gate_up_bias, down_bias)]
    return GroupedLaunch(x.shape[0], topk_ids.shape[1], x.dtype, topk_ids.dtype, gate_up, down, activation, *biases,
                         index, counters)


def experts_launch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up, down,
                   activation: str = "silu", gate_up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None,
                   counters: torch.Tensor | None = None) -> DecodeLaunch | GroupedLaunch | None:
    """The launches of calls like this one on the path grouped_experts_cuda takes (arguments as its, checked the
    same way), to keep and call with new inputs of the same shapes, dtypes and device; None for calls with no
    slot (T x K = 0: nothing to launch)."""
    gate_up, down = stacked_format(gate_up, "gate_up"), stacked_format(down, "down")
    check_grouped_args(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias, counters)
    tokens, topk = topk_ids.shape
    if tokens * topk == 0:
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if takes_decode_path(tokens, topk, gate_up.num_experts):
        return _decode_launch(x, topk_ids, topk_weights, gate_up, down, activation, gate_up_bias, down_bias,
                              counters, index, device_info(index).sm_count)
    return _grouped_launch(x, topk_ids, gate_up, down, activation, gate_up_bias, down_bias, counters, index)


def _decode_launch(x, topk_ids, topk_weights, gate_up: StackedFormat, down: StackedFormat, activation: str,
                   gate_up_bias, down_bias, counters, index: int, sm_count: int) -> DecodeLaunch:
    biases = [None if b is None else b.contiguous() for b in (gate_up_bias, down_bias)]
    return DecodeLaunch(x.shape[0], topk_ids.shape[1], x.dtype, topk_ids.dtype,
                        routing_dtype(topk_weights.dtype, x.dtype), gate_up, down, activation, *biases, index,
                        sm_count, counters)
