"""`tilefish bench sgemm`: every SGEMM ladder step against cuBLAS fp32 (TF32 off), same process.

Default: the nine steps at 4096^3, then a 256 .. 8192 cube sweep of kernel="auto" and cuBLAS.
args.shapes: a list of shapes, (S,) for S^3 or (M, N, K); the ladder runs at each of them
(and the sweep is skipped).  args.variants: also run the autotuner for steps 05-09 at the first
shape and add its ranking.  Rates are TFLOP/s (2*M*N*K / time); "% ceil" is the percentage of
cuBLAS at the same shape; "x cuBLAS" is cuBLAS time / tilefish time.
"""
from __future__ import annotations

import torch

from .report import Report, Row
from .timing import host_overhead_us, time_cuda

DEFAULT_SHAPE = (4096, 4096, 4096)
SWEEP = (256, 512, 1024, 2048, 4096, 8192)
SLOW_STEPS = ("01_naive", "02_coalesced", "03_smem_blocking", "04_blocktile_1d")
FFMA_PEAK_NOTE = ("FP32 FFMA peak (spec): SMs x 128 lanes x 2 flop x boost clock; H200 SXM: "
                  "132 x 128 x 2 x 1.98 GHz = 66.9 TFLOP/s")


def _shape3(s) -> tuple[int, int, int]:
    s = tuple(int(x) for x in s)
    if len(s) == 1:
        return (s[0],) * 3
    if len(s) != 3:
        raise ValueError(f"an SGEMM shape is S (for S^3) or MxNxK, got {'x'.join(map(str, s))}")
    return s  # type: ignore[return-value]


def _case(shape) -> str:
    m, n, k = shape
    return f"{m}^3" if m == n == k else f"{m}x{n}x{k}"


def _tflops(shape, ms: float) -> float:
    m, n, k = shape
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


class _Cublas:
    """torch.mm on fp32 with TF32 off: cuBLAS SGEMM (FFMA), timed like our kernels."""

    def __enter__(self):
        self.prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        return self

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.prev


def _operands(shape):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda")
    b = torch.randn(k, n, device="cuda")
    return a, b


def _time_cublas(a, b, out, reps):
    with _Cublas():
        t = time_cuda(lambda: torch.mm(a, b, out=out), reps=reps)
        torch.mm(a, b, out=out)
    return t


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    den = ref.double().norm().item() or 1.0
    return (x.double() - ref.double()).norm().item() / den


def _gpu(t: torch.Tensor):
    """The GpuSpec of t's device, as tilefish.sgemm.plan takes it."""
    from ..runtime import GpuSpec, device_info

    return GpuSpec.of(device_info(t.device.index))


def _config(gpu, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, kernel="auto"):
    """The configuration sgemm(a, b, c, kernel=kernel) launches on `gpu`: tilefish.sgemm.plan's for a, b and c
    as they are (16-byte aligned or not: a vectorized step falls back without it, or with N or K % 4 != 0)."""
    from ..sgemm import plan

    aligned = not (a.data_ptr() % 16 or b.data_ptr() % 16 or c.data_ptr() % 16)
    return plan(a.shape[0], b.shape[1], a.shape[1], kernel=kernel, aligned=aligned, gpu=gpu).config


