"""`tilefish bench nf4`: NF4 dequantization against bitsandbytes and the copy ceiling, and the fused
NF4 matmul against cuBLAS, bitsandbytes' matmul_4bit and tilefish W4A16 (same group size), with its
per-m summary against the targets (target_summary)."""
from __future__ import annotations

import math
import statistics
import time

import torch

from .ceilings import copy_bandwidth_gbps, cublas_tflops, write_bandwidth_gbps
from .report import Report, Row
from .timing import host_overhead_us, time_alternating_us, time_cuda

DEFAULT_SHAPES = [(4096, 4096), (8192, 8192), (16384, 16384)]
QUICK_SHAPES = [(8192, 8192)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def counted_bytes(q, out_dtype: torch.dtype) -> int:
    """Bytes the op must move, counted as the reference write-up does:
    codes + absmax codes (or fp32 absmax) + absmax2 + code table(s) + output."""
    n = q.codes.numel()
    if q.double_quant:
        n += q.absmax_q.numel() + 4 * q.absmax2.numel() + 4 * q.code2.numel() + 4
    else:
        n += 4 * q.absmax.numel()
    n += 16 * 4  # the NF4 table
    return n + q.numel * torch.empty((), dtype=out_dtype).element_size()


def _bnb():
    try:
        import bitsandbytes.functional as F

        return F
    except Exception:  # noqa: BLE001 - bitsandbytes is an optional peer
        return None


def run(shapes=None, dtype: str = "bf16", blocksize: int = 64, double_quant: bool = True,
        variants: bool = False, reps: int = 50) -> Report:
    from .. import nf4
    from ..ops import nf4 as ops

    out_dtype = DTYPES[dtype]
    copy = copy_bandwidth_gbps()
    report = Report(f"NF4 dequantize -> {dtype}, blocksize {blocksize}, "
                    f"{'double' if double_quant else 'single'} quant",
                    {"copy GB/s": copy, "write-only GB/s": write_bandwidth_gbps()})
    F = _bnb()
    if F is None:
        report.notes.append("bitsandbytes not importable: no peer column (pip install 'tilefish[peers]')")
    for shape in shapes or DEFAULT_SHAPES:
        w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        q = nf4.quantize(w, blocksize=blocksize, double_quant=double_quant)
        del w
        nbytes = counted_bytes(q, out_dtype)
        case = f"{shape[0]}x{shape[1]}"
        t_bnb = None
        if F is not None:
            packed, state = nf4.to_bnb(q)
            state.dtype = out_dtype
            tb = time_cuda(lambda: F.dequantize_4bit(packed, state), reps=reps)
            t_bnb = tb.median_ms
        out = torch.empty(q.shape, dtype=out_dtype, device="cuda")
        configs = ops.variant_configs() if variants else [ops.DEFAULT_CONFIG]
        for cfg in configs:
            t = time_cuda(lambda: ops.launch_dequantize(q, out, cfg), reps=reps)
            gbps = nbytes / (t.median_ms * 1e-3) / 1e9
            impl = "tilefish" if cfg == ops.DEFAULT_CONFIG and not variants else f"tilefish[{cfg.label()}]"
            ratios = {"bitsandbytes": t_bnb / t.median_ms} if t_bnb else {}
            report.add(Row("nf4", case, impl, t.median_us, gbps, "GB/s", 100 * gbps / copy, ratios,
                           {"bytes": nbytes, "config": cfg.label()}))
        if t_bnb is not None:
            gbps = nbytes / (t_bnb * 1e-3) / 1e9
            report.add(Row("nf4", case, "bitsandbytes", t_bnb * 1e3, gbps, "GB/s", 100 * gbps / copy, {},
                           {"bytes": nbytes}))
        del q, out
    # Host overhead per call: a tiny weight, so the GPU keeps up and the host is what is timed.
    small = nf4.quantize(torch.randn(64, 64, device="cuda"), blocksize=blocksize, double_quant=double_quant)
    us = host_overhead_us(lambda: nf4.dequantize(small, out_dtype))
    note = f"host overhead per call (64x64, wrapper + launch): tilefish {us:.1f} us"
    if F is not None:
        p, s = nf4.to_bnb(small)
        s.dtype = out_dtype
        note += f", bitsandbytes {host_overhead_us(lambda: F.dequantize_4bit(p, s)):.1f} us"
    report.notes.append(note)
    return report


# ---- the fused NF4 matmul ----------------------------------------------------------------------------------------
#
# One row per (dtype, k x n, m): tilefish.nf4's fused matmul (the W4A16 kernels with NF4 codes, timed through
# the op's implementation as `bench w4a16` times its own), and in the same process, in alternating rounds
# (time_alternating_us: each round starts at another callable, so none always runs right after a heavy one):
# cuBLAS (F.linear on the dense weight of the same shape and dtype), bitsandbytes' matmul_4bit on the same
# NF4 weight (when importable) and tilefish W4A16 with the NF4 kernel's group size (same kernels, int4 codes:
# what the NF4 codebook costs). Every implementation's output is checked once per row before it is timed.

MATMUL_FAMILY = "nf4_matmul"
# (k, n) of Llama-3 8B and 70B linears and the batch sizes: bench w4a16's.
MATMUL_KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192), (8192, 57344),
             (28672, 8192)]
