"""Ceiling probes on the GPU (kernels/probes/), each next to the production kernel it bounds, in
one process:

* mma.sync m16n8k16 issue rate from registers only, by warps per SM and independent chains, with
  the SM clock read during the run; next to cuBLAS and HGEMM steps 06 / 07 at 4096^3. This is the
  ceiling of the Ampere-style ladder steps on this GPU.
* wgmma with A from registers (the W4A16 Hopper kernel's form), by N = the m tile, with no
  dequantization, with the lop3 dequantization and with group scales on top, at one or two
  warpgroups per SM, with the SM clock: the tensor ceiling of the W4A16 wgmma kernel at each m.
* DRAM read rate of a plain streaming kernel (no writes) at the byte counts of the W4A16 packed
  weights, next to a device copy and the W4A16 m = 1 dispatch: the floor of weight streaming.

Usage: python scripts/bench_probes.py [OUT.json] [mma,wgmma_rs,read]
"""
import json
import sys

import torch

from tilefish.bench.timing import time_cuda
from tilefish.runtime import KernelSpec, get_kernel, i32, i64, launch
from tilefish.bench.timing import w4a16_workspace

SMS = torch.cuda.get_device_properties(0).multi_processor_count
W4A16_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192),
                (8192, 57344), (28672, 8192)]


