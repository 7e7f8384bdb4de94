"""RMSNorm of Llama-family decoders (transformers' LlamaRMSNorm), optionally after the residual add before it:
validate -> pick the block -> launch kernels/norm/rmsnorm.cu on torch's current stream.

With T = x's dtype (fp16 or bf16), every sum and product in fp32 and each line rounded once to T:
    h   = x, or x + residual             (the decoder's `residual + attention output`; returned too)
    y   = h * rsqrt(mean(h^2) + eps)      (mean and rsqrt in fp32, then rounded: LlamaRMSNorm's y.to(T))
    out = weight * y
CPU tensors run the pure-torch reference in LlamaRMSNorm's own op order (bit for bit transformers'); CUDA
runs the kernel, whose sum of squares runs in another order and whose rsqrt is rsqrtf: y, and so out, may
be an ulp or two off transformers' where a rounding boundary lies between the two (tests/test_norm.py).

The kernel: one CTA a row, each thread VPT 16-byte chunks of it in registers; launched with programmatic
dependent launch (sm_90+) unless the caller says pdl=False, so the next kernel (a GEMM) may start on its
weights while the norm runs. Graph-safe: a call allocates only its outputs and never synchronizes.
"""
from __future__ import annotations

import functools
import math

import torch

from ..reference import rms_norm as rms_norm_reference  # the CPU path, and tilefish.norm's autograd route
from ..runtime import KernelSpec, get_kernel, f32, i32, launch_prepared, prepare_launch
from .w4a16.policy import resolve_policy

SOURCE = "norm/rmsnorm.cu"
DTYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
VPTS = (1, 2, 4)        # 16-byte chunks a thread holds (kernel instantiations)
MAX_THREADS = 1024
MAX_COLS = MAX_THREADS * VPTS[-1] * 8  # 32768
MAX_ROWS = 2**31 - 1    # grid.x


@functools.lru_cache(maxsize=None)
def kernel_spec(dtype: torch.dtype, vpt: int) -> KernelSpec:
    return KernelSpec(SOURCE, f"rms_norm<{DTYPES[dtype]}, {vpt}>", hot=True)


def dispatch_specs(arch: str | None = None) -> list[KernelSpec]:
    """Every kernel rms_norm_impl can launch: both dtypes x VPTS, the same on every arch (sm_80 and newer);
    arch ("sm_86", None: any) filters by KernelSpec.supports all the same."""
    specs = [kernel_spec(dt, v) for dt in DTYPES for v in VPTS]
    return [s for s in specs if arch is None or s.supports(arch)]


