"""The nf4 family (`tilefish bench nf4`: the dequantization table and the fused matmul table; the measurements
are bench/nf4.py's)."""
from __future__ import annotations

import argparse

from ..family import (BenchFamily, Step, ceiling_label, checked_rows, choice_list, groups_by_m, int_list, pct_line,
                      ratio_line, shape_list)
from ..progress import HBM_BPS, TENSOR_FLOPS, Case, alternating_s, kernel_s, samples_s

# The quick plan: the dequantization at two sizes (against bitsandbytes where importable and the copy ceiling),
# the fused matmul on bench nf4's --quick shapes at m 1, 16, 256 (against cuBLAS, bitsandbytes, W4A16 of the
# same group).
QUICK_DEQUANT = [(8192, 8192), (16384, 16384)]
QUICK_M = [1, 16, 256]
QUICK_DTYPE = "bf16"


def matmul_case_s(m: int, k: int, n: int, reps: int) -> float:
    """One matmul row's estimated seconds: four callables in alternating rounds, the idle after a heavy row."""
    t_ours = kernel_s(n * k / 2 + n * k / 32 + 2 * m * (k + n), 2 * m * n * k, 0.9 * TENSOR_FLOPS)
    t_cublas = kernel_s(2 * n * k + 2 * m * (k + n), 2 * m * n * k)
    t_bnb = 2 * t_ours if m <= 16 else t_cublas + 2.5 * n * k / HBM_BPS
    per_round = max(4, -(-reps // 4))
    return alternating_s([t_ours, t_cublas, t_ours, t_bnb], 4, per_round, 3) + 0.05 + (0.5 if t_cublas > 1e-3 else 0)


class NF4(BenchFamily):
    name = "nf4"
    title = "NF4 (bitsandbytes-format weights)"
    help = "NF4 dequantization against bitsandbytes, and the fused NF4 matmul against cuBLAS, bitsandbytes, W4A16"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--shapes", type=shape_list, help="comma-separated: dequantize RxC (4096x4096,...), matmul "
                       "KxN (4096x6144,...)")
        p.add_argument("--m", type=int_list, help="matmul: comma-separated batch sizes (default 1,2,4,...,4096)")
        p.add_argument("--dtypes", type=choice_list(("fp16", "bf16")),
                       help="matmul: comma-separated activation dtypes fp16,bf16 (default --dtype, or bf16 where "
                       "--dtype is fp32)")
        p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                       help="dequantize output dtype (default bf16)")
        p.add_argument("--blocksize", type=int, default=64, help="NF4 blocksize (default 64)")
        p.add_argument("--single-quant", action="store_true", help="NF4 without double quantization")
        p.add_argument("--only", choices=["dequantize", "matmul"], help="run one of the two tables (default both)")
        p.add_argument("--quick", action="store_true",
                       help="the short sets (matmul: 3 shapes x m 1,16,64,256,1024; dequantize: 8192x8192); "
                       "--shapes / --m still override")
        p.add_argument("--variants", action="store_true",
                       help="sweep the dequantization kernel's design space (the dequantization table only)")

    def run(self, args):
        """--only picks a table; --variants sweeps the dequantization kernel alone. --quick, and the
        all-families run (args.family None), take the short sets."""
        from .. import nf4 as bench

        reduced = args.family is None
        quick = args.quick or reduced
        only = "dequantize" if args.variants else args.only
        double_quant = not args.single_quant
        dequant = matmul = None
        if only in (None, "dequantize"):
            dequant = bench.run(shapes=args.shapes or (bench.QUICK_SHAPES if quick else None), dtype=args.dtype,
                                blocksize=args.blocksize, double_quant=double_quant, variants=args.variants,
                                reps=args.reps)
        if only in (None, "matmul"):
            ms = [int(v) for v in args.m.split(",") if v] if args.m else (bench.QUICK_M if quick else None)
            kn = [tuple(s) for s in args.shapes] if args.shapes else (bench.QUICK_KN if quick else None)
            # --dtypes, else --dtype where the matmul runs it (bf16 / fp16), else bf16
            dtypes = ([d for d in args.dtypes.split(",") if d] if args.dtypes
                      else [args.dtype if args.dtype in bench.MATMUL_DTYPES else "bf16"])
            note = ""
            if quick and not (args.shapes and args.m):
                what = "the all-families run" if reduced else "--quick"
                note = (f" [reduced for {what}: {len(kn or bench.MATMUL_KN)} shapes, "
                        f"m {','.join(map(str, ms or bench.MATMUL_M))}; `tilefish bench nf4` runs the full set]")
            matmul = bench.run_matmul(shapes=kn, ms=ms, dtypes=dtypes, blocksize=args.blocksize,
                                      double_quant=double_quant, reps=args.reps, title_note=note)
        return bench.combine(dequant, matmul)

    def steps(self, args, full: bool) -> list[Step]:
        from .. import nf4 as bench

        if not full:
            return self._steps(QUICK_DEQUANT, bench.QUICK_KN, QUICK_M, [QUICK_DTYPE], args.reps)
        # run(args) with no family: the dequantization's quick set and the matmul's
        parts = self._steps(args.shapes or bench.QUICK_SHAPES, bench.QUICK_KN, bench.QUICK_M,
                            [args.dtype if args.dtype in bench.MATMUL_DTYPES else "bf16"], args.reps, args.blocksize,
                            not args.single_quant)
        return [Step(self.name, "NF4 dequantize + fused matmul", [c for s in parts for c in s.cases],
                     lambda: self.run(args), lambda info: [k for s in parts for k in s.kernels(info)],
                     lambda r: r.impl == "tilefish" or r.family == bench.MATMUL_FAMILY)]

    def _steps(self, dequant_shapes, kn, ms, dtypes, reps, blocksize=64, double_quant=True) -> list[Step]:
        """bench/nf4.run over dequant_shapes, then bench/nf4.run_matmul over kn x ms x dtypes: a step each."""
        from .. import nf4 as bench
        from .. import w4a16 as bench_w4a16

        steps = []
        if dequant_shapes:
            cases = [Case(f"dequantize {r}x{c}", 2 * samples_s(kernel_s(r * c * 2.6, 0), reps) + 0.1)
                     for r, c in dequant_shapes]
            cases[0].weight += 0.8   # the copy and write ceilings
            cases[-1].weight += 0.3  # host overhead
            steps.append(Step(self.name, "NF4 dequantize vs bitsandbytes", cases,
                              lambda: bench.run(shapes=dequant_shapes, dtype=dtypes[0], blocksize=blocksize,
                                                double_quant=double_quant, reps=reps),
                              lambda info: [_dequantize_spec(dtypes[0], double_quant)],
                              lambda r: r.impl == "tilefish"))
        if kn:
            group = min(blocksize, 128)
            cases = [Case(f"matmul {d} k{k} n{n} m{m}", matmul_case_s(m, k, n, reps) + (0.5 if j == 0 else 0.0))
                     for d in dtypes for k, n in kn for j, m in enumerate(ms)]
            cases[0].weight += 0.5   # cuBLAS' peak, the warm-up check
            cases[-1].weight += 1.0  # the host-cost note
            steps.append(Step(self.name, "NF4 fused matmul vs cuBLAS, bitsandbytes, W4A16", cases,
                              lambda: bench.run_matmul(shapes=kn, ms=ms, dtypes=dtypes, blocksize=blocksize,
                                                       double_quant=double_quant, reps=reps),
                              lambda info: bench_w4a16.dispatched_kernels(info, kn, ms, dtypes, group,
                                                                          ("nf4", "int4"))))
        steps[-1].merge = _merge
        return steps

    def headlines(self, report) -> list[dict]:
        from .. import nf4 as bench

        rows = checked_rows(report)
        deq = [r for r in rows if r.family == "nf4" and r.impl == "tilefish"]
        out = [pct_line(f"dequantize, of copy bandwidth{ceiling_label(report, 'copy')}", deq),
               ratio_line("dequantize vs bitsandbytes", deq, "bitsandbytes")]
        mm = [r for r in rows if r.family == bench.MATMUL_FAMILY]
        for peer, name in (("cuBLAS", "cuBLAS"), ("bitsandbytes", "bitsandbytes"),
                           (lambda p: p.startswith("W4A16"), "W4A16 (int4, same group)")):
            out += [ratio_line(f"matmul vs {name}, {g}", sel, peer) for g, sel in groups_by_m(mm)]
        return [h for h in out if h is not None]

    def summary(self, report) -> str:
        from .. import nf4 as bench

        table = bench.target_summary(report.rows)
        if not table:
            return ""
        return "NF4 fused matmul against the targets (ratio = peer time / tilefish NF4 time):\n" + table


def _dequantize_spec(dtype: str, double_quant: bool):
    from ...ops import nf4 as ops
    from .. import nf4 as bench

    return ops.kernel_spec(bench.DTYPES[dtype], double_quant)


def _merge(reports):
    """The quick plan's two steps' reports (or the one that ran) as `tilefish bench nf4` reports them."""
    from .. import nf4 as bench

    if len(reports) == 2:
        return bench.combine(reports[0], reports[1])
    matmul = any(r.family == bench.MATMUL_FAMILY for r in reports[0].rows)
    return bench.combine(None, reports[0]) if matmul else bench.combine(reports[0], None)


FAMILY = NF4()
