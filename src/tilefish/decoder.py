"""The fused forward of Llama-family decoder layers (transformers' Llama, Mistral, Qwen2, Qwen3) and of their
SiLU-gated MLPs: fewer kernels a layer, the same rounding as transformers' forward.

transformers runs a decoder layer as
    h = x + attn(norm1(x));   out = h + mlp(norm2(h));   mlp(y) = down(silu(gate(y)) * up(y))
and the fused forward as
    x1 = rms_norm(x)                   one tilefish kernel (tilefish.norm)
    a = attn(x1)                       q/k/v one W4A16 launch (fuse_projections); with a StaticCache the rotary
                                       embedding and the cache write one more (tilefish.ops.rope_cache), then
                                       the model's attention function and o; a CUDA decode step of SDPA
                                       attention runs rotary, cache write and attention as one launch
                                       (tilefish.ops.rope_attention), then o; Qwen3's per-head q / k norms
                                       run inside either kernel
    h, x2 = rms_norm(x + a)            one kernel: the residual add and the norm
    g = silu(gate(x2)) * up(x2)        one W4A16 launch with the activation in its epilogue (GatedW4A16Linear)
    out = h + down(g)                  one W4A16 launch with the residual add in its epilogue
Six tilefish launches besides the attention's own kernels and o's GEMM, where transformers' forward (compiled)
adds two norm kernels, a SiLU-mul, a residual add and four rotary / cache kernels around the four GEMMs; and under
programmatic dependent launch
(sm_90, ops.w4a16.LaunchPolicy.programmatic) each of them starts streaming its weights while the kernel ahead
of it in the stream finishes. A fused MLP alone (an MoE model's shared expert) is `down(gated(x))`.

Rounding: each step rounds to the activation dtype where transformers does (the norm: fp32 normalise, round,
times the weight; the adds, the silu and the product: 16-bit results), so on the CPU (the reference ops) the
fused forward equals transformers' bit for bit; on the GPU the norms' fp32 sums run in another order.

The switch is a class swap per module: FusedLlamaDecoderLayer is a LlamaDecoderLayer whose forward is the one
above, FusedLlamaAttention a LlamaAttention whose forward writes the cache with the one kernel (only a
StaticCache's plain layers, once initialized: any other cache, or its first fill, takes transformers' forward),
so isinstance checks, hooks (output_hidden_states), state dicts and save_pretrained see the same modules
(and pickling finds the class here: see __getattr__). use_fused_forward installs it where every piece is in
place; restore_forward undoes it. A call that wants a gradient, or whose pieces were swapped afterwards, runs
transformers' own forward.
"""
from __future__ import annotations

import importlib

import torch

from .nn import FusedW4A16Linear, GatedW4A16Linear, W4A16Linear, W4A16Slice
from .attention import NAME as TILEFISH_SDPA, SDPA_IGNORED_KWARGS
from .ops import rope_attention as rope_attention_ops
from .ops import rope_cache as rope_cache_ops

# The transformers classes whose forward is the one the module docstring spells out (their module is
# transformers.models.<family>.modeling_<family>); an exact class, never a subclass, since a subclass may have
# a forward of its own.
DECODER_LAYERS = {"LlamaDecoderLayer": "llama", "MistralDecoderLayer": "mistral", "Qwen2DecoderLayer": "qwen2",
                  "Qwen3DecoderLayer": "qwen3"}
GATED_MLPS = {"LlamaMLP": "llama", "MistralMLP": "mistral", "Qwen2MLP": "qwen2", "Qwen3MLP": "qwen3",
              "Qwen2MoeMLP": "qwen2_moe", "Qwen3MoeMLP": "qwen3_moe"}
ATTENTIONS = {"LlamaAttention": "llama", "MistralAttention": "mistral", "Qwen2Attention": "qwen2",
              "Qwen3Attention": "qwen3", "Qwen3MoeAttention": "qwen3_moe"}
