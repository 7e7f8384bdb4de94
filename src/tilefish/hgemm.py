"""tilefish.hgemm: fp16 / bf16 GEMM on tensor cores (the HGEMM ladder, ops/hgemm.py), and what a call launches.

    c = tilefish.hgemm(a, b)                        # C = A @ B; b_transposed=True for b [N, K] (nn.Linear's weight)
    p = tilefish.hgemm.plan(4096, 4096, 4096)       # what that call launches (any GPU: gpu=GpuSpec(...))

This module is callable: its class is a ModuleType subclass whose __call__ is the op (Python's documented
way to customize a module, by assigning __class__), so `tilefish.hgemm(a, b)` and
`from tilefish import hgemm; hgemm(a, b)` call the op while `tilefish.hgemm.plan` is the family's plan,
as tilefish.w4a16.plan is W4A16's. The call adds one Python frame to the op's host time.
"""
from __future__ import annotations

import sys
import types

from .ops.gemm_plan import GemmPlan
from .ops.gemm_plan import hgemm_plan as plan
from .ops.hgemm import KERNELS, HgemmConfig
from .ops.hgemm import hgemm as matmul

__all__ = ["GemmPlan", "HgemmConfig", "KERNELS", "matmul", "plan"]


class _Callable(types.ModuleType):
    def __call__(self, a, b, kernel="auto", b_transposed: bool = False):
        """C = A @ B (or A @ B.T for b [N, K] with b_transposed=True), fp16/bf16, fp32 accumulation:
        tilefish.hgemm.matmul (ops/hgemm.py has the preconditions)."""
        return matmul(a, b, kernel, b_transposed)


sys.modules[__name__].__class__ = _Callable
