"""Benchmark families known to `tilefish bench`; each maps CLI args to a Report."""
from __future__ import annotations


def _nf4(args):
    from . import nf4

    return nf4.run(shapes=args.shapes, dtype=args.dtype, blocksize=args.blocksize,
                   double_quant=not args.single_quant, variants=args.variants, reps=args.reps)


def _w4a16(args):
    from . import w4a16

    kn = [tuple(s) for s in args.shapes] if args.shapes else None
    ms = [int(v) for v in args.m.split(",")] if args.m else None
    groups = [int(v) for v in args.groups.split(",")] if args.groups else (128, -1)
    dtypes = args.dtypes.split(",") if args.dtypes else ("fp16", "bf16")
    if args.variants:
        return w4a16.sweep(shapes=kn, ms=ms, dtype=dtypes[0], group=groups[0])
    return w4a16.run(shapes=kn, ms=ms, groups=groups, dtypes=dtypes, reps=args.reps)


def _sgemm(args):
    from . import sgemm

    return sgemm.run(args)


def _hgemm(args):
    from . import hgemm

    return hgemm.run(args)


def _w4a16_summary(report) -> str:
    from . import w4a16

    table = w4a16.target_summary(report.rows)
    return "Against the targets (ratio = cuBLAS time / tilefish time):\n" + table if table else ""


FAMILIES = {"nf4": _nf4, "w4a16": _w4a16, "sgemm": _sgemm, "hgemm": _hgemm}
# Printed after a family's table by `tilefish bench` (families with targets to report against).
SUMMARIES = {"w4a16": _w4a16_summary}
