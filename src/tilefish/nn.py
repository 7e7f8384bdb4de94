"""nn.Module layers over tilefish ops: W4A16Linear, and the fused projection layers of quantize_model."""
from __future__ import annotations

import torch
from torch import nn

from . import w4a16 as _w4a16
from .ops.w4a16 import W4A16Weight, check_perm, check_shape
from .runtime import current_stream_handle

_WEIGHT_FIELDS = ("packed", "scales", "zeros", "perm", "bias")
MAX_PLANS = 64  # launch plans a layer keeps (one per input shape and stream); past this it starts afresh


class WeightInfo:
    """What code written for nn.Linear reads off `layer.weight` (dtype, device, shape), for a layer
    whose weight is packed 4-bit: `dtype` is the activation / scale dtype. `dequantize()` gives the
    dense [out_features, in_features] weight (a copy, for export or inspection)."""

    __slots__ = ("_layer", "_columns")
    requires_grad = False
    ndim = 2

    def __init__(self, layer: "W4A16Linear", columns: tuple[int, int] | None = None):
        self._layer, self._columns = layer, columns

    @property
    def dtype(self) -> torch.dtype:
        return self._layer.scales.dtype

    @property
    def device(self) -> torch.device:
        return self._layer.packed.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def shape(self) -> torch.Size:
        a, b = self._columns or (0, self._layer.out_features)
        return torch.Size((b - a, self._layer.in_features))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dequantize(self) -> torch.Tensor:
        w = _w4a16.unpack(self._layer.weight4).dequantize(self.dtype)  # in the kernel's (permuted) k order
        perm = self._layer.perm
        if perm is not None:
            w = w.index_select(1, torch.argsort(perm))  # back to the checkpoint's input order
        a, b = self._columns or (0, self._layer.out_features)
        return w[a:b]

    def __repr__(self) -> str:
        return f"WeightInfo(packed 4-bit, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class _LayerPlan:
    """One input shape's eager call of a W4A16Linear, decided once (ops.w4a16.LaunchPlan)."""

    __slots__ = ("plan", "out_shape", "dtype", "device", "perm", "m", "k")

    def __init__(self, layer: "W4A16Linear", x: torch.Tensor):
        from .ops.w4a16 import LaunchPlan, _validate

        w = layer.weight4
        _validate(x, w, layer.bias)
        self.m, self.k = x.numel() // w.k, w.k
        self.out_shape = x.shape[:-1] + (w.n,)
        self.dtype, self.device, self.perm = x.dtype, x.device, w.perm
        bias = None if layer.bias is None else layer.bias.detach().contiguous()
        self.plan = LaunchPlan.build(w, bias, self.m, x.device) if self.m else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        if self.plan is not None:
            if self.perm is not None:
                x = x.view(self.m, self.k).index_select(1, self.perm)
            self.plan.launch(x.data_ptr(), out.data_ptr())
        return out


