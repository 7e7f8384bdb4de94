"""Same-process A/B of the NF4 matmul against the same W4A16 plan with int4 codes: what the table
lookup costs, per kernel family and m. Also cuBLAS (dense weight) and bitsandbytes' matmul_4bit on
the same NF4 weight when importable. Alternating rounds (bench.timing.time_alternating_us).

Usage: python scripts/experiments/ab_nf4_codebook.py OUT.json [bf16,fp16] [1,4,16,64,256,1024,4096]
Env SHAPES=KxN,... (default: the Llama-3 8B / 70B shapes); BLOCKSIZE (default 64, double quant).
"""
import json
import os
import sys

import torch

from tilefish import nf4
from tilefish.bench.timing import time_alternating_us
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.reference import nf4_dequantize_fp32_chain

DEFAULT_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192),
                  (8192, 57344), (28672, 8192)]
SHAPES = ([tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(",")] if os.environ.get("SHAPES")
          else DEFAULT_SHAPES)


def _bnb_matmul():
    try:
        import bitsandbytes as bnb
    except Exception:  # noqa: BLE001 - optional peer
        return None
    return bnb.matmul_4bit


def main():
    out_path = sys.argv[1]
    dtypes = (sys.argv[2] if len(sys.argv) > 2 else "bf16").split(",")
    ms = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "1,4,16,64,256,1024,4096").split(",")]
    blocksize = int(os.environ.get("BLOCKSIZE", "64"))
    group = min(blocksize, 128)
    bnb_matmul = _bnb_matmul()
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    print(f"{props.name}, {props.multi_processor_count} SMs; bitsandbytes {'yes' if bnb_matmul else 'no'}", flush=True)
    results = []
    for dname in dtypes:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dname]
        for k, n in SHAPES:
            w = torch.randn(n, k, device="cuda", dtype=dt) * 0.02
            q = nf4.quantize(w, blocksize=blocksize, double_quant=True)
            p = nf4.prepare(q, dt)
            i4 = ops.pack(quantize_rtn(w, group, True, scale_dtype=dt, clip_search=False))
            dense = nf4_dequantize_fp32_chain(q, dt)
            del w
            packed, state = nf4.to_bnb(q) if bnb_matmul else (None, None)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=dt)
                plan_nf4 = ops.LaunchPlan.build(p.kernel, None, m, x.device)
                plan_i4 = ops.LaunchPlan.build(i4, None, m, x.device)
                cfg = ops.choose_config(m, n, k, props.multi_processor_count, props.major * 10 + props.minor, group,
                                        dtype=dt, codebook="nf4")
                out = torch.empty(m, n, device="cuda", dtype=dt)
                fns = {
                    "nf4": lambda: plan_nf4.launch(x.data_ptr(), out.data_ptr()),
                    "int4": lambda: plan_i4.launch(x.data_ptr(), out.data_ptr()),
                    "cuBLAS": lambda: torch.nn.functional.linear(x, dense),
                }
                if bnb_matmul:
                    fns["bnb"] = lambda: bnb_matmul(x, packed.t(), quant_state=state)
                ref = torch.nn.functional.linear(x.float(), dense.float())
                y = nf4.matmul(x, p).float()
                err = ((y - ref).norm() / ref.norm()).item()
                us = time_alternating_us(fns, rounds=4, per_round=6)
                row = {"k": k, "n": n, "m": m, "dtype": dname, "blocksize": blocksize, "config": cfg.label(),
                       "us": us, "err": err}
                results.append(row)
                print(f"{dname} k{k} n{n} m{m} {cfg.label()}: nf4 {us['nf4']:.1f} int4 {us['int4']:.1f} "
                      f"(nf4/int4 {us['nf4'] / us['int4']:.3f}) cuBLAS {us['cuBLAS']:.1f} "
                      f"(x{us['cuBLAS'] / us['nf4']:.2f})"
                      + (f" bnb {us['bnb']:.1f} (x{us['bnb'] / us['nf4']:.2f})" if "bnb" in us else "")
                      + f" err {err:.1e}", flush=True)
            del q, p, i4, dense, packed, state
            json.dump(results, open(out_path, "w"), indent=1)
    print("\nmedian over shapes: m, nf4/int4, cuBLAS/nf4, bnb/nf4 (min)")
    for dname in dtypes:
        for m in ms:
            r = [v for v in results if v["dtype"] == dname and v["m"] == m]
            if not r:
                continue
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            a = med([v["us"]["nf4"] / v["us"]["int4"] for v in r])
            c = med([v["us"]["cuBLAS"] / v["us"]["nf4"] for v in r])
            b = min([v["us"]["bnb"] / v["us"]["nf4"] for v in r]) if "bnb" in r[0]["us"] else float("nan")
            print(f"{dname} m{m:5d}: nf4/int4 {a:.3f}  vs cuBLAS {c:.2f}x  vs bnb (min) {b:.2f}x")


if __name__ == "__main__":
    main()
