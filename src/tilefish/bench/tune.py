"""`tilefish tune`: measure the W4A16 plans of a model's weights on this GPU and store the fastest.

For each case (dtype, scale format, codebook, k, n, m) it times the dispatcher's own plan beside
a short list of alternatives (tune_candidates) in alternating rounds, L2 flushed, then times the
fastest against the dispatcher's plan once more, paired. The fastest is stored only where it beats
the dispatcher's plan by MIN_GAIN in that second measurement; otherwise the case stores the
dispatcher's plan, so a re-run never churns on noise. Every candidate's output is checked against
the dispatcher's before it is timed.

The table (ops/w4a16/tuned.py) goes to the kernel cache (<cache>/tuned/w4a16-<gpu key>.json),
merged with what is there, and from then on the dispatcher takes its plans on this GPU.
"""
from __future__ import annotations

import json
import math
import os
import time
from datetime import datetime
from pathlib import Path

import torch

from . import timing

DEFAULT_TUNE_M = (1, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
MIN_GAIN = 0.03       # a candidate replaces the dispatcher's plan only when this much faster (paired re-measure)
TOP_MODEL = 5         # wgmma tile plans taken from the time model's ranking ...
TOP_STREAMK = 2       # ... and stream-K plans, which it ranks separately (its m > 512 estimates are rough)
TUNE_WARM_MS = 5.0    # per-callable settle time while tuning (the candidates alternate, so no clock state favours one)


def tune_candidates(m: int, n: int, k: int, sm_count: int, cc: int, group: int, clusters, dtype: torch.dtype,
                    codebook: str = "int4"):
    """The plans tune times for one case: the dispatcher's (first), then on sm_90 the time model's
    best tile plans and stream-K plans at any m (the dispatcher's candidate list stops stream-K at
    m = 512), every skinny configuration that takes m at m <= 16, and the mma.sync rule's plan at
    m <= 16. Each at most once."""
    from ..ops.w4a16 import dispatch as d
    from ..ops.w4a16.configs import HOPPER_BK, HOPPER_CONFIGS, SKINNY_CONFIGS, column_tiles, ragged_waste_ok
    from ..ops.w4a16.time_model import predicted_hopper_us
    from ..ops.w4a16.tuned import Plan

    plans = [resolved_plan(d.choose_plan(m, n, k, sm_count, cc, group, clusters, dtype, codebook), m, n, k, sm_count,
                       clusters, group)]
    if cc == 90:
        grouped = group != -1
        tile, streamk = [], []
        for cfg in HOPPER_CONFIGS:
            if not ragged_waste_ok(cfg, n) or cfg.mt > max(32, 2 * m) or (m >= 128 and cfg.mt < 64) or (m >= 512 and cfg.mt < 128):
                continue
            tiles = column_tiles(cfg, n) * -(-m // cfg.mt)
            if cfg.streamk:
                t = predicted_hopper_us(cfg, None, m, n, k, sm_count, clusters, grouped)
                if t is not None and tiles < 4 * sm_count * cfg.ctas_per_sm(128, False):
                    streamk.append((t, cfg.label(), Plan(cfg)))
                continue
            for sl in d.HOPPER_SLICES:
                if sl == 1 or (tiles * sl <= 4 * sm_count and k // HOPPER_BK // sl >= 4):
                    t = predicted_hopper_us(cfg, sl, m, n, k, sm_count, clusters, grouped)
                    if t is not None:
                        tile.append((t, cfg.label(), Plan(cfg, sl)))
        if m >= d.HOPPER_MIN_M:
            plans += [p for *_, p in sorted(tile, key=lambda r: r[:2])[:TOP_MODEL]]
            plans += [p for *_, p in sorted(streamk, key=lambda r: r[:2])[:TOP_STREAMK]]
        if m <= d.SKINNY_MAX_M:
            from dataclasses import replace

            for cfg in SKINNY_CONFIGS:
                if m <= cfg.mt and n % cfg.bn == 0 and (cfg.mt == 8 or m > 8 or cfg.mt == 16):
                    staged = d.skinny_fixup_trips(cfg, m, n, k, sm_count) >= d.SKINNY_STAGED_MIN_TRIPS
                    plans.append(Plan(replace(cfg, staged=staged and not (cfg.mt == 16 and cfg.ns == 2))))
    if m <= d.SKINNY_MAX_M:
        plans.append(Plan(d.choose_mma_config(m, n, k, sm_count)))
    out, seen = [], set()
    for p in plans:
        if p.label() not in seen:
            seen.add(p.label())
            out.append(p)
    return out


def resolved_plan(plan, m, n, k, sm_count, clusters, group):
    """The plan with the k split its launcher would choose written out (so that it and the same
    split among the candidates are one plan)."""
    from dataclasses import replace

    from ..ops.w4a16 import dispatch as d
    from ..ops.w4a16.configs import GemmConfig, HopperConfig
    from ..ops.w4a16.layout import BK

    if plan.slices is not None or plan.cfg.streamk:
        return plan
    if isinstance(plan.cfg, HopperConfig):
        return replace(plan, slices=d.choose_hopper_slices(plan.cfg, m, n, k, sm_count, clusters, group != -1))
    if isinstance(plan.cfg, GemmConfig):
        tiles = (n // plan.cfg.bn) * -(-m // plan.cfg.bm)
        return replace(plan, slices=max(1, min(d.choose_slices(tiles, -(-k // BK), sm_count), -(-k // BK))))
    return plan


def _call(x, w, plan):
    from ..ops.w4a16 import matmul_impl
    from .timing import w4a16_workspace

    ws = w4a16_workspace(x.device)  # the tile counters a layer owns: no timed call zero-fills fresh ones
    if plan.cfg.streamk:
        return lambda: matmul_impl(x, w, cfg=plan.cfg, ctas=plan.ctas, workspace=ws)
    return lambda: matmul_impl(x, w, cfg=plan.cfg, slices=plan.slices, workspace=ws)


def tune(shapes=None, models=None, ms=DEFAULT_TUNE_M, dtypes=("fp16", "bf16"), groups=(128, -1),
         codebook: str = "int4", out: str | Path | None = None, cublas: bool = False, progress=print) -> dict:
    """Tune every (dtype, group, k, n, m) case and merge the result into the table at `out` (default:
    this GPU's user table in the kernel cache). Returns the table document written. cublas: also
    time F.linear of the same shape (written beside each entry: the tuned plan's ratio to it)."""
    from ..ops.w4a16 import pack
    from ..ops.w4a16.tuned import gpu_key, user_table_path
    from ..quant.int4 import quantize_rtn
    from ..runtime import GpuSpec, device_info
    from .w4a16 import DTYPES, select_shapes

    if not torch.cuda.is_available():
        raise RuntimeError("tilefish tune measures kernels on a CUDA GPU; none is visible")
    info = device_info()
    key = gpu_key(info.name, info.sm_count)
    path = Path(out) if out else user_table_path(key)
    kn, _, skipped = select_shapes(shapes, models)
    for line in skipped:
        progress(line)
    clusters = GpuSpec.of(info).clusters
    progress(_warm(kn, ms, dtypes, groups, codebook, info, clusters))
    cases = [(dn, g, k, n, m) for dn in dtypes for (k, n) in kn for g in groups for m in ms if g < 0 or k % g == 0]
    total, done, t0 = len(cases), 0, time.perf_counter()
    entries = []
    saved_warm, timing.WARM_MS = timing.WARM_MS, TUNE_WARM_MS
    try:
        for dname in dtypes:
            dt = DTYPES[dname]
            for k, n in kn:
                dense = torch.randn(n, k, device="cuda", dtype=dt)
                for g in groups:
                    if g > 0 and k % g:  # e.g. k 2880 with group 128: that format cannot exist
                        continue
                    if codebook == "nf4":
                        from ..ops.nf4 import prepare
                        from ..quant.nf4 import quantize as quantize_nf4

                        w = prepare(quantize_nf4(dense, blocksize=g), dt).kernel
                    else:
                        w = pack(quantize_rtn(dense, g, True, scale_dtype=dt, clip_search=False))
                    for m in ms:
                        entries.append(_tune_case(w, dense, m, k, n, g, dname, dt, codebook, info, clusters, cublas))
                        done += 1
                        e = entries[-1]
                        eta = (time.perf_counter() - t0) / done * (total - done)
                        progress(f"[{done}/{total} eta {eta:4.0f}s] {dname} k{k} n{n} g{g} m{m}: {e['plan']} "
                                 f"{e['us']:.1f} us (dispatcher {e['default_plan']} {e['default_us']:.1f} us)"
                                 + (f", {e['cublas_us'] / e['us']:.2f}x cuBLAS" if cublas else ""))
                    del w
                del dense
                _write(path, info, key, entries)
    finally:
        timing.WARM_MS = saved_warm
    doc = _write(path, info, key, entries)
    progress(f"wrote {len(entries)} tuned cases ({len(doc['entries'])} in all) to {path}")
    return doc


def _write(path: Path, info, key: str, entries: list[dict]) -> dict:
    """Merge `entries` into the table at path (atomically: a reader never sees half a file) and make
    this process's dispatcher read it again."""
    from .. import __version__
    from ..ops.w4a16.tuned import TABLE_FORMAT, forget_tables, read_table_doc
    from .report import environment

    env = environment()
    doc = {"format": TABLE_FORMAT, "gpu": info.name, "key": key, "sm_count": info.sm_count, "cc": info.cc,
           "tilefish": __version__, "commit": env.get("commit"), "torch": torch.__version__,
           "created": datetime.now().isoformat(timespec="seconds"), "min_gain": MIN_GAIN, "entries": []}
    old = read_table_doc(path) if path.exists() else None
    fresh = {_entry_key(e) for e in entries}
    doc["entries"] = [e for e in (old or {}).get("entries", []) if _entry_key(e) not in fresh] + entries
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    forget_tables()
    return doc


def _warm(kn, ms, dtypes, groups, codebook, info, clusters) -> str:
    """Compile every candidate's kernel first, in parallel processes (progress.warm_kernels), so the
    cases do not compile them one at a time."""
    from ..ops.w4a16 import kernel_spec
    from .progress import warm_kernels
    from .w4a16 import DTYPES

    specs = [kernel_spec(DTYPES[dname], p.cfg, g, False, codebook)
             for dname in dtypes for k, n in kn for g in groups if g < 0 or k % g == 0 for m in ms
             for p in tune_candidates(m, n, k, info.sm_count, info.cc, g, clusters, DTYPES[dname], codebook)]
    return warm_kernels(specs, info.arch)


def _entry_key(e: dict) -> tuple:
    return (e["dtype"], e["scales"], e.get("codebook", "int4"), e["k"], e["n"], e["m"])


def _tune_case(w, dense, m, k, n, group, dname, dt, codebook, info, clusters, cublas: bool) -> dict:
    from ..ops.w4a16 import matmul_impl, plan_for

    x = torch.randn(m, k, device="cuda", dtype=dt)
    plans = tune_candidates(m, n, k, info.sm_count, info.cc, group, clusters, dt, codebook)
    current = plan_for(w, m)  # a table tuned before: its plan competes too
    if current.label() not in {p.label() for p in plans}:
        plans.append(current)
    ref = matmul_impl(x, w).float()
    fns = {}
    for p in plans:
        try:
            got = _call(x, w, p)().float()
        except ValueError:  # a plan this weight's format or size cannot take (e.g. shared memory)
            continue
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if math.isfinite(err) and err < 2e-2:
            fns[p.label()] = _call(x, w, p)
    times = timing.time_alternating_us(fns, rounds=2, per_round=4, warmup=2)
    default = plans[0].label()
    best = min(times, key=times.get)
    chosen, t_best, t_default = default, times[default], times[default]
    if best != default:
        a, b = timing.time_paired(fns[best], fns[default], rounds=3, reps=30)
        if a.median_ms * 1e3 < (1 - MIN_GAIN) * b.median_ms * 1e3:
            chosen, t_best, t_default = best, a.median_ms * 1e3, b.median_ms * 1e3
        else:
            t_best = t_default = b.median_ms * 1e3
    entry = {"dtype": dname, "scales": "grouped" if group != -1 else "per_channel", "codebook": codebook,
             "group": group, "k": k, "n": n, "m": m, "plan": chosen, "us": round(t_best, 2),
             "default_plan": default, "default_us": round(t_default, 2),
             "candidates": {lab: round(t, 2) for lab, t in sorted(times.items(), key=lambda kv: kv[1])}}
    if cublas:
        entry["cublas_us"] = round(timing.time_cuda(lambda: torch.nn.functional.linear(x, dense), reps=20)
                                   .median_ms * 1e3, 2)
    return entry
