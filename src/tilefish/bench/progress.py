"""`tilefish bench`'s progress across families: what is done, what runs now, and an ETA from the first second.

The run is a list of steps (one call of a family's bench function each), each a list of cases (the rows it
will report) with a weight: the case's estimated seconds. The Tracker turns reported events (a case done, a
step's own inner progress, the time spent in the current case) into a completed weight and an ETA; a display
draws it: a rich progress bar on a terminal where rich is importable (the `bench` extra), else one plain line
per case on stderr. warm_kernels compiles the run's kernels in parallel processes first, reporting each one.
The case weights come from the ETA model at the end (the harness's own structure at an H100's rates), the one
the families' steps all use. InnerProgress is a bench function's own progress (a step per build or measurement),
which moves the run's bar inside a case.
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from dataclasses import dataclass, field

# The ETA scales what is left by (seconds spent) / (weight done), with this much weight of prior belief
# that the estimates are right (scale 1): the first cases alone do not swing it.
PRIOR_WEIGHT_S = 15.0
# Inside a case, time moves the bar toward the case's estimated end, but never past this fraction of it
# until the case is done.
MAX_INTERPOLATION = 0.95


@dataclass
class Case:
    label: str
    weight: float = 1.0      # estimated seconds
    counted: bool = True     # a case of the run (the compile phase is weighted but not counted)


@dataclass
class Phase:
    """One step as the tracker sees it: a title and its cases, in the order they finish."""
    title: str
    cases: list[Case] = field(default_factory=list)

    @property
    def weight(self) -> float:
        return sum(c.weight for c in self.cases)


class Tracker:
    """Where the run stands. Not thread-aware by itself: the displays call it under their own lock."""

    def __init__(self, phases: list[Phase], clock=time.perf_counter):
        self.phases = phases
        self.clock = clock
        self.total_weight = sum(p.weight for p in phases) or 1.0
        self.total_cases = sum(c.counted for p in phases for c in p.cases)
        self.cases_done = 0
        self.t0 = clock()
        self.phase_index = -1
        self.case_index = 0                 # next case of the current phase to finish
        self.done_weight = 0.0              # weight of finished cases (all phases)
        self.done_elapsed = 0.0             # seconds at the last finished case
        self.phase_start_weight = 0.0
        self.case_start = self.t0
        self.inner = 0.0                    # the current phase's own progress report (0..1)
        self.detail = ""

    @property
    def phase(self) -> Phase | None:
        return self.phases[self.phase_index] if 0 <= self.phase_index < len(self.phases) else None

    @property
    def current(self) -> Case | None:
        p = self.phase
        return p.cases[self.case_index] if p is not None and self.case_index < len(p.cases) else None

    def begin_phase(self, index: int) -> None:
        self.end_phase()
        self.phase_index = index
        self.case_index = 0
        self.phase_start_weight = self.done_weight
        self.case_start = self.clock()
        self.inner = 0.0
        self.detail = ""

    def case_done(self) -> Case | None:
        """The current case finished (a row came in); None when the phase had no case left to finish."""
        case = self.current
        if case is None:
            return None
        self.case_index += 1
        self.done_weight += case.weight
        self.cases_done += case.counted
        now = self.clock()
        self.done_elapsed = now - self.t0
        self.case_start = now
        self.detail = ""
        return case

    def end_phase(self) -> None:
        """The phase is over: cases it did not report (a skipped peer, a family that adds its rows at the
        end) finish now."""
        while self.current is not None:
            self.case_done()

    def set_inner(self, fraction: float, detail: str = "") -> None:
        self.inner = min(1.0, max(self.inner, fraction))
        if detail:
            self.detail = detail

    def completed_weight(self, now: float | None = None) -> float:
        """The finished weight, plus the current case's share of its estimate that the time spent in it (or
        the phase's own report) covers, short of its end."""
        now = self.clock() if now is None else now
        p, case = self.phase, self.current
        if p is None or case is None:
            return self.done_weight
        in_case = min(MAX_INTERPOLATION, (now - self.case_start) / max(case.weight, 1e-6)) * case.weight
        by_cases = self.done_weight + in_case
        by_inner = self.phase_start_weight + min(MAX_INTERPOLATION, self.inner) * p.weight
        return max(by_cases, by_inner)

    def eta(self, now: float | None = None) -> float:
        """Seconds left: the weight left, scaled by how the finished cases' times compared to their estimates."""
        now = self.clock() if now is None else now
        scale = (self.done_elapsed + PRIOR_WEIGHT_S) / (self.done_weight + PRIOR_WEIGHT_S)
        return max(0.0, (self.total_weight - self.completed_weight(now)) * scale)

    def elapsed(self, now: float | None = None) -> float:
        return (self.clock() if now is None else now) - self.t0

    def label(self) -> str:
        p, case = self.phase, self.current
        if p is None:
            return "starting"
        what = case.label if case is not None else "finishing"
        return f"{p.title}: {what}" + (f" ({self.detail})" if self.detail and self.detail != what else "")


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}:{s % 60:02d}"


