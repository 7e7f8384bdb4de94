"""The next GEMM's weights streamed into L2 by the GEMM before it (ops/w4a16/prefetch.py), measured on a
Llama-3-8B-shaped decode step: per layer an RMSNorm, the fused qkv GEMM, rotary-like element-wise work,
SDPA over a 512-position KV cache, o, the residual, a second RMSNorm, gate_up, SiLU-mul, down, the
residual, written as plain torch ops around tilefish.ops.w4a16.matmul_impl. Each variant is one CUDA graph
of the whole step (L2 flushed before each replay, alternating rounds); outputs compared bitwise.

Variants: `off` (no prefetch), `on` (each GEMM prefetches the next one's scales and packed weights up to
PREFETCH_L2_SHARE of L2), `share=X` (another cap), and `gemms` / `gemms+pf` (the four GEMMs a layer with
nothing between them). Random packed weights (timing only).

    python scripts/experiments/w4a16_prefetch_chain.py [--layers 4] [--m 1] [--shares 0.25,0.5,0.75] [--out f.json]
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from tilefish.bench.ceilings import copy_bandwidth_gbps
from tilefish.bench.timing import time_alternating_us
from tilefish.ops.w4a16 import W4A16Weight, layer_counters, make_layer_counters, matmul_impl
from tilefish.ops.w4a16 import prefetch as pfm

H, I, NQ, NKV, D, CTX = 4096, 14336, 32, 8, 128, 512


def random_weight(n: int, k: int, dev, g: torch.Generator) -> W4A16Weight:
    packed = torch.randint(-2**31, 2**31 - 1, (n // 64, 8 * k), dtype=torch.int32, device=dev, generator=g)
    scales = (torch.rand(k // 128, n, device=dev, generator=g) * 2e-3 + 1e-3).half()
    return W4A16Weight(packed, scales, None, 128, n, k, None, "int4")


def weight_bytes(w: W4A16Weight) -> int:
    return w.packed.numel() * 4 + w.scales.numel() * 2


def rmsnorm(h, gamma):
    v = h.float().pow(2).mean(-1, keepdim=True)
    return (h.float() * torch.rsqrt(v + 1e-5)).half() * gamma


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--shares", default="0.25,0.75")
    p.add_argument("--out")
    a = p.parse_args()
    dev = torch.device("cuda")
    make_layer_counters(dev)
    counters = layer_counters(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    layers = [dict(qkv=random_weight(H + 2 * NKV * D, H, dev, g), o=random_weight(H, H, dev, g),
                   gu=random_weight(2 * I, H, dev, g), down=random_weight(H, I, dev, g),
                   g1=torch.rand(H, device=dev, generator=g).half() + 0.5,
                   g2=torch.rand(H, device=dev, generator=g).half() + 0.5,
                   kc=torch.randn(a.m, NQ, CTX, D, device=dev, generator=g).half(),
                   vc=torch.randn(a.m, NQ, CTX, D, device=dev, generator=g).half()) for _ in range(a.layers)]
    order = [(i, name) for i in range(a.layers) for name in ("qkv", "o", "gu", "down")]
    nxt = {order[j]: layers[order[j + 1][0]][order[j + 1][1]] for j in range(len(order) - 1)}
    cos = torch.rand(D, device=dev, generator=g).half()
    sin = torch.rand(D, device=dev, generator=g).half()
    x0 = torch.randn(a.m, H, device=dev, generator=g).half()

    def mm(x, i, name, pf):
        return matmul_impl(x, layers[i][name], workspace=counters, prefetch=nxt.get((i, name)) if pf else None)

    def step(pf: bool, spacers: bool = True):
        h = x0
        for i, L in enumerate(layers):
            if not spacers:
                y = mm(h, i, "qkv", pf)
                y = mm(y[:, :H].contiguous(), i, "o", pf)
                y = mm(y, i, "gu", pf)
                h = mm(y[:, :I].contiguous(), i, "down", pf)
                continue
            qkv = mm(rmsnorm(h, L["g1"]), i, "qkv", pf)
            q = qkv[:, :H].view(a.m, NQ, 1, D)
            q = q * cos + torch.roll(q, 1, -1) * sin
            attn = F.scaled_dot_product_attention(q, L["kc"], L["vc"]).reshape(a.m, H)
            h = h + mm(attn, i, "o", pf)
            gu = mm(rmsnorm(h, L["g2"]), i, "gu", pf)
            h = h + mm(F.silu(gu[:, :I]) * gu[:, I:], i, "down", pf)
        return h

    def graph(fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            out = fn()
        return gr, out

    copy = copy_bandwidth_gbps()
    layer_bytes = sum(weight_bytes(layers[0][n]) for n in ("qkv", "o", "gu", "down"))
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s, L2 {torch.cuda.get_device_properties(0).L2_cache_size >> 20} MB; "
          f"m = {a.m}, {a.layers} layers, {layer_bytes / 1e6:.1f} MB of weights a layer = "
          f"{layer_bytes / copy / 1e3:.1f} us at copy rate")
    graphs, outs = {}, {}
    default_share = pfm.PREFETCH_L2_SHARE
    variants = [("off", False, True, default_share), ("on", True, True, default_share)]
    variants += [(f"share={s}", True, True, float(s)) for s in a.shares.split(",") if s]
    variants += [("gemms", False, False, default_share), ("gemms+pf", True, False, default_share)]
    for name, pf, spacers, share in variants:
        pfm.PREFETCH_L2_SHARE = share
        pfm._caps.clear()
        graphs[name], outs[name] = graph(lambda: step(pf, spacers))
    pfm.PREFETCH_L2_SHARE = default_share
    pfm._caps.clear()
    times = time_alternating_us({n: gr.replay for n, gr in graphs.items()}, rounds=6, per_round=10)
    rows = []
    for name, pf, spacers, share in variants:
        base = "off" if spacers else "gemms"
        same = torch.equal(outs[name], outs[base])
        per_layer = times[name] / a.layers
        r = dict(variant=name, share=share, us=times[name], us_per_layer=per_layer,
                 pct_copy=100 * layer_bytes / (per_layer * 1e3) / copy, speedup=times[base] / times[name],
                 bitwise_equal=same)
        rows.append(r)
        print(f"{name:12s} {times[name]:9.1f} us  {per_layer:7.1f} us a layer  {r['pct_copy']:5.1f}% of copy over the "
              f"weights  x{r['speedup']:.3f} vs {base}  {'bitwise equal' if same else 'DIFFERENT'}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), copy_gbps=copy, m=a.m, layers=a.layers,
                           layer_bytes=layer_bytes, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
