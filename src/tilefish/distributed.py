"""Tensor parallelism for tilefish's layers over torch.distributed (NCCL on GPUs, gloo on CPU).

Megatron-style: a column-parallel layer holds a slice of the output features on each rank (no
communication; optionally all-gathered back to full width), a row-parallel layer a slice of the input
features, and all-reduces its partial outputs. In a Llama decoder, q/k/v and gate/up are column-parallel,
o and down row-parallel, so each block communicates twice (docs/distributed.md).

Sharding a 4-bit weight is exact slicing of the kernel layout (ops/w4a16/layout.py):
- columns: the packed words are strip-major (64 output columns a row of `packed`) and the group scales
  are permuted only inside a strip, so a rank's columns are whole strips: n / world % 64 == 0.
- rows: each strip row stores its 16-wide k rows in order, so a contiguous k range is a contiguous slice
  of `packed`'s second dimension; it must hold whole groups and be tileable by the kernel
  (ops.w4a16.check_shape on the shard: k / world % 64, and % group_size).
- act-order (a permutation of the input): a row-parallel shard is a contiguous range of the kernel's
  (permuted) k order, so groups stay whole; the inputs it needs are scattered, so that layer gathers its
  full input from all ranks (an all-gather of m x k activations, small at decode) and picks its columns.
- NF4 (codebook "nf4", NF4Linear): the same kernel tensors, so the same slicing; a shard is a
  W4A16Linear with codebook "nf4" holding the kernel's group scales (bitsandbytes' block scales and
  its state-dict format belong to the whole layer, not a shard).
- dense nn.Linear (the fp16 baseline, or what a model left unquantized) shards the same way.
- fused layers (FusedW4A16Linear: q/k/v, gate/up) split each part separately, so every rank holds its
  own heads of q, k and v side by side.

Collectives are torch.distributed's functional ones: traceable by torch.compile(fullgraph=True) and
usable in a CUDA graph once the communicator exists (run a step before capturing).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from .nn import FusedW4A16Linear, GatedW4A16Linear, NF4Linear, W4A16Linear, W4A16Slice
from .ops.w4a16 import W4A16Weight, check_shape

COLUMN_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "qkv_proj", "gate_up_proj")
ROW_NAMES = ("o_proj", "down_proj")
_QUANTIZED = (W4A16Linear, NF4Linear)


class ShardError(ValueError):
    """A layer or model that cannot be split across the ranks as asked (names the layer and the constraint)."""


def group_rank_world(group=None) -> tuple[int, int]:
    """(this process's rank in `group`, the group's size); group None: the default group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group "
                           "(e.g. under torchrun) before building tensor-parallel layers")
    return dist.get_rank(group), dist.get_world_size(group)


# -- exact slicing of weights -----------------------------------------------------------------------------------

