"""`tilefish bench e2e`: a Llama-3-8B-shaped decoder end to end, dense fp16 against tilefish W4A16,
bitsandbytes NF4 (when importable) and tilefish NF4 (the same NF4 weights, fused matmul): decode
tokens/s at several batch sizes over a filled KV cache, prefill tokens/s, in eager mode and compiled
(torch.compile per decoder layer + one CUDA graph per step). With arch="qwen3-8b" the model is transformers'
Qwen3ForCausalLM with Qwen3-8B's shapes (the same variants); with arch="qwen3-moe" (bench/e2e_models.py) the
model is transformers' Qwen3MoeForCausalLM with Qwen3-30B-A3B's shapes in bf16: transformers' dense experts
(grouped_mm, batched_mm) against tilefish int4 g128 and MXFP4 (QuantizedExperts + W4A16Linear attention).

Random weights (the timings do not depend on the values); every variant is built from the same
seed, and only one model lives at a time. The harness also runs on CPU (no CUDA graph, perf_counter
timing), which is how the tests drive it on a tiny config.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import statistics
import time
import traceback

import torch
from torch import nn

from ..models.llama import LlamaConfig, LlamaForCausalLM, causal_mask
from . import e2e_models
from .e2e_models import MOE_IMPLS, MOE_LABELS, MOE_QUANTIZED, MoEConfig
from .moe_shapes import BATCHED_MM_MAX_BYTES
from .progress import InnerProgress
from .report import Report, Row

DEFAULT_BATCHES = (1, 4, 16, 64)
DEFAULT_PREFILL = (512, 2048)
MODES = ("eager", "compiled")  # run in this order: compiling changes the layers in place
# Built in this order (bitsandbytes' nf4 before tilefish's, whose logits are checked against it). The CLI's
# bench/families/e2e.py HARNESS_IMPLS repeats this tuple (tests/test_e2e.py checks it).
# "fp16-gqa": the dense model with the attention quantize_model's fused forward gives the tilefish variants
# (tilefish.use_gqa_attention: K/V not repeated), so a ratio can be read without the attention's share;
# "w4a16-hf": tilefish w4a16 with transformers' own layer forward (tilefish.restore_forward), so the fused
# decoder forward's share can be read too
IMPLS = ("fp16", "fp16-gqa", "w4a16", "w4a16-hf", "nf4", "tilefish-nf4")
LABELS = {"fp16": "fp16", "fp16-gqa": "fp16 + tilefish attention", "w4a16": "tilefish w4a16",
          "w4a16-hf": "tilefish w4a16, transformers' layer forward", "nf4": "bitsandbytes nf4",
          "tilefish-nf4": "tilefish nf4"}
# tilefish's variants (both archs): checked against their dense twin (dequantize_model)
QUANTIZED = ("w4a16", "w4a16-hf", "tilefish-nf4") + MOE_QUANTIZED
CHECK_TOKENS = 64       # prompt length of the logits checks
# The W4A16 model's logits against its dense twin (the same model with every W4A16 layer replaced
# by its exactly dequantized weight: the kernels' error alone) further apart than this are flagged.
# Measured on the H100, 32 layers: 0.0063. Against fp16 the 4-bit rounding of random weights
# compounds over the layers (0.46 at 2 layers, 1.07 at 32; unrelated logits ~1.4), so that
# distance is reported, not judged.
LARGE_REL_ERR = 0.05
CACHE_ALIGN = 64        # KV cache length rounded up to this (aligned mask rows for SDPA's kernels)
HEADROOM = 6 << 30      # GPU memory kept free for activations, graph pools and compile workspaces


# -- the two model implementations behind one small interface ---------------------------------------------------

class _Builtin:
    """tilefish.models.llama: the KV cache lives in the model."""

    def __init__(self, config: LlamaConfig, device: torch.device):
        self.model = LlamaForCausalLM(config, device, torch.float16).eval()

    def setup(self, batch: int, max_len: int) -> None:
        self.model.setup_cache(batch, max_len)

    def kv_tensors(self) -> list[torch.Tensor]:
        return [t for kv in self.model.model.kv_cache for t in kv]

    def free(self) -> None:
        self.model.model.kv_cache = []

    def step(self, ids: torch.Tensor, pos: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
        return self.model(ids, pos, logits_to_keep)


class _HF:
    """transformers' LlamaForCausalLM (a LlamaConfig, fp16), Qwen3ForCausalLM (an e2e_models.Qwen3DenseConfig, fp16)
    or Qwen3MoeForCausalLM (an e2e_models.MoEConfig, bf16) with its StaticCache. The step calls the model's own modules
    (embedding, rotary, decoder layers, norm, lm_head) the way LlamaModel.forward does, with two
    changes that keep it capturable: the mask is built here from the positions (transformers' mask
    helpers read tensors on the host), and each layer gets its own StaticLayer as its cache, so
    every layer traces to the same graph (the whole cache makes each layer's layer_idx a guard,
    one recompile per layer)."""

    def __init__(self, config: LlamaConfig | MoEConfig, device: torch.device):
        # no fp32 or CPU copy of the weights
        with _default_dtype(e2e_models.torch_dtype(config)), torch.device(device):
            self.model = e2e_models.hf_model(config).eval()
        self.config, self.device, self.cache = config, device, None
        self.tp = 1  # tensor-parallel ranks the attention heads are split over (tilefish.distributed.shard_model)
        # transformers 5.24 renamed the layers' past_key_values argument to cache (the old name warns)
        params = inspect.signature(type(self.model.model.layers[0]).forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def setup(self, batch: int, max_len: int) -> None:
        from transformers import StaticCache

        self.cache = None  # free the old cache before allocating the new one
        self.cache = StaticCache(config=self.model.config, max_cache_len=max_len)
        c = self.config
        dtype = self.model.model.embed_tokens.weight.dtype
        self.cache.early_initialization(batch, c.num_key_value_heads // self.tp, c.head_dim, dtype, self.device)

    def kv_tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.cache.layers for t in (layer.keys, layer.values)]

    def free(self) -> None:
        self.cache = None

    def step(self, ids: torch.Tensor, pos: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
        m, layers = self.model.model, self.cache.layers
        # A StaticLayer writes at its own counter and advances it: point every counter at this
        # step's first position, so each replay of a step writes the same cache slots.
        torch._foreach_copy_([layer.cumulative_length for layer in layers], [pos[0]] * len(layers))
        x = m.embed_tokens(ids)
        position_ids = pos[None].expand(ids.shape[0], -1)
        cos_sin = m.rotary_emb(x, position_ids)
        mask = causal_mask(pos, layers[0].max_cache_len, x.dtype)[None, None]
        for layer, cache in zip(m.layers, layers):
            x = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin,
                      **{self.cache_arg: cache})
        return self.model.lm_head(m.norm(x[:, -logits_to_keep:] if logits_to_keep else x))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _tilefish_nf4_problem() -> str | None:
    """None when tilefish.quantize_model can convert to NF4 (method="nf4"), else why not."""
    try:
        from .. import convert
    except Exception as e:  # noqa: BLE001
        return f"tilefish.convert not importable ({e.__class__.__name__}: {e})"
    if "nf4" not in getattr(convert, "METHODS", ("nf4",)):
        return (f"tilefish.quantize_model has no method='nf4' in this build (methods {convert.METHODS}); "
                "tilefish.nn.NF4Linear is needed")
    return None


def _bnb_problem() -> str | None:
    """None when bitsandbytes can run the nf4 variant, else why not."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an optional peer; any import failure means "skip it"
        return f"bitsandbytes not importable ({e.__class__.__name__}: {e})"
    return None


