"""The decoders `tilefish bench e2e --arch` builds, and what the harness (bench/e2e.py) and the generate() client
(bench/e2e_generate.py) need to know about each: its shapes, activation dtype, variants, the dense variants its
ratios are taken against, and its bytes per layer (to fit the layers in the GPU's memory).

- `llama3-8b` (default): Llama-3-8B shapes, fp16 (tilefish.models.llama's LlamaConfig; transformers'
  LlamaForCausalLM or tilefish's own); its variants are bench/e2e.py's IMPLS and bench/e2e_generate.py's IMPLS.
- `qwen3-8b`: Qwen3-8B shapes (Qwen3DenseConfig below), fp16, transformers' Qwen3ForCausalLM: the Llama's
  decoder but for its attention, which RMS-normalizes each q / k head before the rotary; the Llama's variants.
- `qwen3-moe`: Qwen3-30B-A3B shapes (MoEConfig below), bf16 (the model's own dtype), transformers'
  Qwen3MoeForCausalLM; the variants below.

Pure Python at import (torch and transformers load inside the functions): the command line takes ARCHS and the
variant names from here without torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from .moe_shapes import BATCHED_MM_MAX_BYTES


@dataclass(frozen=True)
class Arch:
    """One --arch choice: name (the flag's value, the rows' extra["arch"]), title (report titles), dtype (the
    activations'), reference (the dense variant the logits are checked against), dense (the dense variants of
    the harness loop, in order; the ratios' denominators), case_prefix (before each row's case, so that rows of
    different models never share a case), default_layers (the full model), moe (the MoE model's variants; a
    dense decoder has the Llama's)."""
    name: str
    title: str
    dtype: str
    reference: str
    dense: tuple[str, ...]
    case_prefix: str
    default_layers: int
    moe: bool = False


LLAMA = Arch("llama3-8b", "Llama-3-8B", "fp16", "fp16", ("fp16", "fp16-gqa"), "", 32)
QWEN3 = Arch("qwen3-8b", "Qwen3-8B", "fp16", "fp16", ("fp16", "fp16-gqa"), "qwen3-8b ", 36)
QWEN3_MOE = Arch("qwen3-moe", "Qwen3-30B-A3B", "bf16", "bf16", ("bf16", "bf16-batched"), "qwen3-moe ", 48, moe=True)
ARCHS = {a.name: a for a in (LLAMA, QWEN3, QWEN3_MOE)}
DEFAULT_ARCH = LLAMA.name

# The MoE model's variants. Harness loop (bench/e2e.py): "bf16" is the dense model as transformers builds it
# (Qwen3MoeExperts with config._experts_implementation "grouped_mm", transformers 5's default for a model built
# from a config or loaded with from_pretrained), "bf16-batched" the same weights on transformers' "batched_mm"
# experts (what generate() switches to for its decode steps); "int4" is tilefish.quantize_model(group_size=128):
# the attention Linears -> W4A16Linear g128 (q/k/v fused), every experts module -> QuantizedExperts int4 g128,
# the routers and lm_head dense; "mxfp4" the same with method "mxfp4".
MOE_IMPLS = ("bf16", "bf16-batched", "int4", "mxfp4")
# The generate() client: "bf16" is generate()'s own (grouped_mm for the prompt, batched_mm for the decode steps);
# "bf16-grouped" keeps grouped_mm in the decode steps too (generate's switch turned off).
MOE_GENERATE_IMPLS = ("bf16", "bf16-grouped", "int4", "mxfp4")
MOE_GENERATE_DENSE = ("bf16", "bf16-grouped")
MOE_LABELS = {"bf16": "bf16 grouped_mm", "bf16-batched": "bf16 batched_mm", "int4": "tilefish int4 g128",
              "mxfp4": "tilefish mxfp4"}
MOE_GENERATE_LABELS = {"bf16": "bf16 batched_mm", "bf16-grouped": "bf16 grouped_mm", "int4": "tilefish int4 g128",
                       "mxfp4": "tilefish mxfp4"}
BEST_DENSE = "best bf16"  # the ratio to the fastest dense variant of the case
MOE_QUANTIZED = ("int4", "mxfp4")


@dataclass
class Qwen3DenseConfig:
    """A dense Qwen3 decoder's shapes (defaults: Qwen3-8B, huggingface.co/Qwen/Qwen3-8B/config.json), in the fields
    of tilefish.models.llama's LlamaConfig (that module imports torch), built as transformers' Qwen3ForCausalLM."""
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 151936
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960

    @classmethod
    def qwen3_8b(cls, layers: int = 36) -> "Qwen3DenseConfig":
        return cls(num_hidden_layers=layers)

    def hf_config(self):
        """The transformers Qwen3Config (sdpa attention, untied lm_head, std 0.02 init)."""
        import transformers

        return transformers.Qwen3Config(**_hf_fields(self))


@dataclass
class MoEConfig:
    """A Qwen3-MoE decoder's shapes (defaults: Qwen3-30B-A3B, huggingface.co/Qwen/Qwen3-30B-A3B/config.json): every
    layer's MLP is the sparse MoE block (decoder_sparse_step 1, no mlp_only_layers)."""
    hidden_size: int = 2048
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    vocab_size: int = 151936
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960

    @classmethod
    def qwen3_30b_a3b(cls, layers: int = 48) -> "MoEConfig":
        return cls(num_hidden_layers=layers)

    def hf_config(self):
        """The transformers Qwen3MoeConfig (sdpa attention, untied lm_head, std 0.02 init)."""
        import transformers

        return transformers.Qwen3MoeConfig(**_hf_fields(self), decoder_sparse_step=1, mlp_only_layers=[])


def _hf_fields(config) -> dict:
    """A shapes dataclass as transformers config arguments: its fields (rope_theta as rope_parameters), sdpa
    attention, an untied lm_head, std 0.02 init."""
    fields = {k: v for k, v in vars(config).items() if k != "rope_theta"}
    return dict(fields, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
                tie_word_embeddings=False, initializer_range=0.02, attn_implementation="sdpa")


def arch_of(config) -> Arch:
    """The Arch of a model config (a LlamaConfig, Qwen3DenseConfig or MoEConfig)."""
    if isinstance(config, Qwen3DenseConfig):
        return QWEN3
    return QWEN3_MOE if isinstance(config, MoEConfig) else LLAMA


def default_config(arch: str, layers: int | None = None):
    """The full-size config of `arch` with `layers` decoder layers (None: all of them)."""
    spec = ARCHS[arch]
    layers = spec.default_layers if layers is None else layers
    if spec is QWEN3_MOE:
        return MoEConfig.qwen3_30b_a3b(layers)
    if spec is QWEN3:
        return Qwen3DenseConfig.qwen3_8b(layers)
    from ..models.llama import LlamaConfig

    return LlamaConfig.llama3_8b(layers)


def torch_dtype(config):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16}[arch_of(config).dtype]


