"""Real models' linear-layer shapes for `tilefish bench w4a16 --models`: per model, the raw numbers of its
Hugging Face config.json and, derived from them, the (k, n) = (in_features, out_features) of the four
weights a decoder layer runs as W4A16 matmuls (sibling projections fused, as `convert.fuse_projections`
does). Pure Python: the command line imports this to check --models without importing torch."""
from __future__ import annotations

from dataclasses import dataclass

# Today's kernels (ops/w4a16/layout.py): n a multiple of 64 (the packed layout's column tile), k a multiple of 64
# (the k stage; group 128 also needs k % 128, checked where the group is known). A shape that misses either is
# kept in the table, marked, and skipped by the bench.
N_MULTIPLE = 64
K_MULTIPLE = 64


@dataclass(frozen=True)
class ModelConfig:
    """The config.json numbers the shapes come from. intermediate: the MLP width (per expert for MoE
    models); gated: a SwiGLU / GeGLU MLP (gate and up fused, n = 2 * intermediate), else a plain up
    projection (n = intermediate)."""
    hidden: int         # hidden_size
    intermediate: int   # intermediate_size (Falcon: ffn_hidden_size, default 4 * hidden)
    heads: int          # num_attention_heads
    kv_heads: int       # num_key_value_heads (Falcon: num_kv_heads / n_head_kv)
    head_dim: int       # head_dim, else hidden_size // num_attention_heads
    source: str         # the config.json it comes from
    gated: bool = True
    moe: bool = False   # the MLP rows are one expert's (num_local_experts copies of them)

    def linears(self) -> list[tuple[str, int, int]]:
        """(projection, k, n) of the four W4A16 weights of one decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        mlp = "expert " if self.moe else ""
        up = (f"{mlp}gate_up", 2 * self.intermediate) if self.gated else (f"{mlp}up", self.intermediate)
        return [("qkv", self.hidden, q + 2 * kv), ("o_proj", q, self.hidden),
                (up[0], self.hidden, up[1]), (f"{mlp}down", self.intermediate, self.hidden)]


HF = "https://huggingface.co/{}/blob/main/config.json"
MODELS: dict[str, ModelConfig] = {
    # The two Llama-3 models are bench w4a16's default set (DEFAULT_KN there, in this order).
    "llama-3-8b": ModelConfig(4096, 14336, 32, 8, 128, HF.format("meta-llama/Meta-Llama-3-8B")),
    "llama-3-70b": ModelConfig(8192, 28672, 64, 8, 128, HF.format("meta-llama/Meta-Llama-3-70B")),
    "qwen2.5-7b": ModelConfig(3584, 18944, 28, 4, 128, HF.format("Qwen/Qwen2.5-7B")),
    "qwen2.5-14b": ModelConfig(5120, 13824, 40, 8, 128, HF.format("Qwen/Qwen2.5-14B")),
    "qwen2.5-32b": ModelConfig(5120, 27648, 40, 8, 128, HF.format("Qwen/Qwen2.5-32B")),
    "qwen2.5-72b": ModelConfig(8192, 29568, 64, 8, 128, HF.format("Qwen/Qwen2.5-72B")),
    "mistral-7b-v0.3": ModelConfig(4096, 14336, 32, 8, 128, HF.format("mistralai/Mistral-7B-v0.3")),
    # Gemma-2: head_dim is set explicitly; num_heads * head_dim (4096) != hidden_size for both.
    "gemma-2-9b": ModelConfig(3584, 14336, 16, 8, 256, HF.format("google/gemma-2-9b")),
    "gemma-2-27b": ModelConfig(4608, 36864, 32, 16, 128, HF.format("google/gemma-2-27b")),
    "phi-3-medium": ModelConfig(5120, 17920, 40, 10, 128, HF.format("microsoft/Phi-3-medium-4k-instruct")),
    "yi-34b": ModelConfig(7168, 20480, 56, 8, 128, HF.format("01-ai/Yi-34B")),
    # Command-R v01: no GQA (64 kv heads).
    "command-r": ModelConfig(8192, 22528, 64, 64, 128, HF.format("CohereForAI/c4ai-command-r-v01")),
    # Falcon-40B: new_decoder_architecture, 8 multi-query groups; query_key_value has (n_head + 2 * n_head_kv)
    # * head_dim outputs (each group: 16 queries, one k, one v); the MLP is dense_h_to_4h (GELU, no gate).
    "falcon-40b": ModelConfig(8192, 4 * 8192, 128, 8, 8192 // 128, HF.format("tiiuae/falcon-40b"), gated=False),
    # gpt-oss-20b: attention dims, and one of its 32 experts' MLP (intermediate_size is per expert).
    "gpt-oss-20b": ModelConfig(2880, 2880, 64, 8, 64, HF.format("openai/gpt-oss-20b"), moe=True),
}
DEFAULT_MODELS = ("llama-3-8b", "llama-3-70b")


@dataclass(frozen=True)
class Shape:
    k: int
    n: int
    labels: tuple[str, ...]   # "model:projection" for every model weight of this (k, n)

    @property
    def models(self) -> str:
        return ",".join(self.labels)


def marks(k: int, n: int) -> list[str]:
    """The alignments a shape misses: 'k%128', 'k%64', 'n%64' (each a != 0)."""
    return [name for name, bad in (("k%128", k % 128), ("k%64", k % 64), ("n%64", n % 64)) if bad]


def untileable_reason(k: int, n: int, group_size: int = 128) -> str | None:
    """Why today's W4A16 kernels cannot run a k x n weight quantized with `group_size` (default 128, the
    bench's grouped format; -1 per channel), or None when they can: n % 64, k % 64, and k % group_size."""
    why = [f"n={n} is not a multiple of {N_MULTIPLE}"] if n % N_MULTIPLE else []
    if k % K_MULTIPLE:
        why.append(f"k={k} is not a multiple of {K_MULTIPLE}")
    elif group_size > 0 and k % group_size:
        why.append(f"k={k} is not a multiple of {group_size} (group_size {group_size})")
    return "; ".join(why) or None