# the families whose attention RMS-normalizes each q and k head (q_norm / k_norm) before the rotary
HEAD_NORMED = ("qwen3", "qwen3_moe")
RMS_NORMS = {"LlamaRMSNorm": "llama", "MistralRMSNorm": "mistral", "Qwen2RMSNorm": "qwen2", "Qwen3RMSNorm": "qwen3",
             "Qwen3MoeRMSNorm": "qwen3_moe"}
SILU = ("SiLUActivation", "SiLU")  # transformers' ACT2FN["silu"] and torch's nn.SiLU
NORM_MULTIPLE = 8  # the norm kernel reads 16-byte vectors of the hidden size
DESCRIPTION = "fused decoder forward: {layers} layer(s), {mlps} gated MLP(s), {attentions} attention(s)"


def _known(module, table: dict[str, str]) -> bool:
    """module is exactly one of the transformers classes named in table."""
    cls = type(module)
    family = table.get(cls.__name__)
    return family is not None and cls.__module__ == f"transformers.models.{family}.modeling_{family}"


def is_gated_mlp(module) -> bool:
    """A transformers SiLU-gated MLP whose forward is down(silu(gate(x)) * up(x)) and whose down projection is a
    W4A16Linear: its gate / up pair fuses as a GatedW4A16Linear (convert.fuse_projections) and the MLP then takes
    the fused forward."""
    return (_known(module, GATED_MLPS) and type(getattr(module, "act_fn", None)).__name__ in SILU
            and _plain_layer(getattr(module, "down_proj", None)))


def _fusable_mlp(module) -> bool:
    if not (is_gated_mlp(module) or isinstance(module, FusedGatedMLP)):
        return False
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    parts = (getattr(module, "gate_proj", None), getattr(module, "up_proj", None))
    return (isinstance(gate_up, GatedW4A16Linear) and _plain_layer(down)
            and all(isinstance(p, W4A16Slice) and p.fused is gate_up for p in parts))


def _plain_layer(layer) -> bool:
    return isinstance(layer, W4A16Linear) and not isinstance(layer, FusedW4A16Linear)


def _norm_fits(norm, dtype: torch.dtype, hidden: int) -> bool:
    weight = getattr(norm, "weight", None)
    return (_known(norm, RMS_NORMS) and isinstance(getattr(norm, "variance_epsilon", None), float)
            and isinstance(weight, torch.Tensor) and weight.dtype == dtype and weight.shape == (hidden,))


def _fusable_layer(layer) -> bool:
    if not (_known(layer, DECODER_LAYERS) or isinstance(layer, FusedDecoderLayer)):
        return False
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, FusedGatedMLP) or not _fusable_mlp(mlp):
        return False
    dtype, hidden = mlp.gate_up_proj.scales.dtype, mlp.gate_up_proj.in_features
    return hidden % NORM_MULTIPLE == 0 and all(
        _norm_fits(getattr(layer, name, None), dtype, hidden) for name in ("input_layernorm", "post_attention_layernorm"))


def _wants_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad


class FusedGatedMLP:
    """The fused forward of a SiLU-gated MLP (mixed in before the transformers class): down(gated(x))."""

    _tilefish_base: type

    def _fused_ready(self, x) -> bool:
        gate_up = self.gate_up_proj
        return (isinstance(x, torch.Tensor) and not _wants_grad(x) and isinstance(gate_up, GatedW4A16Linear)
                and x.dtype == gate_up.scales.dtype and _plain_layer(self.down_proj))

    def forward(self, x):
        if not self._fused_ready(x):
            return super().forward(x)
        return self.down_proj(self.gate_up_proj.forward_gated(x))

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the add in the down projection's epilogue."""
        if not self._fused_ready(x):
            return residual + super().forward(x)
        return self.down_proj.forward_residual(self.gate_up_proj.forward_gated(x), residual)


def _attention_family(module) -> str:
    return ATTENTIONS[(module._tilefish_base if isinstance(module, FusedAttention) else type(module)).__name__]


