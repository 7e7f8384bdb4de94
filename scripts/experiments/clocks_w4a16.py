"""SM clock and board power while a W4A16 plan (or cuBLAS) runs back to back: is a launch bound by
the board's power limit? Each callable runs for CLOCKS_SECONDS (L2 not flushed: the n 57344
weights are ~5x the L2, and the m = 4096 case is compute-bound) while `nvidia-smi` samples clocks
and power every 20 ms; the samples inside the second half of its window (clocks settled) are
averaged, and the median launch time of that half is reported.

Usage: python scripts/experiments/clocks_w4a16.py OUT.json   (env CLOCKS_SECONDS, default 2; CLOCKS_CASES, default
the large-weight cases below: "k:n:m:group:plan,..." with group 128 or -1)
"""
import json
import os
import subprocess
import sys
import time

import torch

from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.bench.timing import w4a16_workspace

SECONDS = float(os.environ.get("CLOCKS_SECONDS", "2"))
# (k, n, m, label): label a plan (ops.w4a16.parse_plan), "auto" or "cuBLAS".
CASES = [(8192, 57344, 64, "cuBLAS"), (8192, 57344, 64, "wg-m64n512c2s6/x1"),
         (8192, 57344, 64, "wg-m64n512c2s5-streamk"),
         (8192, 57344, 32, "cuBLAS"), (8192, 57344, 32, "auto"), (8192, 57344, 1, "auto"),
         (8192, 57344, 128, "cuBLAS"), (8192, 57344, 128, "auto"), (8192, 8192, 4096, "cuBLAS"),
         (8192, 8192, 4096, "auto")]
if os.environ.get("CLOCKS_CASES"):
    CASES = [tuple(int(v) for v in c.split(":")[:4]) + (c.split(":", 4)[4],)
             for c in os.environ["CLOCKS_CASES"].split(",")]
else:
    CASES = [(k, n, m, 128, label) for k, n, m, label in CASES]


def main():
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader,nounits", "-lms", "20"], stdout=subprocess.PIPE, text=True)
    windows, weights = [], {}
    for k, n, m, group, label in CASES:
        if (k, n, group) not in weights:
            q = quantize_rtn(torch.randn(n, k, device="cuda", dtype=torch.float16), group, True,
                             scale_dtype=torch.float16, clip_search=False)
            weights[(k, n, group)] = (ops.pack(q), q.dequantize(torch.float32).half())
        p, deq = weights[(k, n, group)]
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        if label == "cuBLAS":
            fn = lambda: torch.nn.functional.linear(x, deq)  # noqa: E731
        else:
            cfg, sl = (None, None) if label == "auto" else ops.parse_plan(label)
            fn = lambda: ops.matmul_impl(x, p, workspace=w4a16_workspace(x.device), cfg=cfg, slices=sl)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        times = []
        t0 = time.time()
        while time.time() - t0 < SECONDS:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / 20)
        t1 = time.time()
        windows.append((k, n, m, f"{label} g{group}", t0 + (t1 - t0) / 2, t1, sorted(times[len(times) // 2:])))
        time.sleep(0.3)
    time.sleep(0.2)
    smi.terminate()
    samples = []
    for line in smi.communicate()[0].splitlines():
        ts, clk, pw, temp = [v.strip() for v in line.split(",")]
        t = time.mktime(time.strptime(ts.split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + ts.split(".")[1])
        samples.append((t, float(clk), float(pw), float(temp)))
    out = []
    for k, n, m, label, a, b, times in windows:
        inside = [s for s in samples if a <= s[0] <= b]
        avg = [sum(s[i] for s in inside) / max(1, len(inside)) for i in (1, 2, 3)]
        us = times[len(times) // 2]
        out.append({"k": k, "n": n, "m": m, "plan": label, "us": us, "sm_mhz": avg[0], "watts": avg[1],
                    "temp_c": avg[2], "samples": len(inside)})
        print(f"k{k} n{n} m{m:5d} {label:22s} {us:8.1f} us  SM {avg[0]:6.0f} MHz  {avg[1]:5.0f} W  {avg[2]:3.0f} C  "
              f"({len(inside)} samples)", flush=True)
    json.dump(out, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
