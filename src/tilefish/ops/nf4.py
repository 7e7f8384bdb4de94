"""NF4 dequantization op: validate -> pick the kernel variant -> launch.

CPU tensors go to reference.py (bitsandbytes' exact fp32 arithmetic), so the op works everywhere.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..quant.nf4 import NF4Weight
from ..runtime import KernelSpec, device_info, get_kernel, i32, i64, launch

SOURCE = "nf4/dequantize.cu"
THREADS = 256
VECTOR_ELEMS = 32  # one 16-byte vector of codes
OUT_DTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half", torch.float32: "float"}


@dataclass(frozen=True)
class DequantConfig:
    """Template parameters of kernels/nf4/dequantize.cu plus the grid size rule."""
    lut: int = 0          # 0 shared-memory 16 floats, 1 warp shuffle, 2 shared 256 x float2
    transpose: int = 1    # 1: re-deal codes through shared memory so warp stores are contiguous
    ilp: int = 1          # 16-byte vectors in flight per lane
    stream: bool = True   # evict-first output stores
    prefetch: bool = False  # L2::256B hint on code loads
    blocks_per_sm: int = 0  # grid = SMs x this (grid-stride loop); 0: one pass, a block per tile

    def label(self) -> str:
        return (f"lut{self.lut}-t{self.transpose}-ilp{self.ilp}-{'cs' if self.stream else 'wb'}"
                f"{'-pf' if self.prefetch else ''}-b{self.blocks_per_sm}")


# Chosen from `tilefish bench nf4 --variants` on the H200 (docs/nf4.md has the sweep).
DEFAULT_CONFIG = DequantConfig()


@functools.lru_cache(maxsize=None)
def kernel_spec(dtype: torch.dtype, double_quant: bool, cfg: DequantConfig = DEFAULT_CONFIG) -> KernelSpec:
    name = (f"nf4_dequantize<{OUT_DTYPES[dtype]}, {'true' if double_quant else 'false'}, {cfg.lut}, "
            f"{cfg.transpose}, {cfg.ilp}, {'true' if cfg.stream else 'false'}, {'true' if cfg.prefetch else 'false'}>")
    return KernelSpec(SOURCE, name, hot=True)


def variant_configs() -> list[DequantConfig]:
    """The design space the benchmark sweeps (each is compilable; only the default is dispatched).

    TRANSPOSE=0 stays in with one representative per LUT: it shows what the store pattern costs.
    """
    out = [DequantConfig(lut, 0, 1, False) for lut in (0, 1, 2)]
    for lut in (0, 1, 2):
        for ilp in (1, 2):
            for stream in (False, True):
                for bps in (8, 32, 0):
                    out.append(DequantConfig(lut, 1, ilp, stream, False, bps))
    out += [DequantConfig(0, 1, 1, True, True, bps) for bps in (8, 32, 0)]
    return out


def dispatch_specs() -> list[KernelSpec]:
    return [kernel_spec(dt, dq) for dt in OUT_DTYPES for dq in (True, False)]


def _check_out(out: torch.Tensor, q: NF4Weight, dtype: torch.dtype) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")
    if out.numel() != q.numel:
        raise ValueError(f"out has {out.numel()} elements, the weight has {q.numel} (shape {tuple(q.shape)})")
    if out.device != q.codes.device:
        raise ValueError(f"out is on {out.device}, the weight's codes are on {q.codes.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def _launch(q: NF4Weight, out: torch.Tensor, cfg: DequantConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Launch the kernel writing into `out` (contiguous, right dtype and size, same device)."""
    if q.codes.data_ptr() % 16 or out.data_ptr() % 16:
        raise ValueError("the CUDA kernel needs 16-byte aligned codes and output "
                         f"(codes at {q.codes.data_ptr() % 16} mod 16, out at {out.data_ptr() % 16} mod 16); "
                         "pass freshly allocated tensors or .clone() them")
    dev = q.codes.device
    k = get_kernel(kernel_spec(out.dtype, q.double_quant, cfg), dev)
    n_vec = q.numel // VECTOR_ELEMS
    per_block = THREADS * cfg.ilp
    tiles = max(1, -(-n_vec // per_block))
    grid = tiles if cfg.blocks_per_sm == 0 else min(tiles, device_info(dev.index).sm_count * cfg.blocks_per_sm)
    null = 0
    args = (
        q.codes.data_ptr(), out.data_ptr(),
        q.absmax.data_ptr() if q.absmax is not None else null,
        q.absmax_q.data_ptr() if q.double_quant else null,
        q.code2.data_ptr() if q.double_quant else null,
        q.absmax2.data_ptr() if q.double_quant else null,
        q.offset.data_ptr() if q.double_quant else null,
        i64(q.numel), i32(q.blocksize.bit_length() - 1),
    )
    launch(k, grid, THREADS, *args)
    return out


def dequantize_impl(q: NF4Weight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    q.validate()
    if dtype not in OUT_DTYPES:
        raise TypeError(f"NF4 dequantize: dtype must be bfloat16, float16 or float32, not {dtype}")
    if out is not None:
        _check_out(out, q, dtype)
    if q.codes.device.type == "cpu":
        from ..reference import nf4_dequantize_fp32_chain

        res = nf4_dequantize_fp32_chain(q, dtype)
        if out is None:
            return res
        out.view(-1).copy_(res.view(-1))
        return out
    if q.codes.device.type != "cuda":
        raise ValueError(f"NF4 dequantize runs on CUDA or CPU tensors, not {q.codes.device}")
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.codes.device)
    return _launch(q, out)
