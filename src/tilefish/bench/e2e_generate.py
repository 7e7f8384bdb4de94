"""`tilefish bench e2e`'s generate() client: the user's own loop, timed from outside.

A transformers LlamaForCausalLM with Llama-3-8B shapes (random weights) is converted as a user would
and decoded with Hugging Face's documented fast path,
`model.generate(ids, max_new_tokens=N, cache_implementation="static")`, which compiles the decode step
itself (torch.compile mode="reduce-overhead": CUDA graph trees). Variants, one model at a time:

  fp16, bf16     dense (cuBLAS)
  w4a16          tilefish W4A16 g128 (quantize_model: q/k/v and gate/up fused), fp16; w4a16-bf16 the same in bf16
  tilefish-nf4   tilefish NF4 (blocksize 64, double quant, fused), fp16
  nf4            bitsandbytes NF4 Linear4bit (blocksize 64, double quant), fp16 compute
  tinygemm       torch's int4 weight-only GEMM g128 (aten._weight_int4pack_mm: gpt-fast's and torchao's
                 int4 path), bf16 only

Per batch size: two warm-up calls (compile, then the graph trees' recording), then `reps` calls of
N new tokens and of 1 new token (prefill and the first token only), wall clock with the GPU idle at
both ends. Decode per token = (T(N) - T(1)) / (N - 1). One call of each under torch.profiler gives
the GPU's busy time (the union of its kernels' intervals) the same way; the rest of a token's time
is the GPU waiting for the host (generate's Python loop, the graph launch, the logits processors).
min_new_tokens = N, so random weights never stop early at an end-of-sequence token.

With arch="qwen3-8b" the model is transformers' Qwen3ForCausalLM with Qwen3-8B's shapes (the Llama's variants).
With arch="qwen3-moe" (bench/e2e_models.py) the model is transformers' Qwen3MoeForCausalLM with Qwen3-30B-A3B's
shapes, bf16: `bf16` dense as generate() runs it (grouped_mm experts for the prompt, batched_mm for the decode
steps: generate's own switch), `bf16-grouped` the same with grouped_mm kept for the decode steps, `int4` / `mxfp4`
tilefish.quantize_model (QuantizedExperts + W4A16Linear attention); ratios against each dense variant and the
faster of the two ("best bf16").
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time

import torch

from ..models.llama import LlamaConfig
from . import e2e_models
from .e2e_models import MOE_GENERATE_DENSE, MOE_GENERATE_IMPLS, MOE_GENERATE_LABELS, MoEConfig
from .report import Report, Row

# "fp16-gqa": fp16 with the attention the tilefish variants get (tilefish.use_gqa_attention, K/V not repeated)
# "w4a16-hf": tilefish w4a16 with transformers' own layer forward (tilefish.restore_forward)
IMPLS = ("fp16", "fp16-gqa", "bf16", "w4a16", "w4a16-hf", "w4a16-bf16", "tilefish-nf4", "nf4", "tinygemm")
LABELS = {"fp16": "fp16", "fp16-gqa": "fp16 + tilefish attention", "bf16": "bf16", "w4a16": "tilefish w4a16",
          "w4a16-hf": "tilefish w4a16, transformers' layer forward", "w4a16-bf16": "tilefish w4a16 bf16",
          "tilefish-nf4": "tilefish nf4", "nf4": "bitsandbytes nf4", "tinygemm": "torch int4 (tinygemm) bf16"}
DTYPES = {"fp16": torch.float16, "fp16-gqa": torch.float16, "bf16": torch.bfloat16, "w4a16": torch.float16,
          "w4a16-hf": torch.float16, "w4a16-bf16": torch.bfloat16, "tilefish-nf4": torch.float16,
          "nf4": torch.float16, "tinygemm": torch.bfloat16}
DENSE = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# Each variant's ratios: against the dense model of its dtype, and these peers where they ran.
PEERS = {"w4a16-bf16": ("tinygemm",), "tilefish-nf4": ("nf4", "fp16-gqa"),
         "w4a16": ("fp16-gqa", "w4a16-hf", "tilefish-nf4", "nf4")}
BATCHES = (1, 16)
NEW_TOKENS = 128
PROMPT = 32
CHECK_TOKENS = 64


def unavailable(impl: str) -> str | None:
    """None when `impl` can run here, else why not."""
    if impl == "nf4":
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:  # noqa: BLE001 - an optional peer; any import failure means "skip it"
            return f"bitsandbytes not importable ({e.__class__.__name__}: {e})"
    if impl == "tinygemm" and not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
        return "this torch has no aten._weight_int4pack_mm"
    return None


def _build(cfg: LlamaConfig | MoEConfig, impl: str, device: torch.device, seed: int, lm_head: str):
    """The HF model of `impl`, converted in place; (model, one-line summary)."""
    from .e2e import _default_dtype, _to_nf4

    moe = isinstance(cfg, MoEConfig)
    dtype = e2e_models.torch_dtype(cfg) if moe else DTYPES[impl]
    torch.manual_seed(seed)
    with _default_dtype(dtype), torch.device(device):  # no fp32 or CPU copy of the weights
        model = e2e_models.hf_model(cfg).eval()
    if moe:
        if impl == "bf16":
            return model, ("dense: generate() runs transformers' grouped_mm experts for the prompt and switches to "
                           "batched_mm for the decode steps")
        if impl == "bf16-grouped":
            model._optimize_model_for_decode = contextlib.nullcontext  # generate's switch to batched_mm, off
            return model, "dense: transformers' grouped_mm experts in the decode steps too (generate's switch off)"
        return model, e2e_models.convert(model, impl, lm_head)
    if impl == "fp16-gqa":
        from ..attention import use_gqa_attention

        return model, f"dense, attention {use_gqa_attention(model)}"
    if impl in ("w4a16", "w4a16-hf", "w4a16-bf16", "tilefish-nf4"):
        from ..convert import quantize_model
        from ..decoder import restore_forward

        method = "nf4" if impl == "tilefish-nf4" else "w4a16"
        extra = {} if method == "nf4" else {"clip_search": False}  # the speed does not depend on the values
        rep = quantize_model(model, method=method, lm_head=lm_head, **extra)
        if impl == "w4a16-hf":
            restore_forward(model)
        forward = "transformers' layer forward" if impl == "w4a16-hf" else rep.forward or "transformers' layer forward"
        return model, (f"{len(rep.converted)} linears -> tilefish {method}, {len(rep.fused)} fused groups, "
                       f"lm_head {rep.lm_head}, {forward}")
    if impl == "nf4":
        _to_nf4(model.model.layers)
        return model, "decoder linears -> bitsandbytes Linear4bit nf4 (blocksize 64, double quant)"
    if impl == "tinygemm":
        from .peers import tinygemm

        # no error rule of its own: its lm_head is int4 unless tilefish's is held dense (--lm-head dense)
        n = tinygemm.convert(model, 128, skip=("lm_head",) if lm_head == "dense" else ())
        return model, f"{n} linears -> aten._weight_int4pack_mm g128"
    return model, "dense"


def _generate(model, ids: torch.Tensor, new: int) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                          cache_implementation="static", pad_token_id=0)


def _wall_s(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _gpu_busy_s(fn) -> float | None:
    """Seconds the GPU spends running kernels / copies / memsets during fn (the union of their
    intervals), from torch.profiler; None if the profiler recorded no device activity."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > end:
            busy, start, end = busy + end - start, a, b
        else:
            end = max(end, b)
    return (busy + end - start) * 1e-6