# -- variants ---------------------------------------------------------------------------------------------------

def _to_nf4(layers: nn.Module) -> None:
    """Every nn.Linear under `layers` -> bnb Linear4bit with the bnb-4bit defaults (NF4, blocksize 64,
    double quant, fp16 compute), quantized where the weight is; each dense weight dropped as it goes."""
    import bitsandbytes as bnb

    for parent in list(layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=torch.float16, compress_statistics=True, quant_type="nf4",
                                  device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, blocksize=64,
                                         compress_statistics=True, quant_type="nf4").to(child.weight.device)
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, q)


def _convert(runner, impl: str, lm_head: str) -> str:
    """Turn the dense model into `impl` in place (lm_head: quantize_model's choice for the tilefish
    variants); a one-line summary."""
    if impl in MOE_IMPLS:
        return e2e_models.convert(runner.model, impl, lm_head)
    if impl == "fp16-gqa":
        from ..attention import use_gqa_attention

        return f"dense, attention {use_gqa_attention(runner.model)}"
    if impl in ("w4a16", "w4a16-hf"):
        from ..convert import quantize_model
        from ..decoder import restore_forward

        rep = quantize_model(runner.model, group_size=128, lm_head=lm_head)
        if impl == "w4a16-hf":
            restore_forward(runner.model)
        forward = "transformers' layer forward" if impl == "w4a16-hf" else rep.forward or "transformers' layer forward"
        return (f"{len(rep.converted)} linears -> W4A16 g128, {len(rep.fused)} fused groups, lm_head {rep.lm_head}, "
                f"{forward}")
    if impl == "nf4":
        _to_nf4(runner.model.model.layers)
        return "decoder-layer linears -> bnb Linear4bit (nf4, blocksize 64, double quant)"
    if impl == "tilefish-nf4":
        from ..convert import quantize_model

        rep = quantize_model(runner.model, method="nf4", blocksize=64, double_quant=True, fuse=True,
                             lm_head=lm_head)
        return (f"{len(rep.converted)} linears -> tilefish NF4 (blocksize 64, double quant), "
                f"{len(rep.fused)} fused groups, lm_head {rep.lm_head}")
    return "dense"


