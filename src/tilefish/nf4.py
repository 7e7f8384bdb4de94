"""tilefish.nf4: bitsandbytes-compatible NF4 weights, their CUDA dequantization and a fused matmul.

    q = tilefish.nf4.quantize(w, blocksize=64, double_quant=True)   # pure torch, CPU or GPU (or from_bnb(...))
    w_hat = tilefish.nf4.dequantize(q, torch.bfloat16)               # CUDA kernel (CPU: reference)
    p = tilefish.nf4.prepare(q, torch.bfloat16)                      # once: repack for the fused matmul
    y = tilefish.nf4.matmul(x, p, bias)                              # x [..., k] -> [..., n]
    tilefish.nf4.plan(16, 4096, 4096, blocksize=64)                  # what a matmul call launches
"""
from __future__ import annotations

import torch

from .quant.nf4 import (NF4_TABLE, NF4Weight, SUPPORTED_BLOCKSIZES, from_bnb, from_state_dict, quantize,
                        to_bnb, to_state_dict)

from .ops.nf4 import NF4MatmulWeight, prepare

__all__ = ["NF4_TABLE", "NF4Weight", "NF4MatmulWeight", "SUPPORTED_BLOCKSIZES", "quantize", "dequantize", "prepare",
           "matmul", "plan", "from_bnb", "to_bnb", "from_state_dict", "to_state_dict"]


def dequantize(q: NF4Weight, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize to `dtype` (bfloat16, float16 or float32; default: the weight's original dtype).

    Bit-exact with bitsandbytes' dequantize_4bit. `out`, if given, must be a contiguous tensor
    of the right dtype and size on the same device. Works under torch.compile and CUDA graphs.
    """
    if not isinstance(q, NF4Weight):
        raise TypeError(f"dequantize expects an NF4Weight (from tilefish.nf4.quantize / from_bnb), got {type(q).__name__}")
    dtype = q.dtype if dtype is None else dtype
    if torch.compiler.is_compiling():
        from .ops import library

        return library.nf4_dequantize(q, dtype, out)
    from .ops.nf4 import dequantize_impl

    return dequantize_impl(q, dtype, out)


def matmul(x: torch.Tensor, w: NF4MatmulWeight, bias: torch.Tensor | None = None, *, workspace=None) -> torch.Tensor:
    """y = x @ dequantize(w)^T (+ bias), fused: the 4-bit codes are decoded inside the GEMM.

    x [..., k] float16/bfloat16 (w.dtype); w from prepare(). CUDA: the W4A16 kernels with NF4 codes
    (small-m stream-K, wgmma or mma.sync, chosen per shape); CPU: bitsandbytes' dequantization and a
    float64 matmul. Gradients reach x and bias; the weight is frozen. CUDA graphs and
    torch.compile(fullgraph=True) work. workspace: a tilefish.w4a16.Workspace for repeated calls
    (as in tilefish.w4a16.matmul)."""
    if not isinstance(w, NF4MatmulWeight) or (isinstance(x, torch.Tensor) and x.device.type == "cpu"):
        from .ops.nf4 import matmul_impl

        return matmul_impl(x, w, bias)
    from . import w4a16

    return w4a16.matmul(x, w.kernel, bias, workspace=workspace)


def plan(m: int, n: int, k: int, *, blocksize: int = 64, dtype: torch.dtype = torch.float16, gpu=None,
         policy=None):
    """The launch plan of matmul(x [m, k], w) for an NF4 weight [n, k] of `blocksize` on `gpu` (a
    tilefish.GpuSpec; default the current GPU) under `policy` (an ops.w4a16.LaunchPolicy; default the
    active one): tilefish.w4a16.plan with the NF4 codebook and the group scales prepare() makes
    (groups of min(blocksize, 128))."""
    from .ops.nf4 import scale_group
    from .ops.w4a16.plan import plan as w4a16_plan

    if isinstance(blocksize, bool) or blocksize not in SUPPORTED_BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {SUPPORTED_BLOCKSIZES}, got {blocksize!r}")
    return w4a16_plan(m, n, k, group_size=scale_group(blocksize), dtype=dtype, codebook="nf4", gpu=gpu,
                      policy=policy)