def _part_ranges(parts: list[int], rank: int, world: int, what: str, multiple: int) -> list[tuple[int, int]]:
    """Each part's columns for `rank`: [(start, end)] in the layer's column numbering."""
    ranges, offset = [], 0
    for i, p in enumerate(parts):
        if p % world or (p // world) % multiple:
            name = f"part {i} ({p} columns)" if len(parts) > 1 else f"{p} output features"
            raise ShardError(f"{what}: {name} cannot be split into {world} shards of a multiple of {multiple} "
                             f"columns (the kernel's 64-column strips); n / world must be a multiple of {multiple}")
        size = p // world
        ranges.append((offset + rank * size, offset + (rank + 1) * size))
        offset += p
    return ranges


def shard_weight_columns(w: W4A16Weight, rank: int, world: int, parts: list[int] | None = None,
                         what: str = "weight") -> W4A16Weight:
    """`rank`'s output columns of a kernel-layout weight: each of `parts` (split sizes of a fused weight;
    default one part) split into `world` equal slices of whole 64-column strips."""
    ranges = _part_ranges(parts or [w.n], rank, world, what, 64)
    packed = torch.cat([w.packed[a // 64:b // 64] for a, b in ranges], 0)
    scales = torch.cat([w.scales[:, a:b] for a, b in ranges], 1)
    zeros = None if w.zeros is None else torch.cat([w.zeros[:, a:b] for a, b in ranges], 1)
    return replace(w, packed=packed.contiguous(), scales=scales.contiguous(),
                   zeros=None if zeros is None else zeros.contiguous(), n=sum(b - a for a, b in ranges))


def _check_weight_rows(w: W4A16Weight, world: int, what: str) -> None:
    if w.k % world:
        raise ShardError(f"{what}: in_features {w.k} is not divisible by the tensor-parallel size {world}")
    try:
        check_shape(w.n, w.k // world, w.group_size)
    except ValueError as e:
        raise ShardError(f"{what}: a row-parallel shard of {w.k // world} input features (in_features {w.k} / "
                         f"{world}) is not tileable: {e}") from None


def shard_weight_rows(w: W4A16Weight, rank: int, world: int,
                      what: str = "weight") -> tuple[W4A16Weight, torch.Tensor | None, tuple[int, int]]:
    """`rank`'s contiguous range [k0, k1) of the kernel's k order: (the shard, with no permutation; the
    input columns it reads, for an act-order weight, else None; (k0, k1))."""
    _check_weight_rows(w, world, what)
    ks = w.k // world
    k0, k1 = rank * ks, (rank + 1) * ks
    packed = w.packed[:, 8 * k0:8 * k1].contiguous()
    if w.group_size == -1:  # one scale per column over all of k: every shard uses it whole
        scales, zeros = w.scales, w.zeros
    else:
        g0, g1 = k0 // w.group_size, k1 // w.group_size
        scales = w.scales[g0:g1].contiguous()
        zeros = None if w.zeros is None else w.zeros[g0:g1].contiguous()
    index = None if w.perm is None else w.perm[k0:k1].contiguous()
    return replace(w, packed=packed, scales=scales, zeros=zeros, k=ks, perm=None), index, (k0, k1)


def _dense_columns(linear: nn.Linear, ranges) -> nn.Linear:
    out = nn.Linear(linear.in_features, sum(b - a for a, b in ranges), bias=linear.bias is not None,
                    device="meta", dtype=linear.weight.dtype)
    out.weight = nn.Parameter(torch.cat([linear.weight.detach()[a:b] for a, b in ranges]).contiguous(),
                              requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        out.bias = nn.Parameter(torch.cat([linear.bias.detach()[a:b] for a, b in ranges]).contiguous(),
                                requires_grad=linear.bias.requires_grad)
    return out


# -- the layers -------------------------------------------------------------------------------------------------

def _gather_last(y: torch.Tensor, group, world: int, parts: list[int]) -> torch.Tensor:
    """All ranks' [..., n_local] -> [..., n]: each part's slices put back in rank order."""
    from torch.distributed import _functional_collectives as fc

    lead, nl = y.shape[:-1], y.shape[-1]
    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # renamed in torch 2.12
    g = fc.wait_tensor(gather(y.reshape(-1, nl).contiguous(), 0, group))
    g = g.view(world, -1, nl)
    pieces, a = [], 0
    for p in parts:
        pieces.append(g[:, :, a:a + p].permute(1, 0, 2).reshape(g.shape[1], world * p))
        a += p
    return torch.cat(pieces, -1).view(*lead, world * nl)


def _all_reduce(y: torch.Tensor, group) -> torch.Tensor:
    from torch.distributed import _functional_collectives as fc

    return fc.wait_tensor(fc.all_reduce(y, "sum", group))


class ColumnParallelLinear(nn.Module):
    """Output features split across the ranks of `group`: `local` (an nn.Linear, W4A16Linear, NF4-codebook
    W4A16Linear or FusedW4A16Linear) holds this rank's columns of each part. forward returns the local
    columns, or with gather_output the full output (all-gathered, in the original column order).
    Build with from_layer."""

    def __init__(self, local: nn.Module, group, rank: int, world: int, local_parts: list[int],
                 gather_output: bool = False):
        super().__init__()
        self.local, self.group, self.rank, self.world = local, group or dist.group.WORLD, rank, world
        self.local_parts, self.gather_output = list(local_parts), gather_output
        self.in_features = local.in_features
        self.out_features = world * sum(local_parts)  # of the whole layer

    @classmethod
    def from_layer(cls, layer: nn.Module, group=None, *, gather_output: bool = False, rank: int | None = None,
                   world: int | None = None, name: str = "layer") -> "ColumnParallelLinear":
        """This rank's shard of `layer` (a whole nn.Linear, W4A16Linear, NF4Linear or FusedW4A16Linear;
        each fused part split separately), on the layer's device. rank / world default to `group`'s."""
        if rank is None or world is None:
            rank, world = group_rank_world(group)
        parts = list(layer.split_sizes) if isinstance(layer, FusedW4A16Linear) else [layer.out_features]
        local = shard_columns(layer, rank, world, name)
        return cls(local, group, rank, world, [p // world for p in parts], gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        return _gather_last(y, self.group, self.world, self.local_parts) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"rank {self.rank} of {self.world}, in_features={self.in_features}, "
                f"out_features={self.out_features} ({sum(self.local_parts)} here), gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """Input features split across the ranks of `group`: `local` computes this rank's partial product
    (the bias only on rank 0) and forward all-reduces the partials into the full output on every rank.
    input_is_parallel: x holds this rank's input slice (the output of a column-parallel layer), else the
    full input (sliced here). An act-order weight reads scattered inputs: it gathers the full input
    (all-gather when input_is_parallel) and picks `input_index`. Build with from_layer."""

    def __init__(self, local: nn.Module, group, rank: int, world: int, in_features: int, k_range: tuple[int, int],
                 input_index: torch.Tensor | None = None, input_is_parallel: bool = True):
        super().__init__()
        self.local, self.group, self.rank, self.world = local, group or dist.group.WORLD, rank, world
        self.in_features, self.k_range, self.input_is_parallel = in_features, tuple(k_range), input_is_parallel
        self.out_features = local.out_features
        self.register_buffer("input_index", input_index)

    @classmethod
    def from_layer(cls, layer: nn.Module, group=None, *, input_is_parallel: bool = True, rank: int | None = None,
                   world: int | None = None, name: str = "layer") -> "RowParallelLinear":
        if rank is None or world is None:
            rank, world = group_rank_world(group)
        local, index, k_range = shard_rows(layer, rank, world, name)
        return cls(local, group, rank, world, layer.in_features, k_range, index, input_is_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_index is not None:
            if self.input_is_parallel:
                x = _gather_last(x, self.group, self.world, [x.shape[-1]])
            x = x.index_select(-1, self.input_index)
        elif not self.input_is_parallel:
            x = x[..., self.k_range[0]:self.k_range[1]].contiguous()
        return _all_reduce(self.local(x), self.group)

    def extra_repr(self) -> str:
        return (f"rank {self.rank} of {self.world}, in_features={self.in_features} ({self.k_range[0]}:"
                f"{self.k_range[1]} here{', act-order gather' if self.input_index is not None else ''}), "
                f"out_features={self.out_features}, input_is_parallel={self.input_is_parallel}")


def _check_layer(layer: nn.Module, name: str) -> None:
    if type(layer) not in (nn.Linear, W4A16Linear, NF4Linear, FusedW4A16Linear, GatedW4A16Linear):
        raise ShardError(f"{name}: cannot shard a {type(layer).__name__} (nn.Linear, W4A16Linear, NF4Linear and "
                         f"FusedW4A16Linear can be)")


def shard_columns(layer: nn.Module, rank: int, world: int, name: str = "layer") -> nn.Module:
    """The plain layer holding `rank`'s output columns of `layer` (fused parts split separately)."""
    _check_layer(layer, name)
    if isinstance(layer, GatedW4A16Linear):  # its parts side by side (each rank's shard is a FusedW4A16Linear)
        layer = layer.ungated()
    parts = list(layer.split_sizes) if isinstance(layer, FusedW4A16Linear) else [layer.out_features]
    if type(layer) is nn.Linear:
        return _dense_columns(layer, _part_ranges(parts, rank, world, name, 1))
    w = shard_weight_columns(layer.weight4, rank, world, parts, name)
    ranges = _part_ranges(parts, rank, world, name, 64)
    bias = None if layer.bias is None else torch.cat([layer.bias.detach()[a:b] for a, b in ranges])
    if isinstance(layer, FusedW4A16Linear):
        local = FusedW4A16Linear(w.k, [p // world for p in parts], group_size=w.group_size, bias=bias is not None,
                                 symmetric=w.zeros is None, dtype=w.dtype, device="meta",
                                 act_order=w.perm is not None, codebook=w.codebook)
        return local._set(w, bias)
    return W4A16Linear.from_weight(w, bias)


def check_row_shard(layer: nn.Module, world: int, name: str = "layer") -> None:
    """ShardError unless `layer` splits into `world` row-parallel shards (whole groups, tileable k)."""
    _check_layer(layer, name)
    if isinstance(layer, FusedW4A16Linear):
        raise ShardError(f"{name}: a fused layer is column-parallel (its parts share an input, not an output)")
    if type(layer) is nn.Linear:
        if layer.in_features % world:
            raise ShardError(f"{name}: in_features {layer.in_features} is not divisible by the tensor-parallel "
                             f"size {world}")
    else:
        _check_weight_rows(layer.weight4, world, name)


def shard_rows(layer: nn.Module, rank: int, world: int,
               name: str = "layer") -> tuple[nn.Module, torch.Tensor | None, tuple[int, int]]:
    """(the plain layer holding `rank`'s input range of `layer`, with the bias on rank 0 only; the input
    columns it reads for an act-order weight, else None; its range of the kernel's k order)."""
    check_row_shard(layer, world, name)
    bias = layer.bias if rank == 0 else None
    if type(layer) is nn.Linear:
        ks = layer.in_features // world
        k0, k1 = rank * ks, (rank + 1) * ks
        local = nn.Linear(ks, layer.out_features, bias=bias is not None, device="meta", dtype=layer.weight.dtype)
        local.weight = nn.Parameter(layer.weight.detach()[:, k0:k1].contiguous(), requires_grad=False)
        if bias is not None:
            local.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return local, None, (k0, k1)
    w, index, k_range = shard_weight_rows(layer.weight4, rank, world, name)
    return W4A16Linear.from_weight(w, None if bias is None else bias.detach()), index, k_range


# -- whole models -----------------------------------------------------------------------------------------------

@dataclass
class ShardReport:
    """What shard_model did on this rank."""
    rank: int
    world: int
    column: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)
    attention: list[str] = field(default_factory=list)  # modules whose head counts now are per rank
    replicated_bytes: int = 0  # parameters and buffers every rank holds whole (embeddings, norms)

    def __str__(self) -> str:
        return (f"rank {self.rank} of {self.world}: {len(self.column)} column-parallel, {len(self.row)} row-parallel "
                f"layers, {len(self.attention)} attention modules with per-rank heads, "
                f"{self.replicated_bytes / 2**20:.1f} MiB replicated")


def _heads(attn: nn.Module) -> tuple[str, str] | None:
    """The attribute names of an attention module's query / key-value head counts that forward reads."""
    if hasattr(attn, "heads") and hasattr(attn, "kv_heads"):  # tilefish.models.llama
        return "heads", "kv_heads"
    return None


def _attention_heads(attn: nn.Module) -> tuple[int, int] | None:
    names = _heads(attn)
    if names:
        return getattr(attn, names[0]), getattr(attn, names[1])
    cfg = getattr(attn, "config", None)  # transformers: forward infers the head count from q/k/v's width
    if cfg is not None and hasattr(cfg, "num_attention_heads"):
        return cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    return None


def shard_model(model: nn.Module, group=None, *, device=None, lm_head: bool = True) -> ShardReport:
    """Make a Llama-style decoder tensor-parallel over `group`, in place, on every rank (each rank calls it
    with the same whole model: built from the same seed, converted by quantize_model, or loaded by
    load_quantized): q/k/v and gate/up (fused or not) column-parallel, o and down row-parallel, attention
    heads split across the ranks; lm_head (lm_head=True) vocab-parallel: column-parallel with its logits
    all-gathered, so each rank reads 1/world of its weight; everything else (embeddings, norms) stays
    whole on every rank.
    device: where the shards and the rest go (e.g. f"cuda:{local_rank}"), each shard moved as it is cut,
    so a model on the CPU never needs to fit on one GPU whole. Every shape is checked before anything
    changes: a ShardError names the layer and the constraint (heads or kv heads not divisible by the
    size, a shard not a whole number of 64-column strips, or of whole groups / 128-wide k steps)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    rank, world = group_rank_world(group)
    report = ShardReport(rank, world)

    # Plan: every layer to split and every check, before the first change.
    column, row, attention = [], [], []
    fused_slices: dict[int, list[tuple[nn.Module, str]]] = {}
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            full = f"{parent_name}.{name}" if parent_name else name
            if isinstance(child, W4A16Slice):
                fused_slices.setdefault(id(child.fused), []).append((parent, name))
                continue
            if name in COLUMN_NAMES:
                column.append((parent, name, full))
            elif name in ROW_NAMES:
                row.append((parent, name, full))
        if parent_name.endswith("self_attn") or hasattr(parent, "o_proj"):
            heads = _attention_heads(parent)
            if heads is not None:
                for what, h in zip(("num_attention_heads", "num_key_value_heads"), heads):
                    if h % world:
                        raise ShardError(f"{parent_name}: {what} {h} is not divisible by the tensor-parallel "
                                         f"size {world}")
                attention.append((parent, parent_name))
    head = getattr(model, "lm_head", None) if lm_head else None
    if head is not None:
        column.append((model, "lm_head", "lm_head"))
    if not column and not row:
        raise ShardError("no layer to shard: tensor parallelism splits modules named "
                         f"{', '.join(COLUMN_NAMES)} (column-parallel) and {', '.join(ROW_NAMES)} (row-parallel)")
    for parent, name, full in column:
        layer = getattr(parent, name)
        _check_layer(layer, full)
        parts = list(layer.split_sizes) if isinstance(layer, FusedW4A16Linear) else [layer.out_features]
        _part_ranges(parts, rank, world, full, 1 if type(layer) is nn.Linear else 64)
    for parent, name, full in row:
        check_row_shard(getattr(parent, name), world, full)

    # Apply. The fused decoder forward's residual epilogue would add the residual on every rank before the
    # all-reduce: the sharded layers run transformers' forward.
    from .decoder import restore_forward

    restore_forward(model)
    for parent, name, full in column:
        layer = getattr(parent, name)
        # The decoder's own modules take the local columns (attention runs on this rank's heads, the MLP on its
        # slice of the intermediate features); only the logits are gathered.
        shard = ColumnParallelLinear.from_layer(layer, group, gather_output=layer is head, rank=rank, world=world,
                                                name=full)
        if device is not None:
            shard = shard.to(device)
        setattr(parent, name, shard)
        for slice_parent, slice_name in fused_slices.get(id(layer), ()):  # re-point q/k/v at the local columns
            old = getattr(slice_parent, slice_name)
            setattr(slice_parent, slice_name, W4A16Slice(shard.local, old.index))
        report.column.append(full)
    for parent, name, full in row:
        shard = RowParallelLinear.from_layer(getattr(parent, name), group, rank=rank, world=world, name=full)
        if device is not None:
            shard = shard.to(device)
        setattr(parent, name, shard)
        report.row.append(full)
    for attn, name in attention:
        names = _heads(attn)
        if names:
            for a in names:
                setattr(attn, a, getattr(attn, a) // world)
        report.attention.append(name)
    if device is not None:
        model.to(device)
    sharded = {id(t) for mod in model.modules() if isinstance(mod, (ColumnParallelLinear, RowParallelLinear))
               for t in list(mod.parameters()) + list(mod.buffers())}
    report.replicated_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                                  if id(t) not in sharded)
    return report


def load_sharded(path, group=None, *, device=None, dtype: torch.dtype | None = None):
    """load_quantized(path) on the CPU, then shard_model onto `device` (default cuda:<local rank> when CUDA
    is available): each rank reads the checkpoint and keeps its shards. Returns (model, ShardReport)."""
    from .checkpoint import load_quantized

    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    model, _ = load_quantized(path, device="cpu", dtype=dtype)
    return model, shard_model(model, group, device=device)
