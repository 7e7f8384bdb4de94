"""Benchmark families known to `tilefish bench`; each maps CLI args to a Report."""
from __future__ import annotations


def _nf4(args):
    from . import nf4

    return nf4.run(shapes=args.shapes, dtype=args.dtype, blocksize=args.blocksize,
                   double_quant=not args.single_quant, variants=args.variants, reps=args.reps)


FAMILIES = {"nf4": _nf4}
