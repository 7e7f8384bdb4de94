"""`tilefish bench` without a family: every family, one progress bar, one summary screen.

The runner over the family objects (bench/families: what each measures, its cases and kernels, its headlines):
the default is the quick run, each family's steps(args, full=False), a representative handful of cases sized so
that all of them finish in cli.QUICK_RUN_TIME (under two minutes on an H100, compilation included: the words
`tilefish bench --help` and the README use). `--full` runs each family's complete default set instead
(steps(args, full=True): its run() with no family named). Either way:

- the kernels the run will launch are compiled first, in parallel processes, into the disk cache;
- a progress bar (bench/progress.py) counts the cases across families, with an ETA from the cases' estimated
  times (progress.py's ETA model, which the families' steps weigh their cases with);
- the results go to one directory (default ./tilefish-results/<gpu>-<date>/): a JSON per family (the same
  records `tilefish bench <family> --json` writes, `tilefish table` prints them), their PNGs, summary.json
  (the tilefish rows of every family, the headlines, how the run went) and tables.txt (every table);
- one summary screen: per family its headline ratios against each peer and the ceiling, median and worst
  over the cases;
- Ctrl-C stops the run: what was measured is written and summarized as above, marked interrupted; exit 130.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import io
import re
import sys
import time
from pathlib import Path

from .families import FAMILIES
from .family import Step, defaults
from .progress import Case, Phase, Tracker, compile_s, make_display, inner_progress_into, warm_kernels
from .report import Report, Row, on_row


def quick_plan(args) -> list[Step]:
    """The quick run: every family's quick steps, args' --reps."""
    return [s for f in FAMILIES.values() for s in f.steps(defaults(f, reps=args.reps), full=False)]


def full_plan(args) -> list[Step]:
    """Every family's complete default run: its run() with no family named (a family may reduce its set there)."""
    return [s for f in FAMILIES.values() for s in f.steps(defaults(f, reps=args.reps), full=True)]


# ---- the summary screen -----------------------------------------------------------------------------------------

def family_headlines(family: str, rep: Report) -> list[dict]:
    """The headline lines of one family's report: [{label, unit, median, worst, worst_case, n}]."""
    return FAMILIES[family].headlines(rep) if family in FAMILIES else []


def _fmt_value(v: float, unit: str) -> str:
    return f"{v:.2f}x" if unit == "x" else f"{v:.0f}%"


def format_headline(h: dict, width: int = 44) -> str:
    if h["n"] == 1:
        return f"  {h['label']:<{width}} {_fmt_value(h['median'], h['unit']):>14}  {h['worst_case']}"
    return (f"  {h['label']:<{width}} median {_fmt_value(h['median'], h['unit']):>7}   worst "
            f"{_fmt_value(h['worst'], h['unit']):>7}  {h['worst_case']}  ({h['n']} cases)")


def _caveats(rep: Report) -> list[str]:
    """The notes that change what the headlines compare (a peer that did not run)."""
    out = []
    for n in rep.notes:
        if re.search(r"not importable|skipped", n) and not n.startswith("skipped k"):
            out.append(n if len(n) <= 110 else n[:107] + "...")
    return list(dict.fromkeys(out))


def problems(reports: dict[str, Report]) -> list[str]:
    """Failed checks and warnings the families reported (rows flagged CHECK FAILED, notes saying FAILED,
    WARNING or LARGE)."""
    out = []
    for fam, rep in reports.items():
        out += [f"{fam}: {r.case} {r.impl}" for r in rep.rows if "CHECK FAILED" in r.impl]
        out += [f"{fam}: {n}" for n in rep.notes if re.search(r"FAILED|WARNING|LARGE \(", n)]
    return out


def summary_text(reports: dict[str, Report], *, gpu: str, mode: str, elapsed_s: float, cases_done: int,
                 cases_total: int, out_dir: Path | None, files: dict[str, list[str]], interrupted: bool,
                 notes: list[str] = ()) -> str:
    """The summary screen."""
    lines = [f"tilefish bench ({mode} run) on {gpu}: {cases_done} of {cases_total} cases in {elapsed_s:.0f} s"
             + ("  [INTERRUPTED]" if interrupted else "")]
    lines.append("ratio = peer time / tilefish time (above 1: tilefish is faster); % = of the ceiling measured in the "
                 "same process; median and worst over the cases")
    heads = {fam: family_headlines(fam, rep) for fam, rep in reports.items()}
    width = min(52, max([len(h["label"]) for hs in heads.values() for h in hs] + [20]))
    for fam, family in FAMILIES.items():
        rep = reports.get(fam)
        if rep is None:
            continue
        lines.append("")
        lines.append(f"{family.heading(rep)}  [{len(rep.rows)} rows]")
        lines += [format_headline(h, width) for h in heads[fam]] or ["  (no comparable rows)"]
        lines += [f"  note: {n}" for n in _caveats(rep)]
    missing = [f for f in FAMILIES if f not in reports]
    if missing and interrupted:
        lines.append("")
        lines.append(f"not run: {', '.join(missing)}")
    bad = problems(reports)
    lines.append("")
    if bad:
        lines.append(f"{len(bad)} problem(s) reported (see tables.txt):")
        lines += [f"  {b}" for b in bad[:6]] + ([f"  ... {len(bad) - 6} more"] if len(bad) > 6 else [])
    else:
        lines.append("checks: no failed output check or warning in the families' reports")
    lines += list(notes)
    if out_dir is not None:
        lines.append(f"results: {out_dir}/")
        for kind, names in files.items():
            if names:
                lines.append(f"  {kind:<5} {', '.join(names)}")
    if interrupted:
        lines.append("interrupted (Ctrl-C): the results above are the cases finished before it")
    return "\n".join(lines)


