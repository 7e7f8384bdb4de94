"""tilefish.nf4: bitsandbytes-compatible NF4 weights and their CUDA dequantization.

    q = tilefish.nf4.quantize(w, blocksize=64, double_quant=True)   # pure torch, CPU or GPU
    w_hat = tilefish.nf4.dequantize(q, torch.bfloat16)               # CUDA kernel (CPU: reference)
"""
from __future__ import annotations

import torch

from .quant.nf4 import (NF4_TABLE, NF4Weight, SUPPORTED_BLOCKSIZES, from_bnb, from_state_dict, quantize,
                        to_bnb, to_state_dict)

__all__ = ["NF4_TABLE", "NF4Weight", "SUPPORTED_BLOCKSIZES", "quantize", "dequantize", "from_bnb", "to_bnb",
           "from_state_dict", "to_state_dict"]


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