MATMUL_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
QUICK_KN = [(4096, 4096), (14336, 4096), (8192, 10240)]   # --quick: 8B o_proj, 8B down_proj, 70B qkv ...
QUICK_M = [1, 16, 64, 256, 1024]                          # ... at the m that have a cuBLAS target
MATMUL_DTYPES = ("bf16", "fp16")
SMALL_M = 64            # rows up to this m report GB/s (% of the copy ceiling); above it TFLOP/s (% of cuBLAS' peak)
ROUNDS = 4              # alternating rounds per row (each callable leads one)
CUBLAS, BNB, OURS = "cuBLAS", "bitsandbytes", "tilefish"
# Targets, as ratios peer time / tilefish NF4 time: the median over shapes against cuBLAS at these m
# (and CUBLAS_TARGET_LARGE at every m >= 1024); the least ratio against bitsandbytes at every shape and m;
# against W4A16 of the same group size NF4 may be at most W4A16_SLOWDOWN times slower (every shape and m).
CUBLAS_TARGETS = {1: 2.5, 16: 2.0, 64: 1.5, 256: 1.0}
CUBLAS_TARGET_LARGE = (1024, 0.9)
BNB_TARGET = 1.5
W4A16_SLOWDOWN = 1.1
# The correctness check: ||out - ref|| / ||ref|| against the fp32 product of x and the weight dequantized in
# fp32 (tests/conftest.py's matmul tolerances, by activation dtype).
CHECK_TOL = {"bf16": 1.6e-2, "fp16": 2e-3}


def cublas_target(m: int) -> float | None:
    """The least median ratio to cuBLAS asked for at m (None: no target at this m)."""
    return CUBLAS_TARGET_LARGE[1] if m >= CUBLAS_TARGET_LARGE[0] else CUBLAS_TARGETS.get(m)


def w4a16_peer(group: int) -> str:
    return f"W4A16 g{group}"