def experts_bytes(model: nn.Module) -> int:
    """Bytes of the decoder layers' experts modules (0 for a dense model)."""
    return sum(weight_bytes(m) for m in e2e_models.experts_modules(model))


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, with bitsandbytes' quantization state (absmax,
    code tables: attributes of the weight, not buffers); each storage counted once."""
    storages: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()

    def add_state(state):  # bnb QuantState; a double-quant state nests another one
        for value in vars(state).values():
            add(value)
            if hasattr(value, "absmax"):
                add_state(value)

    for t in list(module.parameters()) + list(module.buffers()):
        add(t)
        if getattr(t, "quant_state", None) is not None:
            add_state(t.quant_state)
    return sum(storages.values())


def _kv_bytes_per_token(cfg: LlamaConfig | MoEConfig) -> int:
    """A layer's 16-bit K and V of one cached token."""
    return 2 * 2 * cfg.num_key_value_heads * cfg.head_dim


def decode_bytes(cfg: LlamaConfig, layer_bytes: int, lm_head_bytes: int, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences reads at least: the decoder layers' weights and the lm_head's
    once, and every sequence's KV cache slots (the step's cache holds round_up(context + 1, CACHE_ALIGN) of them,
    16-bit; attention reads them all, the mask hiding the empty ones). The embedding's few rows are left out."""
    slots = _round_up(context + 1, CACHE_ALIGN)
    return layer_bytes + lm_head_bytes + cfg.num_hidden_layers * _kv_bytes_per_token(cfg) * slots * batch


# -- measurement ------------------------------------------------------------------------------------------------

def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _logits(runner, vocab: int, device: torch.device) -> torch.Tensor:
    """All positions' logits of one fixed prompt (batch 1, CHECK_TOKENS tokens), eager, in fp32."""
    ids = torch.randint(vocab, (1, CHECK_TOKENS), generator=torch.Generator().manual_seed(1234)).to(device)
    runner.setup(1, _round_up(CHECK_TOKENS, CACHE_ALIGN))
    out = runner.step(ids, torch.arange(CHECK_TOKENS, device=device), logits_to_keep=0).float()
    runner.free()
    return out


