"""nn.Module layers over tilefish ops."""
from __future__ import annotations

import torch
from torch import nn

from . import w4a16 as _w4a16
from .ops.w4a16 import W4A16Weight


class W4A16Linear(nn.Module):
    """A drop-in nn.Linear with a 4-bit weight (GPTQ-style groups) and fp16/bf16 activations."""

    def __init__(self, in_features: int, out_features: int, *, group_size: int = 128, bias: bool = True,
                 symmetric: bool = True, dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        from .ops.w4a16 import check_shape

        check_shape(out_features, in_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = 1 if group_size == -1 else in_features // group_size
        self.register_buffer("packed", torch.zeros(out_features // 64, 8 * in_features, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(groups, out_features, dtype=dtype, device=device))
        self.register_buffer("zeros", None if symmetric else torch.full((groups, out_features), 8, dtype=dtype, device=device))
        self.register_buffer("perm", None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @property
    def weight4(self) -> W4A16Weight:
        return W4A16Weight(self.packed, self.scales, self.zeros, self.group_size, self.out_features,
                           self.in_features, self.perm)

    def _set(self, w: W4A16Weight, bias: torch.Tensor | None) -> "W4A16Linear":
        self.packed, self.scales, self.zeros, self.perm = w.packed, w.scales, w.zeros, w.perm
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().to(w.scales.dtype), requires_grad=False)
        return self

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, symmetric: bool = True,
                    dtype: torch.dtype | None = None) -> "W4A16Linear":
        dtype = dtype or (linear.weight.dtype if linear.weight.dtype in (torch.float16, torch.bfloat16) else torch.float16)
        w = _w4a16.quantize(linear.weight.detach(), group_size, symmetric, dtype=dtype)
        layer = cls(linear.in_features, linear.out_features, group_size=group_size, bias=linear.bias is not None,
                    symmetric=symmetric, dtype=dtype, device=linear.weight.device)
        return layer._set(w, linear.bias)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None, *, zero_convention: str = "v1",
                  dtype: torch.dtype | None = None) -> "W4A16Linear":
        w = _w4a16.from_gptq(qweight, qzeros, scales, g_idx, zero_convention=zero_convention, dtype=dtype)
        layer = cls(w.k, w.n, group_size=w.group_size, bias=bias is not None, symmetric=w.zeros is None,
                    dtype=w.scales.dtype, device=w.device)
        return layer._set(w, bias)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None, *, group_size: int,
                 dtype: torch.dtype | None = None) -> "W4A16Linear":
        w = _w4a16.from_awq(qweight, qzeros, scales, group_size=group_size, dtype=dtype)
        layer = cls(w.k, w.n, group_size=w.group_size, bias=bias is not None, symmetric=w.zeros is None,
                    dtype=w.scales.dtype, device=w.device)
        return layer._set(w, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _w4a16.matmul(x, self.weight4, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"symmetric={self.zeros is None}, bias={self.bias is not None}")
