"""The held-out checks of the W4A16 dispatch on a GPU's committed tune (no GPU needed). Two protocols:

  halves  (default) the model list (bench/shapes.py MODELS, in its order) split in two halves, every
          other model: the table holds one half's weights only and decides the other half's (weights
          both halves have are in neither evaluation), both ways round.
  weight  leave one weight out: the table without that weight decides it, for every weight.

A decided plan's measured time (bench/results/<gpu>/tune_w4a16.json holds every candidate's) is divided
by the best measured candidate of that case. Prints, per m, the geomean and the WORST case with its
weight and plan, beside the model alone (no table); a plan that was never measured is counted as missing
(no figure), never as good.

    python scripts/heldout_w4a16.py [TUNE.json] [--protocol halves|weight] [--sm-count 132]
    python scripts/heldout_w4a16.py --half b --shapes          # the weights half b holds out: KxN,KxN,...
    python scripts/heldout_w4a16.py --half b --table OUT.json  # the shipped table without them: a device run
        TILEFISH_TUNED=OUT.json tilefish bench w4a16 --shapes <those> --peers marlin   (held-out half b)
"""
import argparse
import json
import math

import torch

from tilefish.bench.shapes import MODELS
from tilefish.bench.tune import resolved_plan
from tilefish.ops.w4a16 import H200_CLUSTERS, dispatch
from tilefish.ops.w4a16.tuned import TunedTable, package_table_path

HALVES = {"a": list(MODELS)[0::2], "b": list(MODELS)[1::2]}


def weights_of(models) -> set:
    return {(k, n) for name in models for _, k, n in MODELS[name].linears()}


def held_out(half: str) -> set:
    """The weights of `half`'s models that the other half's models do not have."""
    other = "b" if half == "a" else "a"
    return weights_of(HALVES[half]) - weights_of(HALVES[other])


def loss(plan, e, sm_count):
    g = 128 if e["scales"] == "grouped" else -1
    t = e["candidates"].get(resolved_plan(plan, e["m"], e["n"], e["k"], sm_count, H200_CLUSTERS, g).label())
    return None if t is None else t / min(e["candidates"].values())


def evaluations(entries, protocol):
    """(the weights evaluated, the table entries they are decided with), one pair per held-out set."""
    shapes = sorted({(e["k"], e["n"]) for e in entries})
    if protocol == "weight":
        return [({kn}, [e for e in entries if (e["k"], e["n"]) != kn]) for kn in shapes]
    out = []
    for half in HALVES:
        out_half = held_out(half)
        out.append((out_half, [e for e in entries if (e["k"], e["n"]) not in weights_of(HALVES[half])]))
    return out


def report(doc, protocol, sm_count):
    """{m: (cases, missing, table geomean, (table worst, case), model geomean, model worst)}."""
    entries = doc["entries"]
    sets = [(held, TunedTable([dict(doc, entries=kept)])) for held, kept in evaluations(entries, protocol)]
    out = {}
    for m in sorted({e["m"] for e in entries}):
        rows, model, missing = [], [], 0
        for held, table in sets:
            for e in (e for e in entries if e["m"] == m and (e["k"], e["n"]) in held):
                dt = torch.float16 if e["dtype"] == "fp16" else torch.bfloat16
                args = (m, e["n"], e["k"], sm_count, 90, 128 if e["scales"] == "grouped" else -1, H200_CLUSTERS, dt,
                        "int4")
                plan = dispatch.choose_plan(*args, table)
                t, b = loss(plan, e, sm_count), loss(dispatch.choose_plan(*args), e, sm_count)
                if t is None or b is None:
                    missing += 1
                    continue
                rows.append((t, f"{e['dtype']} {e['scales']} k{e['k']} n{e['n']} {plan.label()}"))
                model.append(b)
        if rows:
            geo = math.exp(sum(math.log(r[0]) for r in rows) / len(rows))
            out[m] = (len(rows), missing, geo, max(rows), math.exp(sum(map(math.log, model)) / len(model)), max(model))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tune", nargs="?", default="bench/results/h100/tune_w4a16.json")
    ap.add_argument("--protocol", choices=("halves", "weight"), default="halves")
    ap.add_argument("--sm-count", type=int, default=132)
    ap.add_argument("--half", choices=tuple(HALVES), help="with --shapes / --table: the half held out")
    ap.add_argument("--shapes", action="store_true", help="print the weights --half holds out (KxN,...)")
    ap.add_argument("--table", help="write the shipped table of the tune's GPU without --half's weights here")
    a = ap.parse_args()
    doc = json.load(open(a.tune))
    if a.shapes or a.table:
        if a.half is None:
            ap.error("--shapes / --table need --half")
        held = held_out(a.half)
        if a.shapes:
            print(",".join(f"{k}x{n}" for k, n in sorted(held)))
        if a.table:
            shipped = json.loads(package_table_path(doc["key"]).read_text())
            mine = weights_of(HALVES[a.half])
            kept = [e for e in shipped["entries"] if (e["k"], e["n"]) not in mine]
            json.dump(dict(shipped, entries=kept, source=f"{shipped['source']}; without the weights of "
                           f"{','.join(HALVES[a.half])} (scripts/heldout_w4a16.py --half {a.half})"),
                      open(a.table, "w"), indent=1)
        return
    if a.protocol == "halves":
        for half, models in HALVES.items():
            print(f"half {half}: {','.join(models)} ({len(held_out(half))} weights held out)")
    print(f"{'m':>5} {'cases':>5} {'missing':>7} {'table geomean':>13} {'table worst':>11}  {'worst case':<58} "
          f"{'model geomean':>13} {'model worst':>11}")
    for m, (cases, missing, geo, worst, mgeo, mworst) in report(doc, a.protocol, a.sm_count).items():
        print(f"{m:5d} {cases:5d} {missing:7d} {geo:13.3f} {worst[0]:11.2f}  {worst[1]:<58} {mgeo:13.3f} {mworst:11.2f}")


if __name__ == "__main__":
    main()
