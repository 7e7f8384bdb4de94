"""Host cost of one eager W4A16 call, piece by piece, beside F.linear (microseconds per call).

Usage (device): python scripts/profile_w4a16_host.py [KxN ...]  (default 4096x4096 4096x6144, m = 1 and 16)
Each line: the median over 5 runs of (2000 calls timed on the host clock) / 2000, GPU kept ahead.
"""
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import tilefish
from tilefish import w4a16
from tilefish.ops import w4a16 as ops
from tilefish.runtime import device_info, get_kernel, launch, tensor_map_2d
from tilefish.runtime.launch import _stream_for, current_stream_handle


def per_call_us(fn, calls=2000, runs=5):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def row(name, fn, base=None):
    us = per_call_us(fn)
    print(f"  {name:44s} {us:7.2f} us" + (f"  ({us / base:.2f}x F.linear)" if base else ""), flush=True)
    return us


def main():
    shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[1:]] or [(4096, 4096), (4096, 6144)]
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    print(f"host CPU: {cpu}; GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    info = device_info(0)
    for k, n in shapes:
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.float16)
        layer = tilefish.nn.W4A16Linear.from_linear(lin, group_size=128)
        w = layer.weight4 if hasattr(layer, "weight4") else None
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            print(f"k{k} n{n} m{m}")
            base = row("F.linear", lambda: F.linear(x, lin.weight))
            row("W4A16Linear(x)", lambda: layer(x), base)
            if w is not None:
                row("w4a16.matmul(x, w)", lambda: w4a16.matmul(x, w), base)
                row("ops.matmul_impl (fresh counters)", lambda: ops.matmul_impl(x, w), base)
                row("ops.validate", lambda: ops.validate(x, w, None))
                row("choose_config (cached)", lambda: ops.choose_config(m, n, k, info.sm_count, info.cc, 128,
                                                                       ops.device_clusters(info), x.dtype))
            row("torch.empty(m, n)", lambda: torch.empty(m, n, dtype=x.dtype, device=x.device))
            row("tensor_map_2d (hit)", lambda: tensor_map_2d(x, 8, 64))
            row("current_stream_handle", lambda: current_stream_handle(0))
            row("_stream_for", lambda: _stream_for(0))
            row("device_info", lambda: device_info(0))
            row("x.data_ptr() x4", lambda: (x.data_ptr(), x.data_ptr(), x.data_ptr(), x.data_ptr()))
            row("np.int32(m) x4", lambda: (np.int32(m), np.int32(n), np.int32(k), np.int32(1)))
            row("torch.compiler.is_compiling", torch.compiler.is_compiling)
            if w is not None:
                cfg = ops.choose_config(m, n, k, info.sm_count, info.cc, 128, ops.device_clusters(info), x.dtype)
                print(f"  plan {cfg.label()}")
                if isinstance(cfg, ops.SkinnyConfig):
                    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
                    kern = get_kernel(ops.kernel_spec(x.dtype, cfg, 128, False), 0)
                    ws = torch.empty(info.sm_count * cfg.ctas_per_sm * 2 * cfg.mt * cfg.bn, dtype=torch.float32,
                                     device=x.device)
                    counters = ops.Workspace(x.device).counters
                    mx = tensor_map_2d(x, cfg.mt, 64)
                    smem = cfg.smem_bytes(128, False)
                    ctas = info.sm_count * cfg.ctas_per_sm
                    args = (mx, w.packed.data_ptr(), w.scales.data_ptr(), 0, 0, out.data_ptr(), ws.data_ptr(),
                            counters.data_ptr(), np.int32(m), np.int32(n), np.int32(k), 0,
                            np.int32(0))  # the epilogue's residual (none) and gated (0)
                    row("runtime.launch (prepared args)", lambda: launch(kern, ctas, cfg.threads, *args, smem=smem))
                    from cuda.core import LaunchConfig
                    from cuda.core import launch as core_launch
                    lc = LaunchConfig(grid=ctas, block=cfg.threads, shmem_size=smem)
                    st = _stream_for(0)
                    row("cuda.core.launch (prepared)", lambda: core_launch(st, lc, kern.kernel, *args))
                    lcp = LaunchConfig(grid=ctas, block=cfg.threads, shmem_size=smem,
                                       programmatic_stream_serialization=True)
                    row("cuda.core.launch (PDL config)", lambda: core_launch(st, lcp, kern.kernel, *args))
                    row("fp32 partials (per call)", lambda: torch.empty(ws.numel(), dtype=torch.float32,
                                                                        device=x.device))


if __name__ == "__main__":
    main()
