"""`tilefish bench hgemm`: every HGEMM ladder step against cuBLAS (torch.matmul), same dtype, same process.

Default: every step at 4096^3 and 8192^3 (step 07 only on sm_90), then a 512 .. 16384 cube sweep
of kernel="auto" (step 07 on sm_90), the best Ampere-style step (06) and cuBLAS, then LLM
projection shapes M in {1, 16, 128, 1024, 4096} x (K, N) in {(4096, 14336), (8192, 28672)} (b as an
[N, K] nn.Linear weight) for "auto" and step 06 vs cuBLAS.
args.shapes: a list of shapes, (S,) for S^3 or (M, N, K); the ladder runs at each of them (and the
sweeps are skipped).  args.dtype: "fp16" (default) or "bf16" (anything else -> fp16).
args.variants: also time every configuration of the steps 05-07 tuning space at the first shape.
Rates are TFLOP/s (2*M*N*K / time); "x cuBLAS" is cuBLAS time / tilefish time and "% ceil" the same
as a percentage, with cuBLAS re-timed in rounds alternating with each kernel (timing.time_paired:
an 8192^3 GEMM heats the GPU, and the clocks then differ between two back-to-back measurements);
the cuBLAS row itself is timed first, alone. Step 01 (seconds per run) is compared with that row.
"""
from __future__ import annotations

import torch

from .report import Report, Row
from .timing import host_overhead_us, time_cuda, time_paired

DEFAULT_SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192))
SWEEP = (512, 1024, 2048, 4096, 8192, 16384)
LLM_MS = (1, 16, 128, 1024, 4096)
LLM_KN = ((4096, 14336), (8192, 28672))
SLOW_STEPS = ("01_mma_naive",)
PEAK_NOTE = ("H200 SXM dense fp16/bf16 tensor peak (spec) ~989 TFLOP/s (wgmma); mma.sync reaches "
             "~65 % of it at best; cuBLAS (wgmma) measured in this process is the ceiling")


def _dtype(args) -> torch.dtype:
    return torch.bfloat16 if str(getattr(args, "dtype", "fp16") or "fp16").lower() in ("bf16", "bfloat16") \
        else torch.float16


def _shape3(s) -> tuple[int, int, int]:
    s = tuple(int(x) for x in s)
    if len(s) == 1:
        return (s[0],) * 3
    if len(s) != 3:
        raise ValueError(f"an HGEMM shape is S (for S^3) or MxNxK, got {'x'.join(map(str, s))}")
    return s  # type: ignore[return-value]


def _case(shape, nk: bool = False) -> str:
    m, n, k = shape
    s = f"{m}^3" if m == n == k else f"{m}x{n}x{k}"
    return s + (" (b [N,K])" if nk else "")


def _tflops(shape, ms: float) -> float:
    m, n, k = shape
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def _operands(shape, dtype, nk: bool = False):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype) if nk else torch.randn(k, n, device="cuda", dtype=dtype)
    return a, b


def _cublas(a, b, out, nk: bool):
    return torch.matmul(a, b.t() if nk else b, out=out)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    den = ref.double().norm().item() or 1.0
    return (x.double() - ref.double()).norm().item() / den


def _compare(report, ops, label, shape, dtype, nk, kernels, reps, tol):
    """cuBLAS row + one row per kernel at one shape; returns cuBLAS's TFLOP/s (the rows go into report).
    Each row's configuration is tilefish.hgemm.plan's for the call (the current GPU's numbers, N's epilogue)."""
    from ..hgemm import plan

    a, b = _operands(shape, dtype, nk)
    ref = torch.empty(shape[0], shape[1], device="cuda", dtype=dtype)
    tc = time_cuda(lambda: _cublas(a, b, ref, nk), reps=reps)
    _cublas(a, b, ref, nk)
    cub = _tflops(shape, tc.median_ms)
    case = f"{label}{_case(shape, nk)}"
    report.add(Row("hgemm", case, "cuBLAS", tc.median_us, cub, "TFLOP/s", 100.0, {}))
    for kern in kernels:
        slow = kern in SLOW_STEPS
        fn = lambda: ops.hgemm(a, b, kernel=kern, b_transposed=nk)  # noqa: E731
        out = fn()
        torch.cuda.synchronize()
        err = _rel(out, ref)
        if slow:
            t, tc_pair = time_cuda(fn, reps=reps, warmup=1, min_reps=3), tc
        else:  # alternating rounds with cuBLAS: both timed at the same clocks (see time_paired)
            t, tc_pair = time_paired(fn, lambda: _cublas(a, b, ref, nk), reps=reps)
        cfg = plan(*shape, dtype=dtype, b_transposed=nk, kernel=kern).config  # what the call launched
        name = f"tilefish[{cfg.step} {cfg.short()}]" if isinstance(kern, ops.HgemmConfig) else f"tilefish {kern}"
        tf = _tflops(shape, t.median_ms)
        ratio = tc_pair.median_ms / t.median_ms
        row = report.add(Row("hgemm", case, name, t.median_us, tf, "TFLOP/s", 100.0 * ratio, {"cuBLAS": ratio},
                             {"config": cfg.label(), "rel_err_vs_cublas": err, "cublas_paired_us": tc_pair.median_us}))
        if err > tol:
            report.notes.append(f"WARNING: {row.impl} at {row.case} differs from cuBLAS: rel err {err:.3g}")
    del a, b, ref
    torch.cuda.empty_cache()
    return cub