def check_ok(err: float | None, tol: float) -> bool:
    return err is not None and math.isfinite(err) and err <= tol


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (nan when out has NaN or Inf)."""
    den = ref.norm().item()
    return (out.float() - ref).norm().item() / (den if den > 0 else 1.0)


def matmul_row(dtype: str, k: int, n: int, m: int, times_us: dict, errs: dict, *, label: str, weight_bytes: int,
               copy_gbps: float | None, peak_tflops: float | None, group: int, blocksize: int,
               double_quant: bool) -> Row:
    """One table row. times_us: {"tilefish": us, and each peer timed: "cuBLAS", "bitsandbytes", "W4A16 g<G>"};
    errs: each implementation's relative error in the check (None: not checked). weight_bytes: what the
    tilefish kernel reads of the weight (codes + scales); activations in and out are added to it."""
    ours = times_us[OURS]
    elt = torch.empty((), dtype=DTYPES[dtype]).element_size()
    nbytes = weight_bytes + elt * m * (k + n)
    gbps = nbytes / (ours * 1e-6) / 1e9
    tflops = 2 * m * n * k / (ours * 1e-6) / 1e12
    if m <= SMALL_M:
        metric, unit, pct = gbps, "GB/s", (100 * gbps / copy_gbps if copy_gbps else None)
    else:
        metric, unit, pct = tflops, "TFLOP/s", (100 * tflops / peak_tflops if peak_tflops else None)
    tol = CHECK_TOL[dtype]
    checks = {name: check_ok(err, tol) for name, err in errs.items() if err is not None or name == OURS}
    ok = checks.get(OURS, False)
    return Row(MATMUL_FAMILY, f"{dtype} k{k} n{n} m{m}", f"tilefish [{label}]" + ("" if ok else " CHECK FAILED"),
               ours, metric, unit, pct, {peer: t / ours for peer, t in times_us.items() if peer != OURS},
               {"m": m, "k": k, "n": n, "dtype": dtype, "blocksize": blocksize, "double_quant": double_quant,
                "group": group, "plan": label, "gbps": gbps, "tflops": tflops, "bytes": nbytes,
                "times_us": dict(times_us), "rel_err": dict(errs), "tolerance": tol, "checks": checks, "check_ok": ok})


def target_summary(rows) -> str:
    """The fused matmul's rows against the targets, per (dtype, m), as a markdown table: the median
    ratio to cuBLAS over the shapes (target CUBLAS_TARGETS / CUBLAS_TARGET_LARGE, where m has one), the
    least ratio to bitsandbytes (BNB_TARGET) and to W4A16 of the same group (1 / W4A16_SLOWDOWN), with
    the shapes they come from, how many rows passed the correctness check, and the verdict. rows: bench
    Rows or their JSON dicts (other families' rows are ignored). "" when there is no matmul row."""
    def get(r, name):
        return r[name] if isinstance(r, dict) else getattr(r, name)

    by_case: dict[tuple[str, int], list[tuple[dict, str, dict]]] = {}
    for r in rows:
        extra = get(r, "extra")
        if get(r, "family") == MATMUL_FAMILY and "m" in extra:
            shape = f"k{extra['k']} n{extra['n']}"
            by_case.setdefault((extra["dtype"], extra["m"]), []).append((get(r, "ratios"), shape, extra))
    if not by_case:
        return ""
    peer_names = sorted({p for v in by_case.values() for ratios, _, _ in v for p in ratios if p.startswith("W4A16")})
    w4 = peer_names[0] if peer_names else w4a16_peer(64)
    w4_target = 1 / W4A16_SLOWDOWN

    def least(items):  # [(ratio, shape)] -> "0.97x (k4096 n4096)", the ratio
        if not items:
            return "n/a", None
        v, shape = min(items)
        return f"{v:.2f}x ({shape})", v

    lines = [f"| dtype | m | vs {CUBLAS}: median (target) | vs {CUBLAS}: min - max | vs {BNB}: min (shape), "
             f"target {BNB_TARGET:g}x | vs {w4}: min (shape), target {w4_target:.2f}x | checks | result |",
             "|---|---|---|---|---|---|---|---|"]
    met = total = failed_checks = 0
    no_bnb = False
    for dtype, m in sorted(by_case, key=lambda c: (c[0], c[1])):
        items = by_case[(dtype, m)]
        cu = sorted(ratios[CUBLAS] for ratios, _, _ in items if CUBLAS in ratios)
        target = cublas_target(m)
        misses = []
        if cu:
            med = statistics.median(cu)
            cu_cell = f"{med:.2f}x ({'-' if target is None else f'{target:g}x'})"
            if target is not None and med < target:
                misses.append(CUBLAS)
            span = f"{cu[0]:.2f}x - {cu[-1]:.2f}x"
        else:
            cu_cell, span = "n/a", ""
            misses.append(CUBLAS)
        bnb_cell, bnb_min = least([(ratios[BNB], shape) for ratios, shape, _ in items if BNB in ratios])
        if bnb_min is None:
            no_bnb = True
        elif bnb_min < BNB_TARGET:
            misses.append(BNB)
        w4_cell, w4_min = least([(ratios[w4], shape) for ratios, shape, _ in items if w4 in ratios])
        if w4_min is None or w4_min < w4_target:
            misses.append(w4)
        oks = sum(bool(extra.get("check_ok")) for _, _, extra in items)
        failed_checks += len(items) - oks
        result = "; ".join((["CHECK FAILED"] if oks < len(items) else [])
                           + (["MISS " + ", ".join(misses)] if misses else [])) or "ok"
        met += not misses and oks == len(items)
        total += 1
        lines.append(f"| {dtype} | {m} | {cu_cell} | {span} | {bnb_cell} | {w4_cell} | {oks} / {len(items)} "
                     f"| {result} |")
    lines.append(f"\n{met} of {total} (dtype, m) rows meet every target; ratio = peer time / tilefish NF4 time. "
                 f"Targets: median vs {CUBLAS} "
                 + ", ".join(f"m={m} >= {t:g}x" for m, t in CUBLAS_TARGETS.items())
                 + f", m>={CUBLAS_TARGET_LARGE[0]} >= {CUBLAS_TARGET_LARGE[1]:g}x; every shape vs {BNB} >= "
                 f"{BNB_TARGET:g}x; every shape NF4 time <= {W4A16_SLOWDOWN:g} x {w4} time.")
    if no_bnb:
        lines.append(f"No {BNB} ratio in some rows (not importable, or it failed: see the notes): "
                     f"its target is not judged there.")
    if failed_checks:
        lines.append(f"{failed_checks} row(s) FAILED the correctness check (see the notes): their times are not "
                     "evidence.")
    return "\n".join(lines)


def _bnb_module():
    try:
        import bitsandbytes

        return bitsandbytes
    except Exception:  # noqa: BLE001 - bitsandbytes is an optional peer
        return None


class _NoTF32:
    def __enter__(self):
        self.prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.prev


def check_matmul_args(shapes, ms, dtypes) -> None:
    """The bench's arguments, checked before anything runs (ValueError naming the constraint)."""
    for k, n in shapes:
        if n % 64 or k % 64:
            raise ValueError(f"the NF4 matmul needs k % 64 == 0 and n % 64 == 0 (shapes are KxN); got {k}x{n}")
    for m in ms:
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"m must be positive integers, got {m!r}")
    for d in dtypes:
        if d not in MATMUL_DTYPES:
            raise ValueError(f"the NF4 matmul runs {', '.join(MATMUL_DTYPES)} activations, got {d!r}")


