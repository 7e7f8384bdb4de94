"""The w4a16 family (`tilefish bench w4a16`; the measurements are bench/w4a16.py's)."""
from __future__ import annotations

import argparse

from ..family import (BenchFamily, Step, ceiling_label, checked_rows, choice_list, groups_by_m, int_list, pct_line,
                      ratio_line, shape_list)
from ..progress import TENSOR_FLOPS, Case, kernel_s, paired_s
from ..shapes import parse_models

# The quick plan: Llama-3 8B o_proj (the host-cost note's shape too), 8B down_proj, 70B gate_up (fused): small,
# k-heavy, large; decode (1, 16) and prefill-sized (256, 4096) m; both activation dtypes, group 128.
QUICK_KN = [(4096, 4096), (14336, 4096), (8192, 57344)]
QUICK_M = [1, 16, 256, 4096]
QUICK_DTYPES = ("fp16", "bf16")
QUICK_GROUP = 128
PEERS = ("marlin",)


def peer_names(text: str) -> str:
    """--peers: comma-separated, each one of PEERS."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in PEERS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {bad or [text]}; known: {', '.join(PEERS)}")
    return ",".join(names)


def model_names(text: str) -> str:
    """--models (here and in `tilefish tune`): comma-separated names of bench/shapes.py's MODELS, 'all', or
    'list' (kept as the text)."""
    if text.strip().lower() == "list":
        return "list"
    try:
        parse_models(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def case_s(m: int, k: int, n: int, reps: int) -> float:
    """One row's estimated seconds: tilefish and cuBLAS in paired rounds, the idle after a heavy case."""
    t_cublas = kernel_s(2 * n * k + 2 * m * (k + n), 2 * m * n * k)
    t_ours = kernel_s(n * k / 2 + n * k / 64 + 2 * m * (k + n), 2 * m * n * k, 0.95 * TENSOR_FLOPS)
    return paired_s(t_ours, t_cublas, reps) + (0.5 if t_cublas > 1e-3 else 0.0) + 0.01


class W4A16(BenchFamily):
    name = "w4a16"
    title = "W4A16 GEMM (int4 weights, fp16/bf16 activations)"
    help = "the W4A16 GEMM (int4 weights) against cuBLAS fp16 / bf16 (and Marlin with --peers)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--shapes", type=shape_list, help="comma-separated KxN weights (4096x6144,...); overrides "
                       "--models")
        p.add_argument("--m", type=int_list, help="comma-separated batch sizes (default 1,2,4,...,4096)")
        p.add_argument("--groups", help="comma-separated group sizes (default 128,-1)")
        p.add_argument("--models", type=model_names,
                       help="real models' layer shapes, comma-separated names or 'all' (default llama-3-8b,"
                       "llama-3-70b); 'list' prints the table of models and shapes; --shapes overrides")
        p.add_argument("--list-models", action="store_true", help="print the table of models and their shapes")
        p.add_argument("--peers", type=peer_names,
                       help="extra peers to time beside cuBLAS: 'marlin' (the original Marlin, built from the "
                       "vendored sources in .peers/marlin, scripts/vendor_marlin.sh; fp16, groups -1 / 128)")
        p.add_argument("--dtypes", type=choice_list(("fp16", "bf16")),
                       help="comma-separated activation dtypes fp16,bf16 (default both)")
        p.add_argument("--variants", action="store_true",
                       help="sweep the kernel configurations (the design space) at the first dtype and group")

    def text_instead_of_run(self, args) -> str | None:
        if args.list_models or args.models == "list":
            from ..shapes import table

            return table()
        return None

    def run(self, args):
        from .. import w4a16 as bench

        kn = [tuple(s) for s in args.shapes] if args.shapes else None
        ms = [int(v) for v in args.m.split(",")] if args.m else None
        groups = [int(v) for v in args.groups.split(",")] if args.groups else (128, -1)
        dtypes = args.dtypes.split(",") if args.dtypes else ("fp16", "bf16")
        if args.variants:
            return bench.sweep(shapes=kn, ms=ms, dtype=dtypes[0], group=groups[0], models=args.models)
        peers = tuple(args.peers.split(",")) if args.peers else ()
        return bench.run(shapes=kn, ms=ms, groups=groups, dtypes=dtypes, reps=args.reps, models=args.models,
                         peers=peers)

    def steps(self, args, full: bool) -> list[Step]:
        if not full:
            return [self._step(QUICK_KN, QUICK_M, [QUICK_GROUP], list(QUICK_DTYPES), args.reps)]
        from .. import w4a16 as bench

        step = self._step(None, bench.DEFAULT_M, [128, -1], ["fp16", "bf16"], args.reps)
        step.run = lambda: self.run(args)
        return [step]

    def _step(self, shapes, ms, groups, dtypes, reps) -> Step:
        """bench/w4a16.run over shapes (None: its default set) x ms x groups x dtypes, a case a row."""
        from .. import w4a16 as bench

        kn = shapes if shapes is not None else bench.select_shapes()[0]
        cases = [Case(f"{d} k{k} n{n} g{g} m{m}", case_s(m, k, n, reps) + (0.1 if j == 0 else 0.0))
                 for d in dtypes for k, n in kn for g in groups for j, m in enumerate(ms)]
        cases[0].weight += 0.5     # the copy ceiling
        cases[-1].weight += 1.0    # the host-cost note
        return Step(self.name, "W4A16 vs cuBLAS", cases,
                    lambda: bench.run(shapes=kn, ms=ms, groups=groups, dtypes=dtypes, reps=reps),
                    lambda info: [s for g in groups for s in bench.dispatched_kernels(info, kn, ms, dtypes, g)])

    def headlines(self, report) -> list[dict]:
        ours = [r for r in checked_rows(report) if r.impl == "tilefish"]
        out = [ratio_line(f"vs cuBLAS, {g}", sel, "cuBLAS") for g, sel in groups_by_m(ours)]
        out += [pct_line(f"of copy bandwidth{ceiling_label(report, 'copy')}, {g}", sel)
                for g, sel in groups_by_m(ours, (("m<=16", 1, 16),))]
        return [h for h in out if h is not None]

    def summary(self, report) -> str:
        from .. import w4a16 as bench

        table = bench.target_summary(report.rows)
        return "Against the targets (ratio = cuBLAS time / tilefish time):\n" + table if table else ""


FAMILY = W4A16()