def _measure(model, vocab: int, batch: int, prompt: int, new: int, reps: int, device) -> dict:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(device)
    t0 = time.perf_counter()
    _generate(model, ids, new)  # compiles the decode step (graph trees warm up)
    setup_s = time.perf_counter() - t0
    _generate(model, ids, new)  # records the CUDA graphs
    full = statistics.median(_wall_s(lambda: _generate(model, ids, new)) for _ in range(reps))
    one = statistics.median(_wall_s(lambda: _generate(model, ids, 1)) for _ in range(reps))
    busy_full, busy_one = _gpu_busy_s(lambda: _generate(model, ids, new)), _gpu_busy_s(lambda: _generate(model, ids, 1))
    ms = (full - one) / (new - 1) * 1e3
    gpu_ms = None if busy_full is None or busy_one is None else (busy_full - busy_one) / (new - 1) * 1e3
    return {"ms_per_token": ms, "gpu_ms_per_token": gpu_ms,
            "host_ms_per_token": None if gpu_ms is None else ms - gpu_ms, "setup_s": setup_s,
            "generate_s": full, "prefill_s": one}


def _logits(model, vocab: int, device) -> torch.Tensor:
    ids = torch.randint(3, vocab, (1, CHECK_TOKENS), generator=torch.Generator().manual_seed(1234)).to(device)
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def known_impls(cfg) -> tuple[str, ...]:
    """The generate variants of a config's arch."""
    return MOE_GENERATE_IMPLS if isinstance(cfg, MoEConfig) else IMPLS


