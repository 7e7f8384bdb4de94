"""Benchmark peers built from other projects' sources (not importable packages).

Each peer answers ``available(...) -> str | None`` (None: usable for that problem, else a one-line
reason the bench prints and records), builds itself on first use into the tilefish cache directory,
and converts a tilefish :class:`~tilefish.quant.int4.Int4Weight` into its own layout, so that the
peer and tilefish multiply the very same integers and scales.

marlin: the original Marlin FP16xINT4 kernel (IST-DASLab/marlin), from a vendored copy of its two
        source files under ``.peers/marlin/`` (``scripts/vendor_marlin.sh``).
"""
from .marlin import MarlinPeer, MarlinWeight, pack_marlin, unpack_marlin

__all__ = ["MarlinPeer", "MarlinWeight", "pack_marlin", "unpack_marlin"]
