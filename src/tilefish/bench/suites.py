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


def _e2e(args):
    from . import e2e

    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    if args.family is None:  # the all-families run stays quick: a reduced e2e that says so in its title
        return e2e.run(layers=8, batches=[1, 16], prefill=[], modes=["compiled"], impls=list(e2e.IMPLS),
                       model=args.model, reps=args.reps,
                       title_note=" [reduced for the all-families run: 8 layers, decode b1/b16, compiled only; "
                                  "`tilefish bench e2e` runs the full set]")
    return e2e.run(layers=args.layers, batches=ints(args.batches), prefill=ints(args.prefill), context=args.context,
                   modes=args.modes.split(","), impls=args.impls.split(","), model=args.model,
                   int4_lm_head=args.int4_lm_head, reps=args.reps)


def _w4a16_summary(report) -> str:
    from . import w4a16

    table = w4a16.target_summary(report.rows)
    return "Against the targets (ratio = cuBLAS time / tilefish time):\n" + table if table else ""


FAMILIES = {"nf4": _nf4, "w4a16": _w4a16, "sgemm": _sgemm, "hgemm": _hgemm, "e2e": _e2e}
# Printed after a family's table by `tilefish bench` (families with targets to report against).
SUMMARIES = {"w4a16": _w4a16_summary}