def _head_norms_fit(module, d: int) -> bool:
    """Qwen3's q_norm / k_norm: the family's RMSNorm over the head dim, one eps for both (the kernels take one)."""
    norms = [getattr(module, name, None) for name in ("q_norm", "k_norm")]
    return all(_known(n, RMS_NORMS) and isinstance(getattr(n, "variance_epsilon", None), float)
               and isinstance(getattr(n, "weight", None), torch.Tensor) and n.weight.shape == (d,) for n in norms) \
        and norms[0].variance_epsilon == norms[1].variance_epsilon


def _fusable_attention(module) -> bool:
    """An attention of ATTENTIONS whose q / k / v are the three parts, in order, of one FusedW4A16Linear
    (quantize_model / load_quantized with fuse=True), whose head dim the rope_cache kernel takes, and, for
    HEAD_NORMED families, whose head norms the kernels apply (_head_norms_fit)."""
    if not (_known(module, ATTENTIONS) or isinstance(module, FusedAttention)):
        return False
    parts = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(p, W4A16Slice) for p in parts):
        return False
    fused, d = parts[0].fused, getattr(module, "head_dim", None)
    return (type(fused) is FusedW4A16Linear and len(fused.split_sizes) == 3
            and all(p.fused is fused and p.index == i for i, p in enumerate(parts))
            and isinstance(d, int) and d > 0 and d % rope_cache_ops.HEAD_DIM_MULTIPLE == 0
            and fused.split_sizes[0] % d == 0 and fused.split_sizes[1] == fused.split_sizes[2]
            and fused.split_sizes[1] % d == 0
            and (_attention_family(module) not in HEAD_NORMED or _head_norms_fit(module, d)))


def _is_static_layer(layer) -> bool:
    cls = type(layer)
    return cls.__name__ == "StaticLayer" and cls.__module__ == "transformers.cache_utils"


def _static_layer(cache, attention):
    """The cache's layer of `attention` (its layer_idx) if it is transformers' plain StaticLayer (or the cache is
    one such layer, whose update takes it as well; layer_idx is then not read, so layers compiled one at a time
    share one graph), filled once (so its tensors exist), of no offloading cache; else None."""
    if _is_static_layer(cache):
        layer = cache
    else:
        layers, index = getattr(cache, "layers", None), getattr(attention, "layer_idx", None)
        if getattr(cache, "offloading", False) or not isinstance(layers, list) or not isinstance(index, int) \
                or not 0 <= index < len(layers) or not _is_static_layer(layers[index]):
            return None
        layer = layers[index]
    return layer if getattr(layer, "is_initialized", False) is True else None


# attention class name -> (transformers' ALL_ATTENTION_FUNCTIONS, the family's eager_attention_forward): looked
# up when the fused class is made, since an import inside a forward breaks torch.compile's graph
_ATTENTION_FUNCTIONS: dict[str, tuple] = {}


