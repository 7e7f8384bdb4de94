"""One benchmark family as `tilefish bench` sees it: the BenchFamily protocol, the Step the all-families run is
made of, and the pieces families share (argparse types for their flags, the headline statistics).

Each family is one object, in bench/families/<name>.py beside the family's bench module (bench/<name>.py holds
the measurements and imports torch; the family object imports nothing heavy, so the command line is built
without torch). The CLI gives each family its own subcommand, filled by add_arguments; bench/quick.py runs
every family's steps(); nothing outside a family's object knows its flags, cases, kernels or headlines.
"""
from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Callable

from .progress import Case, Phase


def _tilefish_row(row) -> bool:
    return row.impl.startswith("tilefish")


@dataclass
class Step:
    """One call of a family's bench function in the all-families run: the cases it will report (a row each,
    in order; `counts` says which rows are cases), its kernels (for warming the cache: fn(device info) ->
    KernelSpecs) and the call. merge: fn(reports) -> one Report, where a family takes several steps."""
    family: str
    title: str
    cases: list[Case]
    run: Callable
    kernels: Callable = lambda info: []
    counts: Callable = _tilefish_row
    merge: Callable | None = None

    def phase(self) -> Phase:
        return Phase(self.title, self.cases)


class BenchFamily:
    """A family of `tilefish bench`. Subclasses set the three names and define the methods; one instance each."""
    name = ""       # the subcommand: tilefish bench <name>
    title = ""      # its heading on the summary screen
    help = ""       # its line in `tilefish bench --help`

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Its own flags (the ones every family takes, --out / --json / --plot / --reps, come from the CLI)."""

    def text_instead_of_run(self, args) -> str | None:
        """What the flags ask for in place of a run, printed without a GPU (w4a16's --list-models); else None."""
        return None

    def run(self, args):
        """`tilefish bench <name>`: the Report of its complete set, as the flags narrow it. args.family is None
        in the all-families --full run (nf4 and e2e take reduced sets there)."""
        raise NotImplementedError

    def steps(self, args, full: bool) -> list[Step]:
        """Its part of the all-families run, args holding its flags' defaults: the quick plan's few cases
        (full False), or run(args) (full True), with the cases each step reports and the kernels it launches."""
        raise NotImplementedError

    def headlines(self, report) -> list[dict]:
        """The summary screen's lines for its report: [{label, unit ("x" or "%"), median, worst, worst_case, n}]."""
        return []

    def heading(self, report) -> str:
        """Its heading on the summary screen for this report."""
        return self.title

    def summary(self, report) -> str:
        """What `tilefish bench <name>` prints after the table (its results against targets), or ""."""
        return ""


def defaults(family: BenchFamily, **common) -> argparse.Namespace:
    """The namespace `tilefish bench <family>` parses from no flag, with family None (the all-families run)
    and `common` (reps ...) set."""
    parser = argparse.ArgumentParser(add_help=False)
    family.add_arguments(parser)
    args = parser.parse_args([])
    args.family = None
    vars(args).update(common)
    return args


# ---- argparse types of the families' flags (the values stay text where the family splits them itself) -------

def positive_int(text: str) -> int:
    """An int of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1 or more), got {text!r}")
    return value


def int_list(text: str) -> str:
    """A comma-separated list of positive ints (kept as the text)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return text


def choice_list(choices):
    """A comma-separated subset of `choices` (kept as the text)."""
    def parse(text: str) -> str:
        items = [v for v in text.split(",") if v]
        bad = [v for v in items if v not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)}; got {text!r}")
        return text
    return parse


def shape_list(text: str) -> list[tuple[int, ...]] | None:
    """Comma-separated shapes of x-separated ints (4096x6144,8192 -> [(4096, 6144), (8192,)]); '' is None."""
    try:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in text.split(",") if s]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated shapes such as 4096x6144, got {text!r}") from None
    return shapes or None


# ---- headlines: each peer and the ceiling, median and worst over the cases -------------------------------------

def checked_rows(report) -> list:
    """The rows whose output check did not fail: a failed row's time is not evidence."""
    return [r for r in report.rows if "CHECK FAILED" not in r.impl]


def stat(values: list[tuple[float, str]]) -> dict:
    """{median, worst (the least), worst_case, n} over (value, case) pairs (median: the middle of the sorted
    values, the mean of the two middle ones for an even count)."""
    vals = sorted(values)
    return {"median": statistics.median(v for v, _ in vals), "worst": vals[0][0], "worst_case": vals[0][1],
            "n": len(vals)}


def ratio_line(label: str, rows, peer: str | Callable, case=lambda r: r.case) -> dict | None:
    """The ratios to `peer` (a name, or a test on the peer names) over rows; None where no row has one."""
    pairs = []
    for r in rows:
        name = peer if isinstance(peer, str) else next((p for p in r.ratios if peer(p)), None)
        if name in r.ratios:
            pairs.append((r.ratios[name], case(r)))
    return dict(label=label, unit="x", **stat(pairs)) if pairs else None


def pct_line(label: str, rows, case=lambda r: r.case) -> dict | None:
    """The rows' percentages of their ceiling; None where no row has one."""
    pairs = [(r.pct_ceiling, case(r)) for r in rows if r.pct_ceiling is not None]
    return dict(label=label, unit="%", **stat(pairs)) if pairs else None


def groups_by_m(rows, groups=(("m<=16", 1, 16), ("m 17-128", 17, 128), ("m>=256", 256, 1 << 30))):
    """(label, rows) for each m range that has rows (extra["m"])."""
    for label, lo, hi in groups:
        sel = [r for r in rows if r.extra.get("m") is not None and lo <= r.extra["m"] <= hi]
        if sel:
            yield label, sel


def ceiling_label(report, prefix: str) -> str:
    """' (3,000 GB/s)' for the report's first ceiling named `prefix`..., else ''."""
    for name, v in report.ceilings.items():
        if name.startswith(prefix):
            return f" ({v:,.0f} {name[len(prefix):].strip() or 'GB/s'})"
    return ""
