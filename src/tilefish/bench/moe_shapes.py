"""The MoE layers `tilefish bench moe` times (one layer's experts of real models, from their Hugging Face configs)
and the byte accounting of a routing: the distinct experts its tokens select x one expert's bytes in each format.
Pure Python: the command line imports this (through bench/families/moe.py) without torch."""
from __future__ import annotations

import math
from dataclasses import dataclass

HF = "https://huggingface.co/{}/blob/main/config.json"
ACTIVATION_DTYPE_BYTES = 2   # bf16: the dense experts' values, the 4-bit formats' scales and the biases
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)
# The 4-bit formats (tilefish.moe.ExpertWeights codebooks) and their group sizes: int4 groups of 128 along k
# where both k's (hidden, intermediate) allow it, else 64 (gpt-oss: 2880 = 22.5 x 128 = 45 x 64); NF4 with
# bitsandbytes' default blocksize 64 (the kernel's group 64); MXFP4 with its fixed 32.
INT4_GROUPS = (128, 64, 32)
NF4_BLOCKSIZE = 64
MXFP4_GROUP = 32
# What `tilefish bench moe --impls` names: tilefish's op on each 4-bit format, and the bf16 experts of
# transformers (its module's own forward, which loops over the experts; its grouped_mm and batched_mm experts
# implementations, config._experts_implementation) and torch._grouped_mm called directly.
TILEFISH_IMPLS = ("int4", "nf4", "mxfp4")
PEER_IMPLS = ("bf16", "grouped_mm", "batched_mm", "torch_grouped_mm")
IMPLS = TILEFISH_IMPLS + PEER_IMPLS
# The ratio columns (peer time / tilefish time), by peer; "best bf16" is the fastest bf16 row of the case.
RATIO_NAMES = {"bf16": "bf16", "grouped_mm": "grouped_mm", "batched_mm": "batched_mm",
               "torch_grouped_mm": "torch._grouped_mm"}
BEST_BF16 = "best bf16"
# batched_mm gathers a copy of the selected expert's weights for every slot (S x one expert's bf16 bytes): it runs
# where that copy is at most this large (decode-sized token counts), and is skipped (with a note) above.
BATCHED_MM_MAX_BYTES = 4 << 30


@dataclass(frozen=True)
class MoEModel:
    """One MoE layer's experts: E experts of hidden H and intermediate I (per expert), K of them per token.
    family: the transformers experts module (tests/moe_families.py's names: mixtral -> MixtralExperts,
    qwen3_moe -> Qwen3MoeExperts, gpt_oss -> GptOssExperts); bias: gate_up / down biases (gpt-oss)."""
    name: str
    family: str
    hidden: int
    inter: int
    experts: int
    topk: int
    activation: str      # the op's: "silu" or "swiglu_oai"
    bias: bool
    source: str

    def int4_group(self) -> int:
        """The int4 rows' group: the largest of 128 / 64 / 32 dividing both the hidden and the intermediate size."""
        return next(g for g in INT4_GROUPS if self.hidden % g == 0 and self.inter % g == 0)

    def group(self, fmt: str) -> int:
        """The kernel's group size of format fmt ("int4", "nf4", "mxfp4") on this model."""
        return {"int4": self.int4_group(), "nf4": NF4_BLOCKSIZE, "mxfp4": MXFP4_GROUP}[fmt]

    def label(self, impl: str) -> str:
        """A row's impl column for impl (IMPLS) on this model."""
        if impl == "int4":
            return f"tilefish int4 g{self.int4_group()}"
        if impl == "nf4":
            return f"tilefish nf4 b{NF4_BLOCKSIZE}"
        if impl == "mxfp4":
            return "tilefish mxfp4"
        return {"bf16": "bf16 transformers (eager loop)", "grouped_mm": "bf16 transformers grouped_mm",
                "batched_mm": "bf16 transformers batched_mm", "torch_grouped_mm": "bf16 torch._grouped_mm"}[impl]

    def batched_mm_fits(self, tokens: int) -> bool:
        """Whether batched_mm's gathered weights (tokens x K copies of one expert, bf16) stay within
        BATCHED_MM_MAX_BYTES."""
        return tokens * self.topk * self.expert_bytes("bf16") <= BATCHED_MM_MAX_BYTES

    def params_per_expert(self) -> int:
        return 3 * self.hidden * self.inter

    def bias_bytes_per_expert(self) -> int:
        return (2 * self.inter + self.hidden) * ACTIVATION_DTYPE_BYTES if self.bias else 0

    def expert_bytes(self, fmt: str) -> int:
        """One expert's bytes as the kernels read them: fmt "bf16" (the dense module's values), or a 4-bit
        format ("int4", "nf4", "mxfp4"): the packed codes (half a byte a value) plus one bf16 scale per group
        of k, in both projections (gate_up: n = 2I, k = H; down: n = H, k = I); biases included (gpt-oss)."""
        h, i = self.hidden, self.inter
        if fmt == "bf16":
            body = self.params_per_expert() * ACTIVATION_DTYPE_BYTES
        else:
            g = self.group(fmt)
            body = self.params_per_expert() // 2 + (2 * i * (h // g) + h * (i // g)) * ACTIVATION_DTYPE_BYTES
        return body + self.bias_bytes_per_expert()

    def layer_bytes(self, fmt: str) -> int:
        """Every expert of the layer (what a format holds in memory)."""
        return self.experts * self.expert_bytes(fmt)

    def expected_active(self, tokens: int) -> float:
        """Experts with at least one slot, expected under uniform routing (each token's K ids distinct)."""
        if self.topk >= self.experts:
            return float(self.experts)
        return self.experts * (1.0 - (1.0 - self.topk / self.experts) ** tokens)


