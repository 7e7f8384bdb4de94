"""Where a rope_attention launch's time goes (kernels/attention/rope_attention.cu built with -D TF_TIMELINE):
per-CTA %globaltimer stamps at entry, after grid_dependency_wait, q ready, the first two tiles landed and done, the
tile loop's end, the warps' merge,
the split combine's arrival (or the cluster barrier) and the output written, in a CUDA graph replay of the chain
a decode layer runs: the q/k/v GEMM (W4A16, programmatic launch) -> rope_attention -> the o GEMM. Stamps are
relative to the first CTA's entry; the rows give the median and the latest CTA.

    python scripts/experiments/timeline_rope_attention.py [batch] [slots]   (CLUSTER=0: the combine through L2
    with the plan of no split limit, as before the cluster combine; TIMELINE_DEFINES: a comma list of experiment
    switches the kernel is built with too)
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch

import tilefish
from tilefish.bench import e2e
from tilefish.ops import rope_attention as ra
from tilefish.ops.w4a16 import layer_counters, make_layer_counters
from tilefish.runtime import f32, get_kernel, i32, i64, launch_prepared, prepare_launch

# stamp index -> name (7 is the SM id); 8-11: the first two tiles' data landed and products done, which tell the
# first pass through the loop's code from the second
STAMPS = {0: "entry", 1: "waited", 2: "q ready", 8: "tile 0 in", 10: "tile 0 done", 9: "tile 1 in", 11: "tile 1 done",
          3: "loop done", 4: "merged", 5: "arrived", 6: "written"}


def main():
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    slots = int(sys.argv[2]) if len(sys.argv) > 2 else 576
    heads, kv_heads, d, dt = 32, 8, 128, torch.float16
    dev = torch.device("cuda", 0)
    make_layer_counters(dev)
    torch.manual_seed(0)
    qkv_proj = tilefish.nn.W4A16Linear.from_linear(torch.nn.Linear(4096, (heads + 2 * kv_heads) * d, bias=False).half()).to(dev)
    o_proj = tilefish.nn.W4A16Linear.from_linear(torch.nn.Linear(heads * d, 4096, bias=False).half()).to(dev)
    x = torch.randn(batch, 1, 4096, dtype=dt, device=dev)
    keys = torch.randn(batch, kv_heads, slots, d, dtype=dt, device=dev)
    values = torch.randn_like(keys)
    length = torch.tensor([slots - 64], dtype=torch.int64, device=dev)
    ang = torch.rand(1, 1, d, device=dev) * 6
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    mask = (torch.arange(slots, device=dev) <= slots - 64)[None, None, None, :].expand(batch, 1, 1, slots).contiguous()
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    cluster = ra.uses_clusters(tilefish.GpuSpec.current(dev)) and os.environ.get("CLUSTER", "1") != "0"
    chunk = ra.plan_chunk(batch, kv_heads, slots, sm, ra.max_cluster_splits(tilefish.GpuSpec.current(dev)) if cluster else None)
    splits = -(-slots // chunk)
    in_cluster = cluster and ra.combine_in_cluster(tilefish.GpuSpec.current(dev), batch, kv_heads, splits)
    ctas = splits * kv_heads * batch
    spec = ra.kernel_spec(dt, d)
    extra = tuple((d, "1") for d in os.environ.get("TIMELINE_DEFINES", "").split(",") if d)
    kern = get_kernel(dataclasses.replace(spec, defines=spec.defines + (("TF_TIMELINE", "1"),) + extra), 0)
    cfg = prepare_launch(kern, (splits, kv_heads, batch), ra.THREADS, smem=ra.smem_bytes(d),
                         cluster=splits if in_cluster else 1, pdl=True)
    buf = torch.zeros(ctas * 32 + batch * kv_heads * splits * (heads // kv_heads) * (d + 2) + 1, dtype=torch.float32,
                      device=dev)
    counters = layer_counters(dev)
    out = torch.empty(batch, 1, heads, d, dtype=dt, device=dev)

    def step():
        length.fill_(slots - 64)  # ahead of the GEMM: a memset between it and the kernel would break the chain
        qkv = qkv_proj(x)
        launch_prepared(kern, cfg, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(),
                        length.data_ptr(), counters.data_ptr(), mask.data_ptr(), i32(1), i64(slots), out.data_ptr(),
                        buf.data_ptr(), i32(heads), i32(kv_heads), i32(slots), i32(chunk), i64(0),
                        f32(1 / math.sqrt(d) * math.log2(math.e)), i32(1), i32(1 if in_cluster else 0))
        return o_proj(out.view(batch, 1, heads * d))

    replay = e2e._captured(step)  # the bench's capture: warm-up calls on the capture's stream, then the graph
    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    st = buf[: ctas * 32].view(torch.int64).view(ctas, 16).cpu()
    t0 = st[:, 0].min()
    print(f"{torch.cuda.get_device_name()}: batch {batch}, {slots} slots, chunk {chunk}, {splits} splits, {ctas} CTAs, "
          f"combine {'in a cluster' if in_cluster else 'through L2' if splits > 1 else 'none'} "
          f"(us from the first CTA's entry: median / latest CTA)")
    for i, name in STAMPS.items():
        col = st[:, i]
        col = col[col > 0]
        if col.numel():
            rel = (col - t0).double() / 1e3
            print(f"  {i} {name:10s} {rel.median().item():8.2f} {rel.max().item():8.2f}  ({col.numel()} CTAs)")


if __name__ == "__main__":
    main()
