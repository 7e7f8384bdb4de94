"""The families `tilefish bench` knows: one BenchFamily object each (bench/family.py), by name, in the order the
all-families run measures them and its summary lists them. Nothing here imports torch."""
from __future__ import annotations

from . import e2e, hgemm, moe, nf4, sgemm, w4a16

FAMILIES = {f.name: f for f in (w4a16.FAMILY, nf4.FAMILY, sgemm.FAMILY, hgemm.FAMILY, e2e.FAMILY, moe.FAMILY)}
