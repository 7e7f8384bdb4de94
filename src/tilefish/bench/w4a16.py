"""`tilefish bench w4a16`: the W4A16 GEMM against cuBLAS fp16/bf16 of the same shape, same process."""
from __future__ import annotations

import statistics
import time

import torch

from . import shapes as model_shapes
from .ceilings import copy_bandwidth_gbps
from .report import Report, Row
from .timing import host_overhead_paired_us, time_cuda, time_paired, w4a16_workspace

# (k, n) of Llama-3 8B and 70B linears: the union of shapes.DEFAULT_MODELS' weights (tests check the two agree)
DEFAULT_KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192),
              (8192, 57344), (28672, 8192)]
DEFAULT_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAVY_MS = 1.0     # a case whose cuBLAS time passes this heats the GPU ...
COOLDOWN_S = 0.5   # ... and is followed by this much idle time
# Issue 3's targets: the least ratio (cuBLAS time / tilefish time) asked for at each m.
TARGETS = {1: 3.0, 2: 3.0, 4: 3.0, 8: 3.0, 16: 3.0, 32: 2.5, 64: 1.8, 128: 1.3, 256: 0.95, 1024: 0.95, 4096: 0.95}


def target_summary(rows) -> str:
    """Per m with a target: the least, median and greatest ratio to cuBLAS (with their cases) and
    how many cases reach the target, as a markdown table. Median: the middle of the sorted ratios
    (the upper one of an even count). rows: bench Rows or their JSON dicts. "" when no row has a
    target m (the --variants sweep's rows carry no m)."""
    def get(r, name):
        return r[name] if isinstance(r, dict) else getattr(r, name)

    def shape(v):  # a (ratio, case) pair's case without its m
        return v[1].rsplit(" m", 1)[0]

    by_m: dict[int, list[tuple[float, str]]] = {}
    for r in rows:
        ratio, extra = get(r, "ratios").get("cuBLAS"), get(r, "extra")
        if ratio is not None and extra.get("m") in TARGETS:
            by_m.setdefault(extra["m"], []).append((ratio, get(r, "case")))
    if not by_m:
        return ""
    lines = ["| m | target | min (case) | median | max (case) | cases at target |", "|---|---|---|---|---|---|"]
    for m in sorted(by_m):
        vals = sorted(by_m[m])
        target = TARGETS[m]
        lines.append(f"| {m} | {target:g}x | {vals[0][0]:.2f}x ({shape(vals[0])}) | {vals[len(vals) // 2][0]:.2f}x | "
                     f"{vals[-1][0]:.2f}x ({shape(vals[-1])}) | {sum(v >= target for v, _ in vals)} / {len(vals)} |")
    return "\n".join(lines)


def select_shapes(shapes=None, models=None) -> tuple[list[tuple[int, int]], dict[tuple[int, int], str], list[str]]:
    """The (k, n) list a run times: `shapes` when given (it overrides `models`), else the de-duplicated
    union of the models' weights (names as shapes.parse_models takes them: a list, a comma-separated
    string or "all"; None: the Llama-3 default set, DEFAULT_KN). Returns (tileable shapes, {(k, n):
    "model:projection,..."} for the rows' extra, one line per skipped untileable shape)."""
    if shapes:
        entries = [model_shapes.Shape(k, n, ()) for k, n in shapes]
    else:
        names = model_shapes.parse_models(models) if models is None or isinstance(models, str) else list(models)
        entries = model_shapes.union(names)
    kn, labels, skipped = [], {}, []
    for e in entries:
        reason = model_shapes.untileable_reason(e.k, e.n, group_size=-1)  # group sizes: per case (run)
        if reason:
            skipped.append(f"skipped k{e.k} n{e.n}{f' ({e.models})' if e.labels else ''}: untileable, {reason}")
            continue
        kn.append((e.k, e.n))
        if e.labels:
            labels[(e.k, e.n)] = e.models
    return kn, labels, skipped


def _skip_notes(report: Report, skipped: list[str]) -> None:
    for line in skipped:
        print(line, flush=True)
        report.notes.append(line)


