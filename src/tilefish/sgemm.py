"""tilefish.sgemm: fp32 GEMM (the SGEMM ladder, ops/sgemm.py), and what a call launches.

    c = tilefish.sgemm(a, b)                        # C = A @ B; sgemm(a, b, c, alpha, beta) updates c
    p = tilefish.sgemm.plan(4096, 4096, 4096)       # what that call launches (any GPU: gpu=GpuSpec(...))

This module is callable: its class is a ModuleType subclass whose __call__ is the op (Python's documented
way to customize a module, by assigning __class__), so `tilefish.sgemm(a, b)` and
`from tilefish import sgemm; sgemm(a, b)` call the op while `tilefish.sgemm.plan` is the family's plan,
as tilefish.w4a16.plan is W4A16's. The call adds one Python frame to the op's host time.
"""
from __future__ import annotations

import sys
import types

from .ops.gemm_plan import GemmPlan
from .ops.gemm_plan import sgemm_plan as plan
from .ops.sgemm import KERNELS, SgemmConfig
from .ops.sgemm import sgemm as matmul

__all__ = ["GemmPlan", "SgemmConfig", "KERNELS", "matmul", "plan"]


class _Callable(types.ModuleType):
    def __call__(self, a, b, c=None, alpha: float = 1.0, beta: float = 0.0, kernel="auto"):
        """C = alpha * A @ B + beta * C in fp32: tilefish.sgemm.matmul (ops/sgemm.py has the preconditions)."""
        return matmul(a, b, c, alpha, beta, kernel)


sys.modules[__name__].__class__ = _Callable
