"""Same-process A/B of W4A16 kernel builds: the dispatcher's plan for each case (skinny, wgmma or
mma.sync kernel), launched with each build of its kernel in turn and cuBLAS, timed in alternating
rounds. For source changes whose gain is a few percent, below the run-to-run spread of two benches.

Usage: python scripts/experiments/ab_w4a16_builds.py OUT.json [fp16,bf16] [128,-1] [1,4,8,16]
Env SHAPES=KxN,... limits the shapes (default: the eight benchmark shapes); VARIANTS=name:HOW,...
names the builds (default "head:@head,shipped:"; the first is the reference of the printed ratios).
The fence A/B this script was first written for (-D TF_W4A16_SC_FENCES: a fence.sc around the split-tile
hand-offs) was removed from the kernels once decided (docs/w4a16.md has the result); to rerun it, check out a
commit that still has the define. HOW is defines (NAME or NAME=VALUE) joined by "+" (empty: the shipped build), or "@head": the kernel's
source as kernels/w4a16/_<name>_head.cu (an earlier revision put there by hand, e.g.
`git show REV:src/tilefish/kernels/w4a16/skinny.cu > src/tilefish/kernels/w4a16/_skinny_head.cu`;
not committed). Every build's output is checked against fp32 and compared bitwise with the first's.
"""
import dataclasses
import json
import os
import sys

import torch

from tilefish.bench.timing import time_alternating_us
from tilefish.ops import w4a16 as ops
from tilefish.ops.w4a16 import launch
from tilefish.quant.int4 import quantize_rtn
from tilefish.runtime import get_kernel
from tilefish.bench.timing import w4a16_workspace

from ab_w4a16_plans import SHAPES  # noqa: E402 (this script's own directory; env SHAPES applied there)
VARIANTS = [(v.partition(":")[0], v.partition(":")[2])
            for v in os.environ.get("VARIANTS", "head:@head,shipped:").split(",")]


def variant_spec(spec, how):
    if how == "@head":
        folder, name = os.path.split(spec.source)
        return dataclasses.replace(spec, source=os.path.join(folder, "_" + name.replace(".cu", "_head.cu")))
    return dataclasses.replace(spec, defines=spec.defines + tuple((d.partition("=")[0], d.partition("=")[2] or "1")
                                                                  for d in how.split("+") if d))


def main():
    out_path = sys.argv[1]
    dtypes = (sys.argv[2] if len(sys.argv) > 2 else "fp16,bf16").split(",")
    groups = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "128,-1").split(",")]
    ms = [int(v) for v in (sys.argv[4] if len(sys.argv) > 4 else "1,4,8,16").split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dev = torch.cuda.current_device()
    ref_name = VARIANTS[0][0]
    results = []
    for dname in dtypes:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
        for group in groups:
            for k, n in SHAPES:
                q = quantize_rtn(torch.randn(n, k, device="cuda", dtype=dt), group, True, scale_dtype=dt, clip_search=False)
                p = ops.pack(q)
                deq = q.dequantize(torch.float32).to(dt)
                for m in ms:
                    cfg = ops.choose_config(m, n, k, sms, 90, group, dtype=dt)
                    key = (dt, cfg, group, False, dev, "int4")  # launch._kernel's cache key
                    spec = ops.kernel_spec(dt, cfg, group, False)
                    kerns = {name: get_kernel(variant_spec(spec, how), dev) for name, how in VARIANTS}
                    x = torch.randn(m, k, device="cuda", dtype=dt)

                    def run(kern):
                        launch._kernels[key] = kern  # the launch path looks its kernel up here
                        cached = len(launch._kernels)
                        out = ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device))
                        assert len(launch._kernels) == cached, "the launch took another kernel than the override"
                        return out

                    ref = torch.nn.functional.linear(x.float(), deq.float())
                    outs = {name: run(kern).float() for name, kern in kerns.items()}
                    err = {name: ((o - ref).norm() / ref.norm()).item() for name, o in outs.items()}
                    same = all(torch.equal(o, outs[ref_name]) for o in outs.values())
                    fns = {"cuBLAS": lambda: torch.nn.functional.linear(x, deq)}
                    fns.update({name: (lambda kern=kern: run(kern)) for name, kern in kerns.items()})
                    us = time_alternating_us(fns, rounds=4, per_round=6)
                    launch._kernels.pop(key, None)
                    results.append({"k": k, "n": n, "m": m, "dtype": dname, "group": group, "config": cfg.label(),
                                    "us": us, "err": err, "bitwise_same": same})
                    print(f"{dname} g{group} k{k} n{n} m{m} {cfg.label()}: "
                          + " ".join(f"{name} {us[name]:.1f}" + ("" if name == ref_name else f" ({us[name] / us[ref_name]:.3f})")
                                     for name, _ in VARIANTS)
                          + f" cuBLAS {us['cuBLAS']:.1f} err {max(err.values()):.1e} same {same}", flush=True)
                json.dump(results, open(out_path, "w"), indent=1)
    for dname in dtypes:
        for m in ms:
            r = [v for v in results if v["dtype"] == dname and v["m"] == m]
            for name, _ in VARIANTS[1:] if r else ():
                g = torch.tensor([v["us"][name] / v["us"][ref_name] for v in r]).log().mean().exp().item()
                print(f"{dname} m{m}: {name} / {ref_name} geomean {g:.3f} over {len(r)} cases")


if __name__ == "__main__":
    main()
