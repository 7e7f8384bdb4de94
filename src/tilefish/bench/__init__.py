"""Benchmark harness: CUDA-event timing with L2 flushes, same-process ceilings and peers, reports."""
from .timing import Timing, time_cuda, host_overhead_us
from .report import Report, Row

__all__ = ["Timing", "time_cuda", "host_overhead_us", "Report", "Row"]