def run(args) -> Report:
    import importlib

    ops = importlib.import_module("tilefish.ops.sgemm")  # the module (the package may re-export the function)

    reps = getattr(args, "reps", 50) or 50
    given = getattr(args, "shapes", None)
    shapes = [_shape3(s) for s in given] if given else [DEFAULT_SHAPE]
    variants = bool(getattr(args, "variants", False))

    report = Report("SGEMM fp32 C = A @ B (TF32 off): ladder steps vs cuBLAS")
    report.notes.append(FFMA_PEAK_NOTE)
    report.notes.append("% ceil = % of cuBLAS fp32 at the same shape, measured in this process")
    for shape in shapes:
        a, b = _operands(shape)
        ref = torch.empty(shape[0], shape[1], device="cuda")
        tc = _time_cublas(a, b, ref, reps)
        cub = _tflops(shape, tc.median_ms)
        if shape == DEFAULT_SHAPE or len(shapes) == 1:
            report.ceilings[f"cuBLAS fp32 TFLOP/s @{_case(shape)}"] = cub
        report.add(Row("sgemm", _case(shape), "cuBLAS", tc.median_us, cub, "TFLOP/s", 100.0, {}))
        c = torch.empty_like(ref)
        gpu = _gpu(a)
        for step in ops.KERNELS:
            slow = step in SLOW_STEPS
            fn = lambda: ops.sgemm(a, b, c, kernel=step)  # noqa: E731 - beta = 0: c is write-only
            fn()
            torch.cuda.synchronize()
            err = _rel(c, ref)
            t = time_cuda(fn, reps=reps, warmup=1 if slow else 5, min_reps=3 if slow else 10)
            cfg = _config(gpu, a, b, c, step)
            tf = _tflops(shape, t.median_ms)
            row = report.add(Row("sgemm", _case(shape), f"tilefish {step}", t.median_us, tf, "TFLOP/s",
                                 100.0 * tf / cub, {"cuBLAS": tc.median_ms / t.median_ms},
                                 {"config": cfg.label(), "rel_err_vs_cublas": err}))
            if err > 1e-4:
                report.notes.append(f"WARNING: {row.impl} at {row.case} differs from cuBLAS: rel err {err:.3g}")
        del a, b, c, ref
        torch.cuda.empty_cache()

    if not given:
        for s in SWEEP:
            _auto_against_cublas(ops, report, s, reps, f"sweep {_case((s, s, s))}")
        torch.cuda.empty_cache()

    if variants:
        from .sgemm_autotune import autotune, best, ranking_table

        shape = shapes[0]
        a, b = _operands(shape)
        ref = torch.empty(shape[0], shape[1], device="cuda")
        tc = _time_cublas(a, b, ref, reps)
        cub = _tflops(shape, tc.median_ms)
        del a, b, ref
        for step in ops.KERNELS[4:]:
            results = autotune(step, shape, reps=min(reps, 20))
            report.notes.append(ranking_table(results, top=10))
            for r in results:
                if r.ok:
                    report.add(Row("sgemm", _case(shape), f"tilefish[{step} {r.label()}]", r.time_us, r.tflops,
                                   "TFLOP/s", 100.0 * r.tflops / cub, {"cuBLAS": tc.median_us / r.time_us},
                                   {"config": r.config.label(), "registers": r.registers}))
            if (bst := best(results)) is not None:
                report.notes.append(f"best {step} at {_case(shape)}: {bst.config.label()} "
                                    f"({bst.tflops:.2f} TFLOP/s)")

    # Host overhead per call: a tiny problem, so the GPU keeps up and the host is what is timed.
    sa, sb = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    sc = torch.empty(64, 64, device="cuda")
    us = host_overhead_us(lambda: ops.sgemm(sa, sb, sc))
    with _Cublas():
        us_cub = host_overhead_us(lambda: torch.mm(sa, sb, out=sc))
    report.notes.append(f"host overhead per call (64^3, wrapper + launch): tilefish {us:.1f} us, "
                        f"torch.mm {us_cub:.1f} us")
    return report


def run_auto(sizes, reps: int = 50) -> Report:
    """kernel="auto" (the ladder's best step) against cuBLAS fp32 at S^3 for S in sizes: run()'s sweep rows
    without the ladder's slow first steps (the all-families quick run's SGEMM part)."""
    import importlib

    ops = importlib.import_module("tilefish.ops.sgemm")
    report = Report('SGEMM fp32 C = A @ B (TF32 off): kernel="auto" (the best ladder step) vs cuBLAS')
    report.notes.append(FFMA_PEAK_NOTE)
    report.notes.append("% ceil = % of cuBLAS fp32 at the same shape, measured in this process; "
                        "`tilefish bench sgemm` runs every ladder step")
    for s in sizes:
        cub, row = _auto_against_cublas(ops, report, s, reps, _case((s, s, s)))
        report.ceilings[f"cuBLAS fp32 TFLOP/s @{row.case}"] = cub
        if row.extra["rel_err_vs_cublas"] > 1e-4:
            report.notes.append(f"WARNING: {row.impl} at {row.case} differs from cuBLAS: "
                                f"rel err {row.extra['rel_err_vs_cublas']:.3g}")
        torch.cuda.empty_cache()
    return report


def _auto_against_cublas(ops, report: Report, s: int, reps: int, case: str):
    """cuBLAS and kernel="auto" on an s^3 product, one row each under `case`: (cuBLAS TFLOP/s, auto's row)."""
    shape = (s, s, s)
    a, b = _operands(shape)
    ref = torch.empty(s, s, device="cuda")
    c = torch.empty_like(ref)
    tc = _time_cublas(a, b, ref, reps)
    cub = _tflops(shape, tc.median_ms)
    report.add(Row("sgemm", case, "cuBLAS", tc.median_us, cub, "TFLOP/s", 100.0, {}))
    fn = lambda: ops.sgemm(a, b, c)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    err = _rel(c, ref)
    t = time_cuda(fn, reps=reps)
    cfg = _config(_gpu(a), a, b, c)
    tf = _tflops(shape, t.median_ms)
    row = report.add(Row("sgemm", case, "tilefish auto", t.median_us, tf, "TFLOP/s", 100.0 * tf / cub,
                         {"cuBLAS": tc.median_ms / t.median_ms}, {"config": cfg.label(), "rel_err_vs_cublas": err}))
    return cub, row


def kernel_specs(info, shapes, steps=("auto",)) -> list:
    """The KernelSpecs the ladder `steps` launch for (m, n, k) shapes on the device `info` (device_info()):
    tilefish.sgemm.plan's for each, operands 16-byte aligned (torch's allocations are)."""
    from ..runtime import GpuSpec
    from ..sgemm import plan

    gpu = GpuSpec.of(info)
    return [plan(m, n, k, kernel=step, aligned=True, gpu=gpu).kernel_spec for m, n, k in shapes for step in steps]