class FusedAttention:
    """The attention forward of ATTENTIONS' families with a StaticCache (mixed in before the transformers class):
    transformers' steps, with the rotary embedding and the cache write one kernel on the fused q/k/v output."""

    _tilefish_base: type

    def _cache_layer(self, x, kwargs):
        """The StaticLayer the fused forward writes, or None (transformers' forward then)."""
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        emb = kwargs.get("position_embeddings")
        if cache is None or not isinstance(x, torch.Tensor) or x.dim() != 3 or _wants_grad(x) \
                or not _fusable_attention(self) or not isinstance(emb, (tuple, list)) or len(emb) != 2:
            return None
        layer = _static_layer(cache, self)
        if layer is None:
            return None
        cos, sin = emb
        keys, values, length = (getattr(layer, n, None) for n in ("keys", "values", "cumulative_length"))
        fused = self.q_proj.fused
        kv_heads = fused.split_sizes[1] // self.head_dim
        tensors = (cos, sin, keys, values, length)
        if not all(isinstance(t, torch.Tensor) and t.device == x.device for t in tensors):
            return None
        if x.dtype != fused.scales.dtype or any(t.dtype != x.dtype for t in (cos, sin, keys, values)):
            return None
        norms = self._head_norms()
        if norms is not None and any(w.dtype != x.dtype or w.device != x.device for w in norms[:2]):
            return None
        if keys.shape != values.shape or keys.shape[:2] != (x.shape[0], kv_heads) or keys.shape[3] != self.head_dim:
            return None
        return layer

    def _head_norms(self):
        """(q_norm weight, k_norm weight, eps) of a HEAD_NORMED family's attention, else None."""
        if _attention_family(self) not in HEAD_NORMED:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon

    def _one_kernel_step(self, x, mask, layer, kwargs) -> bool:
        """Whether this step's rotary, cache write and attention are one rope_attention launch: a CUDA decode
        step (one token; batch and cache length as rope_attention.routes_decode_step measured them) of SDPA
        attention (what "sdpa" / "tilefish_sdpa" compute: no dropout, a mask of one row per sequence or none, no
        keyword that changes the math) of a shape the kernel takes."""
        if not x.is_cuda or x.shape[1] != 1 or (self.training and self.attention_dropout > 0):
            return False
        if self.config._attn_implementation not in ("sdpa", TILEFISH_SDPA):
            return False
        keys, d = layer.keys, self.head_dim
        fused = self.q_proj.fused
        kv_heads = fused.split_sizes[1] // d
        if not rope_attention_ops.supports(d, fused.split_sizes[0] // d, kv_heads):
            return False
        index, dtype = x.device.index, x.dtype
        if not rope_attention_ops.routes_decode_step(
                x.shape[0], kv_heads, keys.shape[2],
                lambda: rope_attention_ops.device_decode_limits(index, dtype, d)):
            return False
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 4
                                     and mask.dtype in (torch.bool, x.dtype) and mask.shape[0] in (1, x.shape[0])
                                     and tuple(mask.shape[1:]) == (1, 1, keys.shape[2])):
            return False
        return all(k in SDPA_IGNORED_KWARGS or v is None or v is False for k, v in kwargs.items())

    def forward(self, hidden_states, *args, **kwargs):
        layer = None if args else self._cache_layer(hidden_states, kwargs)
        if layer is None:
            return super().forward(hidden_states, *args, **kwargs)
        kwargs = dict(kwargs)
        cos, sin = kwargs.pop("position_embeddings")
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache", None)
        attention_mask = kwargs.pop("attention_mask", None)
        fused, d = self.q_proj.fused, self.head_dim
        b, t = hidden_states.shape[:2]
        heads, kv_heads = fused.split_sizes[0] // d, fused.split_sizes[1] // d
        norms = self._head_norms() or ()
        if self._one_kernel_step(hidden_states, attention_mask, layer, kwargs):
            # early_kv: a model's decode step (module docstring of ops.rope_attention)
            out = rope_attention_ops.rope_attention(fused(hidden_states), cos, sin, layer.keys, layer.values,
                                                    layer.cumulative_length, attention_mask, self.scaling, heads,
                                                    kv_heads, True, *norms)
            return self.o_proj(out.reshape(b, t, -1)), None
        q = rope_cache_ops.rope_cache(fused(hidden_states), cos, sin, layer.keys, layer.values,
                                      layer.cumulative_length, heads, kv_heads, *norms)
        functions, eager = _ATTENTION_FUNCTIONS[self._tilefish_base.__name__]
        attention = functions.get_interface(self.config._attn_implementation, eager)
        family = _attention_family(self)
        if family == "mistral":  # what each family's forward adds
            kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
        elif family in ("qwen2", "qwen3", "qwen3_moe"):
            kwargs["sliding_window"] = self.sliding_window
        out, weights = attention(self, q.transpose(1, 2), layer.keys, layer.values, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                 **kwargs)
        return self.o_proj(out.reshape(b, t, -1).contiguous()), weights


