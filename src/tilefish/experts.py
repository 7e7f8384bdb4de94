"""QuantizedExperts: a drop-in for a transformers experts module (Qwen3MoeExperts, MixtralExperts,
GptOssExperts, ...) whose experts are 4-bit, on the grouped expert op (tilefish.moe.moe_experts).

A dense experts module holds its E experts as two 3-D parameters (transformers 5):

    gate_up_proj  [E, 2I, H]  (x @ W^T)          or, transposed (gpt-oss), [E, H, 2I]  (x @ W)
    down_proj     [E, H, I]                      or, transposed,           [E, I, H]
    gate_up_proj_bias [E, 2I], down_proj_bias [E, H]  (gpt-oss only)

and the 2I rows are [gate; up] concatenated, or interleaved gate0, up0, gate1, ... (gpt-oss). The
quantized module stores both projections as ExpertWeights in one canonical form, [n, k] per expert with
gate rows first (the op's), so every family runs the same kernel; conversion reorders the rows (and the
gate_up bias) once. Its forward takes the dense module's arguments (hidden_states [T, H], the routed expert
ids [T, K], their weights [T, K]) and returns the same [T, H].
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .ops.expert_weights import ExpertWeights
from .ops.w4a16.layout import DTYPES
from .ops.w4a16.workspace import layer_counters, make_layer_counters

__all__ = ["QuantizedExperts", "DenseExpertsLayout", "dense_layout", "is_dense_experts"]

_TENSORS = ("gate_up_packed", "gate_up_scales", "gate_up_zeros", "down_packed", "down_scales", "down_zeros",
            "gate_up_bias", "down_bias")
_DENSE_PARAMETERS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
# plain attributes of the dense module that describe its dense parameters, not the quantized ones
_DENSE_ONLY_ATTRIBUTES = ("is_transposed", "is_concatenated", "training")
_SILU_CLASSES = ("SiLU", "SiLUActivation")
MAX_LAUNCHES = 64  # launches a module keeps (one per call signature); past this it starts afresh
_UNSEEN = object()


def is_dense_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds experts the transformers 5 way: 3-D ``gate_up_proj`` and ``down_proj``."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (not isinstance(module, QuantizedExperts) and isinstance(gate_up, torch.Tensor)
            and isinstance(down, torch.Tensor) and gate_up.dim() == 3 and down.dim() == 3)


@dataclass(frozen=True)
class DenseExpertsLayout:
    """How a dense experts module stores its weights, read off it by dense_layout."""

    num_experts: int
    hidden: int
    intermediate: int
    transposed: bool     # gate_up_proj [E, H, 2I] and down_proj [E, I, H] (x @ W)
    interleaved: bool    # gate / up rows alternate (gpt-oss) instead of [gate; up]
    activation: str      # the op's name for the module's activation
    has_bias: bool

    def gate_up(self, module: nn.Module) -> torch.Tensor:
        """The gate_up weight [E, 2I, H] in the op's form (gate rows, then up rows)."""
        w = module.gate_up_proj.detach()
        w = w.transpose(1, 2) if self.transposed else w
        return torch.cat([w[:, 0::2], w[:, 1::2]], 1) if self.interleaved else w

    def down(self, module: nn.Module) -> torch.Tensor:
        w = module.down_proj.detach()
        return w.transpose(1, 2) if self.transposed else w

    def gate_up_bias(self, module: nn.Module) -> torch.Tensor | None:
        if not self.has_bias:
            return None
        b = module.gate_up_proj_bias.detach()
        return torch.cat([b[:, 0::2], b[:, 1::2]], 1) if self.interleaved else b

    def to_dense(self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None):
        """The inverse of gate_up / down / gate_up_bias: the op's forms back in the module's storage."""
        def interleave(t):  # [..., gate | up] -> gate0, up0, gate1, ... along dim 1
            gate, up = t.chunk(2, 1)
            return torch.stack([gate, up], 2).flatten(1, 2)
        if self.interleaved:
            gate_up = interleave(gate_up)
            gate_up_bias = None if gate_up_bias is None else interleave(gate_up_bias)
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        return gate_up.contiguous(), down.contiguous(), gate_up_bias


