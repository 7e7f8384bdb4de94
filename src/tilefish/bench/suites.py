"""Benchmark families known to `tilefish bench`; each maps CLI args to a Report."""
from __future__ import annotations


def _nf4(args):
    """The dequantization table and the fused matmul table (--only picks one; --variants sweeps the
    dequantization kernel alone). --quick, and the all-families run, take the short sets."""
    from . import nf4

    reduced = args.family is None  # the all-families run stays quick
    quick = getattr(args, "quick", False) or reduced
    only = "dequantize" if args.variants else getattr(args, "only", None)
    double_quant = not args.single_quant
    dequant = matmul = None
    if only in (None, "dequantize"):
        dequant = nf4.run(shapes=args.shapes or (nf4.QUICK_SHAPES if quick else None), dtype=args.dtype,
                          blocksize=args.blocksize, double_quant=double_quant, variants=args.variants, reps=args.reps)
    if only in (None, "matmul"):
        ms = [int(v) for v in args.m.split(",") if v] if args.m else (nf4.QUICK_M if quick else None)
        kn = [tuple(s) for s in args.shapes] if args.shapes else (nf4.QUICK_KN if quick else None)
        # --dtypes, else --dtype where the matmul runs it (bf16 / fp16), else bf16
        dtypes = ([d for d in args.dtypes.split(",") if d] if args.dtypes
                  else [args.dtype if args.dtype in nf4.MATMUL_DTYPES else "bf16"])
        note = ""
        if quick and not (args.shapes and args.m):
            what = "the all-families run" if reduced else "--quick"
            note = (f" [reduced for {what}: {len(kn or nf4.MATMUL_KN)} shapes, "
                    f"m {','.join(map(str, ms or nf4.MATMUL_M))}; `tilefish bench nf4` runs the full set]")
        matmul = nf4.run_matmul(shapes=kn, ms=ms, dtypes=dtypes, blocksize=args.blocksize, double_quant=double_quant,
                                reps=args.reps, title_note=note)
    return nf4.combine(dequant, matmul)


def _w4a16(args):
    from . import w4a16

    kn = [tuple(s) for s in args.shapes] if args.shapes else None
    ms = [int(v) for v in args.m.split(",")] if args.m else None
    groups = [int(v) for v in args.groups.split(",")] if args.groups else (128, -1)
    dtypes = args.dtypes.split(",") if args.dtypes else ("fp16", "bf16")
    models = getattr(args, "models", None)  # --models: names or "all" (--shapes overrides it)
    if args.variants:
        return w4a16.sweep(shapes=kn, ms=ms, dtype=dtypes[0], group=groups[0], models=models)
    peers = tuple(args.peers.split(",")) if getattr(args, "peers", None) else ()
    return w4a16.run(shapes=kn, ms=ms, groups=groups, dtypes=dtypes, reps=args.reps, models=models, peers=peers)


def _sgemm(args):
    from . import sgemm

    return sgemm.run(args)


def _hgemm(args):
    from . import hgemm

    return hgemm.run(args)


def _e2e(args):
    """The harness's loop (e2e.py) and the user's loop (e2e_generate.py: HF generate with the static cache)
    in one report; --loops picks them, --impls the variants (each loop runs the ones it knows)."""
    from . import e2e, e2e_generate

    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    loops = (getattr(args, "loops", None) or "harness,generate").split(",")
    generate = "generate" in loops and args.model != "builtin" and e2e._has_transformers()
    if args.family is None:  # the all-families run stays quick: a reduced e2e that says so in its title
        report = e2e.run(layers=8, batches=[1, 16], prefill=[], modes=["compiled"], impls=list(e2e.IMPLS),
                         model=args.model, reps=args.reps,
                         title_note=" [reduced for the all-families run: 8 layers, decode b1/b16, compiled only; "
                                    "`tilefish bench e2e` runs the full set]")
        return e2e_generate.run(layers=8, report=report) if generate else report
    if getattr(args, "tp", None):  # tensor-parallel, under torchrun (bench/e2e_tp.py)
        from . import e2e_tp

        return e2e_tp.run(ints(args.tp), impls=args.impls.split(",") if args.impls else list(e2e.IMPLS),
                          layers=args.layers, batches=ints(args.batches or ",".join(map(str, e2e_tp.TP_BATCHES))),
                          context=args.context, modes=(args.modes or "compiled").split(","), model=args.model,
                          reps=args.reps)
    batches = args.batches or ",".join(map(str, e2e.DEFAULT_BATCHES))
    impls = args.impls.split(",") if args.impls else list(dict.fromkeys(e2e.IMPLS + e2e_generate.IMPLS))
    report = None
    if "harness" in loops:
        report = e2e.run(layers=args.layers, batches=ints(batches), prefill=ints(args.prefill), context=args.context,
                         modes=(args.modes or "compiled,eager").split(","), impls=[i for i in impls if i in e2e.IMPLS],
                         model=args.model, int4_lm_head=args.int4_lm_head, reps=args.reps)
    if generate and (chosen := [i for i in impls if i in e2e_generate.IMPLS]):
        report = e2e_generate.run(layers=args.layers, batches=ints(getattr(args, "generate_batches", None) or "1,16"),
                                  impls=chosen, new_tokens=getattr(args, "new_tokens", None) or e2e_generate.NEW_TOKENS,
                                  int4_lm_head=args.int4_lm_head, report=report)
    if report is None:
        raise ValueError(f"bench e2e: nothing to run (loops {loops}, impls {impls}; the generate loop needs "
                         "transformers and --model hf or auto)")
    return report


def _w4a16_summary(report) -> str:
    from . import w4a16

    table = w4a16.target_summary(report.rows)
    return "Against the targets (ratio = cuBLAS time / tilefish time):\n" + table if table else ""


def _nf4_summary(report) -> str:
    from . import nf4

    table = nf4.target_summary(report.rows)
    return ("NF4 fused matmul against the targets (ratio = peer time / tilefish NF4 time):\n" + table) if table else ""


FAMILIES = {"nf4": _nf4, "w4a16": _w4a16, "sgemm": _sgemm, "hgemm": _hgemm, "e2e": _e2e}
# Printed after a family's table by `tilefish bench` (families with targets to report against).
SUMMARIES = {"w4a16": _w4a16_summary, "nf4": _nf4_summary}
