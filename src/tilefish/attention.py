"""Grouped-query attention for Hugging Face models without repeating K and V.

The rule: with grouped-query attention (each of `kv_heads` key/value heads serves `groups` consecutive
query heads) and an attention mask, transformers' "sdpa" attention copies K and V `groups` times
(`repeat_kv`), because torch's `enable_gqa` falls back to the math kernel when a mask is given. With a
StaticCache every decode step has a mask, so every step copies the whole KV cache: on a GPU at batch 16
that copy costs more than all of a Llama-3-8B layer's GEMMs. Instead, fold the query heads of one KV head
into the row dimension, q [b, heads, t, d] -> [b, kv_heads, groups * t, d] (rows ordered (group, token)),
tile the mask rows to match, and attend once per KV head: the same math, and K/V are read in place.

Under torch.compile a decode step (one query token) instead calls SDPA with `enable_gqa=True`, which inductor
lowers without copying K/V either and which measured fastest there; eager, that form would fall back to a
math kernel that repeats K/V, so eager decode steps take the folded path.

A decode step on CUDA (one query token, a mask that broadcasts over heads, fp16 / bf16, head dim 64 or 128,
at most 8 query heads a KV head) goes to `decode_attention` instead, in eager and compiled calls alike:
tilefish's kernel (ops/decode_attention.py) on sm_90, one launch that reads each KV head's cache once for its
query heads, where SDPA took two kernels and about 8.6 us a layer at batch 1 on the H200; torch's SDPA
(enable_gqa) on other GPUs. `DECODE_KERNEL = False` sends decode steps down the SDPA paths above (an A/B
switch, read when a call is traced).

`gqa_sdpa_attention_forward` is a drop-in for transformers' `sdpa_attention_forward`: it takes that path
only when the mask broadcasts over heads and nothing else changes the math, and hands every other case
to transformers' function unchanged. It only checks shapes, dtypes, devices and None, so it traces under
torch.compile(fullgraph=True) and is safe in CUDA graphs. `use_gqa_attention(model)` switches a model
to it; transformers stays an optional dependency, imported only when these are called.
"""
from __future__ import annotations

import torch

NAME = "tilefish_sdpa"
DESCRIPTION = f"{NAME}: grouped-query attention without repeating K/V"

# Keyword arguments HF decoders pass that transformers' sdpa path ignores (the mask already encodes them).
# Any other keyword with a value other than None / False (position_bias, s_aux sinks, softcap,
# output_attentions=True, ...) sends the call to transformers' function.
_IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "sliding_window"})