class PlainDisplay:
    """One line per finished case (and per phase) on `stream`: for logs, pipes, and machines without rich."""

    def __init__(self, tracker: Tracker, stream=None):
        self.tracker = tracker
        self.stream = stream or sys.stderr
        self.lock = threading.RLock()

    def __enter__(self):
        t = self.tracker
        self._print(f"{t.total_cases} cases, estimated {_clock(t.total_weight)} (m:ss)")
        return self

    def __exit__(self, *exc):
        return False

    def _print(self, text: str) -> None:
        print(f"[tilefish bench] {text}", file=self.stream, flush=True)

    def _status(self) -> str:
        t = self.tracker
        pct = 100 * t.completed_weight() / t.total_weight
        return (f"{t.cases_done}/{t.total_cases} cases, {pct:3.0f}%, elapsed {_clock(t.elapsed())}, "
                f"ETA {_clock(t.eta())}")

    def begin_phase(self, index: int) -> None:
        with self.lock:
            self.tracker.begin_phase(index)
            self._print(f"{self.tracker.phase.title} ... ({self._status()})")

    def end_phase(self) -> None:
        with self.lock:
            self.tracker.end_phase()

    def case_done(self) -> None:
        with self.lock:
            case = self.tracker.case_done()
            if case is not None and case.counted:
                self._print(f"{case.label} done ({self._status()})")

    def set_inner(self, fraction: float, detail: str = "") -> None:
        with self.lock:
            self.tracker.set_inner(fraction, detail)

    def message(self, text: str) -> None:
        with self.lock:
            self._print(text)


class RichDisplay(PlainDisplay):
    """A rich progress bar on stderr, redrawn a few times a second so the time inside a case moves it too."""

    def __init__(self, tracker: Tracker, stream=None):
        super().__init__(tracker, stream)
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        self.progress = Progress(TextColumn("{task.fields[cases]}"), BarColumn(bar_width=30),
                                 TextColumn("{task.percentage:>3.0f}%"),
                                 TextColumn("elapsed {task.fields[elapsed]}  ETA {task.fields[eta]}"),
                                 TextColumn("{task.description}"),
                                 console=Console(file=self.stream), redirect_stdout=False, redirect_stderr=True,
                                 refresh_per_second=4)
        self.task = None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self.progress.start()
        self.task = self.progress.add_task("starting", total=self.tracker.total_weight, **self._fields())
        self._thread = threading.Thread(target=self._tick, name="tilefish-bench-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._update()
        self.progress.stop()
        return False

    def _fields(self) -> dict:
        t = self.tracker
        return {"cases": f"{t.cases_done}/{t.total_cases} cases", "elapsed": _clock(t.elapsed()),
                "eta": _clock(t.eta())}

    def _update(self) -> None:
        with self.lock:
            if self.task is not None:
                self.progress.update(self.task, completed=self.tracker.completed_weight(),
                                     description=self.tracker.label(), **self._fields())

    def _tick(self) -> None:
        while not self._stop.wait(0.25):
            self._update()

    def begin_phase(self, index: int) -> None:
        with self.lock:
            self.tracker.begin_phase(index)
        self._update()

    def case_done(self) -> None:
        with self.lock:
            self.tracker.case_done()
        self._update()

    def set_inner(self, fraction: float, detail: str = "") -> None:
        with self.lock:
            self.tracker.set_inner(fraction, detail)
        self._update()

    def message(self, text: str) -> None:
        self.progress.console.print(text)


def make_display(tracker: Tracker, stream=None, rich: bool | None = None):
    """RichDisplay where rich is importable and `stream` is a terminal (rich=None), else PlainDisplay."""
    stream = stream or sys.stderr
    if rich is None:
        try:
            import rich as _rich  # noqa: F401
            rich = bool(getattr(stream, "isatty", lambda: False)())
        except ImportError:
            rich = False
    return RichDisplay(tracker, stream) if rich else PlainDisplay(tracker, stream)


# ---- a bench function's own progress ----------------------------------------------------------------------------

class InnerProgress:
    """A bench function's progress, one step per model build or measurement (bench e2e, bench nf4's matmul): a
    rich bar where rich is importable, else a line per step with elapsed time and an ETA. Inside the
    all-families run (inner_progress_into) the steps move that run's bar instead of drawing a second one."""

    display = None  # the all-families run's display, while inner_progress_into holds it

    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, -1, time.perf_counter()
        self._bar = None
        self._into = None

    def __enter__(self):
        self._into = InnerProgress.display
        if self._into is not None:
            return self
        try:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
        except ImportError:
            return self
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TimeRemainingColumn())
        self._bar.start()
        self._task = self._bar.add_task("e2e", total=self.total)
        return self

    def step(self, label: str) -> None:
        """The previous step is done; `label` starts."""
        self.done += 1
        if self._into is not None:
            self._into.set_inner(self.done / max(1, self.total), label)
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=label)
            return
        elapsed = time.perf_counter() - self.t0
        eta = f"{elapsed / self.done * (self.total - self.done):.0f} s" if self.done else "?"
        print(f"[{self.done + 1}/{self.total}] {label}  (elapsed {elapsed:.0f} s, ETA {eta})", flush=True)

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.update(self._task, completed=self.total)
            self._bar.stop()