class FusedDecoderLayer:
    """The fused forward of a Llama-family decoder layer (mixed in before the transformers class)."""

    _tilefish_base: type

    def _fused_ready(self, x) -> bool:
        mlp, norm1, norm2 = self.mlp, self.input_layernorm, self.post_attention_layernorm
        return (isinstance(mlp, FusedGatedMLP) and mlp._fused_ready(x) and norm1.weight.dtype == x.dtype
                and not (torch.is_grad_enabled() and (norm1.weight.requires_grad or norm2.weight.requires_grad)))

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        from .norm import rms_norm

        if args or not self._fused_ready(hidden_states):
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        mlp, norm1, norm2 = self.mlp, self.input_layernorm, self.post_attention_layernorm
        x = rms_norm(hidden_states, norm1.weight, norm1.variance_epsilon)
        attn, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, **kwargs)
        h, x = rms_norm(attn, norm2.weight, norm2.variance_epsilon, residual=hidden_states)
        return mlp.forward_residual(x, h)


def _fused_class(base: type) -> type:
    """The class whose forward is the fused one over `base` (made once, kept in this module by name)."""
    name = "Fused" + base.__name__
    cls = globals().get(name)
    if cls is None:
        mixin = FusedDecoderLayer if base.__name__ in DECODER_LAYERS else \
            FusedAttention if base.__name__ in ATTENTIONS else FusedGatedMLP
        if mixin is FusedAttention:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            eager = importlib.import_module(base.__module__).eager_attention_forward
            _ATTENTION_FUNCTIONS[base.__name__] = (ALL_ATTENTION_FUNCTIONS, eager)
        cls = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name, "_tilefish_base": base,
                                         "__doc__": f"{base.__name__} with tilefish's fused forward ({mixin.__name__})."})
        globals()[name] = cls
    return cls


def __getattr__(name: str):
    """Fused<transformers class> on demand (unpickling a model saved with the fused forward)."""
    base = name[len("Fused"):] if name.startswith("Fused") else ""
    family = DECODER_LAYERS.get(base) or GATED_MLPS.get(base) or ATTENTIONS.get(base)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return _fused_class(getattr(module, base))


def use_fused_forward(model: torch.nn.Module) -> str | None:
    """Give every fusable SiLU-gated MLP and Llama-family decoder layer of `model` its fused forward (in place):
    an MLP whose gate / up are a GatedW4A16Linear (quantize_model / load_quantized with fuse=True) and whose down
    is a W4A16Linear; a layer whose MLP is such and whose two norms are the family's RMSNorm in the layers'
    dtype; an attention (Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE) whose q / k / v are one FusedW4A16Linear.
    Returns a one-line description, or None (nothing changed). Idempotent."""
    if not isinstance(model, torch.nn.Module):
        return None
    mlps = [m for m in model.modules() if _fusable_mlp(m)]
    for m in mlps:
        if not isinstance(m, FusedGatedMLP):
            m.__class__ = _fused_class(type(m))
    layers = [m for m in model.modules() if _fusable_layer(m)]
    for m in layers:
        if not isinstance(m, FusedDecoderLayer):
            m.__class__ = _fused_class(type(m))
    attentions = [m for m in model.modules() if _fusable_attention(m)]
    for m in attentions:
        if not isinstance(m, FusedAttention):
            m.__class__ = _fused_class(type(m))
        m.q_proj.fused.light_ahead = True  # its input is the layer's norm: a cluster-launched plan can start early
    if not (mlps or attentions):
        return None
    return DESCRIPTION.format(layers=len(layers), mlps=len(mlps), attentions=len(attentions))


def restore_forward(model: torch.nn.Module) -> int:
    """Give every module use_fused_forward changed its transformers class back; returns how many."""
    restored = 0
    for m in model.modules():
        if isinstance(m, (FusedDecoderLayer, FusedGatedMLP, FusedAttention)):
            if isinstance(m, FusedAttention):
                m.q_proj.fused.light_ahead = False
            m.__class__ = m._tilefish_base
            restored += 1
    return restored

