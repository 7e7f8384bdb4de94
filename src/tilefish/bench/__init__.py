"""Benchmark harness: CUDA-event timing with L2 flushes, same-process ceilings and peers, reports.

The names below load on first use (they import torch): the command line builds its parser from
bench/families without torch."""
__all__ = ["Timing", "time_cuda", "host_overhead_us", "Report", "Row"]


def __getattr__(name: str):
    if name in ("Timing", "time_cuda", "host_overhead_us"):
        from . import timing

        return getattr(timing, name)
    if name in ("Report", "Row"):
        from . import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