def _captured(step):
    """step() captured in one CUDA graph; returns the replay. The warm-up calls (torch.compile's
    compilation, Triton autotuning, first allocations) run before the capture on the stream the
    capture then uses, so whatever a layer caches per stream (W4A16Linear's eager launch plans, for
    a W4A16 lm_head outside the compiled layers) is built outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    return graph.replay


def _time_ms(fn, device: torch.device, reps: int) -> float:
    """Median ms per call: CUDA events (bench.timing; no L2 flush, the weights are far larger than
    L2) on CUDA, perf_counter on CPU."""
    if device.type == "cuda":
        from .timing import time_cuda

        return time_cuda(fn, reps=reps, flush=False).median_ms
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _measure(runner, phase: str, size: int, context: int, mode: str, vocab: int, device: torch.device,
             reps: int) -> tuple[float, float]:
    """(ms per step, setup seconds: compile + capture + first call) of one decode step of `size`
    sequences over `context` cached tokens, or of one prefill of a `size`-token prompt."""
    batch, tokens, start = (size, 1, context) if phase == "decode" else (1, size, 0)
    runner.setup(batch, _round_up(start + tokens, CACHE_ALIGN))
    if phase == "decode":  # random K/V stand in for the context: attention's cost does not depend on values
        for t in runner.kv_tensors():
            t.normal_()
    ids = torch.randint(vocab, (batch, tokens), device=device)
    pos = torch.arange(start, start + tokens, device=device)
    step = lambda: runner.step(ids, pos)  # noqa: E731
    t0 = time.perf_counter()
    if mode == "compiled" and device.type == "cuda":
        fn = _captured(step)
    else:
        step()  # compiles in compiled mode (CPU: no graph)
        fn = step
    setup_s = time.perf_counter() - t0
    ms = _time_ms(fn, device, reps)
    del fn
    runner.free()
    return ms, setup_s


def _fit_layers(cfg: LlamaConfig | MoEConfig, kv_tokens: int, free_bytes: int) -> int:
    """How many decoder layers fit in `free_bytes`: 16-bit dense weights (a Qwen3-30B-A3B layer, its 128
    experts, is 1.25 GB; a Llama-3-8B one 0.44 GB), a KV cache of `kv_tokens` tokens (batch x length) per
    layer, embedding + lm_head, and HEADROOM."""
    layer = 2 * e2e_models.layer_params(cfg)
    kv = _kv_bytes_per_token(cfg) * kv_tokens
    fixed = 2 * e2e_models.fixed_params(cfg) + HEADROOM
    return max(0, (free_bytes - fixed) // (layer + kv))


@dataclasses.dataclass
class _Plan:
    """What one run measures: run's arguments, resolved."""
    Runner: type
    cfg: LlamaConfig | MoEConfig
    device: torch.device
    modes: list[str]
    cases: list[tuple[str, int]]  # ("decode", batch) / ("prefill", prompt length)
    context: int
    reps: int
    backend: str
    seed: int
    lm_head: str

    @property
    def arch(self) -> e2e_models.Arch:
        return e2e_models.arch_of(self.cfg)

    def runs(self, impl: str, phase: str, size: int) -> bool:
        """Whether `impl` can run this case: transformers' batched_mm experts only where the expert weights it
        gathers per (token, slot) fit (decode sizes, not a long prompt)."""
        return impl != "bf16-batched" or e2e_models.batched_mm_fits(self.cfg, size)  # size: a step's tokens