class W4A16Linear(nn.Module):
    """A drop-in nn.Linear with a 4-bit weight (GPTQ-style groups) and fp16/bf16 activations.

    - x of the layer's dtype runs the W4A16 kernel on CUDA (the float64 reference on CPU); another
      floating dtype (e.g. fp32) is cast to the layer's dtype and the result back.
    - Eager CUDA calls keep a launch plan per input shape and stream: the checks and the kernel
      choice happen on the first call, later calls only allocate the output and launch.
    - Gradients flow to x (through the dequantized weight); the 4-bit weight itself is frozen.
    - `.weight` is a WeightInfo (dtype, device, shape, dequantize()), not a tensor.
    """

    def __init__(self, in_features: int, out_features: int, *, group_size: int = 128, bias: bool = True,
                 symmetric: bool = True, dtype: torch.dtype = torch.float16, device=None, act_order: bool = False):
        super().__init__()
        check_shape(out_features, in_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self._plans: dict = {}
        groups = 1 if group_size == -1 else in_features // group_size
        self.register_buffer("packed", torch.zeros(out_features // 64, 8 * in_features, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(groups, out_features, dtype=dtype, device=device))
        self.register_buffer("zeros", None if symmetric else torch.full((groups, out_features), 8, dtype=dtype, device=device))
        self.register_buffer("perm", torch.arange(in_features, device=device) if act_order else None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    # -- the weight ---------------------------------------------------------------------------------------------
    @property
    def weight4(self) -> W4A16Weight:
        return W4A16Weight(self.packed, self.scales, self.zeros, self.group_size, self.out_features,
                           self.in_features, self.perm)

    @property
    def weight(self) -> WeightInfo:
        return WeightInfo(self)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in _WEIGHT_FIELDS and "_plans" in self.__dict__:
            self._plans = {}  # the plans point into the replaced tensors

    def _apply(self, fn, *args, **kwargs):
        self._plans = {}
        return super()._apply(fn, *args, **kwargs)

    def _set(self, w: W4A16Weight, bias: torch.Tensor | None) -> "W4A16Linear":
        if w.perm is not None:
            check_perm(w.perm, w.k)
        self.packed, self.scales, self.zeros, self.perm = w.packed, w.scales, w.zeros, w.perm
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().to(w.scales.dtype), requires_grad=False)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Zero points and the act-order permutation are None buffers in a layer built without them,
        # which torch's loader would report as unexpected keys: adopt them (checked) instead.
        for name in ("zeros", "perm"):
            key = prefix + name
            if key in state_dict and getattr(self, name) is None:
                value = state_dict[key]
                if name == "perm":
                    try:
                        check_perm(value, self.in_features)
                    except ValueError as e:
                        error_msgs.append(f"{key}: {e}")
                        continue
                    value = value.to(device=self.packed.device, dtype=torch.int64)
                elif value.shape != self.scales.shape:
                    error_msgs.append(f"{key}: shape {tuple(value.shape)}, expected {tuple(self.scales.shape)}")
                    continue
                else:
                    value = torch.empty_like(self.scales)  # filled by the copy below
                self._buffers[name] = value
        self._plans = {}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + "perm" in state_dict and self.perm is not None:
            try:
                check_perm(self.perm, self.in_features)
            except ValueError as e:
                error_msgs.append(f"{prefix}perm: {e}")

    # -- constructors -------------------------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, symmetric: bool = True,
                    dtype: torch.dtype | None = None, clip_search: bool = True) -> "W4A16Linear":
        dtype = dtype or (linear.weight.dtype if linear.weight.dtype in (torch.float16, torch.bfloat16) else torch.float16)
        w = _w4a16.quantize(linear.weight.detach(), group_size, symmetric, dtype=dtype, clip_search=clip_search)
        layer = cls(linear.in_features, linear.out_features, group_size=group_size, bias=linear.bias is not None,
                    symmetric=symmetric, dtype=dtype, device=linear.weight.device)
        return layer._set(w, linear.bias)

    @classmethod
    def from_weight(cls, w: W4A16Weight, bias: torch.Tensor | None = None) -> "W4A16Linear":
        layer = cls(w.k, w.n, group_size=w.group_size, bias=bias is not None, symmetric=w.zeros is None,
                    dtype=w.scales.dtype, device=w.device)
        return layer._set(w, bias)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None, *, zero_convention: str = "v1",
                  dtype: torch.dtype | None = None) -> "W4A16Linear":
        w = _w4a16.from_gptq(qweight, qzeros, scales, g_idx, zero_convention=zero_convention, dtype=dtype)
        return cls.from_weight(w, bias)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None, *, group_size: int,
                 dtype: torch.dtype | None = None) -> "W4A16Linear":
        return cls.from_weight(_w4a16.from_awq(qweight, qzeros, scales, group_size=group_size, dtype=dtype), bias)

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (isinstance(x, torch.Tensor) and x.is_cuda and not torch.compiler.is_compiling()
                and not (x.requires_grad and torch.is_grad_enabled())):
            dev = x.get_device()
            key = (x.shape, x.dtype, dev, current_stream_handle(dev))
            plan = self._plans.get(key)
            if plan is None and x.dtype == self.scales.dtype:
                if len(self._plans) >= MAX_PLANS:
                    self._plans = {}
                plan = self._plans[key] = _LayerPlan(self, x)
            if plan is not None and x.data_ptr() % 16 == 0 and x.is_contiguous():
                return plan(x)
        return self._forward_any(x)

    def _forward_any(self, x: torch.Tensor) -> torch.Tensor:
        """Any input: other float dtypes are cast to the layer's and back; CPU runs the reference."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"W4A16Linear expects a torch.Tensor, got {type(x).__name__}")
        dtype = self.scales.dtype
        if x.dtype != dtype and x.is_floating_point():
            return _w4a16.matmul(x.to(dtype), self.weight4, self.bias).to(x.dtype)
        return _w4a16.matmul(x, self.weight4, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"symmetric={self.zeros is None}, act_order={self.perm is not None}, bias={self.bias is not None}")


class FusedW4A16Linear(W4A16Linear):
    """Several projections of one input (q/k/v, gate/up) as one W4A16 matmul: their weights side by
    side along out_features, so one launch streams all of them. Each original module is replaced by a
    W4A16Slice that returns its columns of the shared result.

    The parts of one input share one launch: the first part called on a tensor computes the whole
    output, the others take their slices of it; once every part has taken its slice the result is
    released. A part called on another tensor (or on the same one after an in-place change, in
    eager mode) recomputes, so the answer never depends on call order."""

    def __init__(self, in_features: int, split_sizes: list[int], **kwargs):
        super().__init__(in_features, sum(split_sizes), **kwargs)
        self.split_sizes = list(split_sizes)
        bounds, a = [], 0
        for s in split_sizes:
            bounds.append((a, a + s))
            a += s
        self.bounds = bounds
        self._shared = None  # (input, its version, output, parts still to take their slice)

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        shared = self._shared
        compiling = torch.compiler.is_compiling()
        if shared is None or shared[0] is not x or shared[3] == 0 or (not compiling and shared[1] != x._version):
            y = self(x)
            shared = (x, 0 if compiling else x._version, y, len(self.bounds))
        left = shared[3] - 1
        self._shared = None if left == 0 else (shared[0], shared[1], shared[2], left)
        a, b = self.bounds[index]
        return shared[2][..., a:b]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", split_sizes={self.split_sizes}"


class W4A16Slice(nn.Module):
    """Stands where one of the projections fused into a FusedW4A16Linear was: its columns of the fused
    result. Holds no tensors of its own (the fused layer, registered beside it, owns them)."""

    def __init__(self, fused: FusedW4A16Linear, index: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: the parent registers it once
        self.index = index
        self.in_features = fused.in_features
        self.out_features = fused.split_sizes[index]

    @property
    def weight(self) -> WeightInfo:
        return WeightInfo(self.fused, tuple(self.fused.bounds[self.index]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)

    def extra_repr(self) -> str:
        a, b = self.fused.bounds[self.index]
        return f"columns {a}:{b} of a FusedW4A16Linear, in_features={self.in_features}, out_features={self.out_features}"
