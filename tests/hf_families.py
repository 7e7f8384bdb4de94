"""Tiny Hugging Face decoders of the model families tilefish supports, for the CPU and GPU tests of the
user's loop (test_families.py, test_user_loops.py): the same module tree and forward as the real
models, with shapes the 4-bit kernels tile (in_features % 128, out_features % 64).

Helpers compare a generate() run's per-step logits with a teacher-forced forward, and with another
run's, so the checks hold whatever a near-tie in greedy decoding picks.
"""
from __future__ import annotations

import copy

import torch

COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=256,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)

# family -> (config class name, model class name, extra config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 64}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),  # its checkpoints hold fused qkv_proj / gate_up_proj
}


def build(family: str, dtype=torch.float32, device="cpu", seed: int = 0, **overrides):
    """A randomly initialized tiny model of `family`, in eval mode."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_cls)(config)
    return model.to(dtype).eval()


def dense_twin(model):
    """A copy with every 4-bit layer replaced by its exactly dequantized weight (the kernels' error alone)."""
    from tilefish.convert import dequantize_model

    twin = copy.deepcopy(model)
    dequantize_model(twin)
    return twin


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def generate(model, ids, mask=None, **kw):
    """model.generate with its per-step logits: (sequences, [steps] of [batch, vocab] fp32 logits)."""
    out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True,
                         pad_token_id=0, **kw)
    return out.sequences, [step.float() for step in out.logits]


def teacher_forced(model, sequences, prompt_len: int, mask=None) -> list[torch.Tensor]:
    """The logits a full forward over `sequences` gives at each generated position (what every decode
    step must have computed), [steps] of [batch, vocab] fp32. mask: the prompt's attention mask (left
    padding), extended with ones over the generated tokens."""
    full_mask = position_ids = None
    if mask is not None:  # positions as generate() numbers them: from the first real token of each row
        ones = torch.ones(mask.shape[0], sequences.shape[1] - mask.shape[1], dtype=mask.dtype, device=mask.device)
        full_mask = torch.cat([mask, ones], 1)
        position_ids = (full_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(sequences, attention_mask=full_mask, position_ids=position_ids, use_cache=False).logits.float()
    return [logits[:, t] for t in range(prompt_len - 1, sequences.shape[1] - 1)]


def agreeing_steps(seq_a, seq_b, prompt_len: int) -> int:
    """How many leading generated tokens two runs share in every row (their logits are comparable up to
    and including the first step that differs)."""
    same = (seq_a[:, prompt_len:] == seq_b[:, prompt_len:]).all(0)
    return int(same.long().cumprod(0).sum().item())
