"""Does a programmatic-dependent-launch chain of rms_norm kernels ever read stale data? (test_norm's
test_pdl_chain_reads_what_the_launch_ahead_wrote failed twice with four pytest processes sharing an H200.)

The chain is the test's: 8 x (add + norm, norm), each launch reading the outputs of the one or two ahead of
it, compared bit for bit with the same chain launched without PDL. Variants of how the kernel reads x and the
residual after grid_dependency_wait (patched copies of kernels/norm/rmsnorm.cu built under /tmp):
  l2     ld.global.cg (ld_cg_v4): L2 only, never L1 -- the kernel as it is
  nc     ld.global.nc (ld_nc_v4): the non-coherent path, LDG.E.128.CONSTANT, cached in L1 (what a plain
         const __restrict__ load compiled to before)
  ca     ld.global.ca: an ordinary L1-cached load, LDG.E.128
Allocation patterns: "reuse" (the caching allocator hands the chain's freed outputs back to later launches,
as in the test) and "fresh" (every output a distinct buffer).
--load N runs N background processes launching small kernels and GEMMs on the GPU (time-slicing, as with
the test run's other pytest processes).

    python scripts/experiments/pdl_chain_stress.py --rounds 300 --load 3
"""
import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tilefish.ops import norm as norm_ops
from tilefish.runtime.compiler import KERNEL_ROOT, KernelSpec
from tilefish.runtime.launch import f32, get_kernel, i32, launch_prepared, prepare_launch

EPS = 1e-5
_LOAD = """
import torch, time, sys
a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16); v = torch.randn(1 << 20, device="cuda")
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for _ in range(50):
        v.mul_(1.0001).add_(1e-6)
    a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


def patched_sources(tmp: Path) -> dict[str, str]:
    text = (KERNEL_ROOT / "norm/rmsnorm.cu").read_text()
    l2 = re.compile(r"ld_cg_v4\(((?:x|residual) \+ base \+ 8 \* c)\)")
    assert len(l2.findall(text)) == 2, "rmsnorm.cu changed: update the patterns"
    ca_helper = ("using namespace tf;\n__device__ __forceinline__ uint4 ld_ca_v4(const void* p) {\n"
                 "    uint4 r; asm volatile(\"ld.global.ca.v4.u32 {%0,%1,%2,%3}, [%4];\"\n"
                 "        : \"=r\"(r.x), \"=r\"(r.y), \"=r\"(r.z), \"=r\"(r.w) : \"l\"(p)); return r; }")
    variants = {"l2": text, "nc": l2.sub(r"ld_nc_v4(\1)", text),
                "ca": l2.sub(r"ld_ca_v4(\1)", text).replace("using namespace tf;", ca_helper)}
    out = {}
    for name, src in variants.items():
        path = tmp / f"rmsnorm_{name}.cu"
        path.write_text(src)
        out[name] = str(path)
    return out


def launcher(source: str, dtype: torch.dtype, cols: int):
    threads, vpt = norm_ops.block_config(cols)
    kern = get_kernel(KernelSpec(source, f"rms_norm<{norm_ops.DTYPES[dtype]}, {vpt}>"), 0)

    def run(x, w, res, h, out, pdl):
        cfg = prepare_launch(kern, x.shape[0], threads, smem=2 * cols, pdl=pdl)
        launch_prepared(kern, cfg, x.data_ptr(), 0 if res is None else res.data_ptr(), w.data_ptr(),
                        0 if h is None else h.data_ptr(), out.data_ptr(), i32(cols), f32(EPS))
    return run


def chain(run, x, w, r, pdl, fresh_pool=None):
    """The test's chain; returns every launch's outputs (16 launches, 24 tensors) in launch order."""
    outs, take = [], (iter(fresh_pool).__next__ if fresh_pool is not None else (lambda: torch.empty_like(x)))
    h, out = r, x
    for _ in range(8):
        nh, nout = take(), take()
        run(out, w, h, nh, nout, pdl)
        h, out = nh, nout
        outs += [h, out]
        nout = take()
        run(out, w, None, None, nout, pdl)
        out = nout
        outs.append(out)
    return [t.clone() for t in outs] if fresh_pool is None else outs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--load", type=int, default=0)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--variants", default="l2,nc,ca")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp())
    srcs = patched_sources(tmp)
    loads = [subprocess.Popen([sys.executable, "-c", _LOAD, str(10_000)]) for _ in range(a.load)]
    time.sleep(3 if a.load else 0)
    try:
        print(f"{torch.cuda.get_device_name()}  rows {a.rows} cols {a.cols}  background processes {a.load}")
        for dtype in (torch.float16, torch.bfloat16):
            g = torch.Generator().manual_seed(1234)
            cols = a.cols
            x = (torch.randn(a.rows, cols, generator=g) * (1 + 20 * (torch.rand(cols, generator=g) < 0.01)))
            w = 1 + 0.3 * torch.randn(cols, generator=g)
            r = 4 * torch.randn(a.rows, cols, generator=g)
            x, w, r = (t.to("cuda", dtype) for t in (x, w, r))
            for variant in a.variants.split(","):
                run = launcher(srcs[variant], dtype, cols)
                want = chain(run, x, w, r, pdl=False)
                for alloc in ("reuse", "fresh"):
                    bad_rounds, first_steps, bad_elems = 0, {}, 0
                    t0 = time.time()
                    for _ in range(a.rounds):
                        pool = [torch.empty_like(x) for _ in range(24)] if alloc == "fresh" else None
                        got = chain(run, x, w, r, pdl=True, fresh_pool=pool)
                        torch.cuda.synchronize()
                        diff = [i for i, (u, v) in enumerate(zip(got, want)) if not torch.equal(u, v)]
                        if diff:
                            bad_rounds += 1
                            first_steps[diff[0]] = first_steps.get(diff[0], 0) + 1
                            bad_elems += int((got[diff[0]] != want[diff[0]]).sum())
                    print(f"{str(dtype)[6:]:9s} {variant:5s} {alloc:6s} rounds {a.rounds:5d}  mismatched rounds "
                          f"{bad_rounds:4d}  first bad output (index: rounds) {first_steps}  "
                          f"elements differing in those {bad_elems}  ({time.time() - t0:.1f} s)", flush=True)
    finally:
        for q in loads:
            q.kill()


if __name__ == "__main__":
    main()