def hf_model(config):
    """transformers' model of `config`, built under the caller's default dtype and device."""
    import transformers

    if isinstance(config, MoEConfig):
        return transformers.Qwen3MoeForCausalLM(config.hf_config())
    if isinstance(config, Qwen3DenseConfig):
        return transformers.Qwen3ForCausalLM(config.hf_config())
    from ..models.llama import hf_config

    return transformers.LlamaForCausalLM(hf_config(config))


def hf_class_name(config) -> str:
    if isinstance(config, Qwen3DenseConfig):
        return "Qwen3ForCausalLM"
    return "Qwen3MoeForCausalLM" if isinstance(config, MoEConfig) else "LlamaForCausalLM"


def describe(config) -> str:
    """The shapes, for the reports' notes."""
    c = config
    common = (f"hidden {c.hidden_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} KV heads of "
              f"{c.head_dim}, vocab {c.vocab_size}")
    if isinstance(c, MoEConfig):
        return (f"{common}, {c.num_experts} experts of intermediate {c.moe_intermediate_size}, top "
                f"{c.num_experts_per_tok}{' (norm_topk_prob)' if c.norm_topk_prob else ''}")
    return f"{common}, intermediate {c.intermediate_size}"


def layer_params(config) -> int:
    """Parameters of one decoder layer (attention, its norms, the MLP or the router and every expert)."""
    c = config
    h, hd, kvh = c.hidden_size, c.head_dim, c.num_key_value_heads
    attention = 2 * h * c.num_attention_heads * hd + 2 * h * kvh * hd
    if isinstance(c, MoEConfig):
        return attention + 2 * h + 2 * hd + c.num_experts * h + experts_params(c)
    return attention + 3 * h * c.intermediate_size + 2 * h