def _variant(plan: _Plan, impl: str, reference: torch.Tensor | None, timed: bool, progress: InnerProgress,
             info: dict, times: dict, notes: list[str], built: dict | None = None) -> torch.Tensor:
    """Build `impl` from the seed, check its logits against `reference` (None: this is the
    reference), record its weight bytes and logits error in info[impl], and time every (mode, case)
    into times[(mode, phase, size)][impl] when `timed`. built: the check logits of variants built
    before ("nf4": bitsandbytes', which tilefish-nf4's are compared with). Returns the check's logits."""
    torch.manual_seed(plan.seed)
    runner = plan.Runner(plan.cfg, plan.device)
    summary = _convert(runner, impl, plan.lm_head)
    logits = _logits(runner, plan.cfg.vocab_size, plan.device)
    err = 0.0 if reference is None else _rel(logits, reference)
    lm_head = getattr(runner.model, "lm_head", None)
    info[impl] = {"layer_bytes": weight_bytes(runner.model.model.layers), "model_bytes": weight_bytes(runner.model),
                  "lm_head_bytes": 0 if lm_head is None else weight_bytes(lm_head),
                  "experts_bytes": experts_bytes(runner.model), "logits_rel_err": err}
    skipped = []
    for mode in plan.modes if timed else ():
        if mode == "compiled":
            for layer in runner.model.model.layers:
                layer.compile(fullgraph=True, dynamic=False, backend=plan.backend)
        for phase, size in plan.cases:
            progress.step(f"{impl} {mode} {phase} {size}")
            if not plan.runs(impl, phase, size):
                skipped.append(f"{mode} {phase} {size}")
                continue
            times.setdefault((mode, phase, size), {})[impl] = _measure(
                runner, phase, size, plan.context, mode, plan.cfg.vocab_size, plan.device, plan.reps)
    if skipped:
        notes.append(f"{impl} not timed at {', '.join(skipped)}: transformers' batched_mm gathers a copy of the "
                     f"selected expert's weights for every token and slot (over {BATCHED_MM_MAX_BYTES >> 30} GiB "
                     "there)")
    if reference is None and plan.arch.moe:  # which experts implementation the dense model ran
        line = f"{impl} ({summary}): the reference of the logits checks"
        print(line, flush=True)
        notes.append(line)
    if reference is not None:
        line = (f"{impl} ({summary}): logits vs {plan.arch.reference} on a {CHECK_TOKENS}-token prompt, relative "
                f"error {err:.4f}")
        if impl in QUANTIZED:
            line += " (random weights: the 4-bit rounding compounds over the layers)"
        if impl == "tilefish-nf4" and (built or {}).get("nf4") is not None and type(runner.model.lm_head) is nn.Linear:
            # The same NF4 weights (same seed, bit-exact quantization): bitsandbytes dequantizes them and runs
            # cuBLAS, so the two differ by the kernels' rounding (tilefish rounds each block scale once to fp16).
            bnb_err = _rel(logits, built["nf4"])
            info[impl]["bnb_nf4_rel_err"] = bnb_err
            flag = f"  LARGE (> {LARGE_REL_ERR}): check the kernels" if bnb_err > LARGE_REL_ERR else ""
            line += f"; vs bitsandbytes nf4 on the same NF4 weights {bnb_err:.4f}{flag}"
        if impl in QUANTIZED:  # after timing: the twin replaces the quantized layers
            from ..convert import dequantize_model

            for layer in runner.model.model.layers:
                layer._compiled_call_impl = None  # back to eager: the twin's layers are other modules
            dequantize_model(runner.model)
            left = sorted({type(m).__name__ for m in runner.model.modules()
                           if type(m).__module__ in ("tilefish.nn", "tilefish.experts")})
            if left:  # dequantize_model does not know these layers (yet): no twin to compare with
                line += f"; no dense twin (dequantize_model left {', '.join(left)} layers)"
            else:
                kernel_err = _rel(logits, _logits(runner, plan.cfg.vocab_size, plan.device))
                info[impl]["kernel_rel_err"] = kernel_err
                flag = f"  LARGE (> {LARGE_REL_ERR}): check the kernels" if kernel_err > LARGE_REL_ERR else ""
                line += f"; vs its dense twin with the dequantized weights (the kernels' error) {kernel_err:.4f}{flag}"
        print(line, flush=True)
        notes.append(line)
    return logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def labels(arch: e2e_models.Arch) -> dict[str, str]:
    """The rows' impl names of an arch's variants."""
    return MOE_LABELS if arch.moe else LABELS


def _ratios(arch: e2e_models.Arch, impl: str, ms: float, by_impl: dict) -> dict[str, float]:
    """A variant's ratios in one case: each dense variant's time over its time ("fp16" for a dense decoder, the
    dense labels and "best bf16", the fastest of them, for the MoE model); none for a dense variant."""
    dense = {d: by_impl[d][0] for d in arch.dense if d in by_impl}
    if impl in arch.dense or not dense:
        return {}
    if not arch.moe:
        return {LABELS[d]: t / ms for d, t in dense.items()}
    ratios = {MOE_LABELS[d]: t / ms for d, t in dense.items()}
    ratios[e2e_models.BEST_DENSE] = min(dense.values()) / ms
    return ratios


