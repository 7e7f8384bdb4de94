"""compressed-tensors' "pack-quantized" int4 weights (llm-compressor's W4A16 checkpoints), pure torch.

The stored tensors of one Linear X (weight [n, k]), as compressed-tensors' PackedQuantizationCompressor writes
them (compressors/quantized_compressors/pack_quantized.py: pack_to_int32 / unpack_from_int32):

* ``X.weight_packed`` int32 [n, k / 8]: the signed int4 values v in -8..7 stored as v + 8, eight to a word along
  k, element 8c + i of row r in bits 4i .. 4i+3 of word (r, c) (the first element in the low bits);
* ``X.weight_scale`` [n, k / G] (strategy "group") or [n, 1] ("channel"), in the model's float dtype;
* ``X.weight_zero_point`` (asymmetric schemes only) int32 [ceil(n / 8), k / G]: the signed zero points z + 8,
  packed the same way but along n: row 8r + i of column g in bits 4i .. of word (r, g);
* ``X.weight_g_idx`` int32 [k] (optional, activation ordering): the group of each input column; -1 entries
  mean "not set" (column order);
* ``X.weight_shape`` int [2] = (n, k).

Value: ``(v - z) * scale`` with v, z signed, i.e. ``(q - zq) * scale`` with the stored unsigned nibbles q = v + 8
and zq = z + 8; a symmetric scheme has z = 0, zq = 8: tilefish's symmetric Int4Weight, nibble for nibble.
"""
from __future__ import annotations

import torch

from .int4 import SCALE_DTYPES, Int4Weight, _maybe_symmetric, _unpack_last

__all__ = ["from_pack_quantized"]


def from_pack_quantized(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                        weight_zero_point: torch.Tensor | None = None, weight_g_idx: torch.Tensor | None = None, *,
                        group_size: int) -> tuple[Int4Weight, torch.Tensor | None]:
    """The stored tensors (module docstring) as (Int4Weight, perm). group_size: the scheme's (-1: channel).

    With activation ordering (a g_idx other than column order) the weight comes back in permuted k order,
    perm = stable argsort(g_idx), as tilefish.quant.int4.from_gptq returns GPTQ's act-order weights: the layer
    computes x[..., perm] @ W^T. Scales must already be fp16 / bf16 (the activation dtype)."""
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise TypeError(f"weight_packed must be int32 [n, k/8]; got {weight_packed.dtype} {tuple(weight_packed.shape)}")
    if weight_scale.dtype not in SCALE_DTYPES:
        raise TypeError(f"weight_scale must be float16 or bfloat16 here (cast it to the activation dtype first); got "
                        f"{weight_scale.dtype}")
    n, k = weight_packed.shape[0], weight_packed.shape[1] * 8
    groups = 1 if group_size == -1 else k // group_size
    if weight_scale.shape != (n, groups):
        raise ValueError(f"weight_scale must be [n, k / G] = {(n, groups)} for weight_packed [n, k/8] = "
                         f"{tuple(weight_packed.shape)} and group_size {group_size}; got {tuple(weight_scale.shape)}")
    q = _unpack_last(weight_packed)                                          # [n, k], nibble i -> column 8c + i
    zeros = None
    if weight_zero_point is not None:
        rows = -(-n // 8)
        if weight_zero_point.dtype != torch.int32 or weight_zero_point.shape != (rows, groups):
            raise ValueError(f"weight_zero_point must be int32 [ceil(n / 8), k / G] = {(rows, groups)}; got "
                             f"{weight_zero_point.dtype} {tuple(weight_zero_point.shape)}")
        zeros = _maybe_symmetric(_unpack_last(weight_zero_point.t().contiguous()).t()[:n].contiguous())
    perm = None
    if weight_g_idx is not None and not bool((weight_g_idx == -1).any()):
        perm = _act_order(weight_g_idx, k, groups, k // groups)
        if perm is not None:
            q = q.index_select(1, perm).contiguous()
    return Int4Weight(q.contiguous(), weight_scale.contiguous(), zeros, group_size), perm


def _act_order(g_idx: torch.Tensor, k: int, groups: int, group_len: int) -> torch.Tensor | None:
    """perm = stable argsort(g_idx) for a g_idx that groups the columns in another order; None for column order.
    Each group must hold group_len columns (the kernel's groups are contiguous runs after the permutation)."""
    if g_idx.shape != (k,) or g_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"weight_g_idx must be an int32 / int64 tensor [k] = [{k}]; got {g_idx.dtype} "
                         f"{tuple(g_idx.shape)}")
    gi = g_idx.to(torch.int64)
    if bool((gi == torch.arange(k, device=gi.device) // group_len).all()):
        return None
    if bool((gi < 0).any()) or bool((gi >= groups).any()):
        raise ValueError(f"weight_g_idx values must be in 0..{groups - 1}")
    counts = torch.bincount(gi, minlength=groups)
    if not bool((counts == group_len).all()):
        raise ValueError(f"weight_g_idx must give each of the {groups} groups {group_len} columns; found "
                         f"{int(counts.min())}..{int(counts.max())}")
    return torch.sort(gi, stable=True).indices