def merge_streamk_resweep(base: list[dict], resweep: list[dict]) -> tuple[list[dict], float]:
    """A wgmma plan sweep (scripts/sweep_w4a16_streamk.py records) with its stream-K rows replaced
    by those of a later sweep of the stream-K configurations alone (after a change to their code),
    each scaled by the day factor: the median ratio, base over resweep, of the dispatcher's
    tile-mode pick timed in both (same label), so two days' clocks do not bias stream-K against the
    tile plans. Returns (merged records, day factor). Labels as the records have them (stream-K:
    "-streamk", or "-sk" in sweeps recorded before the rename)."""
    from ..ops.w4a16 import canonical_label

    def streamk(label: str) -> bool:
        return canonical_label(label).endswith("-streamk")
    later = {(r["k"], r["n"], r["m"]): r for r in resweep}
    same = [r["auto_us"] / later[key]["auto_us"] for r in base if (key := (r["k"], r["n"], r["m"])) in later
            and later[key]["auto"] == r["auto"] and not streamk(r["auto"])]
    if not same:
        raise ValueError("the two sweeps share no tile-mode pick to scale by")
    day = statistics.median(same)
    merged = []
    for r in base:
        rows = [row for row in r["configs"] if not streamk(row[1])]
        if (key := (r["k"], r["n"], r["m"])) in later:
            rows += [[t * day, label, cluster] for t, label, cluster in later[key]["configs"] if streamk(label)]
        else:
            rows += [row for row in r["configs"] if streamk(row[1])]
        merged.append(dict(r, configs=sorted(rows)))
    return merged, day


def sweep(shapes=None, ms=None, dtype: str = "fp16", group: int = 128, reps: int = 20, models=None) -> Report:
    """Every (config, slices) for each case: the data the dispatch heuristic is fitted to. Shapes:
    `shapes`, else the models' (select_shapes), else Llama-3-8B's four."""
    from ..ops import w4a16 as ops
    from ..quant.int4 import quantize_rtn

    dt = DTYPES[dtype]
    report = Report(f"W4A16 config sweep ({dtype}, group {group})")
    ws = w4a16_workspace(torch.device("cuda"))
    kn, _, skipped = select_shapes(shapes, models) if shapes or models else (DEFAULT_KN[:4], {}, [])
    _skip_notes(report, skipped)
    for k, n in kn:
        dense = torch.randn(n, k, device="cuda", dtype=dt)
        p = ops.pack(quantize_rtn(dense, group, True, scale_dtype=dt, clip_search=False))
        for m in ms or [1, 16, 32, 64, 128]:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            t_cublas = time_cuda(lambda: torch.nn.functional.linear(x, dense), reps=reps).median_ms
            rows = []
            for cfg in ops.CONFIGS:
                if n % cfg.bn or (cfg.swap and m > 8):
                    continue
                for slices in (1, 2, 3, 4, 6, 8, 12, 16):
                    if slices > k // 128:
                        continue
                    t = time_cuda(lambda: ops.matmul_impl(x, p, cfg=cfg, slices=slices, workspace=ws), reps=reps).median_ms
                    rows.append((t, cfg, slices))
            rows.sort(key=lambda r: r[0])
            auto = time_cuda(lambda: ops.matmul_impl(x, p, workspace=ws), reps=reps).median_ms
            for t, cfg, slices in rows[:3]:
                report.add(Row("w4a16", f"k{k} n{n} m{m}", f"{cfg.label()} x{slices}", t * 1e3, 0.0, "-", None,
                               {"cuBLAS": t_cublas / t}))
            report.add(Row("w4a16", f"k{k} n{n} m{m}", "auto", auto * 1e3, 0.0, "-", None, {"cuBLAS": t_cublas / auto}))
    return report