# ---- where the results go ---------------------------------------------------------------------------------------

def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    words = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-").split("-")
    words = [w for w in words if w and w not in ("nvidia", "geforce", "tesla")]
    return "-".join(words) or "gpu"


def default_out_dir(gpu_name: str, date: _dt.date | None = None, root: str | Path = "tilefish-results") -> Path:
    return Path(root) / f"{gpu_slug(gpu_name)}-{(date or _dt.date.today()).isoformat()}"


def summary_report(reports: dict[str, Report], title: str) -> Report:
    """Every family's tilefish rows in one Report (what the all-families run's --json always held)."""
    final = Report(title)
    for rep in reports.values():
        final.ceilings.update(rep.ceilings)
        final.rows += [r for r in rep.rows if r.impl.startswith("tilefish")]
        final.notes += rep.notes
    return final


def write_results(out_dir: Path, reports: dict[str, Report], env: dict, run_info: dict,
                  headlines: dict, plots: bool = True) -> dict[str, list[str]]:
    """A JSON (and PNG) per family, summary.json and tables.txt under out_dir; {"json": [...], "png": [...],
    "text": [...]} of the names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {"json": [], "png": [], "text": []}
    plot_error = None
    tables = []
    for fam, rep in reports.items():
        rep.to_json(out_dir / f"{fam}.json", env=env)
        files["json"].append(f"{fam}.json")
        tables.append(rep.table())
        if fam in FAMILIES and (s := FAMILIES[fam].summary(rep)):
            tables.append(s)
        if plots and plot_error is None and rep.rows:
            try:
                rep.plot(out_dir / f"{fam}.png")
                files["png"].append(f"{fam}.png")
            except ImportError as e:
                plot_error = f"no PNG: {e.name or 'matplotlib'} is not installed (pip install 'tilefish[bench]')"
            except Exception as e:  # noqa: BLE001 - a plot never costs the measurements
                files["png"].append(f"({fam}.png failed: {type(e).__name__}: {e})")
    final = summary_report(reports, "tilefish summary (ratios are peer time / tilefish time)")
    final.to_json(out_dir / "summary.json", env=env, run=run_info, headlines=headlines)
    files["json"].append("summary.json")
    (out_dir / "tables.txt").write_text("\n\n".join(tables) + "\n")
    files["text"].append("tables.txt")
    if plot_error:
        files["png"] = [plot_error]
    return files


# ---- the run ----------------------------------------------------------------------------------------------------

class _Collector:
    """Report.add's listener: counts the cases, keeps every Report that got a row (so an interrupted
    family's rows survive the exception that ends its function)."""

    def __init__(self, display):
        self.display = display
        self.step: Step | None = None
        self.seen: dict[int, Report] = {}

    def begin(self, step: Step) -> None:
        self.step = step
        self.seen = {}

    def __call__(self, report: Report, row: Row) -> None:
        self.seen.setdefault(id(report), report)
        if self.step is not None and self.step.counts(row):
            self.display.case_done()

    def partial(self, why: str = "interrupted") -> Report | None:
        """The rows the current step reported before it stopped, in one Report."""
        reps = list(self.seen.values())
        if not reps:
            return None
        out = Report(reps[0].title + f" [{why}]")
        for r in reps:
            out.ceilings.update(r.ceilings)
            out.rows += r.rows
            out.notes += r.notes
        out.notes.append(f"{why}: the rows above are the cases finished before the run stopped")
        return out


class _Tee(io.TextIOBase):
    """stdout while the families run: kept for log.txt, not printed (the summary is the screen)."""

    def __init__(self):
        self.buf = io.StringIO()

    def write(self, s):
        return self.buf.write(s)