@contextlib.contextmanager
def inner_progress_into(display):
    """Every InnerProgress opened inside the block moves `display`'s current case (display.set_inner)."""
    InnerProgress.display = display
    try:
        yield
    finally:
        InnerProgress.display = None


# ---- the kernel cache, warmed in parallel before anything is timed ---------------------------------------------

# Run in a fresh interpreter (as bench/nf4.py's warm_kernel_cache does: its workers neither inherit the
# caller's CUDA context nor re-run its main script): (jobs, processes) pickled on stdin; one line a finished
# compile on stdout ("ok" or "failed"), so the caller can count them as they come.
_WARM_CODE = """
import pickle, sys
from tilefish.runtime import compile_many
jobs, processes = pickle.loads(sys.stdin.buffer.read())
compile_many(jobs, processes, on_done=lambda i, r: print("ok" if r[0] is not None else "failed", flush=True))
"""


def uncached(specs, arch: str) -> list:
    """The specs (deduplicated, in order) whose kernel for `arch` is not in the disk cache yet."""
    from ..runtime import is_cached

    seen, todo = set(), []
    for s in specs:
        if s in seen or not s.supports(arch):
            continue
        seen.add(s)
        if not is_cached(s, arch):
            todo.append(s)
    return todo


def warm_kernels(specs, arch: str, on_done=None, processes: int | None = None, timeout_s: float = 900) -> str:
    """Compile the kernels of `specs` that the disk cache lacks, in parallel processes, calling on_done(done,
    total) as each one finishes. Returns a line for the report. A failed compile is only counted: the kernel
    compiles again (and raises with its log) where the run first launches it."""
    import os
    import pickle
    import subprocess
    import tempfile

    from ..runtime import cache_enabled

    if not cache_enabled():
        return "kernel cache disabled (TILEFISH_CACHE=0): kernels compile on first use, inside the run"
    specs = list(dict.fromkeys(specs))
    todo = uncached(specs, arch)
    if not todo:
        return f"kernel cache: all {len(specs)} kernels of the run were cached"
    t0 = time.perf_counter()
    processes = processes or max(1, min(16, os.cpu_count() or 1, len(todo)))
    errors = tempfile.TemporaryFile()  # not a pipe: nothing reads it while the compiles run
    proc = subprocess.Popen([sys.executable, "-c", _WARM_CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=errors)
    done = failed = 0
    try:
        proc.stdin.write(pickle.dumps(([(s, arch) for s in todo], processes)))
        proc.stdin.close()
        for line in proc.stdout:
            done += 1
            failed += line.strip() != b"ok"
            if on_done is not None:
                on_done(done, len(todo))
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:  # interrupted: the compiles are only a head start
            proc.kill()
            proc.wait()
    errors.seek(0)
    err = errors.read().decode(errors="replace").strip().splitlines()
    errors.close()
    if proc.returncode != 0 and done < len(todo):
        raise RuntimeError(f"kernel compile processes failed: {err[-1] if err else proc.returncode}")
    note = (f"kernel cache warmed before timing: {len(todo)} of the run's {len(specs)} kernels compiled in "
            f"{time.perf_counter() - t0:.0f} s ({processes} processes)")
    return note + (f", {failed} failed to compile (they raise where the run launches them)" if failed else "")


# ---- the ETA model: case times estimated (seconds on an H100 SXM) ----------------------------------------------
# The harness's structure (bench/timing.py) with an H100's rates: each timed block settles for WARM_MS (at most
# WARM_MAX_CALLS calls), then every rep reads the L2 flush buffer (256 MiB), spins ~50 us and runs the kernel.
# The families' steps weigh their cases with these; only the family knows what its case launches.
HBM_BPS = 3.0e12          # bytes/s a kernel streams from HBM
TENSOR_FLOPS = 650e12     # fp16/bf16 dense, cuBLAS-class
FP32_FLOPS = 50e12        # FFMA, cuBLAS-class
HOST_S = 25e-6            # one eager call's host time
FLUSH_S = (256 << 20) / HBM_BPS
SPIN_S = 50e-6
NVRTC_S = 1.0             # one kernel's NVRTC 13.0 compile: 0.2-0.9 s each (the quick run's 31, on a 2-core CPU)
COMPILE_START_S = 4.0     # the compile processes' start (each imports torch)


def kernel_s(nbytes: float, flops: float, peak: float = TENSOR_FLOPS) -> float:
    """A kernel's time: its bytes at HBM rate or its flops at `peak`, whichever is longer, plus a launch."""
    return max(nbytes / HBM_BPS, flops / peak) + 4e-6


def samples_s(t: float, reps: int, warmup: int = 5, min_reps: int = 10, max_seconds: float = 5.0) -> float:
    """timing.time_cuda's time for a kernel of t seconds."""
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


def compile_s(kernels: int, processes: int) -> float:
    """warm_kernels' time for `kernels` kernels in `processes` processes."""
    return math.ceil(kernels / max(1, processes)) * NVRTC_S + (COMPILE_START_S if kernels else 0.0)
