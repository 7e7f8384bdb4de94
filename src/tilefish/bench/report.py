"""Benchmark rows -> printed table, JSON record (with commit, date, GPU, versions), PNG plot."""
from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Row:
    family: str
    case: str                 # shape / problem description
    impl: str                 # "tilefish", "bitsandbytes", "cuBLAS", a variant label ...
    time_us: float
    metric: float             # GB/s or TFLOP/s, see `unit`
    unit: str                 # "GB/s" or "TFLOP/s"
    pct_ceiling: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)  # peer -> (peer time / our time)
    extra: dict = field(default_factory=dict)


def _git_commit() -> str:
    if os.environ.get("TILEFISH_COMMIT"):  # set by scripts that run a copy of the tree without .git
        return os.environ["TILEFISH_COMMIT"]
    for cwd in (os.getcwd(), Path(__file__).resolve().parents[3]):
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
            if out.returncode == 0:
                dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                       capture_output=True, text=True, timeout=5).stdout.strip()
                return out.stdout.strip() + ("-dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"


def environment() -> dict:
    import torch

    from .. import __version__
    env = {"tilefish": __version__, "torch": torch.__version__, "date": _dt.datetime.now().isoformat(timespec="seconds"),
           "commit": _git_commit()}
    try:
        import cuda.core

        env["cuda_core"] = cuda.core.__version__
        from ..runtime.compiler import nvrtc_version

        env["nvrtc"] = nvrtc_version()
    except Exception:  # noqa: BLE001 - informational only
        pass
    if torch.cuda.is_available():
        from ..runtime import device_info

        d = device_info()
        env.update(gpu=d.name, arch=d.arch, sm_count=d.sm_count, l2_bytes=d.l2_bytes,
                   driver=torch.cuda.driver_version() if hasattr(torch.cuda, "driver_version") else None,
                   cuda_runtime=torch.version.cuda)
    try:
        import bitsandbytes

        env["bitsandbytes"] = bitsandbytes.__version__
    except Exception:  # noqa: BLE001
        pass
    return env


# Called as fn(report, row) by every Report.add while registered (on_row): how `tilefish bench` follows a
# family's progress case by case, and keeps the rows measured so far when the run is interrupted, without
# the family's code knowing about either.
_row_listeners: list = []


@contextlib.contextmanager
def on_row(fn):
    """Call fn(report, row) after each Report.add inside the block (any Report, any family)."""
    _row_listeners.append(fn)
    try:
        yield fn
    finally:
        _row_listeners.remove(fn)


class Report:
    def __init__(self, title: str, ceilings: dict[str, float] | None = None):
        self.title = title
        self.rows: list[Row] = []
        self.ceilings = dict(ceilings or {})
        self.notes: list[str] = []

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        for fn in list(_row_listeners):
            fn(self, row)
        return row

    def table(self) -> str:
        peers = sorted({p for r in self.rows for p in r.ratios})
        head = ["case", "impl", "time (us)", "rate", "% ceil"] + [f"x {p}" for p in peers]
        body = []
        for r in self.rows:
            body.append([r.case, r.impl, f"{r.time_us:,.1f}", f"{r.metric:,.1f} {r.unit}",
                         "" if r.pct_ceiling is None else f"{r.pct_ceiling:.1f}%"]
                        + [f"{r.ratios[p]:.2f}x" if p in r.ratios else "" for p in peers])
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        fmt = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        lines = [f"== {self.title} =="]
        if self.ceilings:
            lines.append("ceilings (same process): " + ", ".join(f"{k} {v:,.1f}" for k, v in self.ceilings.items()))
        lines += [fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
        lines += self.notes
        return "\n".join(lines)

    def markdown(self) -> str:
        """The table as GitHub markdown (docs and README tables are generated from JSON with this)."""
        peers = sorted({p for r in self.rows for p in r.ratios})
        head = ["case", "impl", "time (us)", "rate", "% of ceiling"] + [f"vs {p}" for p in peers]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            cells = [r.case, r.impl, f"{r.time_us:,.1f}", f"{r.metric:,.1f} {r.unit}",
                     "" if r.pct_ceiling is None else f"{r.pct_ceiling:.1f}%"]
            cells += [f"{r.ratios[p]:.2f}x" if p in r.ratios else "" for p in peers]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Report":
        rec = json.loads(Path(path).read_text())
        rep = cls(rec["title"], rec.get("ceilings"))
        rep.notes = rec.get("notes", [])
        rep.rows = [Row(**r) for r in rec["rows"]]
        rep.environment = rec.get("environment", {})
        return rep

    def to_json(self, path: str | os.PathLike, env: dict | None = None, **extra) -> None:
        """env: the environment record (default: environment(), asked now); extra: more top-level keys
        (from_json ignores them)."""
        rec = {"title": self.title, "environment": environment() if env is None else env, "ceilings": self.ceilings,
               "notes": self.notes, "rows": [asdict(r) for r in self.rows], **extra}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rec, indent=1) + "\n")

    def plot(self, path: str | os.PathLike) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        cases = list(dict.fromkeys(r.case for r in self.rows))
        impls = list(dict.fromkeys(r.impl for r in self.rows))
        fig, ax = plt.subplots(figsize=(min(14, 3 + 1.3 * len(cases)), 4.5))
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs, ys = [], []
            for i, c in enumerate(cases):
                for r in self.rows:
                    if r.case == c and r.impl == impl:
                        xs.append(i + j * width)
                        ys.append(r.metric)
            ax.bar(xs, ys, width, label=impl)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels(cases, rotation=20, ha="right", fontsize=8)
        unit = self.rows[0].unit if self.rows else ""
        ax.set_ylabel(unit)
        for name, val in self.ceilings.items():
            if unit.split("/")[0] in name:
                ax.axhline(val, ls="--", c="gray", lw=1)
                ax.text(len(cases) - 0.5, val, name, va="bottom", ha="right", fontsize=8, color="gray")
        ax.set_title(self.title, fontsize=10)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
