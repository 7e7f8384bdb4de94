"""nn.Module layers over tilefish ops: W4A16Linear, NF4Linear (a bitsandbytes NF4 weight on the W4A16
kernels), and the fused projection layers of quantize_model (FusedW4A16Linear, GatedW4A16Linear, W4A16Slice)."""
from __future__ import annotations

import torch
from torch import nn

from . import nf4 as _nf4
from . import w4a16 as _w4a16
from .ops.nf4 import MATMUL_DTYPES, NF4MatmulWeight, check_matmul_shape, prepare
from .ops.w4a16.policy import active_policy_key
from .ops.w4a16 import (W4A16Weight, check_perm, check_shape, deinterleave_gated, gated_order, interleave_gated,
                        layer_counters, make_layer_counters, split_gated)
from .quant import nf4 as _nf4_format
from .quant.nf4 import NF4Weight
from .runtime import current_stream_handle

_WEIGHT_FIELDS = ("packed", "scales", "zeros", "perm", "bias")
_KERNEL_CONSTANTS = ("group_size", "out_features", "in_features", "codebook")  # the op's non-tensor arguments
MAX_PLANS = 64  # launch plans a layer keeps (one per input shape, stream and launch policy); past this it starts afresh


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
        w = self._layer.weight4.dequantize(self.dtype)  # in the kernel's (permuted) k order
        perm = self._layer.perm
        if perm is not None:
            w = w.index_select(1, torch.argsort(perm))  # back to the checkpoint's input order
        a, b = self._columns or (0, self._layer.out_features)
        return self._layer._parts_order(w, 0)[a:b]

    def __repr__(self) -> str:
        return f"WeightInfo(packed 4-bit, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