MODELS: dict[str, MoEModel] = {m.name: m for m in (
    MoEModel("mixtral-8x7b", "mixtral", 4096, 14336, 8, 2, "silu", False,
             HF.format("mistralai/Mixtral-8x7B-v0.1")),
    MoEModel("qwen3-30b-a3b", "qwen3_moe", 2048, 768, 128, 8, "silu", False, HF.format("Qwen/Qwen3-30B-A3B")),
    MoEModel("qwen3-235b-a22b", "qwen3_moe", 4096, 1536, 128, 8, "silu", False,
             HF.format("Qwen/Qwen3-235B-A22B")),
    MoEModel("gpt-oss-20b", "gpt_oss", 2880, 2880, 32, 4, "swiglu_oai", True, HF.format("openai/gpt-oss-20b")),
    MoEModel("gpt-oss-120b", "gpt_oss", 2880, 2880, 128, 4, "swiglu_oai", True, HF.format("openai/gpt-oss-120b")),
)}


def parse_models(text: str | None) -> list[MoEModel]:
    """Comma-separated names of MODELS, or 'all' / None (every model, in MODELS' order); a ValueError names
    the unknown ones."""
    if text is None or text.strip().lower() == "all":
        return list(MODELS.values())
    names = [v.strip().lower() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in MODELS]
    if not names or bad:
        raise ValueError(f"unknown MoE model(s) {bad or [text]}; known: {', '.join(MODELS)} (or 'all')")
    return [MODELS[v] for v in dict.fromkeys(names)]


def distinct_experts(topk_ids) -> int:
    """The experts a routing selects at least once: topk_ids a [T, K] tensor or nested lists of ids (ids outside
    [0, E) are not experts; the bench's routings have none)."""
    flat = topk_ids.reshape(-1).tolist() if hasattr(topk_ids, "reshape") else [e for row in topk_ids for e in row]
    return len({int(e) for e in flat})


def selected_bytes(model: MoEModel, fmt: str, topk_ids) -> int:
    """The bytes a layer must read for this routing in format fmt: the distinct selected experts x one expert's
    bytes (the byte floor's numerator; each row's GB/s is over it)."""
    return distinct_experts(topk_ids) * model.expert_bytes(fmt)


def floor_us(nbytes: int, copy_gbps: float) -> float:
    """The byte floor: nbytes at the device's copy rate (GB/s, bytes read plus written, as bench/ceilings.py
    counts them), in microseconds."""
    return nbytes / (copy_gbps * 1e9) * 1e6 if copy_gbps > 0 else math.inf
