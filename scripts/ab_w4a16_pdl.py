"""A/B: W4A16 kernels with and without programmatic dependent launch (ops.w4a16.PDL), inside a CUDA
graph of one Llama-3-8B-shaped decoder layer's GEMMs (fused qkv, o, fused gate_up, down), each
preceded by a small elementwise torch kernel as in a model (norm, rope, activation). Same process,
alternating rounds; prints us per layer for each, and the GEMMs alone at copy bandwidth.

Usage (device): python scripts/ab_w4a16_pdl.py [m ...]   (default 1 4 16)
"""
import statistics
import sys

import torch

from tilefish import w4a16
from tilefish.bench.ceilings import copy_bandwidth_gbps
from tilefish.bench.timing import time_cuda
from tilefish.ops import w4a16 as ops

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (k, n): qkv, o, gate_up, down


def layer_graph(weights, x):
    bufs = {}

    def step():
        h = x * 1.0001                                      # a norm-like elementwise kernel
        q = w4a16.matmul(h, weights[0])
        h = q[:, :4096] * 0.5                               # rope / attention stand-in
        h = w4a16.matmul(h.contiguous(), weights[1]) + x
        g = w4a16.matmul(h, weights[2])
        a = torch.nn.functional.silu(g[:, :14336]) * g[:, 14336:]
        bufs["out"] = w4a16.matmul(a, weights[3]) + h

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g, bufs


def time_graph_us(g, reps=200):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(20):
        g.replay()
    for i in range(reps):
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def main():
    ms = [int(v) for v in sys.argv[1:]] or [1, 4, 16]
    dtype = torch.float16
    print(f"GPU: {torch.cuda.get_device_name()}")
    weights = [w4a16.quantize(torch.randn(n, k, device="cuda", dtype=dtype), 128, clip_search=False)
               for k, n in SHAPES]
    wbytes = sum(w.packed.numel() * 4 + w.scales.numel() * 2 for w in weights)
    copy = copy_bandwidth_gbps()
    print(f"weights {wbytes / 1e6:.1f} MB a layer; at copy bandwidth ({copy:,.0f} GB/s) {wbytes / copy / 1e3:.1f} us")
    for m in ms:
        graphs = {}
        x = torch.randn(m, 4096, device="cuda", dtype=dtype)
        for pdl in (False, True, "again"):
            ops.PDL = bool(pdl)
            graphs[pdl] = layer_graph(weights, x)
        for g, _ in graphs.values():
            g.replay()
        torch.cuda.synchronize()
        outs = {pdl: bufs["out"] for pdl, (_, bufs) in graphs.items()}
        # Bitwise: the same kernels in the same order; PDL changes only when a kernel may start.
        for name, other in (("PDL", True), ("a second graph without PDL", "again")):
            if not torch.equal(outs[False], outs[other]):
                diff = (outs[False].float() - outs[other].float()).abs().max().item()
                print(f"m={m}: {name} changed the result (max abs difference {diff:.3g})")
        for (k, n), w in zip(SHAPES, weights):  # each op alone, eager, with and without PDL
            xs = torch.randn(m, k, device="cuda", dtype=dtype)
            ys = []
            for pdl in (False, True):
                ops.PDL = pdl
                ys.append(ops.matmul_impl(xs * 1.0, w))
            if not torch.equal(*ys):
                print(f"m={m}: k{k} n{n} eager result differs with PDL")
        samples = {False: [], True: []}
        for r in range(6):
            for pdl in ((False, True) if r % 2 == 0 else (True, False)):
                samples[pdl].append(time_graph_us(graphs[pdl][0]))
        off, on = statistics.median(samples[False]), statistics.median(samples[True])
        print(f"m={m:3d}: layer graph {off:7.1f} us without PDL, {on:7.1f} us with ({on / off:.3f}x)")
        for (k, n), w in zip(SHAPES, weights):
            xs = torch.randn(m, k, device="cuda", dtype=dtype)
            alone = time_cuda(lambda: ops.matmul_impl(xs, w), reps=100).median_us
            print(f"        k{k} n{n} alone (L2 flushed): {alone:6.1f} us; its bytes at copy bandwidth "
                  f"{(w.packed.numel() * 4 + w.scales.numel() * 2) / copy / 1e3:5.1f} us")
    ops.PDL = True


if __name__ == "__main__":
    main()