def _plan_label(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> str:
    """The dispatcher's configuration for this call, as LaunchPlan.build picks it on this device."""
    from .. import w4a16

    try:
        return w4a16.plan(m, n, k, group_size=group, dtype=dtype, codebook="nf4").label
    except Exception as e:  # noqa: BLE001 - a label only
        return f"? ({type(e).__name__})"


# Run by warm_kernel_cache in a fresh interpreter: (jobs, processes) pickled on stdin -> which compiles
# failed, pickled on stdout. A fresh `python -c` process: its workers neither inherit this process's CUDA
# context (fork) nor re-run the caller's main script (spawn).
_WARM_CODE = """
import pickle, sys
from tilefish.runtime import compile_many
jobs, processes = pickle.loads(sys.stdin.buffer.read())
sys.stdout.buffer.write(pickle.dumps([r is None for r, _ in compile_many(jobs, processes)]))
"""


def warm_kernel_cache(shapes, ms, dtypes, group: int, processes: int | None = None, timeout_s: float = 900) -> str:
    """Compile the kernels the matmul rows will launch (the dispatcher's pick for every row, NF4 and int4
    codes) in parallel processes into the disk cache, so a fresh machine does not compile them one at a
    time inside the run (about 40 kernels for the default set). Returns a note for the report."""
    import os
    import pickle
    import subprocess
    import sys

    from .. import w4a16
    from ..ops import w4a16 as ops
    from ..runtime import GpuSpec, cache_enabled, device_info, is_cached

    if not cache_enabled():
        return "kernel cache disabled (TILEFISH_CACHE=0): kernels compile on first use, inside the run"
    t0 = time.perf_counter()
    info = device_info()
    gpu = GpuSpec.of(info)
    specs = {}
    for d in dtypes:
        for k, n in shapes:
            for m in ms:
                for codebook in ("nf4", "int4"):
                    cfg = w4a16.plan(m, n, k, group_size=group, dtype=DTYPES[d], codebook=codebook, gpu=gpu).config
                    specs[ops.kernel_spec(DTYPES[d], cfg, group, False, codebook)] = None
    todo = [s for s in specs if not is_cached(s, info.arch)]
    if not todo:
        return f"kernel cache: all {len(specs)} kernels of the run were cached"
    processes = processes or max(1, min(16, os.cpu_count() or 1, len(todo)))
    payload = pickle.dumps(([(s, info.arch) for s in todo], processes))
    out = subprocess.run([sys.executable, "-c", _WARM_CODE], input=payload, capture_output=True, timeout=timeout_s,
                         check=True)
    failed = sum(pickle.loads(out.stdout))
    note = (f"kernel cache warmed before timing: {len(todo)} of the run's {len(specs)} kernels compiled in "
            f"{time.perf_counter() - t0:.0f} s ({processes} processes)")
    return note + (f", {failed} failed to compile (their rows report the error)" if failed else "")


def run_matmul(shapes=None, ms=None, dtypes=("bf16",), blocksize: int = 64, double_quant: bool = True,
               reps: int = 50, title_note: str = "", device="cuda", warm: bool | None = None) -> "NF4Report":
    """The fused NF4 matmul table (module comment above). shapes: (k, n) pairs (default MATMUL_KN);
    ms: batch sizes (default MATMUL_M); dtypes: activation dtypes ("bf16", "fp16"). device: "cuda"
    (the tests drive the rest of the loop on "cpu", with the timing and ceilings replaced). warm:
    compile the kernels first in parallel processes (warm_kernel_cache; default: on CUDA)."""
    import torch.nn.functional as F

    from .. import nf4, w4a16
    from ..ops import nf4 as nf4_ops
    from ..ops import w4a16 as w4_ops
    from .progress import InnerProgress
    from .w4a16 import COOLDOWN_S, HEAVY_MS

    shapes = [tuple(s) for s in (shapes or MATMUL_KN)]
    ms = list(ms or MATMUL_M)
    dtypes = list(dtypes)
    check_matmul_args(shapes, ms, dtypes)
    group = min(blocksize, 128)  # the group size tilefish.nf4.prepare gives the kernel
    peer = w4a16_peer(group)
    warm = torch.device(device).type == "cuda" if warm is None else warm
    bnb = _bnb_module()
    try:
        warm_note = warm_kernel_cache(shapes, ms, dtypes, group) if warm else None
    except Exception as e:  # noqa: BLE001 - only a head start: the kernels still compile on first use
        warm_note = f"kernel cache warm-up skipped ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})"
    copy = copy_bandwidth_gbps()
    ceilings = {"copy GB/s": copy}
    peaks = {}
    if any(m > SMALL_M for m in ms):
        for d in dtypes:
            peaks[d] = ceilings[f"cuBLAS {d} TFLOP/s"] = cublas_tflops(DTYPES[d])
    quant = f"blocksize {blocksize}, {'double' if double_quant else 'single'} quant"
    report = NF4Report(f"NF4 fused matmul ({quant}) vs cuBLAS, bitsandbytes matmul_4bit and {peer} "
                       f"(ratio = peer time / tilefish time){title_note}", ceilings)
    report.sections[MATMUL_FAMILY] = report.title
    ws = w4_ops.Workspace(device)  # the tile counters a layer owns: no timed call zero-fills fresh ones
    report.notes.append(
        f"timed in {ROUNDS} alternating rounds (time_alternating_us), L2 flushed, median; {COOLDOWN_S} s idle after "
        f"each row whose cuBLAS time passes {HEAVY_MS} ms. rate: GB/s (weight codes + scales + x + out; % of the "
        f"copy ceiling) up to m = {SMALL_M}, TFLOP/s (% of cuBLAS' dense peak) above; impl: the dispatcher's "
        f"configuration; every output checked once against the fp32 product with the fp32-dequantized weight "
        f"(tolerance {', '.join(f'{d} {CHECK_TOL[d]:g}' for d in dtypes)})")
    if bnb is None:
        report.notes.append("bitsandbytes not importable: no bitsandbytes column (pip install 'tilefish[peers]')")
    if warm_note:
        report.notes.append(warm_note)
    per_round = max(4, -(-reps // ROUNDS))
    failures: list[str] = []
    with torch.no_grad(), InnerProgress(len(dtypes) * len(shapes) * (1 + len(ms))) as progress:
        for dname in dtypes:
            dt = DTYPES[dname]
            for k, n in shapes:
                progress.step(f"{dname} k{k} n{n}: quantize")
                dense = torch.randn(n, k, device=device, dtype=dt)
                q = nf4.quantize(dense, blocksize=blocksize, double_quant=double_quant)
                p = nf4.prepare(q, dt)
                w4 = w4a16.quantize(dense, group_size=group, dtype=dt, clip_search=False)
                w_ref = nf4.dequantize(q, torch.float32)
                w4_ref = w4.dequantize(torch.float32)
                weight_bytes = p.kernel.packed.numel() * 4 + p.kernel.scales.numel() * p.kernel.scales.element_size()
                if bnb is not None:
                    packed, state = nf4.to_bnb(q)
                    state.dtype = dt  # dequantize straight to the activation dtype, as a bf16/fp16 Linear4bit does
                    packed_t = packed.t()  # Linear4bit.forward passes self.weight.t()
                for m in ms:
                    case = f"{dname} k{k} n{n} m{m}"
                    progress.step(case)
                    x = torch.randn(m, k, device=device, dtype=dt)
                    fns = {OURS: lambda: nf4_ops.matmul_impl(x, p, workspace=ws), CUBLAS: lambda: F.linear(x, dense),
                           peer: lambda: w4_ops.matmul_impl(x, w4, workspace=ws)}
                    if bnb is not None:
                        fns[BNB] = lambda: bnb.matmul_4bit(x, packed_t, quant_state=state)
                    refs = {OURS: w_ref, BNB: w_ref, peer: w4_ref}
                    errs: dict[str, float | None] = {CUBLAS: None}
                    products: dict[int, torch.Tensor] = {}  # x times each reference weight, computed once
                    with _NoTF32():
                        for name, ref_w in refs.items():
                            if name not in fns:
                                continue
                            try:
                                out = fns[name]()
                            except Exception as e:  # noqa: BLE001 - reported, the others still run
                                failures.append(f"{case}: {name} raised {type(e).__name__}: "
                                                f"{(str(e).splitlines() or [''])[0]}")
                                del fns[name]
                                continue
                            if id(ref_w) not in products:
                                products[id(ref_w)] = x.float() @ ref_w.t()
                            errs[name] = rel_err(out, products[id(ref_w)])
                            del out
                    del products
                    if OURS not in fns:
                        continue
                    for name, err in errs.items():
                        if err is not None and not check_ok(err, CHECK_TOL[dname]):
                            failures.append(f"{case}: {name} CHECK FAILED, relative error {err:.3g} > "
                                            f"{CHECK_TOL[dname]:g}")
                    times = time_alternating_us(fns, rounds=ROUNDS, per_round=per_round, warmup=3)
                    if times[CUBLAS] > HEAVY_MS * 1e3:
                        torch.cuda.synchronize(device)
                        time.sleep(COOLDOWN_S)
                    report.add(matmul_row(dname, k, n, m, times, errs, label=_plan_label(m, n, k, group, dt),
                                          weight_bytes=weight_bytes, copy_gbps=copy, peak_tflops=peaks.get(dname),
                                          group=group, blocksize=blocksize, double_quant=double_quant))
                    del x, fns
                del dense, q, p, w4, w_ref, w4_ref
                if bnb is not None:
                    del packed, state, packed_t
                if torch.device(device).type == "cuda":
                    torch.cuda.empty_cache()
    report.notes += failures
    if torch.device(device).type == "cuda":
        report.notes.append(host_cost_note(dtype=DTYPES[dtypes[0]], blocksize=blocksize, double_quant=double_quant))
    return report


def host_cost_note(k: int = 4096, n: int = 4096, dtype: torch.dtype = torch.bfloat16, blocksize: int = 64,
                   double_quant: bool = True) -> str:
    """The eager host time of one call (Python wrapper + launch) at m = 1 on a k x n weight: the
    NF4Linear layer, tilefish.nf4.matmul, F.linear and (when importable) bitsandbytes' Linear4bit on
    the same shape, timed in alternating rounds. 400 calls a round keep the GPU queue short, so the
    host clock measures the host."""
    import torch.nn.functional as F

    from .. import nf4
    from ..nn import NF4Linear
    from .timing import host_overhead_paired_us, w4a16_workspace

    dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
    layer = NF4Linear.from_linear(dense, blocksize=blocksize, double_quant=double_quant)
    p = nf4.prepare(nf4.quantize(dense.weight, blocksize=blocksize, double_quant=double_quant), dtype)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    fns = {"F.linear": lambda: F.linear(x, dense.weight), "NF4Linear": lambda: layer(x),
           "nf4.matmul": lambda: nf4.matmul(x, p, workspace=w4a16_workspace(x.device))}
    bnb = _bnb_module()
    if bnb is not None:
        bnb_layer = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=dtype, quant_type="nf4",
                                      compress_statistics=double_quant, device="meta")
        bnb_layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, blocksize=blocksize,
                                             compress_statistics=double_quant, quant_type="nf4").to("cuda")
        fns["bnb Linear4bit"] = lambda: bnb_layer(x)
    with torch.inference_mode():
        us = host_overhead_paired_us(fns, calls=400)
    text = ", ".join(f"{name} {t:.1f} us" + (f" ({t / us['F.linear']:.2f}x F.linear)" if name != "F.linear" else "")
                     for name, t in us.items())
    return f"host time per eager call (m=1, k={k}, n={n}, wrapper + launch, alternating rounds): {text}"


# ---- the report: one section per part --------------------------------------------------------------------------

class NF4Report(Report):
    """`tilefish bench nf4`'s report: the dequantization rows (family "nf4") and the fused matmul rows
    (MATMUL_FAMILY) print as two tables; the plot draws the matmul's ratios by m (and the
    dequantization's GB/s bars)."""

    def __init__(self, title: str, ceilings: dict[str, float] | None = None):
        super().__init__(title, ceilings)
        self.sections: dict[str, str] = {}  # family -> its table's title

    def table(self) -> str:
        families = list(dict.fromkeys(r.family for r in self.rows))
        if len(families) <= 1 and self.sections.get(families[0] if families else None, self.title) == self.title:
            return super().table()
        lines = [f"== {self.title} =="]
        if self.ceilings:
            lines.append("ceilings (same process): " + ", ".join(f"{k} {v:,.1f}" for k, v in self.ceilings.items()))
        for fam in families:
            sub = Report(self.sections.get(fam, fam))
            sub.rows = [r for r in self.rows if r.family == fam]
            lines += ["", sub.table()]
        if self.notes:
            lines.append("")
        lines += self.notes
        return "\n".join(lines)

    def plot(self, path) -> None:
        matmul = [r for r in self.rows if r.family == MATMUL_FAMILY]
        if not matmul:
            return super().plot(path)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from pathlib import Path

        deq = [r for r in self.rows if r.family != MATMUL_FAMILY]
        peers = [p for p in (CUBLAS, BNB) if any(p in r.ratios for r in matmul)]
        peers += sorted({p for r in matmul for p in r.ratios if p.startswith("W4A16")})
        panels = len(peers) + bool(deq)
        fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4.5), squeeze=False)
        series = list(dict.fromkeys((r.extra["dtype"], r.extra["k"], r.extra["n"]) for r in matmul))
        for ax, peer in zip(axes[0], peers):
            for dtype, k, n in series:
                pts = sorted((r.extra["m"], r.ratios[peer]) for r in matmul
                             if (r.extra["dtype"], r.extra["k"], r.extra["n"]) == (dtype, k, n) and peer in r.ratios)
                if pts:
                    ax.plot([m for m, _ in pts], [v for _, v in pts], marker="o", ms=3, lw=1,
                            label=f"{dtype} k{k} n{n}")
            ms = sorted({r.extra["m"] for r in matmul})
            if peer == CUBLAS:
                tm = [(m, cublas_target(m)) for m in ms if cublas_target(m) is not None]
                ax.scatter([m for m, _ in tm], [t for _, t in tm], marker="_", s=300, c="k", label="target (median)")
            else:
                ax.axhline(BNB_TARGET if peer == BNB else 1 / W4A16_SLOWDOWN, ls="--", c="gray", lw=1)
            ax.axhline(1.0, c="k", lw=0.5)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ms)
            ax.set_xticklabels([str(m) for m in ms], fontsize=7)
            ax.minorticks_off()
            ax.set_xlabel("m")
            ax.set_ylabel(f"{peer} time / tilefish NF4 time")
            ax.set_title(f"vs {peer}", fontsize=10)
        axes[0][0].legend(fontsize=6)
        if deq:
            ax = axes[0][-1]
            cases = list(dict.fromkeys(r.case for r in deq))
            impls = list(dict.fromkeys(r.impl for r in deq))
            width = 0.8 / max(1, len(impls))
            for j, impl in enumerate(impls):
                pts = [(i + j * width, r.metric) for i, c in enumerate(cases) for r in deq
                       if r.case == c and r.impl == impl]
                ax.bar([x for x, _ in pts], [y for _, y in pts], width, label=impl)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
            ax.set_xticklabels(cases, fontsize=8)
            ax.set_ylabel("GB/s")
            ax.set_title("dequantize", fontsize=10)
            ax.legend(fontsize=6)
        fig.suptitle(self.title, fontsize=9)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)


def combine(dequant: Report | None, matmul: Report | None, title_note: str = "") -> NF4Report:
    """One NF4Report holding the parts that ran (dequantize first), each with its own table."""
    parts = [r for r in (dequant, matmul) if r is not None]
    if not parts:
        raise ValueError("nothing to combine: neither part ran")
    if len(parts) == 1:
        rep = NF4Report(parts[0].title, parts[0].ceilings)
    else:
        rep = NF4Report(f"NF4: dequantization and fused matmul{title_note}")
    for part in parts:
        rep.ceilings.update(part.ceilings)
        rep.rows += part.rows
        rep.notes += part.notes
        fams = {r.family for r in part.rows} or {MATMUL_FAMILY if part is matmul else "nf4"}
        for fam in fams:
            rep.sections[fam] = getattr(part, "sections", {}).get(fam, part.title)
    return rep
