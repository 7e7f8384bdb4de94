"""The held-out check of the W4A16 dispatch on a GPU's committed tune (no GPU needed): for every
weight of bench/results/<gpu>/tune_w4a16.json, the table without that weight decides (its neighbours'
configurations at m <= 16, the model or the rules elsewhere), and its plan's measured time is divided
by the best measured candidate of that case. Prints, per m, the geomean and the WORST case with its
weight and plan, beside the model alone (no table); cases whose plan was not among the measured
candidates are counted as missing (no figure), never as good.
    python scripts/heldout_w4a16.py [bench/results/h100/tune_w4a16.json] [--sm-count 132]
"""
import argparse
import json
import math

import torch

from tilefish.bench.tune import resolved_plan
from tilefish.ops.w4a16 import H200_CLUSTERS, dispatch
from tilefish.ops.w4a16.tuned import TunedTable


def loss(plan, e, sm_count):
    g = 128 if e["scales"] == "grouped" else -1
    t = e["candidates"].get(resolved_plan(plan, e["m"], e["n"], e["k"], sm_count, H200_CLUSTERS, g).label())
    return None if t is None else t / min(e["candidates"].values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tune", nargs="?", default="bench/results/h100/tune_w4a16.json")
    ap.add_argument("--sm-count", type=int, default=132)
    a = ap.parse_args()
    doc = json.load(open(a.tune))
    entries = doc["entries"]
    print(f"{'m':>5} {'cases':>5} {'missing':>7} {'table geomean':>13} {'table worst':>11}  {'worst case':<58} "
          f"{'model geomean':>13} {'model worst':>11}")
    for m in sorted({e["m"] for e in entries}):
        rows, model, missing = [], [], 0
        for k, n in sorted({(e["k"], e["n"]) for e in entries}):
            table = TunedTable([dict(doc, entries=[e for e in entries if (e["k"], e["n"]) != (k, n)])])
            for e in (e for e in entries if e["m"] == m and (e["k"], e["n"]) == (k, n)):
                dt = torch.float16 if e["dtype"] == "fp16" else torch.bfloat16
                args = (m, n, k, a.sm_count, 90, 128 if e["scales"] == "grouped" else -1, H200_CLUSTERS, dt, "int4")
                plan = dispatch.choose_plan(*args, table)
                t, b = loss(plan, e, a.sm_count), loss(dispatch.choose_plan(*args), e, a.sm_count)
                if t is None or b is None:
                    missing += 1
                    continue
                rows.append((t, f"{e['dtype']} {e['scales']} k{k} n{n} {plan.label()}"))
                model.append(b)
        geo = math.exp(sum(math.log(r[0]) for r in rows) / len(rows))
        worst = max(rows)
        print(f"{m:5d} {len(rows):5d} {missing:7d} {geo:13.3f} {worst[0]:11.2f}  {worst[1]:<58} "
              f"{math.exp(sum(map(math.log, model)) / len(model)):13.3f} {max(model):11.2f}")


if __name__ == "__main__":
    main()