def run(shapes=None, ms=None, groups=(128, -1), dtypes=("fp16", "bf16"), reps: int = 50, models=None,
        peers=()) -> Report:
    """Shapes: `shapes`, else the union of `models`' weights (default: the Llama-3 set, DEFAULT_KN);
    untileable ones are skipped with a printed line (also in the notes); a row of a model's shape names
    its model:projection pairs in extra["models"]. peers: ("marlin",) also times the original Marlin
    (bench/peers/marlin.py) on the same integers and scales where it runs (fp16, groups -1 / 128,
    n % 256 == 0), paired with tilefish like cuBLAS; its output is checked once per weight."""
    from ..ops import w4a16 as ops

    unknown = set(peers) - {"marlin"}
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}; known: marlin")
    marlin = None
    if "marlin" in peers:
        from .peers.marlin import MarlinPeer

        marlin = MarlinPeer()
    kn, labels, skipped = select_shapes(shapes, models)
    warm_note = warm_run_kernels(kn, ms or DEFAULT_M, dtypes, groups)
    print(warm_note, flush=True)
    copy = copy_bandwidth_gbps()
    report = Report("W4A16 GEMM vs cuBLAS (ratio = cuBLAS time / tilefish time)", {"copy GB/s": copy})
    ws = w4a16_workspace(torch.device("cuda"))  # the tile counters a layer owns (no per-call memset)
    report.notes.append(f"tilefish and cuBLAS timed in alternating rounds (time_paired); {COOLDOWN_S} s idle "
                        f"after each case whose cuBLAS time passes {HEAVY_MS} ms")
    _skip_notes(report, skipped)
    report.notes.append(warm_note)
    for dname in dtypes:
        dtype = DTYPES[dname]
        for k, n in kn:
            dense = torch.randn(n, k, device="cuda", dtype=dtype)
            for group in groups:
                if group > 0 and k % group:
                    _skip_notes(report, [f"skipped k{k} n{n} g{group}: k is not a multiple of the group size"])
                    continue
                q = __import__("tilefish.quant.int4", fromlist=["x"]).quantize_rtn(
                    dense, group, True, scale_dtype=dtype, clip_search=False)
                p = ops.pack(q)
                marlin_w = _marlin_weight(marlin, q, p, dtype, group, k, n, report) if marlin else None
                for m in ms or DEFAULT_M:
                    x = torch.randn(m, k, device="cuda", dtype=dtype)
                    # Paired rounds: both in the same clock state. After a case long enough to heat
                    # the GPU (m >= 1024 on the big weights draws full power), a pause lets the
                    # clocks recover: else the next shape's m = 1 ran at throttled clocks (k28672
                    # n8192: 58-64 us in the table against 41 us in the sweeps).
                    ours, cublas = time_paired(lambda: ops.matmul_impl(x, p, workspace=ws),
                                               lambda: torch.nn.functional.linear(x, dense), reps=reps)
                    t_ours, t_cublas = ours.median_ms, cublas.median_ms
                    ratios = {"cuBLAS": t_cublas / t_ours}
                    marlin_extra = {}
                    if marlin_w is not None:
                        ours2, theirs = time_paired(lambda: ops.matmul_impl(x, p, workspace=ws),
                                                    lambda: marlin.matmul(x, marlin_w.B, marlin_w.s,
                                                                          marlin_w.workspace), reps=reps)
                        ratios["Marlin"] = theirs.median_ms / ours2.median_ms
                        marlin_extra = {"marlin_us": theirs.median_ms * 1e3}
                    if t_cublas > HEAVY_MS:
                        torch.cuda.synchronize()
                        time.sleep(COOLDOWN_S)
                    wbytes = p.packed.numel() * 4 + p.scales.numel() * 2
                    nbytes = wbytes + 2 * m * (k + n)
                    gbps = nbytes / (t_ours * 1e-3) / 1e9
                    tflops = 2 * m * n * k / (t_ours * 1e-3) / 1e12
                    plan = ops.plan_for(p, m)
                    report.add(Row("w4a16", f"{dname} k{k} n{n} g{group} m{m}", "tilefish", t_ours * 1e3, gbps,
                                   "GB/s", 100 * gbps / copy, ratios,
                                   {"tflops": tflops, "cublas_us": t_cublas * 1e3, "m": m, "k": k, "n": n,
                                    "group": group, "dtype": dname, "config": plan.label(), **marlin_extra,
                                    **({"models": labels[(k, n)]} if (k, n) in labels else {})}))
                del p, q, marlin_w
            del dense
    if marlin is not None:
        report.notes.append(f"Marlin: IST-DASLab/marlin {marlin.commit()} built from .peers/marlin "
                            "(createpolicy cache hint patched out), timed paired with tilefish like cuBLAS")
    report.notes.append(host_cost_note())
    return report