class _LayerPlan:
    """One input shape's eager call of a W4A16Linear, decided once (ops.w4a16.LaunchPlan)."""

    __slots__ = ("plan", "out_shape", "gated_shape", "dtype", "device", "perm", "m", "k")

    def __init__(self, layer: "W4A16Linear", x: torch.Tensor):
        from .ops.w4a16 import LaunchPlan, validate

        w = layer.weight4
        validate(x, w, layer.bias)
        self.m, self.k = x.numel() // w.k, w.k
        self.out_shape = x.shape[:-1] + (w.n,)
        self.gated_shape = x.shape[:-1] + (w.n // 2,)
        self.dtype, self.device, self.perm = x.dtype, x.device, w.perm
        bias = None if layer.bias is None else layer.bias.detach().contiguous()
        self.plan = LaunchPlan.build(w, bias, self.m, x.device, counters=layer_counters(x.device),
                                     light_ahead=layer.light_ahead) if self.m else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
        """residual: checked by the caller (_fits); gated: the layer is a GatedW4A16Linear."""
        out = torch.empty(self.gated_shape if gated else self.out_shape, dtype=self.dtype, device=self.device)
        if self.plan is not None:
            if self.perm is not None:
                x = x.view(self.m, self.k).index_select(1, self.perm)
            self.plan.launch(x.data_ptr(), out.data_ptr(), 0 if residual is None else residual.data_ptr(), gated)
        return out

    def fits(self, residual: torch.Tensor) -> bool:
        """Whether the launch can read `residual` as it is: the output's shape, dtype and device, contiguous,
        16-byte aligned."""
        return (residual.shape == self.out_shape and residual.dtype == self.dtype and residual.device == self.device
                and residual.is_contiguous() and residual.data_ptr() % 16 == 0)


class W4A16Linear(nn.Module):
    """A drop-in nn.Linear with a 4-bit weight (GPTQ-style groups) and fp16/bf16 activations.

    - x of the layer's dtype runs the W4A16 kernel on CUDA (the float64 reference on CPU); another
      floating dtype (e.g. fp32) is cast to the layer's dtype and the result back.
    - Eager CUDA calls keep a launch plan per input shape, stream and launch policy: the checks and the kernel
      choice happen on the first call, later calls only allocate the output and launch.
    - Scratch: the tile counters of split plans are shared by the layers of a device and made when a
      weight is set on or moved to it, never inside a call (ops/w4a16/workspace.py). Nothing a call
      allocates outlives it, so eager, torch.compile in every mode (CUDA graph trees included) and
      manual CUDA graphs all work.
    - Casting (`.half()`, `.bfloat16()`, `.to(dtype)`) changes the activation dtype between fp16 and
      bf16. A cast to any other dtype (`.float()`, `.double()`, `model.to(torch.float32)`) leaves the
      layer's 16-bit tensors as they are: the kernels take 16-bit activations, and inputs of other
      float dtypes are cast in and the result back.
    - Gradients flow to x (through the dequantized weight); the 4-bit weight itself is frozen.
    - `.weight` is a WeightInfo (dtype, device, shape, dequantize()), not a tensor.
    - codebook: what a 4-bit code means, "int4" ((q - zero) x scale) or "nf4" (NF4 value x scale,
      symmetric, group scales only; NF4Linear builds these from bitsandbytes weights). It is not in
      the state dict (like group_size): a state dict loads into a layer built with the same codebook.
    """

    def __init__(self, in_features: int, out_features: int, *, group_size: int = 128, bias: bool = True,
                 symmetric: bool = True, dtype: torch.dtype = torch.float16, device=None, act_order: bool = False,
                 codebook: str = "int4"):
        super().__init__()
        check_shape(out_features, in_features, group_size)
        _check_codebook(codebook, group_size, symmetric)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.codebook = codebook
        self._plans: dict = {}
        groups = 1 if group_size == -1 else in_features // group_size
        self.register_buffer("packed", torch.zeros(out_features // 64, 8 * in_features, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(groups, out_features, dtype=dtype, device=device))
        self.register_buffer("zeros", None if symmetric else torch.full((groups, out_features), 8, dtype=dtype, device=device))
        self.register_buffer("perm", torch.arange(in_features, device=device) if act_order else None)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self._kernel_constants = (group_size, out_features, in_features, codebook)
        make_layer_counters(self.packed.device)

    # -- the weight ---------------------------------------------------------------------------------------------
    @property
    def weight4(self) -> W4A16Weight:
        return W4A16Weight(self.packed, self.scales, self.zeros, self.group_size, self.out_features,
                           self.in_features, self.perm, self.codebook)

    @property
    def weight(self) -> WeightInfo:
        return WeightInfo(self)

    # The kernel ahead of this layer's calls in the stream is a light one (a norm: the fused attention's q / k / v
    # projection, decoder.use_fused_forward), so its plan may launch as thread-block clusters
    # (ops.w4a16.matmul_impl's light_ahead).
    light_ahead: bool = False

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "light_ahead" and "_plans" in self.__dict__:
            self._plans = {}  # plans made without the hint
        if name in _WEIGHT_FIELDS and "_plans" in self.__dict__:
            self._plans = {}  # the plans point into the replaced tensors
            if name == "packed" and isinstance(value, torch.Tensor):
                make_layer_counters(value.device)
        elif name in _KERNEL_CONSTANTS and "_kernel_constants" in self.__dict__:
            self._kernel_constants = tuple(getattr(self, n) for n in _KERNEL_CONSTANTS)

    def __getstate__(self):
        # copy.deepcopy / pickle: launch plans hold loaded kernels and raw pointers into this layer's
        # tensors; a copy builds its own on its first call.
        state = self.__dict__.copy()
        state["_plans"] = {}
        return state

    def _apply(self, fn, *args, **kwargs):
        self._plans = {}
        old = self.scales.dtype
        probe = fn(torch.empty(0, dtype=old, device=self.scales.device))
        if probe.dtype != old and probe.dtype not in MATMUL_DTYPES:  # .float(), .double(): 16-bit tensors stay
            move, device = fn, probe.device

            def fn(t):
                return t.to(device) if t.is_floating_point() else move(t)
        result = super()._apply(fn, *args, **kwargs)
        make_layer_counters(self.packed.device)
        return result

    def _set(self, w: W4A16Weight, bias: torch.Tensor | None) -> "W4A16Linear":
        if w.codebook != self.codebook:  # the codes would be read with the wrong table
            raise ValueError(f"a {w.codebook} weight cannot go into a layer built with codebook {self.codebook!r}")
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
                if name == "zeros" and self.codebook != "int4":
                    error_msgs.append(f"{key}: a layer with codebook {self.codebook!r} has no zero points")
                    continue
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
                    dtype=w.scales.dtype, device=w.device, codebook=w.codebook)
        return layer._set(w, bias)

    @classmethod
    def from_gptq(cls, qweight, qzeros, scales, g_idx=None, bias=None, *, zero_convention: str = "v1",
                  group_size: int | None = None, dtype: torch.dtype | None = None) -> "W4A16Linear":
        """group_size: the checkpoint's (None: inferred from the scales; one scale row reads as per-channel,
        which a layer whose in_features is one group of 128 also has)."""
        w = _w4a16.from_gptq(qweight, qzeros, scales, g_idx, zero_convention=zero_convention, group_size=group_size,
                             dtype=dtype)
        return cls.from_weight(w, bias)

    @classmethod
    def from_awq(cls, qweight, qzeros, scales, bias=None, *, group_size: int,
                 dtype: torch.dtype | None = None) -> "W4A16Linear":
        return cls.from_weight(_w4a16.from_awq(qweight, qzeros, scales, group_size=group_size, dtype=dtype), bias)

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self._eager_plan(x)
        if plan is not None:
            return plan(x)
        return self._forward_any(x)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)` with the add in the kernel's epilogue (one launch, the same bits: the product is
        rounded to the dtype, then added as a 16-bit sum). residual: shaped like the output, the layer's dtype.
        Where a gradient is wanted, or x is of another dtype, it is the unfused expression."""
        plan = self._eager_plan(x)
        if plan is not None and isinstance(residual, torch.Tensor) and plan.fits(residual):
            return plan(x, residual)
        return self._epilogue_any(x, residual, False)

    def _eager_plan(self, x) -> "_LayerPlan | None":
        """The launch plan of an eager CUDA call on x as it is (contiguous, aligned, the layer's dtype), or None:
        the call then takes the op's general path."""
        if (isinstance(x, torch.Tensor) and x.is_cuda and not torch.compiler.is_compiling()
                and not (x.requires_grad and torch.is_grad_enabled())):
            dev = x.get_device()
            key = (x.shape, x.dtype, dev, current_stream_handle(dev), active_policy_key())
            plan = self._plans.get(key)
            if plan is None and x.dtype == self.scales.dtype:
                if len(self._plans) >= MAX_PLANS:
                    self._plans = {}
                plan = self._plans[key] = _LayerPlan(self, x)
            if plan is not None and x.data_ptr() % 16 == 0 and x.is_contiguous():
                return plan
        return None

    def _epilogue_any(self, x: torch.Tensor, residual: torch.Tensor | None, gated: bool) -> torch.Tensor:
        """The fused epilogues' general path (ops.w4a16.validate_epilogue): the custom op under torch.compile, the
        op eagerly, and the unfused expression where autograd must record the call or x is of another dtype."""
        from .reference import w4a16_epilogue

        dtype = self.scales.dtype
        grad = torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (x, self.bias, residual))
        if grad or not isinstance(x, torch.Tensor) or x.dtype != dtype:
            y = self._forward_any(x)
            return w4a16_epilogue(y, None if residual is None else residual.to(y.dtype), gated)
        counters = layer_counters(self.packed.device)
        if torch.compiler.is_compiling():
            from .ops.library import w4a16_matmul_epilogue_op

            group_size, n, k, codebook = self._kernel_constants
            return w4a16_matmul_epilogue_op(x, self.packed, self.scales, self.zeros, self.perm, self.bias, group_size,
                                            n, k, codebook, counters, residual, gated)
        return _w4a16.matmul_epilogue(x, self.weight4, self.bias, counters, residual, gated)

    def _parts_order(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """t's entries along `dim` (one per output column) in the order of the layer's parts: as they are."""
        return t

    def _forward_any(self, x: torch.Tensor) -> torch.Tensor:
        """Any input, and every call under torch.compile (the custom op): other float dtypes are cast
        to the layer's and back; CPU runs the reference."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"W4A16Linear expects a torch.Tensor, got {type(x).__name__}")
        dtype = self.scales.dtype
        if x.dtype != dtype and x.is_floating_point():
            return self._matmul(x.to(dtype)).to(x.dtype)
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        counters = layer_counters(self.packed.device)
        if torch.compiler.is_compiling():
            # The op straight from the layer's tensors and one tuple of constants: everything read here
            # is guarded at every call of the compiled graph (a W4A16Weight would add a guard a field).
            from .ops.library import w4a16_matmul_op

            group_size, n, k, codebook = self._kernel_constants
            return w4a16_matmul_op(x, self.packed, self.scales, self.zeros, self.perm, self.bias, group_size, n, k,
                                   codebook, counters, self.light_ahead)
        return _w4a16.matmul_with_counters(x, self.weight4, self.bias, counters, self.light_ahead)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, codebook={self.codebook}, "
                f"group_size={self.group_size}, symmetric={self.zeros is None}, act_order={self.perm is not None}, "
                f"bias={self.bias is not None}")


def _check_codebook(codebook: str, group_size: int, symmetric: bool) -> None:
    """The kernels' rules for each codebook (ops.w4a16.check_codebook)."""
    from .ops.w4a16.layout import check_codebook

    check_codebook(codebook, group_size, symmetric)


# ---- NF4Linear: a bitsandbytes NF4 weight on the W4A16 kernels ----------------------------------------------------

_NF4_STATE = ("absmax", "absmax_q", "code2", "absmax2", "offset")  # bitsandbytes' block scales, kept exact
_BNB_KEYS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.bitsandbytes__nf4")
_NF4_ZERO_WORD = 0x77777777  # eight codes 7, the NF4 value 0.0 (a placeholder weight of zeros)


class NF4WeightInfo(WeightInfo):
    """`.weight` of an NF4Linear: dequantize() is bitsandbytes' dequantize_4bit exactly (the fp32 NF4
    value times the fp32 block absmax, rounded once to `dtype`), not the kernel's rounded group scales."""

    __slots__ = ()

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return _nf4.dequantize(self._layer.to_nf4(), dtype or self.dtype)

    def __repr__(self) -> str:
        return (f"NF4WeightInfo(bitsandbytes nf4, blocksize={self._layer.blocksize}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, device={self.device})")


class NF4Linear(W4A16Linear):
    """A drop-in nn.Linear with a bitsandbytes NF4 weight, run by the W4A16 kernels (codebook "nf4").

    - `packed` / `scales`: the codes in the W4A16 kernel layout and per-group scales in the activation
      dtype (each block's absmax rounded once; group_size = min(blocksize, 128)), so forward, launch
      plans, autograd, torch.compile and CUDA graphs are W4A16Linear's.
    - bitsandbytes' block scales are kept unchanged as buffers (`absmax`, or `absmax_q`, `code2`,
      `absmax2`, `offset` with double quant), with `blocksize` and `orig_dtype` (the weight dtype
      bitsandbytes records): to_nf4() is the NF4Weight bit for bit, state_dict() writes bitsandbytes'
      Linear4bit keys (weight, bias, weight.absmax, weight.quant_map, [weight.nested_absmax,
      weight.nested_quant_map,] weight.quant_state.bitsandbytes__nf4) and load_state_dict reads them.
    - `.weight.dequantize()` is bitsandbytes' exact dequantization. `.to(torch.float16 / bfloat16)`
      rebuilds the kernel scales from the exact block scales; a cast to another dtype (`.float()`)
      keeps the kernel dtype, as in W4A16Linear (fp32 inputs are cast in and the result back).
    - The kernels tile out_features by 64 and in_features by 64 (and by the scale group, min(blocksize,
      128)): other shapes are a ValueError.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, blocksize: int = 64,
                 double_quant: bool = True, dtype: torch.dtype = torch.float16, orig_dtype: torch.dtype | None = None,
                 device=None):
        if isinstance(blocksize, bool) or blocksize not in _nf4_format.SUPPORTED_BLOCKSIZES:
            raise ValueError(f"blocksize must be one of {_nf4_format.SUPPORTED_BLOCKSIZES}, got {blocksize!r}")
        check_matmul_shape((out_features, in_features), blocksize)
        if dtype not in MATMUL_DTYPES:
            raise TypeError(f"dtype (the activation dtype) must be torch.float16 or torch.bfloat16, got {dtype}")
        orig_dtype = dtype if orig_dtype is None else orig_dtype
        if orig_dtype not in _nf4_format.FLOAT_DTYPES:
            raise TypeError(f"orig_dtype must be float16, bfloat16 or float32, got {orig_dtype}")
        super().__init__(in_features, out_features, group_size=min(blocksize, 128), bias=bias, dtype=dtype,
                         device=device, codebook="nf4")
        self.blocksize, self.orig_dtype = blocksize, orig_dtype
        # Placeholders until a weight is set or loaded, consistent with each other: every code 7 (0.0),
        # every block absmax 1.0 (double quant: code2[127] = 0 times absmax2 = 1, plus offset 1).
        self.packed.fill_(_NF4_ZERO_WORD)
        nblocks = in_features * out_features // blocksize  # exact: k is a multiple of the scale group min(blocksize, 128), and n of 64
        f32 = dict(dtype=torch.float32, device=device)
        state = dict.fromkeys(_NF4_STATE)
        if double_quant:
            state.update(absmax_q=torch.full((nblocks,), 127, dtype=torch.uint8, device=device),
                         code2=_nf4_format.dynamic_map_signed(device),
                         absmax2=torch.ones(-(-nblocks // _nf4_format.NESTED_BLOCKSIZE), **f32),
                         offset=torch.ones((), **f32))
        else:
            state.update(absmax=torch.ones(nblocks, **f32))
        for name, t in state.items():
            self.register_buffer(name, t)

    # -- the weight ---------------------------------------------------------------------------------------------
    @property
    def double_quant(self) -> bool:
        return self.absmax_q is not None

    @property
    def weight(self) -> NF4WeightInfo:
        return NF4WeightInfo(self)

    @property
    def matmul_weight(self) -> NF4MatmulWeight:
        """The layer's tensors as a tilefish.nf4.matmul weight (shared, not copied)."""
        return NF4MatmulWeight(self.weight4, self.blocksize, self.orig_dtype,
                               *(getattr(self, name) for name in _NF4_STATE))

    def to_nf4(self) -> NF4Weight:
        """The bitsandbytes weight, bit for bit (codes repacked to bitsandbytes' byte order; scales shared)."""
        return self.matmul_weight.to_nf4()

    def _adopt(self, p: NF4MatmulWeight, bias: torch.Tensor | None, copy: bool = False) -> "NF4Linear":
        """Make p (and bias, if given) the layer's weight. copy: write into the current tensors where
        shape, dtype and device agree (load_state_dict: keeps pointers such as CUDA graphs' valid)."""
        tensors = {"packed": p.kernel.packed, "scales": p.kernel.scales}
        tensors.update((name, getattr(p, name)) for name in _NF4_STATE)
        for name, value in tensors.items():
            old = getattr(self, name)
            if (copy and old is not None and value is not None and not old.is_meta and old.shape == value.shape
                    and old.dtype == value.dtype and old.device == value.device):
                with torch.no_grad():
                    old.copy_(value)
            else:
                setattr(self, name, value)
        self.blocksize, self.orig_dtype, self.group_size = p.blocksize, p.orig_dtype, p.kernel.group_size
        if bias is not None:
            bias = bias.detach().to(device=p.device, dtype=p.dtype)
            if copy and self.bias is not None and not self.bias.is_meta and self.bias.device == bias.device:
                with torch.no_grad():
                    self.bias.copy_(bias)
            else:
                self.bias = nn.Parameter(bias, requires_grad=False)
        self._plans = {}
        return self

    def _apply(self, fn, *args, **kwargs):
        # nn.Module.to / half / cuda apply `fn` to every tensor. The fp32 block scales must only move
        # (a 16-bit absmax would no longer be bitsandbytes' weight), and a new activation dtype
        # rebuilds the kernel scales from them (converting the old 16-bit scales would round twice).
        # Another dtype than fp16 / bf16 (.float(), .double()) keeps the kernel dtype, as in W4A16Linear.
        old = self.scales.dtype
        target = fn(torch.empty(0, dtype=old, device=self.scales.device)).dtype
        rebuild = target != old and target in MATMUL_DTYPES and not self.scales.is_meta
        scales = self.matmul_weight.to(target).kernel.scales if rebuild else None
        state = {name: self._buffers.pop(name) for name in _NF4_STATE}
        try:
            result = super()._apply(fn, *args, **kwargs)
        except BaseException:
            self._buffers.update(state)
            raise
        device = self.packed.device
        for name, t in state.items():
            self._buffers[name] = None if t is None else t.to(device)
        if scales is not None:
            self.scales = scales.to(device)
        return result

    # -- bitsandbytes state dicts -------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # bitsandbytes' Linear4bit order: weight, bias, then its QuantState.as_dict(packed=True) entries
        entries = _nf4_format.to_state_dict(self.to_nf4(), prefix + "weight")
        destination[prefix + "weight"] = entries.pop(prefix + "weight")
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()
        destination.update(entries)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The weight is read as a whole (nf4.from_state_dict checks it), converted, and only then put in
        # place with the bias: after any error or missing key the layer is as it was. (Unexpected keys
        # are only reported: torch raises for them after loading, when strict, as for any module.)
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        wkey, bkey = prefix + "weight", prefix + "bias"
        known = {wkey, bkey} | {f"{wkey}.{s}" for s in _BNB_KEYS}
        errors, missing = len(error_msgs), []
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and (
                k not in known or (k == bkey and self.bias is None)))
        prepared = bias = None
        if not any(k == wkey or k.startswith(wkey + ".") for k in state_dict):
            missing += [k for k in self._bnb_keys(prefix) if k != bkey]
        else:
            try:
                prepared = self._prepare_loaded(state_dict, wkey)
            except (ValueError, TypeError) as e:
                error_msgs.append(f"{wkey}: {e}")
        if self.bias is not None:
            if bkey not in state_dict:
                missing.append(bkey)
            else:
                bias = state_dict[bkey]
                if not isinstance(bias, torch.Tensor) or bias.shape != self.bias.shape:
                    error_msgs.append(f"size mismatch for {bkey}: expected a tensor of shape {tuple(self.bias.shape)}, "
                                      f"got {tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias)}")
        missing_keys.extend(missing)
        if len(error_msgs) > errors or missing:
            return
        self._adopt(prepared, bias, copy=True)

    def _bnb_keys(self, prefix: str) -> list[str]:
        """The keys this layer's state dict has (the bitsandbytes Linear4bit ones)."""
        nested = ("nested_absmax", "nested_quant_map") if self.double_quant else ()
        return ([prefix + "weight"] + ([prefix + "bias"] if self.bias is not None else [])
                + [f"{prefix}weight.{s}" for s in ("absmax", "quant_map", *nested, "quant_state.bitsandbytes__nf4")])

    def _prepare_loaded(self, state_dict, wkey: str) -> NF4MatmulWeight:
        q = _nf4_format.from_state_dict(state_dict, wkey)
        if tuple(q.shape) != (self.out_features, self.in_features):
            raise ValueError(f"shape {list(q.shape)} (quant_state JSON) is not this layer's [out_features, "
                             f"in_features] = [{self.out_features}, {self.in_features}]")
        device = q.device if self.packed.is_meta else self.packed.device
        return prepare(q.to(device), self.scales.dtype)

    # -- constructors -------------------------------------------------------------------------------------------
    @classmethod
    def from_nf4(cls, q: NF4Weight, bias: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> "NF4Linear":
        """An NF4Weight [out_features, in_features] (tilefish.nf4.quantize / from_bnb / from_state_dict),
        on its device. dtype: the activation dtype (default the weight's if 16-bit, else float16). The
        block-scale tensors are shared with q, not copied."""
        if not isinstance(q, NF4Weight):
            raise TypeError(f"from_nf4 expects an NF4Weight, got {type(q).__name__}")
        if dtype is not None and dtype not in MATMUL_DTYPES:
            raise TypeError(f"dtype (the activation dtype) must be torch.float16 or torch.bfloat16, got {dtype}")
        p = prepare(q, dtype)
        layer = cls(p.k, p.n, bias=bias is not None, blocksize=p.blocksize, double_quant=p.double_quant,
                    dtype=p.dtype, orig_dtype=p.orig_dtype, device="meta")  # no placeholder memory
        return layer._adopt(p, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, blocksize: int = 64, double_quant: bool = True,
                    dtype: torch.dtype | None = None) -> "NF4Linear":
        """Quantize an nn.Linear's weight to NF4 as bitsandbytes does (tilefish.nf4.quantize), on its device."""
        check_matmul_shape(tuple(linear.weight.shape), blocksize)  # before the work of quantizing
        dtype = dtype or (linear.weight.dtype if linear.weight.dtype in MATMUL_DTYPES else torch.float16)
        if dtype not in MATMUL_DTYPES:
            raise TypeError(f"dtype (the activation dtype) must be torch.float16 or torch.bfloat16, got {dtype}")
        q = _nf4.quantize(linear.weight.detach(), blocksize, double_quant)
        return cls.from_nf4(q, linear.bias, dtype)

    @classmethod
    def from_bnb(cls, linear4bit, dtype: torch.dtype | None = None) -> "NF4Linear":
        """A bitsandbytes Linear4bit (nf4), duck-typed: its `.weight` (Params4bit) and `.weight.quant_state`,
        `.bias`, and `.compute_dtype` as the default activation dtype when it is 16-bit. Tensors stay
        where they are (a CUDA Linear4bit gives a CUDA layer)."""
        weight = getattr(linear4bit, "weight", None)
        quant_state = getattr(weight, "quant_state", None)
        if quant_state is None:
            raise ValueError(f"{type(linear4bit).__name__} has no weight.quant_state: not a quantized bitsandbytes "
                             "Linear4bit (bitsandbytes quantizes the weight when the layer is moved to the GPU)")
        if dtype is None and getattr(linear4bit, "compute_dtype", None) in MATMUL_DTYPES:
            dtype = linear4bit.compute_dtype
        return cls.from_nf4(_nf4.from_bnb(weight, quant_state), getattr(linear4bit, "bias", None), dtype)

    @classmethod
    def from_state_dict(cls, sd: dict, prefix: str = "", dtype: torch.dtype | None = None) -> "NF4Linear":
        """A layer from bitsandbytes Linear4bit entries `{prefix}weight`, `{prefix}weight.absmax`, ...,
        and `{prefix}bias` if present (an HF checkpoint's, a state_dict()'s). Other keys are ignored."""
        if prefix and not prefix.endswith("."):
            prefix += "."
        q = _nf4_format.from_state_dict(sd, prefix + "weight")
        return cls.from_nf4(q, sd.get(prefix + "bias"), dtype)

    @classmethod
    def from_weight(cls, w, bias=None):
        raise TypeError("NF4Linear is built from bitsandbytes NF4 weights: from_nf4, from_linear, from_bnb or "
                        "from_state_dict (W4A16Linear.from_weight takes a W4A16Weight)")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, codebook=nf4, "
                f"blocksize={self.blocksize}, double_quant={self.double_quant}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")


class FusedW4A16Linear(W4A16Linear):
    """Several projections of one input (q/k/v, gate/up) as one W4A16 matmul: their weights side by
    side along out_features, so one launch streams all of them. Each original module is replaced by a
    W4A16Slice that returns its columns of the shared result.

    The parts of one input share one launch: the first part called on a tensor computes the whole
    output, the others take their columns of it, and once every part has taken its columns the result
    is dropped; the forward of the module holding the parts also drops whatever is left when it
    returns (W4A16Slice.share_within), so no tensor is carried from one forward to the next (CUDA
    graph trees and torch.compile see none). A part called on another tensor (or on the same one after
    an in-place change, in eager mode outside torch.inference_mode, whose tensors keep no version counter)
    recomputes, so the answer never depends on call order."""

    def __init__(self, in_features: int, split_sizes: list[int], **kwargs):
        super().__init__(in_features, sum(split_sizes), **kwargs)
        self.split_sizes = list(split_sizes)
        bounds, a = [], 0
        for s in split_sizes:
            bounds.append((a, a + s))
            a += s
        self.bounds = bounds
        self._shared = _SharedResult()

    def __getstate__(self):
        state = super().__getstate__()
        state["_shared"] = _SharedResult()  # a copy shares no result with the original
        return state

    @property
    def holds_result(self) -> bool:
        """Whether a result is held for parts still to take their columns (never between forwards)."""
        return self._shared.y is not None

    def part(self, x: torch.Tensor, columns: tuple[int, int]) -> torch.Tensor:
        """Columns [a, b) of this layer's output for x, computed once for all parts."""
        shared = self._shared
        # an inference tensor (torch.inference_mode) keeps no version counter: as under torch.compile, an in-place
        # change to x between two parts' calls is then not seen
        tracked = not torch.compiler.is_compiling() and not x.is_inference()
        if not shared.left or shared.x is not x or (tracked and shared.version != x._version):
            shared.x, shared.version, shared.y = x, x._version if tracked else 0, self._shared_forward(x)
            shared.left = len(self.split_sizes)
        y = shared.y
        shared.left -= 1
        if not shared.left:
            shared.clear()
        a, b = columns
        return self._part_of(y, a, b)

    def _shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        """What the parts take their columns from (_part_of): the layer's output."""
        return self(x)

    def _part_of(self, y: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Columns [a, b) (the parts' order) of the shared output y."""
        return y[..., a:b]

    def part_weight(self, index: int) -> tuple[W4A16Weight, torch.Tensor | None]:
        """Part `index` as a layer of its own would hold it: its kernel weight and bias (exact copies of its
        columns: whole 64-column strips of the packed rows and of the scale / zero-point columns, since the
        strip permutation stays inside a strip)."""
        a, b = self.bounds[index]
        return self._columns_weight(self.weight4, a, b), None if self.bias is None else self.bias.detach()[a:b]

    def _columns_weight(self, w: W4A16Weight, a: int, b: int) -> W4A16Weight:
        zeros = None if w.zeros is None else w.zeros[:, a:b].contiguous()
        return W4A16Weight(w.packed[a // 64: b // 64], w.scales[:, a:b].contiguous(), zeros, w.group_size, b - a,
                           w.k, w.perm, w.codebook)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", split_sizes={self.split_sizes}"


class GatedW4A16Linear(FusedW4A16Linear):
    """The gate and up projections of a SiLU-gated MLP (Llama's `down(silu(gate(x)) * up(x))`) as one W4A16
    matmul whose kernel epilogue computes the activation: forward_gated(x) = silu(gate_proj(x)) * up_proj(x) in
    one launch, writing half of what the two projections would. For that its weight's columns alternate 8 gate
    columns and their 8 up columns (ops.w4a16 GATED_BLOCK, interleave_gated), so each kernel thread holds both
    halves of what it multiplies. Everything else sees the parts' order, as for a FusedW4A16Linear: forward(x)
    returns [gate | up], the W4A16Slices gate_proj / up_proj their columns, `.weight` and part_weight the
    parts' rows. Its state dict is the interleaved kernel layout, marked by its extra state, so it loads only
    into a GatedW4A16Linear (and a FusedW4A16Linear's only into one of those)."""

    COLUMN_ORDER = "gated8"

    def __init__(self, in_features: int, intermediate: int, **kwargs):
        super().__init__(in_features, [intermediate, intermediate], **kwargs)

    @classmethod
    def from_fused(cls, fused: FusedW4A16Linear) -> "GatedW4A16Linear":
        """The gated form of a [gate, up] FusedW4A16Linear (the same weights, columns interleaved)."""
        if type(fused) is not FusedW4A16Linear or len(fused.split_sizes) != 2 or \
                fused.split_sizes[0] != fused.split_sizes[1]:
            raise ValueError("GatedW4A16Linear.from_fused takes a FusedW4A16Linear of two parts of one width "
                             f"(gate, up); got {type(fused).__name__} with parts {getattr(fused, 'split_sizes', None)}")
        w = fused.weight4
        gated = cls(w.k, w.n // 2, group_size=w.group_size, bias=fused.bias is not None, symmetric=w.zeros is None,
                    dtype=w.dtype, device="meta", act_order=w.perm is not None, codebook=w.codebook)
        bias = None if fused.bias is None else fused.bias.detach()[gated_order(w.n, w.packed.device)]
        return gated._set(interleave_gated(w), bias)

    def ungated(self) -> FusedW4A16Linear:
        """The [gate, up] FusedW4A16Linear of the same weights (for what needs the parts side by side)."""
        w = self.weight4
        fused = FusedW4A16Linear(w.k, list(self.split_sizes), group_size=w.group_size, bias=self.bias is not None,
                                 symmetric=w.zeros is None, dtype=w.dtype, device="meta",
                                 act_order=w.perm is not None, codebook=w.codebook)
        return fused._set(deinterleave_gated(w), None if self.bias is None else self._parts_order(self.bias.detach(), 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(split_gated(super().forward(x)), -1)

    def forward_gated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate_proj(x)) * up_proj(x), the activation in the kernel's epilogue ([..., intermediate])."""
        plan = self._eager_plan(x)
        if plan is not None:
            return plan(x, gated=True)
        return self._epilogue_any(x, None, True)

    def _shared_forward(self, x: torch.Tensor) -> torch.Tensor:
        return W4A16Linear.forward(self, x)  # the interleaved kernel output; _part_of picks the columns

    def _part_of(self, y: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return torch.cat(split_gated(y), -1)[..., a:b]

    def _parts_order(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.index_select(dim, torch.argsort(gated_order(self.out_features, t.device)))

    def part_weight(self, index: int) -> tuple[W4A16Weight, torch.Tensor | None]:
        a, b = self.bounds[index]
        bias = None if self.bias is None else self._parts_order(self.bias.detach(), 0)[a:b]
        return self._columns_weight(deinterleave_gated(self.weight4), a, b), bias

    def get_extra_state(self):
        return {"column_order": self.COLUMN_ORDER}

    def set_extra_state(self, state) -> None:
        if not isinstance(state, dict) or state.get("column_order") != self.COLUMN_ORDER:
            raise ValueError(f"a GatedW4A16Linear's state dict has extra state {{'column_order': "
                             f"{self.COLUMN_ORDER!r}}}; got {state!r} (a FusedW4A16Linear's tensors are in another "
                             "column order)")


class _SharedResult:
    """A fused layer's result while its parts take their columns. A plain object, not module state:
    torch.compile replays the updates of a compiled call after it, and a module's __setattr__ is
    Python (slow at every decode step), a slot's is not."""

    __slots__ = ("x", "version", "y", "left")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.x = self.y = None
        self.version = self.left = 0


def _drop_shared_results(module: nn.Module, args, output) -> None:
    """Forward hook of a module holding W4A16Slices: what its fused layers still hold is dropped (parts
    the forward did not call). Reached through the slices it names, the paths the forward itself took,
    so torch.compile adds no guard for another path to the same modules."""
    for name in module._w4a16_slices:
        getattr(module, name).fused._shared.clear()


class W4A16Slice(nn.Module):
    """Stands where one of the projections fused into a FusedW4A16Linear was: its columns of the fused
    result. Holds no tensors of its own (the fused layer, registered beside it, owns them)."""

    def __init__(self, fused: FusedW4A16Linear, index: int):
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: the parent registers it once
        self.index = index
        self.columns = tuple(fused.bounds[index])
        self.in_features = fused.in_features
        self.out_features = fused.split_sizes[index]

    @staticmethod
    def share_within(parent: nn.Module, slice_name: str) -> None:
        """After parent's forward, drop what the fused layer of parent's slice `slice_name` still holds
        (one forward hook on parent, added once; one slice name per fused layer)."""
        names = getattr(parent, "_w4a16_slices", ())
        if slice_name not in names:
            parent._w4a16_slices = names + (slice_name,)
        if _drop_shared_results not in parent._forward_hooks.values():
            parent.register_forward_hook(_drop_shared_results)

    @staticmethod
    def stop_sharing(parent: nn.Module) -> None:
        """Remove share_within's hook from parent (its slices are gone)."""
        for key in [key for key, hook in parent._forward_hooks.items() if hook is _drop_shared_results]:
            del parent._forward_hooks[key]
        parent.__dict__.pop("_w4a16_slices", None)

    @property
    def weight(self) -> WeightInfo:
        return WeightInfo(self.fused, self.columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.columns)

    def extra_repr(self) -> str:
        a, b = self.columns
        return f"columns {a}:{b} of a FusedW4A16Linear, in_features={self.in_features}, out_features={self.out_features}"