def _add_rows(report: Report, plan: _Plan, model: str, times: dict, info: dict, copy_gbps: float | None) -> None:
    """copy_gbps: the copy ceiling measured in this process (None: not measured); a Llama decode row's % of it
    is decode_bytes over the step time."""
    arch, names = plan.arch, labels(plan.arch)
    ref = info[arch.reference]
    for impl, i in info.items():
        if impl not in arch.dense:  # the dense variants share the reference's weights
            line = (f"{names[impl]} weights: decoder layers {i['layer_bytes'] / 2**30:.2f} GiB "
                    f"({i['layer_bytes'] / ref['layer_bytes']:.3f}x {arch.reference}), whole model "
                    f"{i['model_bytes'] / 2**30:.2f} GiB ({i['model_bytes'] / ref['model_bytes']:.3f}x)")
            if ref["experts_bytes"]:
                line += (f", experts {i['experts_bytes'] / 2**30:.2f} GiB "
                         f"({i['experts_bytes'] / ref['experts_bytes']:.3f}x)")
            report.notes.append(line)
    for (mode, phase, size), by_impl in times.items():
        case = f"{mode} decode b{size} ctx{plan.context}" if phase == "decode" else f"{mode} prefill {size}"
        for impl, (ms, setup_s) in by_impl.items():
            i = info[impl]
            read = None  # bytes a decode step reads (dense decoders only: an MoE step's experts depend on routing)
            if phase == "decode" and not arch.moe:
                read = decode_bytes(plan.cfg, i["layer_bytes"], i["lm_head_bytes"], size, plan.context)
            pct = 100 * read / (ms * 1e-3) / (copy_gbps * 1e9) if read and copy_gbps else None
            report.add(Row("e2e", arch.case_prefix + case, names[impl], ms * 1e3, size / (ms * 1e-3), "tok/s", pct,
                           _ratios(arch, impl, ms, by_impl), {
                "bytes_per_step": read, "copy_gbps": copy_gbps,
                "mode": mode, "phase": phase, "batch": size if phase == "decode" else 1,
                "tokens": size if phase == "prefill" else 1, "context": plan.context if phase == "decode" else 0,
                "ms_per_step": ms, "setup_s": setup_s, "model": model, "arch": arch.name, "dtype": arch.dtype,
                "impl_key": impl, "layers": plan.cfg.num_hidden_layers,
                "layer_bytes": i["layer_bytes"], "model_bytes": i["model_bytes"],
                "layer_bytes_ratio": i["layer_bytes"] / ref["layer_bytes"],
                "model_bytes_ratio": i["model_bytes"] / ref["model_bytes"],
                "experts_bytes": i["experts_bytes"] or None,
                "experts_bytes_ratio": i["experts_bytes"] / ref["experts_bytes"] if ref["experts_bytes"] else None,
                "logits_rel_err": i["logits_rel_err"],
                "kernel_rel_err": i.get("kernel_rel_err"), "bnb_nf4_rel_err": i.get("bnb_nf4_rel_err")}))


