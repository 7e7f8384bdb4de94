"""The sgemm family (`tilefish bench sgemm`: the fp32 ladder; the measurements are bench/sgemm.py's), and what
the two GEMM ladders share: a case's estimated time, the headlines."""
from __future__ import annotations

import argparse

from ..family import BenchFamily, Step, checked_rows, ratio_line, shape_list
from ..progress import FP32_FLOPS, TENSOR_FLOPS, Case, kernel_s, paired_s, samples_s

# The quick plan: kernel="auto" (the ladder's best step) against cuBLAS fp32 at three cubes.
QUICK_SIZES = (1024, 2048, 4096)
# The full run's ladder at 4096^3: each step's time over cuBLAS's, roughly (its estimated cases).
LADDER_SLOWDOWN = (100.0, 8.1, 6.1, 3.0, 1.67, 1.44, 1.17, 1.14, 1.08)


def gemm_case_s(m: int, n: int, k: int, reps: int, fp32: bool = False, paired: bool = True,
                slowdown: float = 1.0) -> float:
    """One GEMM shape's estimated seconds: cuBLAS alone, then a kernel `slowdown` times slower than it (paired
    with cuBLAS where `paired`; the ladder's first steps take one warm-up call and three reps at least)."""
    t_cublas = kernel_s(4 * (m * k + k * n + m * n), 2 * m * n * k, FP32_FLOPS if fp32 else TENSOR_FLOPS)
    t_ours = t_cublas * slowdown
    slow = slowdown > 4
    ours = samples_s(t_ours, reps, 1 if slow else 5, 3 if slow else 10)
    if paired and not slow:
        ours = paired_s(t_ours, t_cublas, reps)
    return samples_s(t_cublas, reps) + ours + 0.05


def gemm_headlines(report, what: str) -> list[dict]:
    """kernel="auto" against cuBLAS: the square shapes and, where the report has them, the LLM projections."""
    auto = [r for r in checked_rows(report) if r.impl == "tilefish auto"]
    square = [r for r in auto if not r.case.startswith("llm")]
    llm = [r for r in auto if r.case.startswith("llm")]
    out = [ratio_line(f"{what} vs cuBLAS" + (", square" if llm else ""), square, "cuBLAS"),
           ratio_line(f"{what} vs cuBLAS, LLM projections", llm, "cuBLAS")]
    return [h for h in out if h is not None]


class SGEMM(BenchFamily):
    name = "sgemm"
    title = "SGEMM fp32 (ladder)"
    help = "every SGEMM ladder step (fp32) against cuBLAS fp32, then kernel=\"auto\" over a sweep"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--shapes", type=shape_list,
                       help="comma-separated S (S^3) or MxNxK: the ladder at each (default 4096^3, then kernel=auto "
                       "over 256..8192)")
        p.add_argument("--variants", action="store_true",
                       help="also autotune steps 05-09 at the first shape and rank their configurations")

    def run(self, args):
        from .. import sgemm as bench

        return bench.run(args)

    def steps(self, args, full: bool) -> list[Step]:
        from .. import sgemm as bench

        reps = args.reps
        if not full:
            return [Step(self.name, "SGEMM auto vs cuBLAS",
                         [Case(f"{s}^3", gemm_case_s(s, s, s, reps, fp32=True, paired=False, slowdown=1.08))
                          for s in QUICK_SIZES],
                         lambda: bench.run_auto(QUICK_SIZES, reps),
                         lambda info: bench.kernel_specs(info, [(s, s, s) for s in QUICK_SIZES]))]
        # run(args): the ladder at 4096^3, then auto over the sweep
        import importlib

        ladder = importlib.import_module("tilefish.ops.sgemm").KERNELS
        s0 = bench.DEFAULT_SHAPE
        cases = [Case(f"{s0[0]}^3 {step}", gemm_case_s(*s0, reps, fp32=True, paired=False, slowdown=sl) / 2 + 0.05)
                 for step, sl in zip(ladder, LADDER_SLOWDOWN)]
        cases[0].weight += samples_s(kernel_s(0, 2 * s0[0] ** 3, FP32_FLOPS), reps)
        cases += [Case(f"sweep {s}^3", gemm_case_s(s, s, s, reps, fp32=True, paired=False, slowdown=1.1))
                  for s in bench.SWEEP]
        return [Step(self.name, "SGEMM ladder + auto sweep", cases, lambda: self.run(args),
                     lambda info: bench.kernel_specs(info, [s0], ladder)
                     + bench.kernel_specs(info, [(s, s, s) for s in bench.SWEEP]))]

    def headlines(self, report) -> list[dict]:
        return gemm_headlines(report, "auto (best ladder step)")


FAMILY = SGEMM()
