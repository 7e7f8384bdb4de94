"""Regenerate every measured table in README.md and docs/*.md from bench/results JSON.

A table lives between `<!-- table: PATH [rows="IMPL,..."] -->` and `<!-- end table -->`; everything
between the markers is replaced by the markdown that `tilefish table PATH` prints. With
`view="targets"` instead (W4A16), it is the per-m summary against issue 3's targets that
`tilefish bench w4a16` prints after its table; `view="nf4-targets"`, the NF4 matmul's summary
that `tilefish bench nf4` prints. Tables are never typed by hand.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from tilefish.bench.report import Report  # noqa: E402

MARK = re.compile(r'(<!-- table: (\S+)(?: (rows|view)="([^"]+)")? -->\n)(.*?)(<!-- end table -->)', re.S)


def render(path: str, attr: str | None, value: str | None) -> str:
    rep = Report.from_json(ROOT / path)
    rows = value if attr == "rows" else None
    if attr == "view":
        if value not in ("targets", "nf4-targets"):
            raise ValueError(f"{path}: unknown view {value!r} (known: targets, nf4-targets)")
        if value == "targets":
            from tilefish.bench.w4a16 import target_summary
            what = "cuBLAS time / tilefish time"
        else:
            from tilefish.bench.nf4 import target_summary
            what = "peer time / tilefish NF4 time"

        env = getattr(rep, "environment", {})
        return (f"*Ratio = {what}* — {env.get('gpu', '?')}, tilefish commit "
                f"{str(env.get('commit', '?'))[:12]}, {str(env.get('date', '?'))[:10]}\n\n"
                f"{target_summary(rep.rows)}\n")
    if rows:
        keep = rows.split(",")
        rep.rows = [r for r in rep.rows if r.impl in keep]
    env = getattr(rep, "environment", {})
    head = (f"*{rep.title}* — {env.get('gpu', '?')}, tilefish commit {str(env.get('commit', '?'))[:12]}, "
            f"{str(env.get('date', '?'))[:10]}"
            + ("; ceilings measured in the same process: " + ", ".join(f"{k} {v:,.0f}" for k, v in rep.ceilings.items())
               if rep.ceilings else ""))
    notes = "".join(f"\n{n}\n" for n in rep.notes)
    return f"{head}\n\n{rep.markdown()}\n{notes}"


def main() -> int:
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        new = MARK.sub(lambda m: m.group(1) + render(m.group(2), m.group(3), m.group(4)) + m.group(6), text)
        if new != text:
            doc.write_text(new)
            print(f"updated {doc.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
