"""A small Llama decoder with a static KV cache, written for torch.compile and CUDA graphs.

Module names and math follow transformers' LlamaForCausalLM (a state dict of one loads into the
other; the logits agree), so tilefish.convert.quantize_model and bitsandbytes swaps see the same
tree. One forward serves prefill and decode:

    model = LlamaForCausalLM(LlamaConfig.llama3_8b(), device="cuda", dtype=torch.float16)
    model.setup_cache(batch_size=4, max_len=1024)
    logits = model(prompt_ids, torch.arange(prompt_len, device="cuda"))           # prefill
    logits = model(next_ids[:, None], torch.tensor([prompt_len], device="cuda"))  # one decode step

Every shape is fixed by the inputs' shapes and the cache size, and nothing reads a tensor's value
on the host, so torch.compile(fullgraph=True) traces a step and a CUDA graph can capture it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 128256
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192

    @classmethod
    def llama3_8b(cls, layers: int = 32) -> "LlamaConfig":
        """Llama-3-8B's shapes (the field defaults), with `layers` decoder layers."""
        return cls(num_hidden_layers=layers)


def hf_config(config: LlamaConfig):
    """The same model as a transformers LlamaConfig (sdpa attention, untied lm_head, std 0.02 init)."""
    import transformers

    return transformers.LlamaConfig(**asdict(config), tie_word_embeddings=False, initializer_range=0.02,
                                    attn_implementation="sdpa")


class LlamaRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers: normalise in fp32, cast back, then scale in the model dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(x.dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig, device=None):
        super().__init__()
        exponents = torch.arange(0, config.head_dim, 2, device=device, dtype=torch.float32) / config.head_dim
        self.register_buffer("inv_freq", 1.0 / config.rope_theta ** exponents, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [t] -> cos, sin [t, head_dim] in `dtype` (angles in fp32, as transformers)."""
        freqs = positions[:, None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def causal_mask(cache_position: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """[t, max_len] additive mask: the query at position p sees cache slots 0..p. Additive in the
    model dtype (0 / dtype min), as transformers' sdpa path, from tensors only (no host reads)."""
    visible = torch.arange(max_len, device=cache_position.device)[None, :] <= cache_position[:, None]
    return torch.zeros(visible.shape, device=visible.device, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden, kw = config.hidden_size, dict(bias=False, device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, **kw)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, **kw)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, **kw)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, **kw)

    def forward(self, x, cos, sin, mask, cache_position, k_cache, v_cache):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_cache.index_copy_(2, cache_position, k)
        v_cache.index_copy_(2, cache_position, v)
        # GQA without repeating K/V: the query heads sharing a kv head become extra query rows
        # ([b, kv_heads, groups * t, d], rows ordered (group, token)); `mask` is already tiled to
        # match. SDPA's enable_gqa with a mask falls back to the math kernel on CUDA; this keeps
        # the memory-efficient kernel and reads each kv head once.
        groups = self.heads // self.kv_heads
        q = q.reshape(b, self.kv_heads, groups * t, self.head_dim)
        out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
        out = out.reshape(b, self.heads, t, self.head_dim).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None):
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, **kw)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """One block. The KV cache tensors come in as arguments, so every layer traces to the same
    graph and torch.compile of one layer module serves all of them."""

    def __init__(self, config: LlamaConfig, device=None, dtype=None):
        super().__init__()
        self.self_attn = LlamaAttention(config, device, dtype)
        self.mlp = LlamaMLP(config, device, dtype)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)

    def forward(self, x, cos, sin, mask, cache_position, k_cache, v_cache):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_position, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, device, dtype) for _ in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.rotary_emb = LlamaRotaryEmbedding(config, device)
        # Per layer (keys, values), each [batch, kv_heads, max_len, head_dim]: plain attributes, not
        # buffers, so they stay out of the state dict and of the weight bytes.
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        if not self.kv_cache:
            raise RuntimeError("no KV cache: call setup_cache(batch_size, max_len) first")
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(cache_position, x.dtype)
        # Built once per step and tiled for the GQA query rows of LlamaAttention.
        groups = self.config.num_attention_heads // self.config.num_key_value_heads
        mask = causal_mask(cache_position, self.kv_cache[0][0].shape[2], x.dtype).repeat(groups, 1)[None, None]
        for layer, (k_cache, v_cache) in zip(self.layers, self.kv_cache):
            x = layer(x, cos, sin, mask, cache_position, k_cache, v_cache)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype: torch.dtype = torch.float16):
        """Random weights (normal, std 0.02; norms 1), created directly on `device` in `dtype`."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, device, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, 0.02)

    def setup_cache(self, batch_size: int, max_len: int) -> None:
        """(Re)allocate a zeroed static KV cache; a forward's batch must be `batch_size`."""
        c = self.config
        if max_len > c.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds max_position_embeddings {c.max_position_embeddings}")
        self.model.kv_cache = []  # free the old cache before allocating the new one
        w = self.model.embed_tokens.weight
        # per layer heads: fewer than the config's on each rank of a tensor-parallel model (tilefish.distributed)
        shape = (batch_size, self.model.layers[0].self_attn.kv_heads, max_len, c.head_dim)
        self.model.kv_cache = [(torch.zeros(shape, device=w.device, dtype=w.dtype),
                                torch.zeros(shape, device=w.device, dtype=w.dtype)) for _ in range(c.num_hidden_layers)]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
        """input_ids [batch, t] at positions cache_position [t] (the same for every sequence) ->
        logits [batch, t, vocab]; logits_to_keep > 0: only the last that many positions."""
        h = self.model(input_ids, cache_position)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self.lm_head(h)
