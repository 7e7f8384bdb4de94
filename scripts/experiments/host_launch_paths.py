"""Where an eager W4A16Linear call's host time goes, and what a raw driver launch would cost instead
(device; one-off for issue 39's host-cost target). Per call, median of 5 runs x 2000 calls:
F.linear, W4A16Linear(x), torch.empty, LaunchPlan.launch, runtime.launch_prepared (cuda.core's launch)
with prepared arguments, and cuLaunchKernel with a parameter block packed once (only x / out change).
    python scripts/experiments/host_launch_paths.py [K N M]
"""
import ctypes
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import tilefish
from tilefish.runtime import i32, launch_prepared


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


def main(k=4096, n=4096, m=1):
    from cuda.bindings import driver

    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.float16, device="cuda")
    layer = tilefish.nn.W4A16Linear.from_linear(lin, group_size=128)
    x = torch.randn(m, k, dtype=torch.float16, device="cuda")
    layer(x)
    (lp,) = layer._plans.values()
    plan = lp.plan
    out = torch.empty(m, n, dtype=torch.float16, device="cuda")
    (kern, config, box, head, tail), = plan.launches
    assert box is None, "this experiment times the pointer-x kernels (m <= 8: the swapped mma.sync plan)"
    ws = torch.zeros(plan.tiles or 1, dtype=torch.int32, device="cuda")
    partials = torch.empty(max(plan.partials, 1), dtype=torch.float32, device="cuda")
    xp, op = x.data_ptr(), out.data_ptr()
    args = (xp, *head, op, partials.data_ptr(), ws.data_ptr(), *tail, 0, i32(0))  # no epilogue: residual, gated

    # The driver path: the CUfunction, the launch geometry, one parameter block (void** of values).
    h = kern.kernel.handle
    func = driver.cuKernelGetFunction(h)[1] if isinstance(h, driver.CUkernel) else h
    grid, block, smem = config.grid, config.block, config.shmem_size
    values = ([ctypes.c_uint64(v) for v in (xp, *head, op, partials.data_ptr(), ws.data_ptr())]
              + [ctypes.c_int32(int(v)) for v in tail] + [ctypes.c_uint64(0), ctypes.c_int32(0)])
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    params_addr = ctypes.addressof(params)

    def raw():
        values[0].value, values[5].value = xp, op
        driver.cuLaunchKernel(func, *grid, *block, smem, torch.cuda.current_stream().cuda_stream, params_addr, 0)

    raw()
    torch.cuda.synchronize()
    ref = out.clone()
    out.fill_(float("nan"))
    raw()
    torch.cuda.synchronize()
    assert torch.equal(out, ref), "the raw launch computes something else"

    base = per_call_us(lambda: F.linear(x, lin.weight))
    print(f"k{k} n{n} m{m} plan {plan.config.label() if hasattr(plan, 'config') else kern.spec.name}")
    for name, fn in [("F.linear", lambda: F.linear(x, lin.weight)), ("W4A16Linear(x)", lambda: layer(x)),
                     ("torch.empty(m, n)", lambda: torch.empty(m, n, dtype=torch.float16, device="cuda")),
                     ("LaunchPlan.launch", lambda: plan.launch(xp, op)),
                     ("launch_prepared (cuda.core)", lambda: launch_prepared(kern, config, *args)),
                     ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream().cuda_stream),
                     ("cuLaunchKernel, packed once", raw)]:
        us = per_call_us(fn)
        print(f"  {name:32s} {us:7.2f} us  ({us / base:.2f}x F.linear)", flush=True)


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