def dense_layout(module: nn.Module) -> DenseExpertsLayout:
    """The layout of a dense experts module, or a ValueError saying what tilefish cannot convert in it."""
    if not is_dense_experts(module):
        raise ValueError(f"{type(module).__name__} has no 3-D gate_up_proj and down_proj (not a transformers 5 "
                         "experts module)")
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.shape[0] != down.shape[0]:
        raise ValueError(f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} hold different "
                         "numbers of experts")
    e, a, b = gate_up.shape
    _, c, d = down.shape
    plain, transposed = a == 2 * d and b == c, b == 2 * c and a == d   # never both (it would need a = 0)
    declared = getattr(module, "is_transposed", None)
    if not (plain or transposed) or (declared is not None and bool(declared) != transposed):
        raise ValueError(f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are neither "
                         "[E, 2I, H] + [E, H, I] nor the transposed [E, H, 2I] + [E, I, H]"
                         + (f" (the module says is_transposed={declared})" if declared is not None else ""))
    hidden, inter = (b, d) if plain else (a, c)
    others = sorted((set(dict(module.named_parameters())) | set(dict(module.named_buffers()))) - set(_DENSE_PARAMETERS))
    if others:
        raise ValueError(f"it holds tensors tilefish does not know how to quantize or keep: {', '.join(others)}")
    has_bias = isinstance(getattr(module, "gate_up_proj_bias", None), torch.Tensor)
    if has_bias != isinstance(getattr(module, "down_proj_bias", None), torch.Tensor):
        raise ValueError("it has a bias on one projection only (gate_up_proj_bias and down_proj_bias go together)")
    if getattr(module, "has_gate", True) is not True:
        raise ValueError("it has no gate projection (has_gate=False): only gated experts are supported")
    return DenseExpertsLayout(e, hidden, inter, transposed, not getattr(module, "is_concatenated", True),
                              _activation(module), has_bias)


def _activation(module: nn.Module) -> str:
    """"silu" for an act_fn that is SiLU; "swiglu_oai" for gpt-oss's clamped SwiGLU (alpha, limit)."""
    act = getattr(module, "act_fn", None)
    if act is not None:
        if type(act).__name__ in _SILU_CLASSES or act is nn.functional.silu:
            return "silu"
        raise ValueError(f"its act_fn is {type(act).__name__}; the expert op supports SiLU (and gpt-oss's SwiGLU)")
    from .ops.moe import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

    alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
    if alpha is None or limit is None:
        raise ValueError("it has neither act_fn nor gpt-oss's alpha and limit: its activation is unknown")
    if (float(alpha), float(limit)) != (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
        raise ValueError(f"its SwiGLU has alpha={alpha}, limit={limit}; the expert op's swiglu_oai is "
                         f"alpha={SWIGLU_OAI_ALPHA}, limit={SWIGLU_OAI_LIMIT}")
    return "swiglu_oai"


def dense_template(module: nn.Module) -> nn.Module:
    """A copy of a dense experts module whose tensors are on the meta device (no memory): what
    QuantizedExperts.to_dense fills back in."""
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta"), t.requires_grad) if isinstance(t, nn.Parameter)
                    else torch.empty_like(t, device="meta"))
            for t in list(module.parameters()) + list(module.buffers())}
    return copy.deepcopy(module, memo)


