"""Host time per eager call of the MoE expert op (what a user running eager PyTorch pays per layer), beside
F.linear's on one of the layer's projections and transformers' bf16 experts module (grouped_mm), interleaved
(bench.timing.host_overhead_paired_us), at one token: the converted module (QuantizedExperts, which keeps its
decode launches per call signature), the functional op and the launcher on each path.

    python scripts/experiments/moe_host.py --models qwen3-30b-a3b,gpt-oss-20b
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tilefish.bench import moe as bm
from tilefish.bench.moe_shapes import parse_models
from tilefish.bench.timing import host_overhead_paired_us
from tilefish.experts import QuantizedExperts
from tilefish.moe import moe_experts
from tilefish.ops.moe_kernels import grouped_experts_cuda
from tilefish.ops.w4a16.workspace import new_counters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b")
    a = p.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name())
    for model in parse_models(a.models):
        module = bm.dense_experts(model, dev)
        gu, dn, gb, db, act = bm.quantized_weights(module, model, "int4")
        ids, w = bm.routing(model, 1, dev)
        x = torch.randn(1, model.hidden, device=dev, dtype=torch.bfloat16)
        weight = torch.randn(2 * model.inter, model.hidden, device=dev, dtype=torch.bfloat16)
        counters = new_counters(dev)
        layer = QuantizedExperts(gu, dn, act, gb, db)
        grouped = bm.with_implementation(module, model, "grouped_mm")
        fns = {"F.linear (one gate_up weight)": lambda: F.linear(x, weight),
               "QuantizedExperts (eager module)": lambda: layer(x, ids, w),
               "tilefish.moe.moe_experts (auto: decode)": lambda: moe_experts(x, ids, w, gu, dn, act, gb, db),
               "grouped_experts_cuda decode": lambda: grouped_experts_cuda(x, ids, w, gu, dn, act, gb, db, counters,
                                                                            "decode"),
               "grouped_experts_cuda grouped": lambda: grouped_experts_cuda(x, ids, w, gu, dn, act, gb, db, counters,
                                                                             "grouped")}
        if grouped is not None:
            fns["transformers grouped_mm experts (bf16)"] = lambda: grouped(x, ids, w.to(x.dtype))
        for name, fn in list(fns.items()):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a peer whose forward takes other arguments is left out
                print(f"{model.name}: {name} left out ({type(e).__name__}: {e})")
                del fns[name]
        torch.cuda.synchronize()
        us = host_overhead_paired_us(fns, calls=500, rounds=5)
        base = us["F.linear (one gate_up weight)"]
        for name, v in us.items():
            print(f"{model.name:16s} {name:42s} {v:7.1f} us host a call ({v / base:.2f}x F.linear)")


if __name__ == "__main__":
    main()