def events_us(fn, reps=5):
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return sorted(ts)[len(ts) // 2]


def mma_probe(results):
    sink = torch.empty(1 << 22, device="cuda")
    clocks = torch.zeros(4, dtype=torch.int64, device="cuda")
    rows = []
    for dt, tname in ((torch.float16, "__half"), (torch.bfloat16, "__nv_bfloat16")):
        for chains in (4, 8):
            kern = get_kernel(KernelSpec("probes/mma_sync_peak.cu", f"mma_sync_peak<{tname}, {chains}>"))
            for warps, per_sm in ((4, 1), (4, 2), (8, 1), (8, 2), (16, 1), (16, 2)):
                iters = 20000
                blocks = SMS * per_sm
                run = lambda: launch(kern, blocks, warps * 32, sink.data_ptr(), clocks.data_ptr(), i32(iters))  # noqa: E731
                run(); torch.cuda.synchronize()
                us = events_us(run)
                c = clocks.tolist()
                mhz = (c[1] - c[0]) / max(1, c[3] - c[2]) * 1e3
                tf = blocks * warps * iters * chains * 4096 / us / 1e6
                rows.append(dict(dtype=str(dt)[6:], chains=chains, warps_per_sm=warps * per_sm, tflops=tf, sm_mhz=mhz))
                print(f"mma.sync {str(dt)[6:]:9s} chains {chains} warps/SM {warps * per_sm:3d}: {tf:6.1f} TFLOP/s at {mhz:5.0f} MHz")
    results["mma_sync_peak"] = rows
    from tilefish.ops import hgemm as hg
    n = 4096
    a = torch.randn(n, n, device="cuda", dtype=torch.float16); b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    fl = 2 * n ** 3
    peers = {}
    for name, fn in (("cuBLAS", lambda: torch.matmul(a, b)), ("06_rasterized", lambda: hg.hgemm(a, b, kernel="06_rasterized")),
                     ("07_wgmma_tma", lambda: hg.hgemm(a, b, kernel="07_wgmma_tma"))):
        us = time_cuda(fn, reps=30).median_us
        peers[name] = fl / us / 1e6
        print(f"4096^3 fp16 {name:14s} {peers[name]:6.1f} TFLOP/s")
    results["hgemm_4096_fp16_tflops"] = peers


WGMMA_RS_SHAPES = ((16, 4), (32, 4), (64, 4), (64, 2), (128, 2), (128, 1), (256, 1))  # (N, NT) of HOPPER_CONFIGS


def wgmma_rs_probe(results):
    sink = torch.empty(1 << 20, device="cuda")
    clocks = torch.zeros(4, dtype=torch.int64, device="cuda")
    rows = []
    for dt, tname in ((torch.float16, "__half"), (torch.bfloat16, "__nv_bfloat16")):
        for n, nt in WGMMA_RS_SHAPES:
            for deq in (0, 1, 2):
                kern = get_kernel(KernelSpec("probes/wgmma_rs_peak.cu", f"wgmma_rs_peak<{tname}, {n}, {nt}, {deq}>",
                                             arch_specific=True, min_sm=90))
                for wgs in (1, 2):
                    iters = max(200, 400000 // (n * nt))
                    # 160 KB of shared memory a block: exactly one block (of 1 or 2 warpgroups) per SM
                    run = lambda: launch(kern, SMS, 128 * wgs, sink.data_ptr(), clocks.data_ptr(), i32(iters),  # noqa: E731
                                         smem=160 * 1024)
                    run(); torch.cuda.synchronize()
                    us = events_us(run)
                    c = clocks.tolist()
                    mhz = (c[1] - c[0]) / max(1, c[3] - c[2]) * 1e3
                    tf = SMS * wgs * iters * 4 * nt * 64 * n * 16 * 2 / us / 1e6
                    rows.append(dict(dtype=str(dt)[6:], n=n, nt=nt, dequant=("none", "lop3", "lop3+scale")[deq],
                                     warpgroups_per_sm=wgs, tflops=tf, sm_mhz=mhz))
                    print(f"wgmma RS {str(dt)[6:]:9s} m64n{n:<3d}k16 x{nt} dequant {rows[-1]['dequant']:10s} "
                          f"WG/SM {wgs}: {tf:6.1f} TFLOP/s at {mhz:5.0f} MHz")
    results["wgmma_rs_peak"] = rows


def read_probe(results):
    sink = torch.empty(4, dtype=torch.int32, device="cuda")
    specs = {(u, h): get_kernel(KernelSpec("probes/read_stream.cu", f"read_stream<{u}, {'true' if h else 'false'}>"))
             for u in (4, 8) for h in (False, True)}
    e = torch.empty(1, device="cuda")
    empty_us = time_cuda(lambda: e.add_(0), reps=50).median_us
    print(f"empty kernel {empty_us:.1f} us")
    from tilefish.ops import w4a16 as w4
    from tilefish.quant.int4 import quantize_rtn
    rows = []
    for k, n in W4A16_SHAPES:
        nbytes = n * k // 2
        src = torch.randint(0, 1 << 30, (nbytes // 4,), device="cuda", dtype=torch.int32)
        dst = torch.empty_like(src)
        copy_us = time_cuda(lambda: dst.copy_(src), reps=30).median_us
        best = None
        for (u, h), kern in specs.items():
            for threads, per_sm in ((256, 4), (256, 8), (512, 4), (1024, 2)):
                run = lambda: launch(kern, SMS * per_sm, threads, src.data_ptr(), i64(nbytes // 16), sink.data_ptr())  # noqa: E731
                us = time_cuda(run, reps=30).median_us
                if best is None or us < best[0]:
                    best = (us, f"unroll {u} l2_256 {int(h)} {threads}x{per_sm}/SM")
        del src, dst
        dense = torch.randn(n, k, device="cuda", dtype=torch.float16)
        p = w4.pack(quantize_rtn(dense, 128, True, scale_dtype=torch.float16, clip_search=False))
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        w_us = time_cuda(lambda: w4.matmul_impl(x, p, workspace=w4a16_workspace(x.device)), reps=30).median_us
        deq = dense
        cublas_us = time_cuda(lambda: torch.nn.functional.linear(x, deq), reps=30).median_us
        del dense, p, deq
        r = dict(k=k, n=n, mbytes=nbytes / 1e6, read_us=best[0], read_cfg=best[1], read_gbs=nbytes / best[0] / 1e3,
                 copy_us=copy_us, w4a16_m1_us=w_us, cublas_m1_us=cublas_us)
        rows.append(r)
        print(f"k{k:5d} n{n:5d} {nbytes/1e6:6.1f} MB  read {best[0]:6.1f} us ({r['read_gbs']:5.0f} GB/s, {best[1]})  "
              f"copy {copy_us:6.1f}  w4a16 m1 {w_us:6.1f}  cuBLAS m1 {cublas_us:6.1f}  "
              f"cuBLAS/read {cublas_us / best[0]:4.2f}x  cuBLAS/w4a16 {cublas_us / w_us:4.2f}x")
    results["read_stream"] = dict(empty_kernel_us=empty_us, rows=rows)


def main():
    results = {"gpu": torch.cuda.get_device_name(0)}
    which = sys.argv[2].split(",") if len(sys.argv) > 2 else ["mma", "wgmma_rs", "read"]
    if "mma" in which:
        mma_probe(results)
    if "wgmma_rs" in which:
        wgmma_rs_probe(results)
    if "read" in which:
        read_probe(results)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