def labels(cfg) -> dict[str, str]:
    return MOE_GENERATE_LABELS if isinstance(cfg, MoEConfig) else LABELS


def _dtype(cfg, impl: str) -> torch.dtype:
    return e2e_models.torch_dtype(cfg) if isinstance(cfg, MoEConfig) else DTYPES[impl]


def run(layers: int | None = None, batches=BATCHES, impls=None, new_tokens: int = NEW_TOKENS, prompt: int = PROMPT,
        reps: int = 3, lm_head: str = "auto", *, arch: str | None = None,
        config: LlamaConfig | MoEConfig | None = None, device=None, seed: int = 0, report: Report | None = None,
        title_note: str = "") -> Report:
    """The generate() rows (added to `report` when given). arch: e2e_models.ARCHS (default the Llama), `layers`
    decoder layers (None: all); impls: its variants (None: all; IMPLS, or MOE_GENERATE_IMPLS for the MoE model).
    config: a LlamaConfig or MoEConfig instead (tests); its type picks the arch."""
    from .e2e import _fit_layers, _rel, weight_bytes
    from .progress import InnerProgress

    device = torch.device(device or "cuda")
    if device.type != "cuda":
        raise ValueError("the generate() client times HF's CUDA fast path (static cache, CUDA graph trees): "
                         "it needs a GPU")
    if arch is not None and arch not in e2e_models.ARCHS:
        raise ValueError(f"unknown arch {arch!r}; known: {', '.join(e2e_models.ARCHS)}")
    if config is not None and arch is not None and e2e_models.arch_of(config).name != arch:
        raise ValueError(f"arch {arch!r} with a {type(config).__name__}")
    cfg = config or e2e_models.default_config(arch or e2e_models.DEFAULT_ARCH, layers)
    spec, known = e2e_models.arch_of(cfg), known_impls(cfg)
    impls = known if impls is None else impls
    unknown = set(impls) - set(known)
    if unknown:
        raise ValueError(f"unknown generate impls {sorted(unknown)}; {spec.name}'s: {known}")
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 (decode time = T(N) - T(1)), got {new_tokens}")
    fit = _fit_layers(cfg, max(batches) * max(prompt + new_tokens, CHECK_TOKENS), torch.cuda.mem_get_info(device)[0])
    if fit < 1:
        raise RuntimeError("not even one decoder layer fits in the free GPU memory")
    reduced = fit < cfg.num_hidden_layers
    if reduced:
        layers_before, cfg = cfg.num_hidden_layers, dataclasses.replace(cfg, num_hidden_layers=fit)
    report = report or Report(f"generate() with the static cache, {spec.title} shapes, {cfg.num_hidden_layers} "
                              f"layers{title_note}")
    report.notes.append(
        f"generate(): transformers {e2e_models.hf_class_name(cfg)} ({cfg.num_hidden_layers} layers, "
        + ("" if spec is e2e_models.LLAMA else f"{spec.title} shapes, {spec.dtype}, ")
        + f"random weights, seed {seed}), "
        f"model.generate(ids, max_new_tokens={new_tokens}, cache_implementation='static'), HF's own compile "
        f"(mode reduce-overhead: CUDA graph trees), greedy, prompt {prompt} tokens; decode per token = "
        f"(T({new_tokens} tokens) - T(1 token)) / {new_tokens - 1}, median of {reps}; GPU = the profiler's busy "
        "time the same way; host = the rest (the GPU waiting for generate's Python loop)")
    if reduced:
        report.notes.append(f"generate(): reduced to {fit} of {layers_before} layers: {spec.dtype} weights + the "
                            "static cache must fit in the free GPU memory")
    order = [i for i in known if i in impls]
    results: dict[str, dict[int, dict]] = {}
    info: dict[str, dict] = {}
    reference: dict[torch.dtype, torch.Tensor] = {}
    with InnerProgress(len(order) * (1 + len(batches))) as progress:
        for impl in order:
            progress.step(f"generate {impl}: build")
            if (why := unavailable(impl)) is not None:
                report.notes.append(f"generate {impl} skipped: {why}")
                continue
            try:
                model, summary = _build(cfg, impl, device, seed, lm_head)
                logits = _logits(model, cfg.vocab_size, device)
                dense = reference.setdefault(_dtype(cfg, impl), logits) if impl in DENSE.values() else None
                ref = reference.get(_dtype(cfg, impl))
                err = None if dense is not None or ref is None else _rel(logits, ref)
                info[impl] = {"summary": summary, "model_bytes": weight_bytes(model),
                              "logits_rel_err_vs_dense": err}
                results[impl] = {}
                for b in batches:
                    progress.step(f"generate {impl} b{b}")
                    results[impl][b] = _measure(model, cfg.vocab_size, b, prompt, new_tokens, reps, device)
            except Exception as e:  # noqa: BLE001 - a variant's failure is reported and the others still run
                import traceback

                traceback.print_exc()
                report.notes.append(f"generate {impl} FAILED: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
            model = logits = None
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()
    _add_rows(report, cfg, results, info, new_tokens, prompt)
    return report


def _add_rows(report: Report, cfg, results: dict, info: dict, new_tokens: int, prompt: int) -> None:
    spec, names = e2e_models.arch_of(cfg), labels(cfg)
    for impl, i in info.items():
        err = i["logits_rel_err_vs_dense"]
        why = ("" if impl in MOE_GENERATE_DENSE or impl == "fp16-gqa" else
               " (random weights: the 4-bit rounding compounds over the layers)")
        report.notes.append(f"generate {spec.case_prefix}{impl}: {i['summary']}; model "
                            f"{i['model_bytes'] / 2**30:.2f} GiB"
                            + ("" if err is None else f"; logits vs {DENSE[_dtype(cfg, impl)]} dense {err:.3f}{why}"))
    if results:
        report.notes.append("generate() per token, where the time goes (ms: wall = GPU busy + host, the GPU "
                            "waiting for generate's loop):")
    for impl, by_batch in results.items():
        for b, r in by_batch.items():
            split = ("" if r["gpu_ms_per_token"] is None else
                     f" = GPU {r['gpu_ms_per_token']:.2f} + host {r['host_ms_per_token']:.2f}")
            report.notes.append(f"  {spec.case_prefix}{names[impl]:<28} b{b:<3} {r['ms_per_token']:.2f}{split}; "
                                f"first call (compile) {r['setup_s']:.0f} s")
    for impl, by_batch in results.items():
        for b, r in by_batch.items():
            ratios = (_moe_ratios(impl, b, r, results) if spec.moe else _llama_ratios(impl, b, r, results))
            report.add(Row("e2e", f"{spec.case_prefix}generate decode b{b}", names[impl], r["ms_per_token"] * 1e3,
                           b / (r["ms_per_token"] * 1e-3), "tok/s", None, ratios, {
                               "mode": "generate", "phase": "decode", "batch": b, "new_tokens": new_tokens,
                               "prompt": prompt, "layers": cfg.num_hidden_layers, "impl_key": impl,
                               "arch": spec.name, "dtype": DENSE[_dtype(cfg, impl)], **r,
                               "model_bytes": info[impl]["model_bytes"],
                               "logits_rel_err_vs_dense": info[impl]["logits_rel_err_vs_dense"]}))


def _llama_ratios(impl: str, b: int, r: dict, results: dict) -> dict[str, float]:
    """Against the dense model of its dtype, its PEERS, and fp16."""
    peers = (DENSE[DTYPES[impl]],) + PEERS.get(impl, ())
    ratios = {LABELS[p]: results[p][b]["ms_per_token"] / r["ms_per_token"]
              for p in peers if p != impl and b in results.get(p, {})}
    if impl != "fp16" and "fp16" not in peers and b in results.get("fp16", {}):
        ratios[LABELS["fp16"]] = results["fp16"][b]["ms_per_token"] / r["ms_per_token"]
    return ratios


def _moe_ratios(impl: str, b: int, r: dict, results: dict) -> dict[str, float]:
    """A quantized variant against each dense one that ran at this batch and the fastest of them; none for a
    dense variant."""
    dense = {d: results[d][b]["ms_per_token"] for d in MOE_GENERATE_DENSE if b in results.get(d, {})}
    if impl in MOE_GENERATE_DENSE or not dense:
        return {}
    ratios = {MOE_GENERATE_LABELS[d]: t / r["ms_per_token"] for d, t in dense.items()}
    ratios[e2e_models.BEST_DENSE] = min(dense.values()) / r["ms_per_token"]
    return ratios