def experts_params(config) -> int:
    """One layer's experts' parameters (0 for a dense model)."""
    if not isinstance(config, MoEConfig):
        return 0
    return 3 * config.num_experts * config.hidden_size * config.moe_intermediate_size


def fixed_params(config) -> int:
    """Embedding and lm_head (untied)."""
    return 2 * config.vocab_size * config.hidden_size


def batched_mm_fits(config, tokens: int) -> bool:
    """Whether transformers' batched_mm experts can run `tokens` tokens: it gathers a copy of the selected
    expert's weights for every (token, slot), tokens x top-k x one expert's bf16 bytes, which must stay within
    bench/moe_shapes.py's BATCHED_MM_MAX_BYTES (decode sizes do; a 2048-token prompt of Qwen3-30B-A3B would
    gather 150 GB)."""
    one_expert = 3 * config.hidden_size * config.moe_intermediate_size * 2
    return tokens * config.num_experts_per_tok * one_expert <= BATCHED_MM_MAX_BYTES


def experts_modules(model) -> list:
    """The experts modules of an HF MoE model's decoder layers (dense or tilefish's), in layer order."""
    return [m for layer in model.model.layers
            if (m := getattr(getattr(layer, "mlp", None), "experts", None)) is not None]


# What the MoE model's rows are (the harness report's notes).
MOE_NOTES = [
    "dense experts: transformers' Qwen3MoeExperts; bf16 grouped_mm is config._experts_implementation 'grouped_mm', "
    "transformers' default for a model built from a config or loaded with from_pretrained (torch grouped_mm over the "
    "routed experts); bf16 batched_mm is 'batched_mm', which generate() switches to for its decode steps (a copy of "
    "the selected expert's weights per token and slot, then bmm); 'best bf16' is the faster of the two in each case. "
    "The module's own loop ('eager': nonzero and a Python loop over the hit experts) cannot be traced with "
    "fullgraph=True nor captured, and is not timed",
    "tilefish: quantize_model: every experts module -> QuantizedExperts (the tilefish::moe_experts op: CUDA kernels, "
    "a fake implementation under torch.compile), the attention Linears -> W4A16Linear (q/k/v fused); the routers "
    "(mlp.gate) stay bf16, lm_head as quantize_model's lm_head rule says (--lm-head); int4 rounds to nearest (no "
    "clip search: the speed does not depend on the values)"]


def convert(model, impl: str, lm_head: str) -> str:
    """Turn the dense bf16 MoE model into `impl` (MOE_IMPLS) in place; a one-line summary."""
    if impl == "bf16":
        return f"dense, transformers' {model.config._experts_implementation} experts"
    if impl == "bf16-batched":
        model.set_experts_implementation("batched_mm")
        return f"dense, transformers' {model.config._experts_implementation} experts"
    from ..convert import quantize_model

    options = dict(group_size=128, clip_search=False) if impl == "int4" else {}
    rep = quantize_model(model, "w4a16" if impl == "int4" else "mxfp4", **options, lm_head=lm_head)
    experts = sum(v.startswith("experts") for v in rep.converted.values())
    fmt = "int4 g128" if impl == "int4" else "mxfp4"
    return (f"{len(rep.converted) - experts} linears -> W4A16Linear {fmt}, {len(rep.fused)} fused groups, "
            f"{experts} experts modules -> QuantizedExperts {fmt}; routers dense, lm_head {rep.lm_head}")