def run(args) -> Report:
    import importlib

    ops = importlib.import_module("tilefish.ops.hgemm")  # the module (the package may re-export the function)

    dtype = _dtype(args)
    dname = "bf16" if dtype == torch.bfloat16 else "fp16"
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3
    reps = getattr(args, "reps", 50) or 50
    given = getattr(args, "shapes", None)
    shapes = [_shape3(s) for s in given] if given else list(DEFAULT_SHAPES)
    variants = bool(getattr(args, "variants", False))

    props = torch.cuda.get_device_properties(0)
    sm90 = props.major * 10 + props.minor == 90
    steps = [s for s in ops.KERNELS if sm90 or not ops.STEPS[s].hopper]
    report = Report(f"HGEMM {dname} C = A @ B (fp32 accumulation; mma.sync steps 01-06, wgmma step 07): "
                    "ladder steps vs cuBLAS")
    report.notes.append(PEAK_NOTE)
    report.notes.append(f"% ceil = x cuBLAS as a percentage: cuBLAS {dname} (torch.matmul) at the same shape, "
                        "re-timed in 3 rounds alternating with each kernel (same clocks); the cuBLAS row is timed alone")
    for shape in shapes:
        cub = _compare(report, ops, "", shape, dtype, False, steps + ["auto"], reps, tol)
        if shape in DEFAULT_SHAPES or len(shapes) == 1:
            report.ceilings[f"cuBLAS {dname} TFLOP/s @{_case(shape)}"] = cub

    if not given:
        for s in SWEEP:
            _compare(report, ops, "sweep ", (s, s, s), dtype, False, ["auto", ops.AUTO_STEP], reps, tol)
        for k, n in LLM_KN:
            for m in LLM_MS:
                _compare(report, ops, "llm ", (m, n, k), dtype, True, ["auto", ops.AUTO_STEP], reps, tol)

    if variants:
        shape = shapes[0]
        cfgs = ops.variant_configs(sm90=sm90)
        _compare(report, ops, "variants ", shape, dtype, False, cfgs, min(reps, 20), tol)
        best = max((r for r in report.rows if r.case.startswith("variants") and r.impl.startswith("tilefish[")),
                   key=lambda r: r.metric, default=None)
        if best is not None:
            report.notes.append(f"best variant at {_case(shape)}: {best.extra['config']} ({best.metric:.1f} TFLOP/s)")

    if sm90:  # how many clusters fit at once decides the persistent grid of step 07
        from ..hgemm import plan

        m, n, k = DEFAULT_SHAPES[-1]  # more tiles than SMs: the persistent grid is the GPU's capacity
        for cfg in (ops.TUNED["07_wgmma_tma"], ops.TUNED_SMALL["07_wgmma_tma"]):
            if cfg.CLUSTER > 1:
                p = plan(m, n, k, dtype=dtype, kernel=cfg)
                report.notes.append(f"{p.label}: {p.ctas // p.cluster} clusters of {p.cluster} resident at once "
                                    f"({p.ctas} of {p.gpu.sm_count} SMs)")

    # Host overhead per call: a tiny problem, so the GPU keeps up and the host is what is timed.
    sa, sb = torch.randn(64, 64, device="cuda", dtype=dtype), torch.randn(64, 64, device="cuda", dtype=dtype)
    sc = torch.empty(64, 64, device="cuda", dtype=dtype)
    us = host_overhead_us(lambda: ops.hgemm(sa, sb))
    us_cub = host_overhead_us(lambda: torch.matmul(sa, sb, out=sc))
    report.notes.append(f"host overhead per call (64^3, wrapper + launch): tilefish {us:.1f} us, "
                        f"torch.matmul {us_cub:.1f} us")
    return report


def run_auto(shapes, dtype: str = "fp16", reps: int = 50) -> Report:
    """kernel="auto" against cuBLAS (paired rounds) at each (shape, b as [N, K], label): run()'s comparison,
    one kernel a shape (the all-families quick run's HGEMM part)."""
    import importlib

    ops = importlib.import_module("tilefish.ops.hgemm")
    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    report = Report(f'HGEMM {dtype} C = A @ B (fp32 accumulation): kernel="auto" vs cuBLAS')
    report.notes.append(PEAK_NOTE)
    report.notes.append("% ceil = x cuBLAS as a percentage, cuBLAS re-timed in rounds alternating with the kernel; "
                        "`tilefish bench hgemm` runs every ladder step and the sweeps")
    for shape, nk, label in shapes:
        cub = _compare(report, ops, label, tuple(shape), dt, nk, ["auto"], reps, 2e-2 if dtype == "bf16" else 5e-3)
        if not nk:
            report.ceilings[f"cuBLAS {dtype} TFLOP/s @{_case(shape)}"] = cub
    return report


def kernel_specs(info, shapes, steps=("auto",), dtype: str = "fp16") -> list:
    """The KernelSpecs the ladder `steps` launch for ((m, n, k), b as [N, K]) pairs on the device `info`
    (device_info()): tilefish.hgemm.plan's for each; step 07 (sm_90a) only on sm_90, as run() times it."""
    import importlib

    from ..hgemm import plan
    from ..runtime import GpuSpec

    ops = importlib.import_module("tilefish.ops.hgemm")
    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    gpu = GpuSpec.of(info)
    return [plan(m, n, k, dtype=dt, b_transposed=nk, kernel=step, gpu=gpu).kernel_spec
            for (m, n, k), nk in shapes for step in steps
            if gpu.cc == 90 or not _hopper_only(ops, step)]  # off sm_90 the plan of step 07 raises


def _hopper_only(ops, kernel) -> bool:
    """kernel (a step name or an HgemmConfig; "auto" is not) runs on sm_90 only."""
    if isinstance(kernel, ops.HgemmConfig):
        return kernel.info.hopper
    return kernel in ops.STEPS and ops.STEPS[kernel].hopper
