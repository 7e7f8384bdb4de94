"""Hardware ceilings measured in the same process as the kernels they judge."""
from __future__ import annotations

import functools

import torch

from .timing import time_cuda


@functools.lru_cache(maxsize=None)
def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written (GB/s, 1e9)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), reps=30)
    del src, dst
    return 2 * nbytes / (t.median_ms * 1e-3) / 1e9


@functools.lru_cache(maxsize=None)
def write_bandwidth_gbps(nbytes: int = 2 << 30) -> float:
    """Write-only rate (torch fill_), GB/s: the ceiling of an op whose traffic is mostly output."""
    dst = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    t = time_cuda(lambda: dst.fill_(1.5), reps=30)
    del dst
    return nbytes / (t.median_ms * 1e-3) / 1e9


@functools.lru_cache(maxsize=None)
def cublas_tflops(dtype: torch.dtype = torch.float16, n: int = 8192) -> float:
    """Dense cuBLAS matmul rate on random n x n x n operands (TF32 off for fp32)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        t = time_cuda(lambda: a @ b, reps=20)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return 2 * n ** 3 / (t.median_ms * 1e-3) / 1e12