DECODE_KERNEL = True


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of one query token against a KV cache: query [b, heads, 1, d], key / value
    [b, kv_heads, S, d] (read in place), mask None, bool (True = attend) or additive in query's dtype, shaped
    [b or 1, 1, 1, S]; scale None: 1 / sqrt(d). Returns [b, 1, heads, d] contiguous (transformers' layout).

    fp16 / bf16, d 64 or 128, heads a multiple of kv_heads with at most 8 query heads a kv head; anything else
    raises a TypeError / ValueError naming the rule. CUDA: tilefish's kernel on sm_90, torch's SDPA on other
    GPUs (and for tensors whose rows are not 16-byte aligned); CPU: the fp32 reference. A row whose every
    position is masked gives zeros. Works in CUDA graphs and under torch.compile (tilefish::decode_attention);
    with grad enabled and an input requiring grad, runs the differentiable reference instead."""
    from .ops import decode_attention as ops

    if scale is None and isinstance(query, torch.Tensor) and query.dim() == 4:
        scale = 1.0 / (query.shape[-1] ** 0.5)
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (query, key, value, mask)):
        if not torch.compiler.is_compiling():
            ops.check_inputs(query, key, value, mask, scale)
        return ops.decode_attention_reference(query, key, value, mask, float(scale))
    if torch.compiler.is_compiling():
        from .ops import library

        return library.decode_attention_op(query, key, value, mask, float(scale))
    return ops.decode_attention_impl(query, key, value, mask, scale)


def _decodes(module, query, key, value, attention_mask, dropout, is_causal, kwargs) -> bool:
    """Whether the call is a decode step decode_attention takes: shapes, dtypes, devices and None only."""
    from .ops.decode_attention import HEAD_DIMS, MAX_GROUPS

    if not DECODE_KERNEL or torch.jit.is_tracing() or not isinstance(query, torch.Tensor) or not query.is_cuda:
        return False
    if query.dim() != 4 or query.shape[2] != 1 or not isinstance(key, torch.Tensor) or key.dim() != 4:
        return False
    if not isinstance(value, torch.Tensor) or value.shape != key.shape or dropout or is_causal:
        return False
    b, heads, _, d = query.shape
    kv_heads = key.shape[1]
    if kv_heads < 1 or key.device != query.device or value.device != query.device:
        return False
    if query.dtype not in (torch.float16, torch.bfloat16) or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if d not in HEAD_DIMS or key.shape[0] != b or key.shape[3] != d or heads % kv_heads or heads // kv_heads > MAX_GROUPS:
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    if attention_mask is not None:
        m = attention_mask
        if not isinstance(m, torch.Tensor) or m.dim() != 4 or m.dtype not in (torch.bool, query.dtype) \
                or m.device != query.device:
            return False
        if m.shape[0] not in (1, b) or m.shape[1] != 1 or m.shape[2] != 1 or m.shape[3] != key.shape[2]:
            return False
    return all(k in _IGNORED_KWARGS or v is None or v is False for k, v in kwargs.items())


def _hf_sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def _folds(module, query, key, attention_mask, kwargs) -> bool:
    """Whether the call takes the folded path: type, shape, device and None checks only (no tensor values)."""
    groups = getattr(module, "num_key_value_groups", 1)
    if not isinstance(groups, int) or groups <= 1 or not isinstance(attention_mask, torch.Tensor):
        return False
    if torch.jit.is_tracing() or query.device.type in ("xpu", "npu"):  # transformers' own handling there
        return False
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[2] not in (1, query.shape[2]):
        return False  # a per-head mask, or rows that do not broadcast to the queries
    if query.dim() != 4 or query.shape[1] != key.shape[1] * groups:
        return False
    return all(k in _IGNORED_KWARGS or v is None or v is False for k, v in kwargs.items())


def gqa_sdpa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, is_causal: bool | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, without repeating K/V for a masked grouped-query call.

    query [b, heads, t, d], key / value [b, kv_heads, S, d]; returns ([b, t, heads, d] contiguous, None)."""
    if _decodes(module, query, key, value, attention_mask, dropout, is_causal, kwargs):
        return decode_attention(query, key, value, attention_mask, scaling), None
    if not _folds(module, query, key, attention_mask, kwargs):
        return _hf_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    b, heads, t, d = query.shape
    if t == 1 and torch.compiler.is_compiling():
        # A compiled decode step: SDPA's own grouped-query form, which inductor lowers without copying K/V,
        # was the fastest of the four ways measured on the H100 (scripts/experiments/gqa_attention_paths.py:
        # 12 us at batch 1 and a 576-slot cache against 17.5 repeating and 19.8 folded; 50 against 59 / 418
        # at batch 16 and 2048). Eager, it would fall back to a math kernel that repeats K/V, so only here.
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    kv_heads, groups = key.shape[1], heads // key.shape[1]
    # query head h uses kv head h // groups: heads of one kv head are consecutive -> rows (group, token)
    q = query.reshape(b, kv_heads, groups * t, d)
    mask = attention_mask if attention_mask.shape[2] == 1 else attention_mask.repeat(1, 1, groups, 1)
    # a mask is given, so transformers' sdpa passes is_causal=False too
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    return out.reshape(b, heads, t, out.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register "tilefish_sdpa" with transformers: this attention function, and the "sdpa" mask function
    (so masks are built exactly as for "sdpa"). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, gqa_sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def use_gqa_attention(model) -> str | None:
    """Switch a transformers model from "sdpa" to "tilefish_sdpa" attention when it has grouped-query
    attention; returns a one-line description, or None (and changes nothing) for anything else: not a
    transformers model, another attention implementation, no GQA. Idempotent."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current not in ("sdpa", NAME) or not callable(getattr(model, "set_attn_implementation", None)):
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    if not isinstance(model, PreTrainedModel):
        return None
    text = _text_config(config)
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and 0 < kv_heads < heads):
        return None
    register()
    if current == NAME:
        return DESCRIPTION
    try:
        model.set_attn_implementation(NAME)
    except ValueError:  # a sub-model that refuses it: back to "sdpa" everywhere, the model as it was
        model.set_attn_implementation(current)
        return None
    return DESCRIPTION if model.config._attn_implementation == NAME else None