def parse_models(text: str | None) -> list[str]:
    """'all', or comma-separated names from MODELS (case-insensitive), in the order given, once each;
    None or '' -> the default set. Raises ValueError naming the unknown ones and listing the known."""
    if not text:
        return list(DEFAULT_MODELS)
    names = [v.strip().lower() for v in text.split(",") if v.strip()]
    if names == ["all"]:
        return list(MODELS)
    bad = [v for v in names if v not in MODELS]
    if bad or not names:
        raise ValueError(f"unknown model(s) {', '.join(bad) or repr(text)}; known: all, {', '.join(MODELS)}")
    return list(dict.fromkeys(names))


def union(models) -> list[Shape]:
    """The (k, n) of the models' weights, each once, in first-seen order, labelled with every
    model:projection it serves."""
    seen: dict[tuple[int, int], list[str]] = {}
    for name in models:
        for proj, k, n in MODELS[name].linears():
            seen.setdefault((k, n), []).append(f"{name}:{proj}")
    return [Shape(k, n, tuple(labels)) for (k, n), labels in seen.items()]


def table(models=None) -> str:
    """The models, their config numbers and derived shapes (alignment misses marked; a weight no format can
    run flagged untileable, one that only group 128 cannot run flagged so)."""
    head = (f"{'model':16s} {'hidden':>6s}  {'inter':>6s}  {'heads':>5s}  {'kv':>3s}  {'head_dim':>8s}  "
            f"{'projection':14s} {'k':>6s} {'n':>6s}  marks")
    lines = [head, "-" * len(head)]
    for name in models or MODELS:
        c = MODELS[name]
        head = f"{name:16s} {c.hidden:6d}  {c.intermediate:6d}  {c.heads:5d}  {c.kv_heads:3d}  {c.head_dim:8d}"
        for i, (proj, k, n) in enumerate(c.linears()):
            skip = ("  (skipped: untileable)" if untileable_reason(k, n, -1) else
                    "  (group 128 skipped; per channel runs)" if untileable_reason(k, n) else "")
            flag = ",".join(marks(k, n)) + skip
            lines.append(f"{head if i == 0 else ' ' * len(head)}  {proj:14s} {k:6d} {n:6d}  {flag}".rstrip())
        lines.append(f"{'':16s} {c.source}")
    lines.append("marks: k%128 / k%64 / n%64 = the dimension is not a multiple of that; today's kernels need "
                 f"n % {N_MULTIPLE} == 0 and k % {K_MULTIPLE} == 0, and k % 128 == 0 for group size 128")
    return "\n".join(lines)
