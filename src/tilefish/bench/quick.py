"""`tilefish bench` without a family: every family, one progress bar, one summary screen.

The default is the quick run: a representative handful of cases per family (QUICK_* below), each through
the family's own bench function (bench/w4a16.py, nf4.py, hgemm.py's comparison, e2e.py; SGEMM's auto rows
with bench/sgemm.py's helpers), sized to finish in cli.QUICK_RUN_TIME (under two minutes on an H100, compilation
included: the words `tilefish bench --help` and the README use).
`--full` runs each family's complete default sweep instead (what `tilefish bench` ran before: suites.FAMILIES
with no family named). Either way:

- the kernels the run will launch are compiled first, in parallel processes, into the disk cache;
- a progress bar (bench/progress.py) counts the cases across families, with an ETA from estimated case
  times (ESTIMATE: an H100's rates through the timing harness's own structure);
- the results go to one directory (default ./tilefish-results/<gpu>-<date>/): a JSON per family (the same
  records `tilefish bench <family> --json` writes, `tilefish table` prints them), their PNGs, summary.json
  (the tilefish rows of every family, the headlines, how the run went) and tables.txt (every table);
- one summary screen: per family its headline ratios against each peer and the ceiling, median and worst
  over the cases;
- Ctrl-C stops the run: what was measured is written and summarized as above, marked interrupted; exit 130.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import io
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .progress import Case, Phase, Tracker, make_display, warm_kernels
from .report import Report, Row, on_row

# ---- the quick plan -------------------------------------------------------------------------------------------

# W4A16: Llama-3 8B o_proj (the host-cost note's shape too), 8B down_proj, 70B gate_up (fused): small, k-heavy,
# large; decode (1, 16) and prefill-sized (256, 4096) m; both activation dtypes, group 128.
QUICK_W4A16_KN = [(4096, 4096), (14336, 4096), (8192, 57344)]
QUICK_W4A16_M = [1, 16, 256, 4096]
QUICK_W4A16_DTYPES = ("fp16", "bf16")
QUICK_W4A16_GROUP = 128
# NF4: the dequantization at two sizes (against bitsandbytes where importable and the copy ceiling), the fused
# matmul on bench nf4's --quick shapes at m 1, 16, 256 (against cuBLAS, bitsandbytes, W4A16 of the same group).
QUICK_NF4_DEQUANT = [(8192, 8192), (16384, 16384)]
QUICK_NF4_M = [1, 16, 256]
QUICK_NF4_DTYPE = "bf16"
# SGEMM: kernel="auto" (the ladder's best step) against cuBLAS fp32 at three cubes.
QUICK_SGEMM_SIZES = (1024, 2048, 4096)
# HGEMM: kernel="auto" against cuBLAS at the two square sizes of bench hgemm and one decode-sized projection
# (m 16, b as an nn.Linear weight [N, K]).
QUICK_HGEMM = [((4096, 4096, 4096), False, ""), ((8192, 8192, 8192), False, ""), ((16, 14336, 4096), True, "llm ")]
QUICK_HGEMM_DTYPE = "fp16"
# e2e: the Llama-3-8B-shaped decoder at 8 layers, fp16 against tilefish W4A16, compiled (torch.compile per
# layer + CUDA graph), decode batch 1; and the same model through HF's generate() (static cache, its own
# compile: the user's loop), 64 new tokens at batch 1.
QUICK_E2E = dict(layers=8, batches=[1], prefill=[], modes=["compiled"], impls=["fp16", "w4a16"])
QUICK_GENERATE = dict(batches=[1], impls=["fp16", "w4a16"], new_tokens=64)
GENERATE_REPS = 3         # generate() calls timed per length (each is a whole generation)
GENERATE_COMPILE_S = 1.5

FAMILY_ORDER = ("w4a16", "nf4", "sgemm", "hgemm", "e2e")
FAMILY_NAMES = {"w4a16": "W4A16 GEMM (int4 weights, fp16/bf16 activations)", "nf4": "NF4 (bitsandbytes-format weights)",
                "sgemm": "SGEMM fp32 (ladder)", "hgemm": "HGEMM fp16 (ladder)", "e2e": "End-to-end decoder"}

# ---- case times, estimated (seconds on an H100 SXM), for the ETA -------------------------------------------------
# The harness's structure (bench/timing.py) with an H100's rates: each timed block settles for WARM_MS (at most
# WARM_MAX_CALLS calls), then every rep reads the L2 flush buffer (256 MiB), spins ~50 us and runs the kernel.
HBM_BPS = 3.0e12          # bytes/s a kernel streams from HBM
TENSOR_FLOPS = 650e12     # fp16/bf16 dense, cuBLAS-class
FP32_FLOPS = 50e12        # FFMA, cuBLAS-class
HOST_S = 25e-6            # one eager call's host time
FLUSH_S = (256 << 20) / HBM_BPS
SPIN_S = 50e-6
NVRTC_S = 1.0             # one kernel's NVRTC 13.0 compile: 0.2-0.9 s each (the quick run's 31, on a 2-core CPU)
COMPILE_START_S = 4.0     # the compile processes' start (each imports torch)
INDUCTOR_S = (20.0, 8.0)  # torch.compile of a decoder layer: the first variant (cold), each later one


def kernel_s(nbytes: float, flops: float, peak: float = TENSOR_FLOPS) -> float:
    return max(nbytes / HBM_BPS, flops / peak) + 4e-6


def samples_s(t: float, reps: int, warmup: int = 5, min_reps: int = 10, max_seconds: float = 5.0) -> float:
    """timing._samples_ms's time for a kernel of t seconds."""
    from .timing import WARM_MAX_CALLS, WARM_MS

    call = max(t, HOST_S)
    settle = warmup * call + min(WARM_MS / 1e3, WARM_MAX_CALLS * call)
    n = max(min_reps, min(reps, int(max_seconds / max(t, 1e-6))))
    return settle + call + n * (FLUSH_S + SPIN_S + t) + 2e-3


