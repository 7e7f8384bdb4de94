"""Measured W4A16 plans per GPU: the tables `tilefish tune` writes, which the dispatcher reads first.

The time model (time_model.py) and the rules (dispatch.py) were fitted on one GPU; a plan that
model picks can sit far from the best one on another GPU or on a shape it never saw. A tuned table
holds, for one GPU, the plan measured fastest for each (dtype, scale format, codebook, k, n, m) that
was tuned. choose_plan takes the table's plan for a call whose weight was tuned, and the model's
plan otherwise:

- Tables are looked up by GPU key (gpu_key: the device name and SM count, e.g.
  "nvidia-h100-80gb-hbm3-132sm"). A user's own table (`tilefish tune`, written to
  <kernel cache>/tuned/w4a16-<key>.json) comes first, then the table shipped in the package
  (ops/w4a16/tuned/<key>.json) for the GPUs this project measured. Entries of the user's table
  replace the shipped entries of the same case. TILEFISH_TUNED=0 turns tables off (A/Bs);
  TILEFISH_TUNED=<path of a table file> makes that file the only table (held-out runs: a table
  tuned on some models' weights, evaluated on others'), for the GPU its "key" names.
- For a weight the table does not hold, at m <= 16 (decode), the configuration tuned for the
  nearest weight is taken (lookup_nearby); elsewhere the model decides.
- A call's m is matched to the tuned m nearest in log2 (ties to the larger m, whose tiles the
  smaller m fills no worse), within a factor of 2; outside it, or where the tuned plan cannot run
  at this m (a skinny or swapped configuration has a row limit), the model decides.
- A table is read once per process and GPU; lookups are pure functions of the table and the call,
  so the same call always gets the same plan. A table that does not parse, or whose entries name
  unknown plans, is ignored with one warning (the model decides): a bad file never fails a matmul.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from .configs import GemmConfig, HopperConfig, SkinnyConfig, parse_plan, ragged_waste_ok

TABLE_FORMAT = 1
PACKAGE_TABLES = Path(__file__).with_name("tuned")
MAX_M_RATIO = 2.0  # a tuned m stands for calls within this factor of it


@dataclass(frozen=True)
class Plan:
    """A launch plan: the configuration, and the k split (tile kernels) or the grid (stream-K ones);
    None where the launcher's default applies."""
    cfg: GemmConfig | HopperConfig | SkinnyConfig
    slices: int | None = None
    ctas: int | None = None

    def label(self) -> str:
        return self.cfg.label() + (f"/x{self.slices}" if self.slices else "") + (f"/c{self.ctas}" if self.ctas else "")

    @classmethod
    def parse(cls, label: str) -> "Plan":
        name, _, ctas = label.partition("/c")
        cfg, slices = parse_plan(name)
        return cls(cfg, slices, int(ctas) if ctas else None)

    def runs_at(self, m: int) -> bool:
        """Whether the plan's kernel takes m rows (the skinny kernel: m <= its tile; swapped mma.sync: m <= 8)."""
        if isinstance(self.cfg, SkinnyConfig):
            return m <= self.cfg.mt
        return not (getattr(self.cfg, "swap", False) and m > 8)