def dispatched_kernels(info, shapes, ms, dtypes, group: int, codebooks=("int4",)) -> list:
    """The KernelSpecs of the dispatcher's plans for these calls on the device `info` (device_info(); its tuned
    table first, as matmul_impl): (k, n) shapes x ms x dtypes x codebooks; a shape whose k the group does not
    divide is left out (the run skips it)."""
    from .. import w4a16
    from ..ops.w4a16 import kernel_spec
    from ..runtime import GpuSpec

    gpu = GpuSpec.of(info)
    return [kernel_spec(DTYPES[d], w4a16.plan(m, n, k, group_size=group, dtype=DTYPES[d], codebook=cb,
                                              gpu=gpu).config, group, False, cb)
            for d in dtypes for k, n in shapes if group < 0 or k % group == 0 for m in ms for cb in codebooks]


def warm_run_kernels(kn, ms, dtypes, groups, codebook: str = "int4") -> str:
    """Compile the kernels of every plan the run will launch in parallel processes first, so the timed loop
    never compiles one at a time."""
    from ..runtime import device_info
    from .progress import warm_kernels

    info = device_info()
    return warm_kernels([s for g in groups for s in dispatched_kernels(info, kn, ms, dtypes, g, (codebook,))],
                        info.arch)


def _marlin_weight(marlin, q, p, dtype, group: int, k: int, n: int, report):
    """Marlin's copy of the same integers and scales, or None with the reason in the notes; its output
    at m = 16 must match tilefish's (same weight, fp16 tolerance) before it is timed."""
    from ..ops import w4a16 as ops

    why = marlin.available(dtype, group, k=k, n=n, build=True)
    if why is None:
        mw = marlin.prepare(q)
        x = torch.randn(16, k, device="cuda", dtype=dtype)
        ours = ops.matmul_impl(x, p).float()
        err = ((marlin.matmul(x, mw.B, mw.s, mw.workspace).float() - ours).norm() / ours.norm()).item()
        if err < 2e-3:
            return mw
        why = f"its output differs from tilefish's on the same weight (relative error {err:.1e})"
    report.notes.append(f"Marlin skipped for {str(dtype).removeprefix('torch.')} k{k} n{n} g{group}: {why}")
    return None


def host_cost_note(k: int = 4096, n: int = 4096, dtype: torch.dtype = torch.float16) -> str:
    """The eager host time of one call (Python wrapper + launch) at m = 1 on a k x n weight: the
    W4A16Linear layer (its planned path), the functional op, and F.linear on the same shape, timed
    in alternating rounds. Calls are few enough (400) that the GPU queue never fills, so the host
    clock measures the host."""
    import torch.nn.functional as F

    from .. import w4a16
    from ..nn import W4A16Linear

    dense = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=dtype)
    layer = W4A16Linear.from_linear(dense, group_size=128)
    w = layer.weight4
    ws = w4a16.Workspace(x_device := torch.device("cuda"))
    x = torch.randn(1, k, device=x_device, dtype=dtype)
    with torch.inference_mode():
        us = host_overhead_paired_us({"F.linear": lambda: F.linear(x, dense.weight), "W4A16Linear": lambda: layer(x),
                                      "w4a16.matmul": lambda: w4a16.matmul(x, w, workspace=ws)}, calls=400)
    return (f"host time per eager call (m=1, k={k}, n={n}, wrapper + launch, alternating rounds): "
            f"W4A16Linear {us['W4A16Linear']:.1f} us ({us['W4A16Linear'] / us['F.linear']:.2f}x F.linear), "
            f"w4a16.matmul {us['w4a16.matmul']:.1f} us, F.linear {us['F.linear']:.1f} us")
