"""Issue 39's targets over bench w4a16 reports (held-out runs): per m, the worst and geomean time
against the original Marlin (Marlin runs fp16 only) and the worst speed against cuBLAS, with the case.
    python scripts/heldout_targets.py bench/results/h100/heldout_half_*.json
"""
import json
import math
import sys
from collections import defaultdict


def main(paths):
    rows = [r for p in paths for r in json.load(open(p))["rows"] if r["impl"] == "tilefish"]
    by_m = defaultdict(list)
    for r in rows:
        by_m[r["extra"]["m"]].append(r)
    print("| m | cases | time / Marlin: worst (case) | geomean | x cuBLAS: worst (case) | geomean |")
    print("|---|---|---|---|---|---|")
    for m in sorted(by_m):
        rs = by_m[m]
        mar = [(1 / r["ratios"]["Marlin"], r["case"]) for r in rs if r["ratios"].get("Marlin")]
        cub = [(r["ratios"]["cuBLAS"], r["case"]) for r in rs if r["ratios"].get("cuBLAS")]
        geo = lambda v: math.exp(sum(math.log(x) for x, _ in v) / len(v))
        worst_mar = max(mar) if mar else (float("nan"), "")
        print(f"| {m} | {len(rs)} | {worst_mar[0]:.2f} ({worst_mar[1]}) | {geo(mar):.2f} | "
              f"{min(cub)[0]:.2f}x ({min(cub)[1]}) | {geo(cub):.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1:])
