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
SDPA_IGNORED_KWARGS = frozenset({"position_ids", "cache_position", "use_cache", "sliding_window"})


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
    return all(k in SDPA_IGNORED_KWARGS or v is None or v is False for k, v in kwargs.items())


def gqa_sdpa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, is_causal: bool | None = None,
                               **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, without repeating K/V for a masked grouped-query call.

    query [b, heads, t, d], key / value [b, kv_heads, S, d]; returns ([b, t, heads, d] contiguous, None)."""
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
