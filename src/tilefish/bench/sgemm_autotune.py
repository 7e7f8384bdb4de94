"""SGEMM autotuner: time every tile configuration of a ladder step on one shape and rank them.

    python -m tilefish.bench.sgemm_autotune --step 09_pipelined --shape 4096
    python -m tilefish.bench.sgemm_autotune --all --shape 4096 --shape 1024x1024x1024 --json out.json

Each variant is compiled (disk-cached), checked against a float64 reference (relative error
< 1e-5; a wrong variant is reported, never ranked first), then timed with
tilefish.bench.timing.time_cuda (CUDA events, L2 flushed before every run, median).  The JSON
holds every result plus `tuned`: the winning configuration per (step, shape), which is what
ops/sgemm.py's TUNED / TUNED_SMALL tables are filled from (`--snippet` prints them as Python).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..ops.sgemm import KERNELS, SgemmConfig, launch_config, variant_configs, vector_ok

REL_TOL = 1e-5


@dataclass
class TuneResult:
    step: str
    params: dict[str, int]
    shape: tuple[int, int, int]          # (M, N, K)
    time_us: float | None = None
    tflops: float | None = None
    rel_err: float | None = None
    ok: bool = False
    error: str | None = None
    registers: int | None = None
    spills: int | None = None
    threads: int | None = None
    smem_bytes: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def config(self) -> SgemmConfig:
        return SgemmConfig.of(self.step, **self.params)

    def label(self) -> str:
        return self.config.short()


def _shape3(shape) -> tuple[int, int, int]:
    shape = tuple(int(x) for x in shape)
    if len(shape) == 1:
        return (shape[0],) * 3
    if len(shape) != 3:
        raise ValueError(f"a shape is (S,) for S^3 or (M, N, K), got {shape}")
    return shape  # type: ignore[return-value]


def _operands(shape, device, seed: int = 0):
    m, n, k = shape
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, k, device=device, generator=g)
    b = torch.randn(k, n, device=device, generator=g)
    ref = (a.double() @ b.double()).float()
    return a, b, ref


def autotune(step: str, shape=(4096,), *, configs: list[SgemmConfig] | None = None, reps: int = 20,
             warmup: int = 2, check: bool = True, device: torch.device | str | None = None,
             verbose: bool = False) -> list[TuneResult]:
    """Time every configuration of `step` (default: its variant_configs()) on shape (M, N, K).

    Returns the results fastest first; failed or wrong variants (ok=False) come last.
    """
    from .timing import time_cuda
    from ..runtime import get_kernel

    if step not in KERNELS:
        raise ValueError(f"unknown SGEMM step {step!r}; one of {KERNELS}")
    shape = _shape3(shape)
    m, n, k = shape
    device = torch.device(device or "cuda")
    configs = variant_configs(step) if configs is None else list(configs)
    a, b, ref = _operands(shape, device)
    c = torch.empty(m, n, device=device)
    flops = 2.0 * m * n * k
    out: list[TuneResult] = []
    for cfg in configs:
        r = TuneResult(cfg.step, cfg.params, shape, threads=cfg.threads, smem_bytes=cfg.smem_bytes)
        out.append(r)
        if cfg.info.vectorized and not vector_ok(a, b, c):
            r.error = "shape/alignment outside the vectorized fast path (K % 4, N % 4)"
            continue
        try:
            kern = get_kernel(cfg.spec, device)
            res = kern.compiled.resources
            r.registers, r.spills = res.registers, res.spill_stores + res.spill_loads
            if check:
                c.fill_(float("nan"))
                launch_config(cfg, a, b, c)
                torch.cuda.synchronize(device)
                den = ref.double().norm().item() or 1.0
                r.rel_err = (c.double() - ref.double()).norm().item() / den
                if not r.rel_err < REL_TOL:  # also catches NaN (unwritten output)
                    r.error = f"wrong result: relative error {r.rel_err:.3g}"
                    continue
            t = time_cuda(lambda: launch_config(cfg, a, b, c), reps=reps, warmup=warmup, min_reps=3)
        except Exception as e:  # noqa: BLE001 - a broken variant is a result, not a crash
            r.error = f"{type(e).__name__}: {e}"[:500]
            continue
        r.time_us = t.median_us
        r.tflops = flops / (t.median_ms * 1e-3) / 1e12
        r.ok = True
        if verbose:
            print(f"  {cfg.short():40s} {r.time_us:10.1f} us {r.tflops:7.2f} TFLOP/s  regs {r.registers}",
                  file=sys.stderr, flush=True)
    out.sort(key=lambda r: (not r.ok, r.time_us if r.time_us is not None else float("inf")))
    return out


def best(results: list[TuneResult]) -> TuneResult | None:
    return next((r for r in results if r.ok), None)


def ranking_table(results: list[TuneResult], top: int | None = None) -> str:
    if not results:
        return "(no results)"
    m, n, k = results[0].shape
    lines = [f"{results[0].step} at M={m} N={n} K={k}",
             f"{'#':>3s}  {'config':40s} {'time (us)':>10s} {'TFLOP/s':>8s} {'regs':>5s} {'thr':>4s} {'smem':>7s}"]
    for i, r in enumerate(results[:top] if top else results, 1):
        if r.ok:
            lines.append(f"{i:3d}  {r.label():40s} {r.time_us:10.1f} {r.tflops:8.2f} {r.registers:5d} "
                         f"{r.threads:4d} {r.smem_bytes:7d}")
        else:
            lines.append(f"{i:3d}  {r.label():40s} {'--':>10s} {'--':>8s}  {r.error}")
    return "\n".join(lines)


def dump_json(results_by_key: dict[str, list[TuneResult]], path: str | Path, extra: dict | None = None) -> None:
    """Write {"environment", "tuned": {key: best config}, "results": {key: [every result]}}."""
    from .report import environment

    rec = {
        "environment": environment(),
        "tuned": {key: ({"step": b.step, "params": b.params, "time_us": b.time_us, "tflops": b.tflops}
                        if (b := best(rs)) else None) for key, rs in results_by_key.items()},
        "results": {key: [asdict(r) for r in rs] for key, rs in results_by_key.items()},
    }
    if extra:
        rec.update(extra)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(rec, indent=1) + "\n")


def tuned_snippet(results_by_key: dict[str, list[TuneResult]]) -> str:
    """Python lines for ops/sgemm.py's TUNED table from the winners (one per step)."""
    lines = []
    for key, rs in results_by_key.items():
        b = best(rs)
        if b is not None:
            vals = ", ".join(str(v) for v in b.config.values)
            lines.append(f'    "{b.step}": _cfg("{b.step}", {vals}),  # {key}: {b.tflops:.1f} TFLOP/s')
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tilefish.bench.sgemm_autotune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", action="append", choices=KERNELS, help="ladder step (repeatable)")
    p.add_argument("--all", action="store_true", help="every step from 05 on (01-04 with --all-steps)")
    p.add_argument("--all-steps", action="store_true", help="every step, including the slow 01-04")
    p.add_argument("--shape", action="append", default=None,
                   help="S (for S^3) or MxNxK; repeatable; default 4096")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--top", type=int, default=None, help="print only the best N of each ranking")
    p.add_argument("--json", help="write every result and the winners here")
    p.add_argument("--snippet", action="store_true", help="print the TUNED lines for ops/sgemm.py")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("the autotuner needs an NVIDIA GPU", file=sys.stderr)
        return 2
    steps = list(KERNELS) if args.all_steps else [s for s in KERNELS if int(s[:2]) >= 5] if args.all else \
        (args.step or ["09_pipelined"])
    shapes = [_shape3(tuple(int(x) for x in s.lower().split("x"))) for s in (args.shape or ["4096"])]
    results: dict[str, list[TuneResult]] = {}
    for shape in shapes:
        for step in steps:
            key = f"{step}@{shape[0]}x{shape[1]}x{shape[2]}"
            rs = autotune(step, shape, reps=args.reps, verbose=args.verbose)
            results[key] = rs
            print(ranking_table(rs, args.top), flush=True)
            print()
    if args.snippet:
        print(tuned_snippet(results))
    if args.json:
        dump_json(results, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
