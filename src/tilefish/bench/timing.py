"""CUDA-event timing: median of many runs, L2 flushed before each run."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch

_flush_buffers: dict[int, torch.Tensor] = {}
_workspaces: dict[int, object] = {}


def w4a16_workspace(device: torch.device):
    """One W4A16 Workspace per device for the benchmarks' functional calls: the tile counters a
    layer owns, so a timed call never includes the memset of fresh ones."""
    from ..w4a16 import Workspace

    index = torch.device(device).index or 0
    if index not in _workspaces:
        _workspaces[index] = Workspace(torch.device("cuda", index))
    return _workspaces[index]
_SPIN_CYCLES = 100_000  # ~50 us at H200 clocks
# Before its timed calls every callable runs back to back for WARM_MS (at most WARM_MAX_CALLS
# calls), so it is timed at its own sustained clocks. The H200's power controller takes 30-60 ms
# to settle: without this the block timed right after cuBLAS inherited cuBLAS's lowered clocks
# (HGEMM step 06 at 8192^3: 2869 us after cuBLAS, 2665 us settled) and cuBLAS after a
# lower-power kernel ran at boost clocks (1490 against 1738 us settled). Memory-bound kernels
# time the same either way (W4A16 m <= 128 within 1%). TILEFISH_BENCH_WARM_MS=0 restores the
# old behaviour (a few warm-up calls only).
def _warm_ms_from_env() -> float:
    text = os.environ.get("TILEFISH_BENCH_WARM_MS", "100")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also rejects nan
        raise ValueError(f"TILEFISH_BENCH_WARM_MS must be a number of milliseconds >= 0, got {text!r}")
    return value


WARM_MS = _warm_ms_from_env()
WARM_MAX_CALLS = 500


@dataclass
class Timing:
    median_ms: float
    min_ms: float
    p90_ms: float
    reps: int

    @property
    def median_us(self) -> float:
        return self.median_ms * 1e3


def _flush_buffer(device: int) -> torch.Tensor:
    buf = _flush_buffers.get(device)
    if buf is None:
        from ..runtime import device_info

        l2 = device_info(device).l2_bytes or 64 << 20
        buf = torch.ones(max(4 * l2, 256 << 20), dtype=torch.uint8, device=f"cuda:{device}")
        _flush_buffers[device] = buf
    return buf


def flush_l2(device: int | None = None) -> None:
    """Read a buffer several times the L2 size, so no operand of the next run is cached.

    A read, not a write: a written flush buffer leaves ~L2-size of dirty lines whose write-back
    to DRAM then happens during the timed kernel (about 15 us of DRAM time on an H200, a large
    error for a 50 us kernel). Reading evicts earlier dirty lines here, before the clock starts,
    and leaves only clean lines behind."""
    buf = _flush_buffer(torch.cuda.current_device() if device is None else device)
    torch.sum(buf.view(torch.int32), dtype=torch.int32)


def time_cuda(fn, *, reps: int = 50, warmup: int = 5, flush: bool = True, min_reps: int = 10,
              max_seconds: float = 5.0) -> Timing:
    """Median of `reps` CUDA-event-timed calls of fn(), each after an L2 flush and a short GPU spin.

    Warm-up calls run first (compilation, allocator, cuBLAS handles stay out of the numbers),
    then back-to-back calls until the clocks settle (WARM_MS).
    The rep count shrinks for slow kernels so one measurement stays under `max_seconds`.
    """
    return _timing(_samples_ms(fn, reps, warmup, flush, min_reps, max_seconds))


def time_paired(fn, peer, *, rounds: int = 3, reps: int = 50, warmup: int = 5, flush: bool = True,
                min_reps: int = 10, max_seconds: float = 5.0) -> tuple[Timing, Timing]:
    """fn and peer timed in alternating rounds (peer, fn, peer, fn, ...), about reps / rounds calls
    each a round, samples pooled: (fn's Timing, peer's Timing).

    For kernels long enough to heat the GPU (an 8192^3 GEMM draws full power): its clocks fall as
    it warms up, so timing all of one and then all of the other compares two clock states, and
    whichever runs later loses (cuBLAS at 8192^3 measured 632-793 TFLOP/s on one day). Each block
    first settles at its own clocks (WARM_MS), so neither inherits the other's."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"time_paired needs rounds >= 1, got {rounds!r}")
    per = max(min_reps, -(-reps // rounds))
    a: list[float] = []
    b: list[float] = []
    for _ in range(rounds):
        b += _samples_ms(peer, per, warmup, flush, min(min_reps, per), max_seconds / rounds)
        a += _samples_ms(fn, per, warmup, flush, min(min_reps, per), max_seconds / rounds)
    return _timing(a), _timing(b)


def time_alternating_us(fns: dict, *, rounds: int = 4, per_round: int = 6, warmup: int = 2, flush: bool = True,
                        max_seconds: float = 10.0) -> dict:
    """Several callables timed in alternating rounds (each round runs every fn in turn, per_round
    calls each), samples pooled: {name: median us}. The same-process A/B of scripts/experiments/ab_*.py, for
    choices a one-after-another comparison cannot settle because the clocks drift. Each round
    starts at a different place in the list (offset r x len / rounds): the fn timed right after a
    heavy one runs slower (HGEMM 8192^3 on the H200: the same configuration read 0.531x of cuBLAS
    in second place and 0.568x in fourth), so a fixed order would favour the later ones."""
    if not isinstance(rounds, int) or rounds < 1 or not isinstance(per_round, int) or per_round < 1:
        raise ValueError(f"time_alternating_us needs rounds >= 1 and per_round >= 1, got {rounds!r}, {per_round!r}")
    if not fns:
        raise ValueError("time_alternating_us needs at least one callable")
    samples: dict = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        start = r * len(names) // rounds
        for name in names[start:] + names[:start]:
            samples[name] += _samples_ms(fns[name], per_round, warmup, flush, per_round, max_seconds)
    return {name: statistics.median(v) * 1e3 for name, v in samples.items()}


def _timing(ms: list[float]) -> Timing:
    ms = sorted(ms)
    return Timing(statistics.median(ms), ms[0], ms[int(0.9 * (len(ms) - 1))], len(ms))


def _settle(fn, warmup: int) -> None:
    """`warmup` calls, then more back to back until WARM_MS have passed (WARM_MAX_CALLS at most)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0, calls = time.perf_counter(), 0
    while (time.perf_counter() - t0) * 1e3 < WARM_MS and calls < WARM_MAX_CALLS:
        fn()
        calls += 1
        if calls % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


def _samples_ms(fn, reps: int, warmup: int, flush: bool, min_reps: int, max_seconds: float) -> list[float]:
    _settle(fn, warmup)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    reps = max(min_reps, min(reps, int(max_seconds / max(one, 1e-6))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush:
            flush_l2()
        # Keep the GPU busy ~50 us before the start event, so the host has always enqueued fn()
        # by the time the GPU gets there: Python launch overhead never shows up as a gap inside
        # the timed region (it did for 30-45 us wrappers behind a 70 us flush).
        torch.cuda._sleep(_SPIN_CYCLES)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def host_overhead_us(fn, calls: int = 2000) -> float:
    """Host time per call (Python wrapper + launch) on a problem small enough that the GPU keeps up."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def host_overhead_paired_us(fns: dict, calls: int = 1000, rounds: int = 7) -> dict:
    """host_overhead_us of several callables in alternating rounds, median per callable: {name: us}.
    The host's speed drifts (a busy or throttled CPU moved one F.linear reading from 20 to 33 us
    between runs), so callables compared in one table are timed interleaved, never one after the other."""
    samples: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(host_overhead_us(fn, calls))
    return {name: statistics.median(v) for name, v in samples.items()}