def run(layers: int | None = None, batches=DEFAULT_BATCHES, prefill=DEFAULT_PREFILL, context: int = 512,
        modes=MODES, impls=None, model: str = "auto", lm_head: str = "auto", reps: int = 50, *,
        arch: str | None = None, config: LlamaConfig | MoEConfig | None = None, device=None,
        backend: str = "inductor", seed: int = 0, title_note: str = "") -> Report:
    """The e2e report. arch: e2e_models.ARCHS ("llama3-8b", default; "qwen3-moe"), `layers` decoder layers
    (None: the whole model, 32 / 48). impls: the arch's variants (None: all of them; IMPLS / MOE_IMPLS).
    model: "hf" (transformers), "builtin" (tilefish.models.llama, the Llama only) or "auto" (hf when
    transformers is importable). config: a LlamaConfig or MoEConfig instead (tests); its type picks the arch.
    backend: torch.compile's (tests use "eager")."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if arch is not None and arch not in e2e_models.ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(e2e_models.ARCHS)}")
    if config is not None and arch is not None and e2e_models.arch_of(config).name != arch:
        raise ValueError(f"arch {arch!r} with a {type(config).__name__}")
    cfg = config or e2e_models.default_config(arch or e2e_models.DEFAULT_ARCH, layers)
    spec = e2e_models.arch_of(cfg)
    known = MOE_IMPLS if spec.moe else IMPLS
    impls = known if impls is None else impls
    if model == "auto":
        model = "hf" if has_transformers() or spec is not e2e_models.LLAMA else "builtin"
    if model not in ("hf", "builtin"):
        raise ValueError(f"model must be auto, hf or builtin; got {model!r}")
    if model == "builtin" and spec is not e2e_models.LLAMA:
        raise ValueError(f"--arch {spec.name} is transformers' model: it needs --model hf (or auto)")
    if model == "hf" and not has_transformers():
        raise ValueError("--model hf needs transformers (pip install transformers)")
    unknown = set(modes) - set(MODES) | set(impls) - set(known)
    if unknown:
        raise ValueError(f"unknown modes or impls {sorted(unknown)}; modes are {MODES}, {spec.name}'s impls {known}")
    notes = []
    if device.type == "cuda":
        kv_tokens = max([b * _round_up(context + 1, CACHE_ALIGN) for b in batches] + list(prefill) + [CHECK_TOKENS])
        fit = _fit_layers(cfg, kv_tokens, torch.cuda.mem_get_info(device)[0])
        if fit < 1:
            raise RuntimeError("not even one decoder layer fits in the free GPU memory")
        if fit < cfg.num_hidden_layers:
            notes.append(f"reduced to {fit} of {cfg.num_hidden_layers} layers: {spec.dtype} weights + the KV cache "
                         f"of the largest case must fit in the free GPU memory")
            cfg = dataclasses.replace(cfg, num_hidden_layers=fit)
    timed = [i for i in known if i in impls]
    if "nf4" in timed and (why := _bnb_problem()):
        timed.remove("nf4")
        notes.append(f"nf4 skipped: {why}")
    if "fp16-gqa" in timed and model == "builtin":
        timed.remove("fp16-gqa")
        notes.append("fp16-gqa skipped: the built-in model's attention reads K/V in place already")
    if "w4a16-hf" in timed and model == "builtin":
        timed.remove("w4a16-hf")
        notes.append("w4a16-hf skipped: the built-in model has no transformers layer forward")
    if "tilefish-nf4" in timed and (why := _tilefish_nf4_problem()):
        timed.remove("tilefish-nf4")
        notes.append(f"tilefish-nf4 skipped: {why}")
    plan = _Plan(_HF if model == "hf" else _Builtin, cfg, device, [m for m in MODES if m in modes],
                 [("decode", b) for b in batches] + [("prefill", p) for p in prefill], context, reps, backend, seed,
                 lm_head)
    ratio = (f"ratio = {spec.reference} time / variant time" if not spec.moe else
             f"ratio = dense time / variant time, {e2e_models.BEST_DENSE}: the faster dense experts implementation")
    report = Report(f"End-to-end decoder, {spec.title} shapes, {cfg.num_hidden_layers} layers, {model} model, "
                    f"{spec.dtype} activations (tok/s; {ratio}){title_note}")
    hf = f"transformers {e2e_models.hf_class_name(cfg)} + StaticCache"
    report.notes += notes + [
        f"model: {hf if model == 'hf' else 'tilefish.models.llama'}, "
        + (f"{spec.title} shapes ({e2e_models.describe(cfg)}), " if spec is not e2e_models.LLAMA else "")
        + f"random weights (seed {seed}); decode: one token per sequence over a KV cache filled with {context} random "
        f"K/V positions (no prefill run); prefill: batch 1, logits of the last position only",
        "compiled: each decoder layer torch.compile(fullgraph=True) (one graph shared by all layers), the whole "
        "step captured in one CUDA graph and replayed; eager: plain calls"]
    if spec.moe:
        report.notes += e2e_models.MOE_NOTES

    copy_gbps = None
    if device.type == "cuda" and not spec.moe:  # before any model: 4 GiB of copy buffers
        from .ceilings import copy_bandwidth_gbps

        copy_gbps = copy_bandwidth_gbps()
        report.notes.append(f"% of ceiling (decode): the bytes a step reads (decoder weights and lm_head once, every "
                            f"sequence's KV cache slots) over the step time, against the device-to-device copy rate "
                            f"measured in this process, {copy_gbps:,.0f} GB/s")

    ref = spec.reference  # always built: the reference of the logits checks
    build = [ref] + [i for i in timed if i != ref]
    times: dict[tuple, dict[str, tuple[float, float]]] = {}
    info: dict[str, dict] = {}
    built: dict[str, torch.Tensor] = {}  # bitsandbytes nf4's check logits, for tilefish-nf4's
    reference = None
    with torch.no_grad(), InnerProgress(len(build) + len(timed) * len(plan.modes) * len(plan.cases)) as progress, \
            torch._dynamo.config.patch(recompile_limit=max(8, len(plan.cases) + 2)):
        for impl in build:
            progress.step(f"{impl}: build")
            try:
                logits = _variant(plan, impl, reference, impl in timed, progress, info, times, report.notes, built)
                reference = logits if reference is None else reference
                if impl == "nf4" and "tilefish-nf4" in timed:
                    built[impl] = logits
            except Exception as e:  # noqa: BLE001 - a variant's failure is reported and the others still run
                if impl == ref:  # no reference, no ratios: nothing left to measure against
                    raise
                traceback.print_exc()
                report.notes.append(f"{impl} FAILED (the cases it had not finished are missing): "
                                    f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
            logits = None
            # The variant's compiled graphs (which may hold on to its weights, and would count against the
            # recompile limit) and its model go before the next one is built.
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    _add_rows(report, plan, model, times, info, copy_gbps)
    return report
