"""The e2e family (`tilefish bench e2e`: a Llama-3-8B-shaped decoder end to end, or with --arch qwen3-8b a
Qwen3-8B-shaped one, or with --arch qwen3-moe a Qwen3-30B-A3B-shaped MoE decoder (bench/e2e_models.py), in the
harness's loop, bench/e2e.py, in the user's,
bench/e2e_generate.py, and tensor-parallel, bench/e2e_tp.py (the Llama only))."""
from __future__ import annotations

import argparse
import re

from ..e2e_models import ARCHS, BEST_DENSE, DEFAULT_ARCH, LLAMA, MOE_GENERATE_IMPLS, MOE_IMPLS
from ..family import BenchFamily, Step, checked_rows, choice_list, int_list, positive_int, ratio_line
from ..progress import Case, samples_s

# The variants of each loop (bench/e2e.py IMPLS, bench/e2e_generate.py IMPLS; tests check that they agree): kept
# here too, so that the command line is built without torch.
HARNESS_IMPLS = ("fp16", "fp16-gqa", "w4a16", "w4a16-hf", "nf4", "tilefish-nf4")
GENERATE_IMPLS = ("fp16", "fp16-gqa", "bf16", "w4a16", "w4a16-hf", "w4a16-bf16", "tilefish-nf4", "nf4", "tinygemm")
LOOPS = ("harness", "generate")
# The quick plan: the decoder at 8 layers, fp16 against tilefish W4A16, compiled (torch.compile per layer + CUDA
# graph), decode batch 1; and the same model through HF's generate() (static cache, its own compile: the user's
# loop), 64 new tokens at batch 1.
QUICK = dict(layers=8, batches=[1], prefill=[], modes=["compiled"], impls=["fp16", "w4a16"])
QUICK_GENERATE = dict(batches=[1], impls=["fp16", "w4a16"], new_tokens=64)
GENERATE_REPS = 3         # generate() calls timed per length in the quick plan (each is a whole generation)
# The decoder's W4A16 linears (Llama-3-8B, q/k/v and gate/up fused; lm_head stays fp16): (k, n), for the warm-up.
LINEARS = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
# Estimated seconds: torch.compile of a decoder layer, the first variant (cold) and each later one; HF's
# compile per layer in generate().
INDUCTOR_S = (20.0, 8.0)
GENERATE_COMPILE_S = 1.5


def variant_s(layers: int, first: bool, batches: int, reps: int) -> float:
    """One variant of the harness loop: build + quantize, the logits check, compile + capture per size, timing."""
    build = 1.0 + 0.25 * layers
    compile_s = INDUCTOR_S[0] if first else INDUCTOR_S[1]
    step = layers * 250e-6 + 0.4e-3
    return build + 0.5 + batches * (compile_s * (1 if batches == 1 else 0.6) + 0.5 + samples_s(step, reps))


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