def run(args, *, full: bool = False, out: str | None = None, stream=None, plan: list[Step] | None = None,
        device_info=None, environment=None, warm: bool | None = None, display=None) -> int:
    """The all-families run. Returns the exit status: 0; 1 when a family failed (the others still ran, its rows
    so far are kept, the traceback is in log.txt); 130 after Ctrl-C (what was measured is written).
    plan / device_info / environment / display: the tests' replacements (default: quick_plan or full_plan,
    the current GPU, report.environment(), make_display)."""
    from . import report as report_mod

    stream = stream or sys.stderr
    steps = plan if plan is not None else (full_plan(args) if full else quick_plan(args))
    if device_info is None:
        from ..runtime import device_info as _info

        device_info = _info()
    env = environment() if environment is not None else report_mod.environment()
    out_dir = Path(out) if out else default_out_dir(device_info.name)
    warm = (plan is None) if warm is None else warm

    specs: list = []
    if warm:
        for s in steps:
            try:
                specs += s.kernels(device_info)
            except Exception as e:  # noqa: BLE001 - only a head start
                print(f"[tilefish bench] kernel list of {s.title} unavailable: {type(e).__name__}: {e}", file=stream)
        from .progress import uncached

        n_compile = len(uncached(specs, device_info.arch))
    else:
        n_compile = 0
    import os

    processes = max(1, min(16, os.cpu_count() or 1))
    phases = ([Phase("compiling kernels", [Case(f"{n_compile} kernels", compile_s(n_compile, processes), False)])]
              if n_compile else []) + [s.phase() for s in steps]
    tracker = Tracker(phases)
    display = display or make_display(tracker, stream)
    collector = _Collector(display)
    by_family: dict[str, list[Report]] = {}
    notes: list[str] = []
    failed: list[str] = []
    interrupted = False
    log = _Tee()
    offset = 1 if n_compile else 0
    t0 = time.perf_counter()
    try:
        with display, on_row(collector), inner_progress_into(display), contextlib.redirect_stdout(log):
            if n_compile:
                display.begin_phase(0)
                try:
                    note = warm_kernels(specs, device_info.arch,
                                        on_done=lambda d, n: display.set_inner(d / n, f"{d}/{n} kernels"),
                                        processes=processes)
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # noqa: BLE001 - the kernels still compile on first use
                    note = f"kernel cache warm-up skipped ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
                notes.append(note)
                display.end_phase()
            for i, step in enumerate(steps):
                display.begin_phase(i + offset)
                collector.begin(step)
                try:
                    rep = step.run()
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # noqa: BLE001 - one family's failure costs neither the others nor its rows
                    import traceback

                    log.write(traceback.format_exc())
                    failed.append(f"{step.title} FAILED ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}); "
                                  "the traceback is in log.txt")
                    display.message(failed[-1])
                    rep = collector.partial("failed")
                collector.step = None
                display.end_phase()
                if rep is not None:
                    by_family.setdefault(step.family, []).append(rep)
    except KeyboardInterrupt:
        interrupted = True
        part = collector.partial()
        if part is not None and collector.step is not None:
            by_family.setdefault(collector.step.family, []).append(part)
    elapsed = time.perf_counter() - t0
    reports = {}
    for fam in list(FAMILIES) + [f for f in by_family if f not in FAMILIES]:
        reps = by_family.get(fam)
        if not reps:
            continue
        merge = next((s.merge for s in steps if s.family == fam and s.merge), None)
        try:
            reports[fam] = merge(reps) if merge and len(reps) <= 2 else _concat(reps)
        except Exception:  # noqa: BLE001 - never lose rows over a title
            reports[fam] = _concat(reps)
    mode = "full" if full else "quick"
    headlines = {fam: family_headlines(fam, rep) for fam, rep in reports.items()}
    notes = failed + notes
    run_info = {"mode": mode, "interrupted": interrupted, "failed": failed, "elapsed_s": round(elapsed, 1),
                "cases_done": tracker.cases_done, "cases_total": tracker.total_cases, "notes": notes,
                "stdout": log.buf.getvalue()[-20000:]}
    files: dict[str, list[str]] = {}
    try:
        files = write_results(out_dir, reports, env, run_info, headlines)
        if log.buf.getvalue():
            (out_dir / "log.txt").write_text(log.buf.getvalue())
            files["text"].append("log.txt")
    except KeyboardInterrupt:
        interrupted = True
    text = summary_text(reports, gpu=env.get("gpu") or device_info.name, mode=mode, elapsed_s=elapsed,
                        cases_done=tracker.cases_done, cases_total=tracker.total_cases, out_dir=out_dir, files=files,
                        interrupted=interrupted, notes=notes)
    print(text, flush=True)
    if getattr(args, "json", None) or getattr(args, "plot", None):
        final = summary_report(reports, "tilefish summary (ratios are peer time / tilefish time)")
        if args.json:
            final.to_json(args.json, env=env, run=run_info, headlines=headlines)
            print(f"wrote {args.json}")
        if args.plot:
            final.plot(args.plot)
            print(f"wrote {args.plot}")
    return 130 if interrupted else 1 if failed else 0


def _concat(reps: list[Report]) -> Report:
    if len(reps) == 1:
        return reps[0]
    out = Report(" + ".join(dict.fromkeys(r.title for r in reps)))
    for r in reps:
        out.ceilings.update(r.ceilings)
        out.rows += r.rows
        out.notes += r.notes
    return out
