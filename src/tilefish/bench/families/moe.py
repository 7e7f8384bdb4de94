"""The moe family (`tilefish bench moe`: one MoE layer's experts, tilefish's grouped 4-bit op against transformers'
bf16 experts and torch._grouped_mm; the measurements are bench/moe.py's)."""
from __future__ import annotations

import argparse
import math

from ..family import BenchFamily, Step, ceiling_label, checked_rows, choice_list, int_list, pct_line, ratio_line
from ..moe_shapes import (BEST_BF16, DEFAULT_TOKENS, IMPLS, MODELS, TILEFISH_IMPLS, MoEModel,
                          parse_models)
from ..progress import HBM_BPS, TENSOR_FLOPS, Case, alternating_s, kernel_s

# The quick plan (the all-families run, and --quick): the two MoE shapes most run today, Qwen3-30B-A3B (128
# small experts, top 8) and gpt-oss-20b (32 experts of 2880, top 4, biases, swiglu_oai), at a decode token,
# a decode batch and a prefill chunk; int4 and MXFP4 against transformers' own loop and its grouped_mm.
QUICK_MODELS = ("qwen3-30b-a3b", "gpt-oss-20b")
QUICK_TOKENS = (1, 16, 256)
QUICK_IMPLS = ("int4", "mxfp4", "bf16", "grouped_mm")
ROUNDS = 3  # bench/moe.py's (kept here too, so that the plan is built without torch; tests check they agree)
# The summary's token ranges.
TOKEN_GROUPS = (("1 token", 1, 1), ("2-16 tokens", 2, 16), ("17-256 tokens", 17, 256), (">256 tokens", 257, 1 << 30))

# ---- the ETA model (seconds on an H100; bench/progress.py's rates) ------------------------------------------------
TILEFISH_HOST_S = 60e-6     # one eager call of the op: validation, five launches
GRAPH_REPLAY_S = 12e-6      # a CUDA graph's replay
EAGER_PER_EXPERT_S = 150e-6  # transformers' loop: a sync and ~10 launches an expert hit
GROUPED_MM_HOST_S = 350e-6  # transformers' grouped_mm forward: ~30 launches
BATCHED_MM_HOST_S = 250e-6
TORCH_GROUPED_MM_HOST_S = 150e-6
TRANSFORMERS_IMPORT_S = 2.0  # its experts modules (the all-families run imported transformers in e2e)
CHECK_S = 0.15              # one implementation's output against the float64 reference (first token count)


def call_s(model: MoEModel, tokens: int, impl: str, graphs: bool = False) -> float:
    """One call's estimated seconds: its bytes (the expected selected experts) at HBM rate or its flops, and its
    host time where that is longer (eager calls)."""
    slots = tokens * model.topk
    active = model.expected_active(tokens)
    flops = 2 * slots * model.params_per_expert()
    acts = 2 * slots * (2 * model.hidden + 3 * model.inter)
    if impl in TILEFISH_IMPLS:
        t = kernel_s(active * model.expert_bytes(impl) + acts, flops, 0.5 * TENSOR_FLOPS)
        return max(t, GRAPH_REPLAY_S if graphs else TILEFISH_HOST_S)
    dense = kernel_s(active * model.expert_bytes("bf16") + acts, flops)
    if impl == "bf16":
        return active * EAGER_PER_EXPERT_S + dense
    if impl == "batched_mm":
        dense = kernel_s(3 * slots * model.expert_bytes("bf16"), flops)
    host = {"grouped_mm": GROUPED_MM_HOST_S, "batched_mm": BATCHED_MM_HOST_S,
            "torch_grouped_mm": TORCH_GROUPED_MM_HOST_S}[impl]
    return max(dense, GRAPH_REPLAY_S if graphs else host)


