"""The hgemm family (`tilefish bench hgemm`: the fp16 / bf16 ladder; the measurements are bench/hgemm.py's)."""
from __future__ import annotations

import argparse

from ..family import BenchFamily, Step, shape_list
from ..progress import Case
from .sgemm import gemm_case_s, gemm_headlines

# The quick plan: kernel="auto" against cuBLAS at the two square sizes of bench hgemm and one decode-sized
# projection (m 16, b as an nn.Linear weight [N, K]): (shape, b as [N, K], case label prefix).
QUICK_SHAPES = [((4096, 4096, 4096), False, ""), ((8192, 8192, 8192), False, ""), ((16, 14336, 4096), True, "llm ")]
QUICK_DTYPE = "fp16"


class HGEMM(BenchFamily):
    name = "hgemm"
    title = "HGEMM fp16 (ladder)"
    help = "every HGEMM ladder step (fp16 / bf16, fp32 accumulation) against cuBLAS, then the sweeps"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--shapes", type=shape_list,
                       help="comma-separated S (S^3) or MxNxK: the ladder at each (default 4096^3 and 8192^3, then "
                       "kernel=auto and step 06 over the square sweep and the LLM projections)")
        p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="operand dtype (default bf16)")
        p.add_argument("--variants", action="store_true",
                       help="also time the design space's configurations at the first shape")

    def run(self, args):
        from .. import hgemm as bench

        return bench.run(args)

    def steps(self, args, full: bool) -> list[Step]:
        from .. import hgemm as bench

        reps = args.reps
        if not full:
            return [Step(self.name, "HGEMM auto vs cuBLAS",
                         [Case(f"{label}{'x'.join(map(str, shape))}", gemm_case_s(*shape, reps))
                          for shape, nk, label in QUICK_SHAPES],
                         lambda: bench.run_auto(QUICK_SHAPES, QUICK_DTYPE, reps),
                         lambda info: bench.kernel_specs(info, [(s, nk) for s, nk, _ in QUICK_SHAPES],
                                                         dtype=QUICK_DTYPE))]
        # run(args): every step at 4096^3 and 8192^3, auto and step 06 over the sweeps
        import importlib

        ops = importlib.import_module("tilefish.ops.hgemm")
        ladder, auto_pair = list(ops.KERNELS) + ["auto"], ["auto", ops.AUTO_STEP]
        cases = [Case(f"{shape[0]}^3 {step}",
                      gemm_case_s(*shape, reps, slowdown=20.0 if step in bench.SLOW_STEPS else 1.3) / 1.5)
                 for shape in bench.DEFAULT_SHAPES for step in ladder]
        cases += [Case(f"sweep {s}^3 {k}", gemm_case_s(s, s, s, reps) / 1.5)
                  for s in bench.SWEEP for k in ("auto", "06")]
        cases += [Case(f"llm {m}x{n}x{k} {s}", gemm_case_s(m, n, k, reps) / 1.5)
                  for k, n in bench.LLM_KN for m in bench.LLM_MS for s in ("auto", "06")]
        # The rows of step 07 (sm_90 only) do not come on other GPUs: the bar settles them when the step ends.
        squares = [((s, s, s), False) for s in bench.SWEEP]
        llm = [((m, n, k), True) for k, n in bench.LLM_KN for m in bench.LLM_MS]
        ladder_shapes = [(s, False) for s in bench.DEFAULT_SHAPES]
        return [Step(self.name, "HGEMM ladder + sweeps", cases, lambda: self.run(args),
                     lambda info: bench.kernel_specs(info, ladder_shapes, ladder, args.dtype)
                     + bench.kernel_specs(info, squares, auto_pair, args.dtype)
                     + bench.kernel_specs(info, llm, auto_pair, args.dtype))]

    def headlines(self, report) -> list[dict]:
        return gemm_headlines(report, "auto")


FAMILY = HGEMM()