def paired_s(t_a: float, t_b: float, reps: int, rounds: int = 3) -> float:
    """timing.time_paired's time."""
    per = max(10, -(-reps // rounds))
    return rounds * sum(samples_s(t, per, 5, min(10, per), 5.0 / rounds) for t in (t_a, t_b))


def alternating_s(times, rounds: int = 4, per_round: int = 13, warmup: int = 2) -> float:
    """timing.time_alternating_us's time."""
    return rounds * sum(samples_s(t, per_round, warmup, per_round, 10.0) for t in times)


def w4a16_case_s(m: int, k: int, n: int, reps: int) -> float:
    t_cublas = kernel_s(2 * n * k + 2 * m * (k + n), 2 * m * n * k)
    t_ours = kernel_s(n * k / 2 + n * k / 64 + 2 * m * (k + n), 2 * m * n * k, 0.95 * TENSOR_FLOPS)
    return paired_s(t_ours, t_cublas, reps) + (0.5 if t_cublas > 1e-3 else 0.0) + 0.01


def nf4_matmul_case_s(m: int, k: int, n: int, reps: int) -> float:
    t_ours = kernel_s(n * k / 2 + n * k / 32 + 2 * m * (k + n), 2 * m * n * k, 0.9 * TENSOR_FLOPS)
    t_cublas = kernel_s(2 * n * k + 2 * m * (k + n), 2 * m * n * k)
    t_bnb = 2 * t_ours if m <= 16 else t_cublas + 2.5 * n * k / HBM_BPS
    per_round = max(4, -(-reps // 4))
    return alternating_s([t_ours, t_cublas, t_ours, t_bnb], 4, per_round, 3) + 0.05 + (0.5 if t_cublas > 1e-3 else 0)


def gemm_case_s(m: int, n: int, k: int, reps: int, fp32: bool = False, paired: bool = True,
                slowdown: float = 1.0) -> float:
    t_cublas = kernel_s(4 * (m * k + k * n + m * n), 2 * m * n * k, FP32_FLOPS if fp32 else TENSOR_FLOPS)
    t_ours = t_cublas * slowdown
    slow = slowdown > 4  # the ladder's first steps: 1 warm-up call, 3 reps at least
    ours = samples_s(t_ours, reps, 1 if slow else 5, 3 if slow else 10)
    if paired and not slow:
        ours = paired_s(t_ours, t_cublas, reps)
    return samples_s(t_cublas, reps) + ours + 0.05


def e2e_impl_s(layers: int, first: bool, batches: int, reps: int) -> float:
    """One variant of the e2e run: build + quantize, the logits check, compile + capture per batch size, timing."""
    build = 1.0 + 0.25 * layers
    compile_s = INDUCTOR_S[0] if first else INDUCTOR_S[1]
    step = layers * 250e-6 + 0.4e-3
    return build + 0.5 + batches * (compile_s * (1 if batches == 1 else 0.6) + 0.5 + samples_s(step, reps))


def compile_s(kernels: int, processes: int) -> float:
    return math.ceil(kernels / max(1, processes)) * NVRTC_S + (COMPILE_START_S if kernels else 0.0)


# ---- steps: one call of a family's bench function ---------------------------------------------------------------

def _tilefish_row(row: Row) -> bool:
    return row.impl.startswith("tilefish")


@dataclass
class Step:
    """One call of a family's bench function: the cases it will report (a row each, in order; `counts` says
    which rows are cases), its kernels (for warming the cache: fn(device info) -> KernelSpecs) and the call."""
    family: str
    title: str
    cases: list[Case]
    run: Callable[[], Report]
    kernels: Callable = lambda info: []
    counts: Callable[[Row], bool] = _tilefish_row
    merge: Callable | None = None  # fn(reports) -> one Report, where a family takes several steps

    def phase(self) -> Phase:
        return Phase(self.title, self.cases)


_DT = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def _torch_dtype(name: str):
    import torch

    return getattr(torch, _DT[name])


def w4a16_kernels(info, shapes, ms, dtypes, group: int, codebooks=("int4",)) -> list:
    """The kernels the dispatcher picks for these calls on this device (tuned table first, as matmul_impl)."""
    from .. import w4a16
    from ..ops import w4a16 as ops
    from ..runtime import GpuSpec

    gpu = GpuSpec.of(info)
    specs = []
    for d in dtypes:
        dt = _torch_dtype(d)
        for k, n in shapes:
            for m in ms:
                for cb in codebooks:
                    cfg = w4a16.plan(m, n, k, group_size=group, dtype=dt, codebook=cb, gpu=gpu).config
                    specs.append(ops.kernel_spec(dt, cfg, group, False, cb))
    return specs


def _w4a16_step(shapes, ms, groups, dtypes, reps, title: str = "W4A16 vs cuBLAS") -> Step:
    from . import w4a16

    kn = shapes if shapes is not None else w4a16.select_shapes()[0]
    cases = []
    for d in dtypes:
        for i, (k, n) in enumerate(kn):
            for g in groups:
                for j, m in enumerate(ms):
                    w = w4a16_case_s(m, k, n, reps) + (0.1 if j == 0 else 0.0)
                    cases.append(Case(f"{d} k{k} n{n} g{g} m{m}", w))
    cases[0].weight += 0.5     # the copy ceiling
    cases[-1].weight += 1.0    # the host-cost note
    return Step("w4a16", title, cases,
                lambda: w4a16.run(shapes=kn, ms=ms, groups=groups, dtypes=dtypes, reps=reps),
                lambda info: [s for g in groups for s in w4a16_kernels(info, kn, ms, dtypes, g)])


def _nf4_steps(dequant_shapes, kn, ms, dtypes, reps, blocksize=64, double_quant=True) -> list[Step]:
    from ..ops import nf4 as nf4_ops
    from . import nf4

    steps = []
    if dequant_shapes:
        cases = [Case(f"dequantize {r}x{c}", 2 * samples_s(kernel_s(r * c * 2.6, 0), reps) + 0.1)
                 for r, c in dequant_shapes]
        cases[0].weight += 0.8   # the copy and write ceilings
        cases[-1].weight += 0.3  # host overhead
        steps.append(Step("nf4", "NF4 dequantize vs bitsandbytes", cases,
                          lambda: nf4.run(shapes=dequant_shapes, dtype=dtypes[0], blocksize=blocksize,
                                          double_quant=double_quant, reps=reps),
                          lambda info: [nf4_ops.kernel_spec(_torch_dtype(dtypes[0]), double_quant)],
                          lambda r: r.impl == "tilefish"))
    if kn:
        group = min(blocksize, 128)
        cases = [Case(f"matmul {d} k{k} n{n} m{m}", nf4_matmul_case_s(m, k, n, reps) + (0.5 if j == 0 else 0.0))
                 for d in dtypes for k, n in kn for j, m in enumerate(ms)]
        cases[0].weight += 0.5   # cuBLAS' peak, the warm-up check
        cases[-1].weight += 1.0  # the host-cost note
        steps.append(Step("nf4", "NF4 fused matmul vs cuBLAS, bitsandbytes, W4A16", cases,
                          lambda: nf4.run_matmul(shapes=kn, ms=ms, dtypes=dtypes, blocksize=blocksize,
                                                 double_quant=double_quant, reps=reps),
                          lambda info: w4a16_kernels(info, kn, ms, dtypes, group, ("nf4", "int4"))))
    steps[-1].merge = _merge_nf4
    return steps


def _merge_nf4(reports: list[Report]) -> Report:
    from . import nf4

    if len(reports) == 1:
        return nf4.combine(reports[0], None) if not _is_matmul(reports[0]) else nf4.combine(None, reports[0])
    return nf4.combine(reports[0], reports[1])


def _is_matmul(rep: Report) -> bool:
    from . import nf4

    return any(r.family == nf4.MATMUL_FAMILY for r in rep.rows)


def sgemm_auto(sizes, reps: int = 50) -> Report:
    """kernel="auto" (the ladder's best step) against cuBLAS fp32 at S^3: bench/sgemm.py's sweep rows, timed
    with its helpers, without the ladder's slow first steps."""
    import importlib

    import torch

    from . import sgemm as bs
    from .timing import time_cuda

    ops = importlib.import_module("tilefish.ops.sgemm")
    report = Report('SGEMM fp32 C = A @ B (TF32 off): kernel="auto" (the best ladder step) vs cuBLAS')
    report.notes.append(bs.FFMA_PEAK_NOTE)
    report.notes.append("% ceil = % of cuBLAS fp32 at the same shape, measured in this process; "
                        "`tilefish bench sgemm` runs every ladder step")
    for s in sizes:
        shape = (s, s, s)
        a, b = bs._operands(shape)
        ref = torch.empty(s, s, device="cuda")
        c = torch.empty_like(ref)
        tc = bs._time_cublas(a, b, ref, reps)
        cub = bs._tflops(shape, tc.median_ms)
        report.ceilings[f"cuBLAS fp32 TFLOP/s @{bs._case(shape)}"] = cub
        report.add(Row("sgemm", bs._case(shape), "cuBLAS", tc.median_us, cub, "TFLOP/s", 100.0, {}))
        fn = lambda: ops.sgemm(a, b, c)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        err = bs._rel(c, ref)
        t = time_cuda(fn, reps=reps)
        cfg = ops.select(s, s, ops.vector_ok(a, b, c), "auto")
        tf = bs._tflops(shape, t.median_ms)
        row = report.add(Row("sgemm", bs._case(shape), "tilefish auto", t.median_us, tf, "TFLOP/s", 100.0 * tf / cub,
                             {"cuBLAS": tc.median_ms / t.median_ms}, {"config": cfg.label(), "rel_err_vs_cublas": err}))
        if err > 1e-4:
            report.notes.append(f"WARNING: {row.impl} at {row.case} differs from cuBLAS: rel err {err:.3g}")
        del a, b, c, ref
        torch.cuda.empty_cache()
    return report


def hgemm_auto(shapes, dtype: str = "fp16", reps: int = 50) -> Report:
    """kernel="auto" against cuBLAS (paired rounds) at each (shape, b as [N, K], label): bench/hgemm.py's
    comparison, one kernel a shape."""
    import importlib

    from . import hgemm as bh

    ops = importlib.import_module("tilefish.ops.hgemm")
    dt = _torch_dtype(dtype)
    report = Report(f'HGEMM {dtype} C = A @ B (fp32 accumulation): kernel="auto" vs cuBLAS')
    report.notes.append(bh.PEAK_NOTE)
    report.notes.append("% ceil = x cuBLAS as a percentage, cuBLAS re-timed in rounds alternating with the kernel; "
                        "`tilefish bench hgemm` runs every ladder step and the sweeps")
    for shape, nk, label in shapes:
        cub = bh._compare(report, ops, label, tuple(shape), dt, nk, ["auto"], reps, 2e-2 if dtype == "bf16" else 5e-3)
        if not nk:
            report.ceilings[f"cuBLAS {dtype} TFLOP/s @{bh._case(shape)}"] = cub
    return report


def _gemm_kernels(info, family: str, shapes, steps=("auto",), dtype: str = "fp16") -> list:
    import importlib

    ops = importlib.import_module(f"tilefish.ops.{family}")
    specs = []
    for shape, nk in shapes:
        m, n, _ = shape
        for step in steps:
            if family == "sgemm":
                specs.append(ops.select(m, n, True, step, info.sm_count).spec)
            else:
                cfg = ops.select(m, n, step, info.sm_count, info.cc, info.smem_per_block_optin)
                if cfg.info.hopper and info.cc != 90:
                    continue
                specs.append(cfg.spec(_torch_dtype(dtype), nk))
    return specs


# The e2e model's W4A16 linears (Llama-3-8B, q/k/v and gate/up fused; lm_head stays fp16): (k, n).
E2E_LINEARS = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def _e2e_step(args, layers, batches, prefill, modes, impls, title_note, reps, generate=None) -> Step:
    """generate: e2e_generate.run's batches / impls / new_tokens for its rows in the same report, or None."""
    from . import e2e, e2e_generate

    timed = [i for i in e2e.IMPLS if i in impls]
    cases, first = [], True
    per_impl = {}
    for impl in ["fp16"] + [i for i in timed if i != "fp16"]:
        per_impl[impl] = e2e_impl_s(layers, first, len(batches) + len(prefill), reps) * len(modes)
        first = False
    for mode in modes:
        for size in list(batches) + list(prefill):
            for impl in timed:
                cases.append(Case(f"{mode} {'decode b' if size in batches else 'prefill '}{size} {impl}",
                                  per_impl[impl] / (len(modes) * (len(batches) + len(prefill)))))
    for batch in (generate or {}).get("batches", []):
        for impl in generate["impls"]:
            calls = 2 + 2 * GENERATE_REPS + 2  # warm-ups, timed N and 1 tokens, the profiled pair
            cases.append(Case(f"generate b{batch} {impl}", 1.0 + 0.25 * layers + GENERATE_COMPILE_S * layers
                              + calls * generate["new_tokens"] * (layers * 250e-6 + 1.5e-3)))

    def kernels(info):
        ms = sorted(set(batches) | set(prefill) | {e2e.CHECK_TOKENS})
        specs = []
        if "w4a16" in timed:
            specs += w4a16_kernels(info, E2E_LINEARS, ms, ["fp16"], 128)
        if "tilefish-nf4" in timed:
            specs += w4a16_kernels(info, E2E_LINEARS, ms, ["fp16"], 64, ("nf4",))
        return specs

    def run():
        report = e2e.run(layers=layers, batches=batches, prefill=prefill, modes=modes, impls=impls,
                         model=args.model, reps=reps, title_note=title_note)
        if generate and e2e._has_transformers():
            e2e_generate.run(layers=layers, report=report, reps=GENERATE_REPS, **generate)
        return report

    return Step("e2e", "End-to-end decoder", cases, run, kernels, lambda r: True)


def quick_plan(args) -> list[Step]:
    """The quick run: QUICK_* above, through the families' own bench functions."""
    reps = args.reps
    kn_nf4 = _nf4_kn()
    steps = [_w4a16_step(QUICK_W4A16_KN, QUICK_W4A16_M, [QUICK_W4A16_GROUP], list(QUICK_W4A16_DTYPES), reps)]
    steps += _nf4_steps(QUICK_NF4_DEQUANT, kn_nf4, QUICK_NF4_M, [QUICK_NF4_DTYPE], reps)
    steps.append(Step("sgemm", "SGEMM auto vs cuBLAS",
                      [Case(f"{s}^3", gemm_case_s(s, s, s, reps, fp32=True, paired=False, slowdown=1.08))
                       for s in QUICK_SGEMM_SIZES],
                      lambda: sgemm_auto(QUICK_SGEMM_SIZES, reps),
                      lambda info: _gemm_kernels(info, "sgemm", [((s, s, s), False) for s in QUICK_SGEMM_SIZES])))
    steps.append(Step("hgemm", "HGEMM auto vs cuBLAS",
                      [Case(f"{label}{'x'.join(map(str, shape))}", gemm_case_s(*shape, reps))
                       for shape, nk, label in QUICK_HGEMM],
                      lambda: hgemm_auto(QUICK_HGEMM, QUICK_HGEMM_DTYPE, reps),
                      lambda info: _gemm_kernels(info, "hgemm", [(s, nk) for s, nk, _ in QUICK_HGEMM],
                                                 dtype=QUICK_HGEMM_DTYPE)))
    q = QUICK_E2E
    steps.append(_e2e_step(args, q["layers"], q["batches"], q["prefill"], q["modes"], q["impls"],
                           f" [quick: {q['layers']} layers, decode b{','.join(map(str, q['batches']))}, compiled; "
                           "`tilefish bench e2e` runs the full set]", reps, QUICK_GENERATE))
    return steps


def _nf4_kn():
    from . import nf4

    return list(nf4.QUICK_KN)


def full_plan(args) -> list[Step]:
    """Each family's complete default run, as suites.FAMILIES runs it with no family named (nf4 and e2e
    reduced, as the all-families run always had them), with its cases estimated for the progress bar."""
    import importlib

    from . import e2e, e2e_generate, hgemm, nf4, sgemm, suites, w4a16

    reps = args.reps
    fam = lambda name: (lambda: suites.FAMILIES[name](args))  # noqa: E731
    steps = []
    # nf4: the dequantization's quick set and the matmul's (suites._nf4 with no family)
    nf4_steps = _nf4_steps(args.shapes or nf4.QUICK_SHAPES, nf4.QUICK_KN, nf4.QUICK_M,
                           [args.dtype if args.dtype in nf4.MATMUL_DTYPES else "bf16"], reps, args.blocksize,
                           not args.single_quant)
    cases = [c for s in nf4_steps for c in s.cases]
    steps.append(Step("nf4", "NF4 dequantize + fused matmul", cases, fam("nf4"),
                      lambda info: [k for s in nf4_steps for k in s.kernels(info)],
                      lambda r: r.impl == "tilefish" or r.family == nf4.MATMUL_FAMILY))
    # w4a16: the default Llama-3 set
    ws = _w4a16_step(None, w4a16.DEFAULT_M, [128, -1], ["fp16", "bf16"], reps)
    ws.run = fam("w4a16")
    steps.append(ws)
    # sgemm: the ladder at 4096^3, then auto over the sweep
    sg_ops = importlib.import_module("tilefish.ops.sgemm")
    slow = (100.0, 8.1, 6.1, 3.0, 1.67, 1.44, 1.17, 1.14, 1.08)
    s0 = sgemm.DEFAULT_SHAPE
    cases = [Case(f"{s0[0]}^3 {step}", gemm_case_s(*s0, reps, fp32=True, paired=False, slowdown=sl) / 2 + 0.05)
             for step, sl in zip(sg_ops.KERNELS, slow)]
    cases[0].weight += samples_s(kernel_s(0, 2 * s0[0] ** 3, FP32_FLOPS), reps)
    cases += [Case(f"sweep {s}^3", gemm_case_s(s, s, s, reps, fp32=True, paired=False, slowdown=1.1))
              for s in sgemm.SWEEP]
    steps.append(Step("sgemm", "SGEMM ladder + auto sweep", cases, fam("sgemm"),
                      lambda info: _gemm_kernels(info, "sgemm", [(s0, False)], sg_ops.KERNELS)
                      + _gemm_kernels(info, "sgemm", [((s, s, s), False) for s in sgemm.SWEEP])))
    # hgemm: every step at 4096^3 and 8192^3, auto and step 06 over the sweeps
    hg_ops = importlib.import_module("tilefish.ops.hgemm")
    dname = "bf16" if str(args.dtype) == "bf16" else "fp16"
    cases = []
    for shape in hgemm.DEFAULT_SHAPES:
        for step in list(hg_ops.KERNELS) + ["auto"]:
            cases.append(Case(f"{shape[0]}^3 {step}",
                              gemm_case_s(*shape, reps, slowdown=20.0 if step in hgemm.SLOW_STEPS else 1.3) / 1.5))
    cases += [Case(f"sweep {s}^3 {k}", gemm_case_s(s, s, s, reps) / 1.5) for s in hgemm.SWEEP for k in ("auto", "06")]
    cases += [Case(f"llm {m}x{n}x{k} {s}", gemm_case_s(m, n, k, reps) / 1.5)
              for k, n in hgemm.LLM_KN for m in hgemm.LLM_MS for s in ("auto", "06")]
    steps.append(Step("hgemm", "HGEMM ladder + sweeps", cases, fam("hgemm"),
                      lambda info: _gemm_kernels(info, "hgemm", [(s, False) for s in hgemm.DEFAULT_SHAPES],
                                                 list(hg_ops.KERNELS) + ["auto"], dname)
                      + _gemm_kernels(info, "hgemm", [((s, s, s), False) for s in hgemm.SWEEP],
                                      ["auto", hg_ops.AUTO_STEP], dname)
                      + _gemm_kernels(info, "hgemm", [((m, n, k), True) for k, n in hgemm.LLM_KN for m in hgemm.LLM_MS],
                                      ["auto", hg_ops.AUTO_STEP], dname)))
    # e2e: suites._e2e's reduced run (8 layers, decode b1 / b16, compiled, every variant)
    es = _e2e_step(args, 8, [1, 16], [], ["compiled"], list(e2e.IMPLS), "", reps,
                   dict(batches=[1, 16], impls=list(e2e_generate.IMPLS), new_tokens=e2e_generate.NEW_TOKENS))
    es.run = fam("e2e")
    steps.append(es)
    # The rows of the hgemm steps that are not sm_90's (step 07) do not come on other GPUs: end_phase settles them.
    return steps


# ---- the headlines: per family, each peer and the ceiling, median and worst over the cases ----------------------

def _m(r: Row):
    return r.extra.get("m")


def _groups_by_m(rows, groups=(("m<=16", 1, 16), ("m 17-128", 17, 128), ("m>=256", 256, 1 << 30))):
    for label, lo, hi in groups:
        sel = [r for r in rows if _m(r) is not None and lo <= _m(r) <= hi]
        if sel:
            yield label, sel


def stat(values: list[tuple[float, str]]) -> dict:
    """{median, worst (the least), worst_case, n} over (value, case) pairs (median: the middle of the sorted
    values, the mean of the two middle ones for an even count)."""
    vals = sorted(values)
    return {"median": statistics.median(v for v, _ in vals), "worst": vals[0][0], "worst_case": vals[0][1],
            "n": len(vals)}


def _ratio_line(label: str, rows, peer: str | Callable, case=lambda r: r.case) -> dict | None:
    pairs = []
    for r in rows:
        name = peer if isinstance(peer, str) else next((p for p in r.ratios if peer(p)), None)
        if name in r.ratios:
            pairs.append((r.ratios[name], case(r)))
    return dict(label=label, unit="x", **stat(pairs)) if pairs else None


def _pct_line(label: str, rows, case=lambda r: r.case) -> dict | None:
    pairs = [(r.pct_ceiling, case(r)) for r in rows if r.pct_ceiling is not None]
    return dict(label=label, unit="%", **stat(pairs)) if pairs else None


def _ceiling(rep: Report, prefix: str) -> str:
    for name, v in rep.ceilings.items():
        if name.startswith(prefix):
            return f" ({v:,.0f} {name[len(prefix):].strip() or 'GB/s'})"
    return ""


def family_headlines(family: str, rep: Report) -> list[dict]:
    """The headline lines of one family's report: [{label, unit, median, worst, worst_case, n}]."""
    ok = lambda r: "CHECK FAILED" not in r.impl  # noqa: E731 - a failed row's time is not evidence
    rows = [r for r in rep.rows if ok(r)]
    out: list[dict | None] = []
    if family == "w4a16":
        ours = [r for r in rows if r.impl == "tilefish"]
        for g, sel in _groups_by_m(ours):
            out.append(_ratio_line(f"vs cuBLAS, {g}", sel, "cuBLAS"))
        for g, sel in _groups_by_m(ours, (("m<=16", 1, 16),)):
            out.append(_pct_line(f"of copy bandwidth{_ceiling(rep, 'copy')}, {g}", sel))
    elif family == "nf4":
        from .nf4 import MATMUL_FAMILY

        deq = [r for r in rows if r.family == "nf4" and r.impl == "tilefish"]
        out.append(_pct_line(f"dequantize, of copy bandwidth{_ceiling(rep, 'copy')}", deq))
        out.append(_ratio_line("dequantize vs bitsandbytes", deq, "bitsandbytes"))
        mm = [r for r in rows if r.family == MATMUL_FAMILY]
        for peer, name in (("cuBLAS", "cuBLAS"), ("bitsandbytes", "bitsandbytes"),
                           (lambda p: p.startswith("W4A16"), "W4A16 (int4, same group)")):
            for g, sel in _groups_by_m(mm):
                out.append(_ratio_line(f"matmul vs {name}, {g}", sel, peer))
    elif family in ("sgemm", "hgemm"):
        auto = [r for r in rows if r.impl == "tilefish auto"]
        square = [r for r in auto if not r.case.startswith("llm")]
        llm = [r for r in auto if r.case.startswith("llm")]
        what = "auto (best ladder step)" if family == "sgemm" else "auto"
        out.append(_ratio_line(f"{what} vs cuBLAS" + (", square" if llm else ""), square, "cuBLAS"))
        out.append(_ratio_line(f"{what} vs cuBLAS, LLM projections", llm, "cuBLAS"))
    elif family == "e2e":
        for impl in dict.fromkeys(r.impl for r in rows if "fp16" in r.ratios):
            for r in (r for r in rows if r.impl == impl):
                out.append(_ratio_line(f"{impl} vs fp16, {re.sub(r' ctx[0-9]+', '', r.case)}", [r], "fp16",
                                       lambda r: f"{r.metric:,.0f} {r.unit}"))
    return [h for h in out if h is not None]


def _fmt_value(v: float, unit: str) -> str:
    return f"{v:.2f}x" if unit == "x" else f"{v:.0f}%"


def format_headline(h: dict, width: int = 44) -> str:
    if h["n"] == 1:
        return f"  {h['label']:<{width}} {_fmt_value(h['median'], h['unit']):>14}  {h['worst_case']}"
    return (f"  {h['label']:<{width}} median {_fmt_value(h['median'], h['unit']):>7}   worst "
            f"{_fmt_value(h['worst'], h['unit']):>7}  {h['worst_case']}  ({h['n']} cases)")


def _family_header(fam: str, rep: Report) -> str:
    name = FAMILY_NAMES[fam]
    layers = next((r.extra.get("layers") for r in rep.rows if r.extra.get("layers")), None)
    if fam == "e2e" and layers:
        name += f", Llama-3-8B shapes, {layers} layers"
    return f"{name}  [{len(rep.rows)} rows]"


def _caveats(rep: Report) -> list[str]:
    """The notes that change what the headlines compare (a peer that did not run)."""
    out = []
    for n in rep.notes:
        if re.search(r"not importable|skipped", n) and not n.startswith("skipped k"):
            out.append(n if len(n) <= 110 else n[:107] + "...")
    return list(dict.fromkeys(out))


def problems(reports: dict[str, Report]) -> list[str]:
    """Failed checks and warnings the families reported (rows flagged CHECK FAILED, notes saying FAILED,
    WARNING or LARGE)."""
    out = []
    for fam, rep in reports.items():
        out += [f"{fam}: {r.case} {r.impl}" for r in rep.rows if "CHECK FAILED" in r.impl]
        out += [f"{fam}: {n}" for n in rep.notes if re.search(r"FAILED|WARNING|LARGE \(", n)]
    return out


def summary_text(reports: dict[str, Report], *, gpu: str, mode: str, elapsed_s: float, cases_done: int,
                 cases_total: int, out_dir: Path | None, files: dict[str, list[str]], interrupted: bool,
                 notes: list[str] = ()) -> str:
    """The summary screen."""
    lines = [f"tilefish bench ({mode} run) on {gpu}: {cases_done} of {cases_total} cases in {elapsed_s:.0f} s"
             + ("  [INTERRUPTED]" if interrupted else "")]
    lines.append("ratio = peer time / tilefish time (above 1: tilefish is faster); % = of the ceiling measured in the "
                 "same process; median and worst over the cases")
    heads = {fam: family_headlines(fam, rep) for fam, rep in reports.items()}
    width = min(52, max([len(h["label"]) for hs in heads.values() for h in hs] + [20]))
    for fam in FAMILY_ORDER:
        rep = reports.get(fam)
        if rep is None:
            continue
        lines.append("")
        lines.append(_family_header(fam, rep))
        lines += [format_headline(h, width) for h in heads[fam]] or ["  (no comparable rows)"]
        lines += [f"  note: {n}" for n in _caveats(rep)]
    missing = [f for f in FAMILY_ORDER if f not in reports]
    if missing and interrupted:
        lines.append("")
        lines.append(f"not run: {', '.join(missing)}")
    bad = problems(reports)
    lines.append("")
    if bad:
        lines.append(f"{len(bad)} problem(s) reported (see tables.txt):")
        lines += [f"  {b}" for b in bad[:6]] + ([f"  ... {len(bad) - 6} more"] if len(bad) > 6 else [])
    else:
        lines.append("checks: no failed output check or warning in the families' reports")
    lines += list(notes)
    if out_dir is not None:
        lines.append(f"results: {out_dir}/")
        for kind, names in files.items():
            if names:
                lines.append(f"  {kind:<5} {', '.join(names)}")
    if interrupted:
        lines.append("interrupted (Ctrl-C): the results above are the cases finished before it")
    return "\n".join(lines)


# ---- where the results go ---------------------------------------------------------------------------------------

def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    words = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-").split("-")
    words = [w for w in words if w and w not in ("nvidia", "geforce", "tesla")]
    return "-".join(words) or "gpu"


def default_out_dir(gpu_name: str, date: _dt.date | None = None, root: str | Path = "tilefish-results") -> Path:
    return Path(root) / f"{gpu_slug(gpu_name)}-{(date or _dt.date.today()).isoformat()}"


def summary_report(reports: dict[str, Report], title: str) -> Report:
    """Every family's tilefish rows in one Report (what the all-families run's --json always held)."""
    final = Report(title)
    for rep in reports.values():
        final.ceilings.update(rep.ceilings)
        final.rows += [r for r in rep.rows if r.impl.startswith("tilefish")]
        final.notes += rep.notes
    return final


def write_results(out_dir: Path, reports: dict[str, Report], env: dict, run_info: dict,
                  headlines: dict, plots: bool = True) -> dict[str, list[str]]:
    """A JSON (and PNG) per family, summary.json and tables.txt under out_dir; {"json": [...], "png": [...],
    "text": [...]} of the names written."""
    from . import suites

    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, list[str]] = {"json": [], "png": [], "text": []}
    plot_error = None
    tables = []
    for fam, rep in reports.items():
        rep.to_json(out_dir / f"{fam}.json", env=env)
        files["json"].append(f"{fam}.json")
        tables.append(rep.table())
        if fam in suites.SUMMARIES and (s := suites.SUMMARIES[fam](rep)):
            tables.append(s)
        if plots and plot_error is None and rep.rows:
            try:
                rep.plot(out_dir / f"{fam}.png")
                files["png"].append(f"{fam}.png")
            except ImportError as e:
                plot_error = f"no PNG: {e.name or 'matplotlib'} is not installed (pip install 'tilefish[bench]')"
            except Exception as e:  # noqa: BLE001 - a plot never costs the measurements
                files["png"].append(f"({fam}.png failed: {type(e).__name__}: {e})")
    final = summary_report(reports, "tilefish summary (ratios are peer time / tilefish time)")
    final.to_json(out_dir / "summary.json", env=env, run=run_info, headlines=headlines)
    files["json"].append("summary.json")
    (out_dir / "tables.txt").write_text("\n\n".join(tables) + "\n")
    files["text"].append("tables.txt")
    if plot_error:
        files["png"] = [plot_error]
    return files


# ---- the run ----------------------------------------------------------------------------------------------------

class _Collector:
    """Report.add's listener: counts the cases, keeps every Report that got a row (so an interrupted
    family's rows survive the exception that ends its function)."""

    def __init__(self, display):
        self.display = display
        self.step: Step | None = None
        self.seen: dict[int, Report] = {}

    def begin(self, step: Step) -> None:
        self.step = step
        self.seen = {}

    def __call__(self, report: Report, row: Row) -> None:
        self.seen.setdefault(id(report), report)
        if self.step is not None and self.step.counts(row):
            self.display.case_done()

    def partial(self, why: str = "interrupted") -> Report | None:
        """The rows the current step reported before it stopped, in one Report."""
        reps = list(self.seen.values())
        if not reps:
            return None
        out = Report(reps[0].title + f" [{why}]")
        for r in reps:
            out.ceilings.update(r.ceilings)
            out.rows += r.rows
            out.notes += r.notes
        out.notes.append(f"{why}: the rows above are the cases finished before the run stopped")
        return out


class _InnerProgress:
    """Stands in for bench/e2e.py's _Progress (which nf4.run_matmul uses too) during the run: its steps move
    this run's bar instead of drawing a second one."""

    display = None

    def __init__(self, total: int):
        self.total, self.done = max(1, total), -1

    def __enter__(self):
        return self

    def step(self, label: str) -> None:
        self.done += 1
        if self.display is not None:
            self.display.set_inner(self.done / self.total, label)

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def _inner_progress(display):
    from . import e2e

    saved = e2e._Progress
    _InnerProgress.display = display
    e2e._Progress = _InnerProgress
    try:
        yield
    finally:
        e2e._Progress = saved
        _InnerProgress.display = None


class _Tee(io.TextIOBase):
    """stdout while the families run: kept for log.txt, not printed (the summary is the screen)."""

    def __init__(self):
        self.buf = io.StringIO()

    def write(self, s):
        return self.buf.write(s)


def run(args, *, full: bool = False, out: str | None = None, stream=None, plan: list[Step] | None = None,
        device_info=None, environment=None, warm: bool | None = None, display=None) -> int:
    """The all-families run. Returns the exit status: 0; 1 when a family failed (the others still ran, its rows
    so far are kept, the traceback is in log.txt); 130 after Ctrl-C (what was measured is written).
    plan / device_info / environment / display: the tests' replacements (default: quick_plan or full_plan,
    the current GPU, report.environment(), make_display)."""
    from . import report as report_mod

    stream = stream or sys.stderr
    steps = plan if plan is not None else (full_plan(args) if full else quick_plan(args))
    if device_info is None:
        from ..runtime import device_info as _info

        device_info = _info()
    env = environment() if environment is not None else report_mod.environment()
    out_dir = Path(out) if out else default_out_dir(device_info.name)
    warm = (plan is None) if warm is None else warm

    specs: list = []
    if warm:
        for s in steps:
            try:
                specs += s.kernels(device_info)
            except Exception as e:  # noqa: BLE001 - only a head start
                print(f"[tilefish bench] kernel list of {s.title} unavailable: {type(e).__name__}: {e}", file=stream)
        from .progress import uncached

        n_compile = len(uncached(specs, device_info.arch))
    else:
        n_compile = 0
    import os

    processes = max(1, min(16, os.cpu_count() or 1))
    phases = ([Phase("compiling kernels", [Case(f"{n_compile} kernels", compile_s(n_compile, processes), False)])]
              if n_compile else []) + [s.phase() for s in steps]
    tracker = Tracker(phases)
    display = display or make_display(tracker, stream)
    collector = _Collector(display)
    by_family: dict[str, list[Report]] = {}
    notes: list[str] = []
    failed: list[str] = []
    interrupted = False
    log = _Tee()
    offset = 1 if n_compile else 0
    t0 = time.perf_counter()
    try:
        with display, on_row(collector), _inner_progress(display), contextlib.redirect_stdout(log):
            if n_compile:
                display.begin_phase(0)
                try:
                    note = warm_kernels(specs, device_info.arch,
                                        on_done=lambda d, n: display.set_inner(d / n, f"{d}/{n} kernels"),
                                        processes=processes)
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # noqa: BLE001 - the kernels still compile on first use
                    note = f"kernel cache warm-up skipped ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
                notes.append(note)
                display.end_phase()
            for i, step in enumerate(steps):
                display.begin_phase(i + offset)
                collector.begin(step)
                try:
                    rep = step.run()
                except KeyboardInterrupt:
                    raise
                except Exception as e:  # noqa: BLE001 - one family's failure costs neither the others nor its rows
                    import traceback

                    log.write(traceback.format_exc())
                    failed.append(f"{step.title} FAILED ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}); "
                                  "the traceback is in log.txt")
                    display.message(failed[-1])
                    rep = collector.partial("failed")
                collector.step = None
                display.end_phase()
                if rep is not None:
                    by_family.setdefault(step.family, []).append(rep)
    except KeyboardInterrupt:
        interrupted = True
        part = collector.partial()
        if part is not None and collector.step is not None:
            by_family.setdefault(collector.step.family, []).append(part)
    elapsed = time.perf_counter() - t0
    reports = {}
    for fam in FAMILY_ORDER + tuple(f for f in by_family if f not in FAMILY_ORDER):
        reps = by_family.get(fam)
        if not reps:
            continue
        merge = next((s.merge for s in steps if s.family == fam and s.merge), None)
        try:
            reports[fam] = merge(reps) if merge and len(reps) <= 2 else _concat(reps)
        except Exception:  # noqa: BLE001 - never lose rows over a title
            reports[fam] = _concat(reps)
    mode = "full" if full else "quick"
    headlines = {fam: family_headlines(fam, rep) for fam, rep in reports.items()}
    notes = failed + notes
    run_info = {"mode": mode, "interrupted": interrupted, "failed": failed, "elapsed_s": round(elapsed, 1),
                "cases_done": tracker.cases_done, "cases_total": tracker.total_cases, "notes": notes,
                "stdout": log.buf.getvalue()[-20000:]}
    files: dict[str, list[str]] = {}
    try:
        files = write_results(out_dir, reports, env, run_info, headlines)
        if log.buf.getvalue():
            (out_dir / "log.txt").write_text(log.buf.getvalue())
            files["text"].append("log.txt")
    except KeyboardInterrupt:
        interrupted = True
    text = summary_text(reports, gpu=env.get("gpu") or device_info.name, mode=mode, elapsed_s=elapsed,
                        cases_done=tracker.cases_done, cases_total=tracker.total_cases, out_dir=out_dir, files=files,
                        interrupted=interrupted, notes=notes)
    print(text, flush=True)
    if getattr(args, "json", None) or getattr(args, "plot", None):
        final = summary_report(reports, "tilefish summary (ratios are peer time / tilefish time)")
        if args.json:
            final.to_json(args.json, env=env, run=run_info, headlines=headlines)
            print(f"wrote {args.json}")
        if args.plot:
            final.plot(args.plot)
            print(f"wrote {args.plot}")
    return 130 if interrupted else 1 if failed else 0


def _concat(reps: list[Report]) -> Report:
    if len(reps) == 1:
        return reps[0]
    out = Report(" + ".join(dict.fromkeys(r.title for r in reps)))
    for r in reps:
        out.ceilings.update(r.ceilings)
        out.rows += r.rows
        out.notes += r.notes
    return out