def build_s(model: MoEModel, impls) -> float:
    """The layer's build: the random bf16 experts, then each 4-bit format quantized on the GPU, one expert and
    projection at a time (~5 ms of launches each, plus ~60 bytes of traffic a weight)."""
    fmts = [i for i in impls if i in TILEFISH_IMPLS]
    weights = model.experts * model.params_per_expert()
    return 0.5 + 2 * weights / HBM_BPS + len(fmts) * (model.experts * 2 * 5e-3 + weights * 60 / HBM_BPS)


def runs(model: MoEModel, tokens: int, impls) -> list[str]:
    """The implementations that make a row at (model, tokens), in the row order (batched_mm only where it fits)."""
    return [i for i in IMPLS if i in impls and (i != "batched_mm" or model.batched_mm_fits(tokens))]


def plan_cases(models, tokens, impls, reps: int, graphs: bool = False) -> list[Case]:
    """A case per (model, token count), as bench/moe.run reports them (its rows, then the byte floor row that
    ends it): the implementations' alternating rounds, the first of a model with its build and output checks,
    the very first with transformers' import."""
    cases = []
    per_round = max(4, -(-reps // ROUNDS))
    for mi, model in enumerate(models):
        for j, t in enumerate(tokens):
            names = runs(model, t, impls)
            if not names:
                continue
            total = alternating_s([call_s(model, t, i, graphs) for i in names], ROUNDS, per_round, 2) + 0.02
            if j == 0:
                total += build_s(model, impls) + CHECK_S * len(names) + (TRANSFORMERS_IMPORT_S if mi == 0 else 0.0)
            cases.append(Case(f"{model.name} t{t}", total))
    return cases


def model_names(text: str) -> str:
    """--models: comma-separated names of bench/moe_shapes.py's MODELS or 'all' (kept as the text)."""
    try:
        parse_models(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _counted(row) -> bool:
    """A case is done at its last row, the byte floor."""
    return row.impl.startswith("byte floor")


class MoE(BenchFamily):
    name = "moe"
    title = "MoE layer (4-bit experts, router output given)"
    help = ("one MoE layer's experts: tilefish int4 / NF4 / MXFP4 against transformers' bf16 experts and "
            "torch._grouped_mm, and the byte floor")

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--models", type=model_names,
                       help=f"comma-separated expert shapes: {', '.join(MODELS)}, or 'all' (default all)")
        p.add_argument("--tokens", type=int_list,
                       help=f"comma-separated token counts (default {','.join(map(str, DEFAULT_TOKENS))})")
        p.add_argument("--impls", type=choice_list(IMPLS),
                       help="comma-separated implementations: int4, nf4, mxfp4 (tilefish's op), bf16 (transformers' "
                       "experts module, its own forward), grouped_mm / batched_mm (its experts implementations), "
                       "torch_grouped_mm (torch._grouped_mm called directly) (default all that run here)")
        p.add_argument("--graphs", action="store_true",
                       help="replay the tilefish op (and the peers that capture) from CUDA graphs, as decode runs")
        p.add_argument("--quick", action="store_true",
                       help=f"the all-families run's set: {', '.join(QUICK_MODELS)} at "
                       f"{','.join(map(str, QUICK_TOKENS))} tokens, {', '.join(QUICK_IMPLS)}; "
                       "--models / --tokens / --impls still override")

    def _selection(self, args, quick: bool):
        models = parse_models(args.models or (",".join(QUICK_MODELS) if quick else None))
        tokens = [int(v) for v in args.tokens.split(",") if v] if args.tokens else list(
            QUICK_TOKENS if quick else DEFAULT_TOKENS)
        impls = [v for v in args.impls.split(",") if v] if args.impls else list(QUICK_IMPLS if quick else IMPLS)
        return models, tokens, impls

    def run(self, args):
        """The complete set as the flags narrow it (the all-families --full run too, args.family None); --quick
        takes the quick set and says so."""
        from .. import moe as bench

        models, tokens, impls = self._selection(args, args.quick)
        note = (f" [--quick: {', '.join(m.name for m in models)}, tokens {','.join(map(str, tokens))}; `tilefish "
                "bench moe` runs the full set]") if args.quick else ""
        return bench.run(models=models, tokens=tokens, impls=impls, graphs=args.graphs, reps=args.reps,
                         title_note=note)

    def steps(self, args, full: bool) -> list[Step]:
        """The quick plan (full False) or run(args) (full True): one step, a case per row."""
        models, tokens, impls = self._selection(args, not full)
        step = Step(self.name, "MoE layer vs transformers bf16", plan_cases(models, tokens, impls, args.reps,
                                                                            args.graphs),
                    lambda: _run(models, tokens, impls, args), lambda info: _kernels(info, models, tokens, impls),
                    _counted)
        if full:
            step.run = lambda: self.run(args)
        return [step]

    def headlines(self, report) -> list[dict]:
        ours = [r for r in checked_rows(report) if r.impl.startswith("tilefish")]
        out = []
        for label, lo, hi in TOKEN_GROUPS:
            sel = [r for r in ours if lo <= r.extra.get("tokens", 0) <= hi]
            if not sel:
                continue
            if hi <= 16:
                out.append(pct_line(f"{label}, of copy bandwidth{ceiling_label(report, 'copy')}", sel, _case))
            out.append(ratio_line(f"{label}, vs best bf16", sel, BEST_BF16, _case))
            out.append(ratio_line(f"{label}, vs grouped_mm", sel, "grouped_mm", _case))
        return [h for h in out if h is not None]

    def heading(self, report) -> str:
        models = list(dict.fromkeys(r.extra["model"] for r in report.rows if r.extra.get("model")))
        return self.title + (f", {', '.join(models)}" if models else "")

    def summary(self, report) -> str:
        return summary_table(report.rows)


def _case(row) -> str:
    return f"{row.case} {row.impl.removeprefix('tilefish ')}"


def _run(models, tokens, impls, args):
    from .. import moe as bench

    return bench.run(models=models, tokens=tokens, impls=impls, graphs=args.graphs, reps=args.reps,
                     title_note=f" [quick: {', '.join(m.name for m in models)}, tokens {','.join(map(str, tokens))}; "
                                "`tilefish bench moe` runs the full set]")


def _kernels(info, models, tokens, impls):
    from .. import moe as bench

    return bench.kernel_specs(info, models, tokens, impls)


def summary_table(rows) -> str:
    """Per model and token count, the fastest tilefish row against the fastest bf16 row and the byte floor, as
    a markdown table; "" without tilefish rows. rows: Rows or their JSON dicts."""
    def get(r, name):
        return r[name] if isinstance(r, dict) else getattr(r, name)

    cells: dict[tuple[str, int], tuple[float, str, float | None, float | None]] = {}
    for r in rows:
        impl, extra = get(r, "impl"), get(r, "extra")
        if not impl.startswith("tilefish") or "CHECK FAILED" in impl or "tokens" not in extra:
            continue
        key = (extra["model"], extra["tokens"])
        if key not in cells or get(r, "time_us") < cells[key][0]:
            cells[key] = (get(r, "time_us"), impl.removeprefix("tilefish "), get(r, "ratios").get(BEST_BF16),
                          get(r, "pct_ceiling"))
    if not cells:
        return ""
    tokens = sorted({t for _, t in cells})
    lines = ["Fastest tilefish format per case: vs the fastest bf16 row (x), and % of the byte floor (copy rate):",
             "| model | " + " | ".join(f"t{t}" for t in tokens) + " |", "|---|" + "---|" * len(tokens)]
    for model in dict.fromkeys(m for m, _ in cells):
        row = []
        for t in tokens:
            c = cells.get((model, t))
            row.append("" if c is None else f"{c[1]} " + (f"{c[2]:.2f}x " if c[2] is not None else "")
                       + (f"{c[3]:.0f}%" if c[3] is not None and not math.isnan(c[3]) else ""))
        lines.append(f"| {model} | " + " | ".join(row) + " |")
    return "\n".join(lines)


FAMILY = MoE()