class QuantizedExperts(nn.Module):
    """E experts with 4-bit weights (module docstring); forward(hidden_states, top_k_index, top_k_weights).

    - hidden_states [..., H] of the module's dtype run the op directly; other float dtypes (fp32) are cast
      to it and the result back. CUDA: the grouped kernel; CPU: the float64 reference.
    - The plain attributes transformers code reads off the dense module (num_experts, hidden_dim,
      intermediate_dim, ...) are copied from it.
    - Casting (.half(), .bfloat16()) changes the activation dtype; .float() / .double() leave the 16-bit
      tensors as they are (the op takes 16-bit activations), as W4A16Linear does.
    - No gradients: the experts are frozen.
    - Eager CUDA calls keep their launches per call signature (shapes, dtypes, devices), on either path (decode
      or grouped): the checks and the plan happen on the first call, later ones only allocate and launch.
    """

    def __init__(self, gate_up: ExpertWeights, down: ExpertWeights, activation: str = "silu",
                 gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                 template: nn.Module | None = None, storage: DenseExpertsLayout | None = None):
        super().__init__()
        from .ops.moe import validate

        self._launches: dict = {}
        x = torch.empty(0, gate_up.k, dtype=gate_up.dtype, device=gate_up.device)
        ids = torch.empty(0, 1, dtype=torch.int64, device=gate_up.device)
        validate(x, ids, ids.float(), gate_up, down, activation, gate_up_bias, down_bias)   # shapes agree
        self.num_experts = gate_up.num_experts
        self.activation = activation
        self._constants = (gate_up.group_size, down.group_size, gate_up.codebook, down.codebook, down.k, activation)
        for name, t in zip(_TENSORS, (gate_up.packed, gate_up.scales, gate_up.zeros, down.packed, down.scales,
                                      down.zeros, gate_up_bias, down_bias)):
            self.register_buffer(name, t)
        make_layer_counters(gate_up.scales.device)  # the split-k tile counters the device's layers share
        # the dense module's class and attributes (its tensors on meta) and how it stored its weights, for
        # to_dense; not a submodule: its meta tensors are no state of this module
        object.__setattr__(self, "dense_template", template)
        object.__setattr__(self, "storage", storage)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in _TENSORS and "_launches" in self.__dict__:
            self._launches = {}  # the launches point into the replaced tensors

    def __getstate__(self):
        # copy.deepcopy / pickle: launches hold loaded kernels and raw pointers into this module's tensors
        state = self.__dict__.copy()
        state["_launches"] = {}
        return state

    def _load_from_state_dict(self, *args, **kwargs):
        self._launches = {}
        super()._load_from_state_dict(*args, **kwargs)

    @property
    def gate_up(self) -> ExpertWeights:
        g, _, cb, _, inter, _ = self._constants
        return ExpertWeights(self.gate_up_packed, self.gate_up_scales, self.gate_up_zeros, g, 2 * inter,
                             self.gate_up_packed.shape[2] // 8, cb)

    @property
    def down(self) -> ExpertWeights:
        _, g, _, cb, inter, _ = self._constants
        return ExpertWeights(self.down_packed, self.down_scales, self.down_zeros, g, self.down_packed.shape[1] * 64,
                             inter, cb)

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up_scales.dtype

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def from_dense(cls, module: nn.Module, codebook: str = "int4", *, dtype: torch.dtype | None = None,
                   **options) -> "QuantizedExperts":
        """Quantize a dense experts module (dense_layout reads its layout; a ValueError says why one cannot
        be converted), one projection at a time, where its weights are. codebook and options as
        ExpertWeights.from_weights (int4: group_size, symmetric, clip_search; nf4: blocksize,
        double_quant); dtype: the activation dtype (default the weights' if 16-bit, else fp16)."""
        layout = dense_layout(module)
        weight_dtype = module.gate_up_proj.dtype
        dtype = dtype or (weight_dtype if weight_dtype in DTYPES else torch.float16)
        gate_up = ExpertWeights.from_weights(layout.gate_up(module), codebook, dtype=dtype, **options)
        down = ExpertWeights.from_weights(layout.down(module), codebook, dtype=dtype, **options)
        bias = layout.gate_up_bias(module)
        biases = (None, None) if bias is None else (bias.to(dtype), module.down_proj_bias.detach().to(dtype))
        layer = cls(gate_up, down, layout.activation, *biases, template=dense_template(module), storage=layout)
        layer.copy_attributes(module)
        return layer

    def copy_attributes(self, module: nn.Module) -> None:
        """Copy the dense module's plain int / float / str / bool attributes (num_experts, hidden_dim, ...)
        that describe the experts, not their dense storage."""
        for name, value in vars(module).items():
            if (not name.startswith("_") and name not in _DENSE_ONLY_ATTRIBUTES and name not in self.__dict__
                    and isinstance(value, (bool, int, float, str))):
                setattr(self, name, value)

    def to_dense(self, dtype: torch.dtype | None = None) -> nn.Module:
        """The dense experts module back (the class and attributes it was converted from), holding the exactly
        dequantized weights in ``dtype`` (default the module's). Needs the template from_dense keeps."""
        if self.dense_template is None or self.storage is None:
            raise ValueError("this QuantizedExperts keeps no dense template (built without from_dense or a loader): "
                             "its dense module class is unknown")
        dtype = dtype or self.dtype
        bias = None if self.gate_up_bias is None else self.gate_up_bias.to(dtype)
        gate_up, down, bias = self.storage.to_dense(self.gate_up.dequantize(dtype), self.down.dequantize(dtype),
                                                         bias)
        values = {"gate_up_proj": gate_up, "down_proj": down, "gate_up_proj_bias": bias,
                  "down_proj_bias": None if self.down_bias is None else self.down_bias.to(dtype)}
        dense = copy.deepcopy(self.dense_template)
        for name, value in values.items():
            if value is not None:
                setattr(dense, name, nn.Parameter(value, requires_grad=False))
        return dense.train(self.training)

    # -- forward ------------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None, *, router_indices: torch.Tensor | None = None,
                routing_weights: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states [..., H], top_k_index [T, K] (gpt-oss: router_indices), top_k_weights [T, K]
        (gpt-oss: routing_weights) -> [..., H]: each token's sum of weight x expert(token)."""
        ids = top_k_index if top_k_index is not None else router_indices
        weights = top_k_weights if top_k_weights is not None else routing_weights
        if ids is None or weights is None:
            raise TypeError("QuantizedExperts needs the routed expert ids and their weights (top_k_index, "
                            "top_k_weights)")
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        dtype = self.gate_up_scales.dtype
        if not torch.compiler.is_compiling() and x.is_cuda and x.dtype == dtype and isinstance(ids, torch.Tensor) \
                and isinstance(weights, torch.Tensor):
            launch = self._kept_launch(x, ids, weights)
            if launch is not None:
                return launch(x, ids, weights).reshape(hidden_states.shape)
        y = self._experts(x.to(dtype) if x.dtype != dtype else x, ids, weights)
        return y.to(hidden_states.dtype).reshape(hidden_states.shape)

    def _kept_launch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """The kept launches of this call signature, decode or grouped (built and kept on its first call, after
        the op's checks), or None for a call with no slot."""
        key = (x.shape, ids.shape, ids.dtype, weights.dtype, x.device, ids.device, weights.device)
        launch = self._launches.get(key, _UNSEEN)
        if launch is _UNSEEN:
            from .ops.moe import validate
            from .ops.moe_kernels import experts_launch

            gate_up, down = self.gate_up, self.down
            validate(x, ids, weights, gate_up, down, self.activation, self.gate_up_bias, self.down_bias)
            launch = experts_launch(x, ids, weights, gate_up, down, self.activation, self.gate_up_bias,
                                   self.down_bias, layer_counters(x.device))
            if len(self._launches) >= MAX_LAUNCHES:
                self._launches = {}
            self._launches[key] = launch
        return launch

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # the op straight from the buffers and one tuple of constants (no dataclass built in the graph)
            from .ops.library import moe_experts_op

            return moe_experts_op(x, ids, weights, self.gate_up_packed, self.gate_up_scales, self.gate_up_zeros,
                                  self.down_packed, self.down_scales, self.down_zeros, self.gate_up_bias,
                                  self.down_bias, *self._constants)
        from .ops.moe import moe_experts_impl

        return moe_experts_impl(x, ids, weights, self.gate_up, self.down, self.activation, self.gate_up_bias,
                                self.down_bias)

    def _apply(self, fn, *args, **kwargs):
        self._launches = {}
        # a cast to a dtype the op does not take (.float(), .double()) moves the tensors but keeps their dtype
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.gate_up_scales.device))
        if probe.dtype != self.dtype and probe.dtype not in DTYPES:
            move, device = fn, probe.device

            def fn(t):
                return t.to(device) if t.is_floating_point() else move(t)
        out = super()._apply(fn, *args, **kwargs)
        make_layer_counters(self.gate_up_scales.device)  # scratch made on the move, never inside a call
        return out

    def extra_repr(self) -> str:
        g, d = self.gate_up, self.down
        return (f"num_experts={self.num_experts}, hidden={g.k}, intermediate={d.k}, activation={self.activation}, "
                f"gate_up={g.codebook} g{g.group_size}{' asym' if g.zeros is not None else ''}, "
                f"down={d.codebook} g{d.group_size}{' asym' if d.zeros is not None else ''}, "
                f"bias={self.gate_up_bias is not None}, dtype={self.dtype}")