def gpu_key(name: str, sm_count: int) -> str:
    """The table key of a GPU: its name as a slug plus the SM count (parts sold under one name with
    other SM counts tune differently), e.g. 'NVIDIA H100 80GB HBM3', 132 -> 'nvidia-h100-80gb-hbm3-132sm'."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"{slug}-{sm_count}sm"


def case_key(dtype: str, grouped: bool, codebook: str, k: int, n: int) -> tuple:
    return (dtype, "grouped" if grouped else "per_channel", codebook, k, n)


class TunedTable:
    """One GPU's measured plans: {case_key: {m: Plan}}. Built from table JSON documents (later ones
    replace earlier ones' entries of the same case and m)."""

    def __init__(self, docs: list[dict] = (), source: str = ""):
        self.source = source
        self.cases: dict[tuple, dict[int, Plan]] = {}
        for doc in docs:
            self.merge(doc)

    def merge(self, doc: dict) -> None:
        if doc.get("format") != TABLE_FORMAT:
            raise ValueError(f"tuned table format {doc.get('format')!r}, expected {TABLE_FORMAT}")
        for e in doc["entries"]:
            key = case_key(e["dtype"], e["scales"] == "grouped", e.get("codebook", "int4"), int(e["k"]), int(e["n"]))
            self.cases.setdefault(key, {})[int(e["m"])] = Plan.parse(e["plan"])

    def __len__(self) -> int:
        return sum(len(v) for v in self.cases.values())

    def lookup(self, dtype: str, grouped: bool, codebook: str, k: int, n: int, m: int) -> Plan | None:
        """The tuned plan for this call, or None (the model decides)."""
        by_m = self.cases.get(case_key(dtype, grouped, codebook, k, n))
        if not by_m:
            return None
        # nearest tuned m in log2, ties to the larger; then the next nearest where the plan cannot run at m
        for tm in sorted(by_m, key=lambda t: (abs(math.log2(t / m)), -t)):
            if max(tm / m, m / tm) > MAX_M_RATIO:
                return None
            if by_m[tm].runs_at(m) and _fits(by_m[tm], n):
                return by_m[tm]
        return None


    def lookup_nearby(self, dtype: str, grouped: bool, codebook: str, k: int, n: int, m: int) -> Plan | None:
        """For a weight the table does not hold, at m <= NEARBY_MAX_M: the configuration tuned for
        the nearest weight (log2 distance in k plus in n, at most NEARBY_MAX_DISTANCE; ties to the
        smaller (k, n)) at the tuned m nearest this one, with the launcher's own split / grid.
        Which kernel wins at small m depends on the GPU's bandwidth and changes slowly with the
        weight's size, so a neighbour's measured choice beats a rule fitted on another GPU."""
        if m > NEARBY_MAX_M:
            return None
        shapes = sorted((abs(math.log2(k2 / k)) + abs(math.log2(n2 / n)), k2, n2)
                        for (dt, fmt, cb, k2, n2) in self.cases
                        if (dt, fmt, cb) == case_key(dtype, grouped, codebook, k, n)[:3])
        for dist, k2, n2 in shapes:
            if dist > NEARBY_MAX_DISTANCE:
                break
            plan = self.lookup(dtype, grouped, codebook, k2, n2, m)
            if plan is not None and plan.runs_at(m) and _fits(plan, n):
                return Plan(plan.cfg)
        return None


NEARBY_MAX_M = 16           # lookup_nearby serves calls up to this m ...
NEARBY_MAX_DISTANCE = 2.0   # ... from weights at most this far (log2 k + log2 n distance)


def _fits(plan: Plan, n: int) -> bool:
    return ragged_waste_ok(plan.cfg, n)


def user_table_path(key: str) -> Path:
    from ...runtime.compiler import cache_dir

    return cache_dir() / "tuned" / f"w4a16-{key}.json"


def package_table_path(key: str) -> Path:
    return PACKAGE_TABLES / f"{key}.json"


def read_table_doc(path: Path) -> dict | None:
    """A table file's JSON document, checked (format, every plan label parses), or None if absent.
    Raises ValueError naming the file if it is there but unusable."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        TunedTable([doc])  # validates every entry
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"tuned table {path} is unusable ({type(e).__name__}: {e}); delete it or re-run "
                         "`tilefish tune`") from e
    return doc


_tables: dict[str, TunedTable | None] = {}


def tables_enabled() -> bool:
    return os.environ.get("TILEFISH_TUNED", "1") not in ("0", "false", "no", "off")


def _only_table_path() -> Path | None:
    """TILEFISH_TUNED's file, when it names one (any value but on / off words)."""
    value = os.environ.get("TILEFISH_TUNED", "1")
    return None if value in ("1", "true", "yes", "on", "0", "false", "no", "off") else Path(value)


def table_for(key: str) -> TunedTable | None:
    """The GPU's table (package entries, then the user's), read once per process; None if neither
    exists or tables are off. An unusable file is skipped with a warning."""
    if not tables_enabled():
        return None
    if key not in _tables:
        docs, only = [], _only_table_path()
        if only is not None and not only.is_file():
            warnings.warn(f"TILEFISH_TUNED={only}: no such table file; the dispatcher's model decides",
                          RuntimeWarning, stacklevel=2)
        paths = (package_table_path(key), user_table_path(key)) if only is None else (only,)
        for path in paths:
            try:
                doc = read_table_doc(path)
            except ValueError as e:
                warnings.warn(f"{e}; the dispatcher's model decides instead", RuntimeWarning, stacklevel=2)
                doc = None
            if doc is not None and (only is None or doc.get("key") == key):
                docs.append(doc)
        _tables[key] = TunedTable(docs, key) if docs else None
    return _tables[key]


def forget_tables() -> None:
    """Drop the tables read so far (after `tilefish tune` wrote a new one, or in tests)."""
    _tables.clear()