@functools.lru_cache(maxsize=1024)
def block_config(cols: int) -> tuple[int, int]:
    """(threads, VPT) for a row of cols (a multiple of 8, at most MAX_COLS): VPT 1 while the row fits one
    warp, 2 while it fits 512 threads (cols <= 8192), else 4 (up to 1024 threads). Threads: a multiple of 32
    (the kernel reduces whole warps). Measured on the H200 (bf16, add + norm, CUDA graphs of back-to-back
    launches): at cols 2048-8192 VPT 2 was the fastest at 1 and 16 rows (1.3 us at 4096 with PDL) and within
    1.5% of the fastest at 2048 rows from cols 4096 (7% at 2048); VPT 1 lost 11-15% at 2048 rows from cols
    4096, VPT 4 up to 0.2 us at one row (1.67 against 1.45 us at 5120); at 14336 VPT 2 and 4 tied."""
    chunks = cols // 8
    vpt = 1 if chunks <= 32 else 2 if chunks <= 2 * 512 else 4
    threads = -(-chunks // vpt)
    return -(-threads // 32) * 32, vpt


def _check_tensor(t, name: str, x: torch.Tensor | None = None) -> None:
    # is_cuda / is_cpu / get_device, not torch.device objects: this runs on every eager call
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"rms_norm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x is None:
        if t.dtype not in DTYPES:
            raise TypeError(f"rms_norm: x must be float16 or bfloat16, got {t.dtype}")
        if not (t.is_cuda or t.is_cpu):
            raise ValueError(f"rms_norm runs on CUDA or CPU tensors, not {t.device}")
    else:
        if t.dtype != x.dtype:
            raise TypeError(f"rms_norm: {name} must have x's dtype {x.dtype}, got {t.dtype}")
        if t.is_cuda != x.is_cuda or t.get_device() != x.get_device() or not (t.is_cuda or t.is_cpu):
            raise ValueError(f"rms_norm: {name} is on {t.device}, x on {x.device}: they must share a device")


def check_inputs(x, weight, eps, residual=None) -> tuple[int, int]:
    """(rows, cols), or a TypeError / ValueError naming the broken constraint; the same rules on every
    device, so a CPU run rejects what the kernel would."""
    _check_tensor(x, "x")
    shape = x.shape
    if not shape:
        raise ValueError("rms_norm: x must have at least one dimension ([..., cols])")
    cols = shape[-1]
    if cols <= 0 or cols % 8:
        raise ValueError(f"rms_norm: cols (x.shape[-1] = {cols}) must be a positive multiple of 8 (16-byte vectors)")
    if cols > MAX_COLS:
        raise ValueError(f"rms_norm: cols (x.shape[-1] = {cols}) must be at most {MAX_COLS} "
                         f"({MAX_THREADS} threads x {VPTS[-1]} chunks of 8)")
    _check_tensor(weight, "weight", x)
    if weight.shape != (cols,):
        raise ValueError(f"rms_norm: weight must have shape ({cols},) (x's last dimension), got {tuple(weight.shape)}")
    if residual is not None:
        _check_tensor(residual, "residual", x)
        if residual.shape != shape:
            raise ValueError(f"rms_norm: residual must have x's shape {tuple(shape)}, got {tuple(residual.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"rms_norm: eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"rms_norm: eps must be a finite non-negative float, got {eps}")
    rows = x.numel() // cols
    if rows > MAX_ROWS:
        raise ValueError(f"rms_norm: at most {MAX_ROWS} rows (one CTA each), got {rows}")
    return rows, cols


def launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                    h: torch.Tensor | None, out: torch.Tensor, rows: int, cols: int, pdl: bool = True) -> None:
    """Launch the kernel on checked CUDA tensors: out (and h, with a residual) written, rows >= 1."""
    threads, vpt = block_config(cols)
    kern = get_kernel(kernel_spec(x.dtype, vpt), x.get_device())
    cfg = prepare_launch(kern, rows, threads, smem=2 * cols, pdl=pdl)  # the weight row in shared memory
    launch_prepared(kern, cfg, x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                    0 if h is None else h.data_ptr(), out.data_ptr(), i32(cols), f32(eps))


def _vectors(t: torch.Tensor | None) -> torch.Tensor | None:
    """t as the kernel reads it, 16-byte vectors: contiguous and aligned (a copy where it is not)."""
    if t is None:
        return None
    t = t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


def rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
                  pdl: bool | None = None):
    """out = RMSNorm(x) (module docstring), or (h, out) with h = x + residual: CPU -> the reference, CUDA -> the
    kernel, with programmatic dependent launch where pdl (ignored below sm_90; None: the active W4A16 launch
    policy's `programmatic`, so one switch covers the decoder's kernels). Inputs of any layout: the kernel's
    read a copy where they are not contiguous and 16-byte aligned."""
    rows, cols = check_inputs(x, weight, eps, residual)
    if x.is_cpu:
        return rms_norm_reference(x, weight, eps, residual)
    x, weight, residual = _vectors(x), _vectors(weight), _vectors(residual)
    if pdl is None:
        pdl = resolve_policy(None).programmatic
    out = torch.empty_like(x)  # x is contiguous: so is out
    h = None if residual is None else torch.empty_like(x)
    if rows:
        launch_rms_norm(x, weight, float(eps), residual, h, out, rows, cols, pdl)
    return out if residual is None else (h, out)
