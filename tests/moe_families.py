"""Tiny Hugging Face mixture-of-experts decoders (Mixtral, Qwen3-MoE, gpt-oss) for the CPU tests of the
expert op, QuantizedExperts and the MoE checkpoint loaders: transformers 5's experts modules (3-D
gate_up_proj / down_proj; gpt-oss's transposed, interleaved and with biases), with shapes the 4-bit kernels
tile (hidden and intermediate sizes multiples of 128)."""
from __future__ import annotations

import warnings

import torch

COMMON = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (config class name, model class name, extra config)
MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=128, intermediate_size=256, num_experts=8, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                     layer_types=["sliding_attention", "full_attention"])),
}


def moe_config(family: str, **overrides):
    import transformers

    config_cls, _, extra = MOE_FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})


# Router weights are scaled up so a token's top-k experts win by clear margins: a model against its twin
# differs by rounding (1e-3 relative), and with the default initialization a near tie flips one token's
# expert now and then, changing that token's output entirely (0.1 .. 0.2 of the logits' norm).
ROUTER_GAIN = 10.0


def build_moe(family: str, dtype=torch.float32, seed: int = 0, **overrides):
    """A randomly initialized tiny MoE model of `family`, in eval mode. gpt-oss's expert biases are
    initialized to zero by transformers: they get random values here, so the tests see them."""
    import transformers

    config = moe_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, MOE_FAMILIES[family][1])(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj_bias"):
                p.normal_(0, 0.02)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.mul_(ROUTER_GAIN)
    return model.to(dtype).eval()


def experts_modules(model) -> dict:
    """name -> the model's experts modules (dense or quantized)."""
    return {name: m for name, m in model.named_modules() if name.endswith(".experts")}