class E2E(BenchFamily):
    name = "e2e"
    title = "End-to-end decoder"
    help = ("a decoder end to end: Llama-3-8B or Qwen3-8B, fp16 vs tilefish W4A16 / NF4 and bitsandbytes NF4; "
            "Qwen3-30B-A3B, bf16 vs tilefish int4 / MXFP4")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--arch", default=DEFAULT_ARCH, choices=list(ARCHS),
                       help="the model: llama3-8b (Llama-3-8B shapes, fp16; default), qwen3-8b (transformers' "
                       "Qwen3ForCausalLM with Qwen3-8B's shapes, fp16: the Llama's variants) or qwen3-moe "
                       "(transformers' Qwen3MoeForCausalLM with Qwen3-30B-A3B's shapes, bf16: 128 experts, top 8; "
                       "variants bf16 (grouped_mm experts), bf16-batched (batched_mm), int4, mxfp4; generate loop "
                       "bf16, bf16-grouped, int4, mxfp4)")
        p.add_argument("--layers", type=positive_int,
                       help="decoder layers (default all: 32, qwen3-8b 36, qwen3-moe 48; fewer if the GPU cannot "
                       "hold them)")
        p.add_argument("--batches", type=int_list, help="decode batch sizes (default 1,4,16,64; with --tp 1,16)")
        p.add_argument("--prefill", default="512,2048",
                       help="prefill prompt lengths, batch 1 (default 512,2048; '' for none)")
        p.add_argument("--context", type=int, default=512,
                       help="tokens in the KV cache before a decode step (default 512)")
        p.add_argument("--modes", help="compiled (torch.compile per layer + CUDA graph) and/or eager (default both; "
                       "with --tp compiled)")
        p.add_argument("--model", default="auto", choices=["auto", "hf", "builtin"],
                       help="transformers' LlamaForCausalLM or tilefish.models.llama (default: hf when importable)")
        p.add_argument("--impls", type=choice_list(tuple(dict.fromkeys(HARNESS_IMPLS + GENERATE_IMPLS + MOE_IMPLS
                                                                      + MOE_GENERATE_IMPLS))),
                       help="variants to time: fp16, bf16 (dense), fp16-gqa (fp16 with tilefish's attention), w4a16 / "
                       "w4a16-bf16 (tilefish), w4a16-hf (tilefish w4a16 with transformers' layer forward), nf4 "
                       "(bitsandbytes Linear4bit), tilefish-nf4 (tilefish NF4, fused), tinygemm (torch's int4 kernel, "
                       "bf16); each "
                       f"loop runs the ones it has (default: all; harness {','.join(HARNESS_IMPLS)}, generate "
                       f"{','.join(GENERATE_IMPLS)}; --arch qwen3-moe: harness {','.join(MOE_IMPLS)}, generate "
                       f"{','.join(MOE_GENERATE_IMPLS)})")
        p.add_argument("--loops", default=",".join(LOOPS), type=choice_list(LOOPS),
                       help="harness: tilefish's own decode loop (each layer compiled, one CUDA graph a step); "
                       "generate: Hugging Face's model.generate with the static cache and its own compile, as users "
                       "run it (default both)")
        p.add_argument("--new-tokens", type=positive_int, default=128,
                       help="generate loop: tokens generated per call (default 128)")
        p.add_argument("--generate-batches", type=int_list, help="generate loop: batch sizes (default 1,16)")
        p.add_argument("--tp", type=int_list,
                       help="tensor-parallel sizes, e.g. 1,2: run under torchrun with one process per GPU "
                       "(torchrun --nproc_per_node 2 -m tilefish.cli bench e2e --tp 1,2); times fp16, w4a16 and "
                       "tilefish-nf4 sharded by tilefish.distributed, decode only (default batches 1,16); the "
                       "Llama only")
        p.add_argument("--lm-head", choices=("auto", "quantize", "dense"), default="auto",
                       help="the tilefish variants' lm_head (quantize_model's lm_head): auto (default) quantizes it "
                       "where its weight error is within the decoder layers', quantize always, dense never")
        p.add_argument("--int4-lm-head", dest="lm_head", action="store_const", const="quantize",
                       help="the same as --lm-head quantize")

    def run(self, args):
        """The harness's loop and the user's loop in one report; --arch the model, --loops picks the loops,
        --impls the variants (each loop runs the ones it knows for the arch). The all-families run (args.family
        None) takes a reduced set of the Llama and says so."""
        from .. import e2e, e2e_generate

        arch = getattr(args, "arch", None) or DEFAULT_ARCH
        loops = (getattr(args, "loops", None) or ",".join(LOOPS)).split(",")
        generate = "generate" in loops and args.model != "builtin" and e2e.has_transformers()
        if args.family is None:
            report = e2e.run(layers=8, batches=[1, 16], prefill=[], modes=["compiled"], impls=list(e2e.IMPLS),
                             model=args.model, reps=args.reps,
                             title_note=" [reduced for the all-families run: 8 layers, decode b1/b16, compiled only; "
                                        "`tilefish bench e2e` runs the full set]")
            return e2e_generate.run(layers=8, report=report) if generate else report
        if getattr(args, "tp", None):  # tensor-parallel, under torchrun
            from .. import e2e_tp

            if arch != LLAMA.name:
                raise ValueError(f"bench e2e --tp runs the Llama only (--arch {LLAMA.name}), not --arch {arch}")
            return e2e_tp.run(_ints(args.tp), impls=args.impls.split(",") if args.impls else list(e2e.IMPLS),
                              layers=args.layers or LLAMA.default_layers,
                              batches=_ints(args.batches or ",".join(map(str, e2e_tp.TP_BATCHES))),
                              context=args.context, modes=(args.modes or "compiled").split(","), model=args.model,
                              reps=args.reps)
        harness_impls, generate_impls = ((MOE_IMPLS, MOE_GENERATE_IMPLS) if ARCHS[arch].moe else
                                         (e2e.IMPLS, e2e_generate.IMPLS))
        batches = args.batches or ",".join(map(str, e2e.DEFAULT_BATCHES))
        impls = args.impls.split(",") if args.impls else list(dict.fromkeys(harness_impls + generate_impls))
        report = None
        if "harness" in loops and (chosen := [i for i in impls if i in harness_impls]):
            report = e2e.run(layers=args.layers, batches=_ints(batches), prefill=_ints(args.prefill),
                             context=args.context, modes=(args.modes or "compiled,eager").split(","),
                             impls=chosen, model=args.model, lm_head=args.lm_head, reps=args.reps,
                             arch=arch)
        if generate and (chosen := [i for i in impls if i in generate_impls]):
            report = e2e_generate.run(layers=args.layers, impls=chosen,
                                      batches=_ints(getattr(args, "generate_batches", None) or "1,16"),
                                      new_tokens=getattr(args, "new_tokens", None) or e2e_generate.NEW_TOKENS,
                                      lm_head=args.lm_head, report=report, arch=arch)
        if report is None:
            raise ValueError(f"bench e2e: nothing to run (--arch {arch}, loops {loops}, impls {impls}; {arch}'s "
                             f"variants: harness {','.join(harness_impls)}, generate {','.join(generate_impls)}; the "
                             "generate loop needs transformers and --model hf or auto)")
        return report

    def steps(self, args, full: bool) -> list[Step]:
        if not full:
            q = QUICK
            return [self._step(args, q["layers"], q["batches"], q["prefill"], q["modes"], q["impls"],
                               f" [quick: {q['layers']} layers, decode b{','.join(map(str, q['batches']))}, compiled; "
                               "`tilefish bench e2e` runs the full set]", QUICK_GENERATE)]
        from .. import e2e_generate

        # run(args) with no family: 8 layers, decode b1 / b16, compiled, every variant
        step = self._step(args, 8, [1, 16], [], ["compiled"], list(HARNESS_IMPLS), "",
                          dict(batches=list(e2e_generate.BATCHES), impls=list(e2e_generate.IMPLS),
                               new_tokens=e2e_generate.NEW_TOKENS))
        step.run = lambda: self.run(args)
        return [step]

    def _step(self, args, layers, batches, prefill, modes, impls, title_note, generate=None) -> Step:
        """bench/e2e.run, then (generate: e2e_generate.run's batches / impls / new_tokens) its rows in the
        same report."""
        from .. import e2e, e2e_generate
        from .. import w4a16 as bench_w4a16

        reps = args.reps
        timed = [i for i in e2e.IMPLS if i in impls]
        cases, first, per_impl = [], True, {}
        for impl in ["fp16"] + [i for i in timed if i != "fp16"]:
            per_impl[impl] = variant_s(layers, first, len(batches) + len(prefill), reps) * len(modes)
            first = False
        for mode in modes:
            for size in list(batches) + list(prefill):
                for impl in timed:
                    cases.append(Case(f"{mode} {'decode b' if size in batches else 'prefill '}{size} {impl}",
                                      per_impl[impl] / (len(modes) * (len(batches) + len(prefill)))))
        for batch in (generate or {}).get("batches", []):
            for impl in generate["impls"]:
                calls = 2 + 2 * GENERATE_REPS + 2  # warm-ups, timed N and 1 tokens, the profiled pair
                cases.append(Case(f"generate b{batch} {impl}", 1.0 + 0.25 * layers + GENERATE_COMPILE_S * layers
                                  + calls * generate["new_tokens"] * (layers * 250e-6 + 1.5e-3)))

        def kernels(info):
            ms = sorted(set(batches) | set(prefill) | {e2e.CHECK_TOKENS})
            specs = []
            if "w4a16" in timed:
                specs += bench_w4a16.dispatched_kernels(info, LINEARS, ms, ["fp16"], 128)
            if "tilefish-nf4" in timed:
                specs += bench_w4a16.dispatched_kernels(info, LINEARS, ms, ["fp16"], 64, ("nf4",))
            return specs

        def run():
            report = e2e.run(layers=layers, batches=batches, prefill=prefill, modes=modes, impls=impls,
                             model=args.model, reps=reps, title_note=title_note)
            if generate and e2e.has_transformers():
                e2e_generate.run(layers=layers, report=report, reps=GENERATE_REPS, **generate)
            return report

        return Step(self.name, "End-to-end decoder", cases, run, kernels, lambda r: True)

    def headlines(self, report) -> list[dict]:
        """Each variant's ratio per case: to fp16 (the Llama), to the fastest dense variant (the MoE model)."""
        rows = checked_rows(report)
        out = []
        for impl in dict.fromkeys(r.impl for r in rows if _peer(r)):
            for r in (r for r in rows if r.impl == impl and _peer(r)):
                out.append(ratio_line(f"{impl} vs {_peer(r)}, {re.sub(r' ctx[0-9]+', '', r.case)}", [r], _peer(r),
                                      lambda r: f"{r.metric:,.0f} {r.unit}"))
        return [h for h in out if h is not None]

    def heading(self, report) -> str:
        first = next((r for r in report.rows if r.extra.get("layers")), None)
        if first is None:
            return self.title
        arch = ARCHS[first.extra.get("arch", DEFAULT_ARCH)]
        return f"{self.title}, {arch.title} shapes, {first.extra['layers']} layers"


def _peer(row) -> str | None:
    """The ratio a row's headline takes: fp16 (the Llama's rows) or the best dense variant (the MoE model's)."""
    return "fp16" if "fp16" in row.ratios else BEST_DENSE if BEST_DENSE in row.ratios else None


FAMILY = E2E()
