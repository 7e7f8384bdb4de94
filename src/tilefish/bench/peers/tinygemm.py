"""torch's own int4 weight-only GEMM ("tinygemm", `torch.ops.aten._weight_int4pack_mm`) as a peer of
tilefish's W4A16 layers in whole models: what gpt-fast and torchao's int4 weight-only quantization run.

The format (torch's op schemas; gpt-fast's and torchao's use of them), for a weight W [n, k] in bf16:
- groups of `group_size` along k, asymmetric: q = round((w - min) / scale) in 0..15 with
  scale = (max - min) / 15, stored with a float zero point zero = min + 8 * scale, so that the kernel
  computes w = (q - 8) * scale + zero;
- `scales_and_zeros` bf16 [k / group_size, n, 2] (scale, zero);
- the codes packed by `_convert_weight_to_int4pack` (CUDA: uint8 [n, k / 2], element 2j in the high
  nibble and 2j + 1 in the low one; the CPU kernel has its own `_for_cpu` variant taking int32 [n, k]),
  with inner_k_tiles = 8, so k % 128 == 0 (inner_k_tiles x 16) and n % 8 == 0.
The op runs bf16 activations on sm_80+ (CUDA) and on the CPU (the `_for_cpu` ops, for the tests).
"""
from __future__ import annotations

import torch
from torch import nn

INNER_K_TILES = 8
GROUP_SIZES = (32, 64, 128, 256)


def check(linear: nn.Module, group_size: int) -> str | None:
    """None when `linear` can become a TinyGemmLinear, else why not."""
    if type(linear) is not nn.Linear:
        return f"{type(linear).__name__} is not a plain nn.Linear"
    n, k = linear.out_features, linear.in_features
    if group_size not in GROUP_SIZES:
        return f"group_size {group_size} (tinygemm takes {GROUP_SIZES})"
    if k % (INNER_K_TILES * 16) or k % group_size or n % 8:
        return f"shape n {n} x k {k}: tinygemm needs k % {INNER_K_TILES * 16}, k % group_size and n % 8 == 0"
    return None


def quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int32 [n, k] in 0..15, scales_and_zeros bf16 [k / group_size, n, 2]) of a weight [n, k]."""
    n, k = w.shape
    groups = w.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    codes = ((groups - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    scales_and_zeros = torch.cat([scale, zero], -1).to(torch.bfloat16).permute(1, 0, 2).contiguous()
    return codes, scales_and_zeros


def dequantize(codes: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight [n, k] the kernel multiplies by (fp32): (q - 8) * scale + zero, per group."""
    n, k = codes.shape
    sz = scales_and_zeros.float().permute(1, 0, 2)  # [n, groups, 2]
    q = codes.float().reshape(n, k // group_size, group_size)
    return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(n, k)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """The op's weight layout for codes' device."""
    if codes.is_cuda:
        pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
        return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), INNER_K_TILES)


class TinyGemmLinear(nn.Module):
    """An nn.Linear replaced by torch's int4 weight-only GEMM (bf16 activations)."""

    def __init__(self, linear: nn.Linear, group_size: int = 128):
        super().__init__()
        why = check(linear, group_size)
        if why is not None:
            raise ValueError(f"tinygemm cannot take this layer: {why}")
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        codes, scales_and_zeros = quantize(linear.weight, group_size)
        self.register_buffer("weight_int4pack", pack(codes))
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        mm = torch.ops.aten._weight_int4pack_mm if flat.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        y = mm(flat, self.weight_int4pack, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def convert(module: nn.Module, group_size: int = 128, skip=("lm_head",)) -> int:
    """Every plain nn.Linear under `module` (but `skip` names) -> TinyGemmLinear, dense weights dropped
    as it goes; layers tinygemm cannot take stay. Returns how many it converted."""
    converted = 0
    for parent_name, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if any(full == s or full.endswith("." + s) for s in skip) or check(child, group_size):
                continue
            setattr(parent, name, TinyGemmLinear(child, group_size))
            converted += 1
    return converted
