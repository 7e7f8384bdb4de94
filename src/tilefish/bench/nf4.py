"""`tilefish bench nf4`: NF4 dequantization against bitsandbytes and the copy ceiling."""
from __future__ import annotations

import torch

from .ceilings import copy_bandwidth_gbps, write_bandwidth_gbps
from .report import Report, Row
from .timing import host_overhead_us, time_cuda

DEFAULT_SHAPES = [(4096, 4096), (8192, 8192), (16384, 16384)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def counted_bytes(q, out_dtype: torch.dtype) -> int:
    """Bytes the op must move, counted as the reference write-up does:
    codes + absmax codes (or fp32 absmax) + absmax2 + code table(s) + output."""
    n = q.codes.numel()
    if q.double_quant:
        n += q.absmax_q.numel() + 4 * q.absmax2.numel() + 4 * q.code2.numel() + 4
    else:
        n += 4 * q.absmax.numel()
    n += 16 * 4  # the NF4 table
    return n + q.numel * torch.empty((), dtype=out_dtype).element_size()


def _bnb():
    try:
        import bitsandbytes.functional as F

        return F
    except Exception:  # noqa: BLE001 - bitsandbytes is an optional peer
        return None


def run(shapes=None, dtype: str = "bf16", blocksize: int = 64, double_quant: bool = True,
        variants: bool = False, reps: int = 50) -> Report:
    from .. import nf4
    from ..ops import nf4 as ops

    out_dtype = DTYPES[dtype]
    copy = copy_bandwidth_gbps()
    report = Report(f"NF4 dequantize -> {dtype}, blocksize {blocksize}, "
                    f"{'double' if double_quant else 'single'} quant",
                    {"copy GB/s": copy, "write-only GB/s": write_bandwidth_gbps()})
    F = _bnb()
    if F is None:
        report.notes.append("bitsandbytes not importable: no peer column (pip install 'tilefish[peers]')")
    for shape in shapes or DEFAULT_SHAPES:
        w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        q = nf4.quantize(w, blocksize=blocksize, double_quant=double_quant)
        del w
        nbytes = counted_bytes(q, out_dtype)
        case = f"{shape[0]}x{shape[1]}"
        t_bnb = None
        if F is not None:
            packed, state = nf4.to_bnb(q)
            state.dtype = out_dtype
            tb = time_cuda(lambda: F.dequantize_4bit(packed, state), reps=reps)
            t_bnb = tb.median_ms
        out = torch.empty(q.shape, dtype=out_dtype, device="cuda")
        configs = ops.variant_configs() if variants else [ops.DEFAULT_CONFIG]
        for cfg in configs:
            t = time_cuda(lambda: ops._launch(q, out, cfg), reps=reps)
            gbps = nbytes / (t.median_ms * 1e-3) / 1e9
            impl = "tilefish" if cfg == ops.DEFAULT_CONFIG and not variants else f"tilefish[{cfg.label()}]"
            ratios = {"bitsandbytes": t_bnb / t.median_ms} if t_bnb else {}
            report.add(Row("nf4", case, impl, t.median_us, gbps, "GB/s", 100 * gbps / copy, ratios,
                           {"bytes": nbytes, "config": cfg.label()}))
        if t_bnb is not None:
            gbps = nbytes / (t_bnb * 1e-3) / 1e9
            report.add(Row("nf4", case, "bitsandbytes", t_bnb * 1e3, gbps, "GB/s", 100 * gbps / copy, {},
                           {"bytes": nbytes}))
        del q, out
    # Host overhead per call: a tiny weight, so the GPU keeps up and the host is what is timed.
    small = nf4.quantize(torch.randn(64, 64, device="cuda"), blocksize=blocksize, double_quant=double_quant)
    us = host_overhead_us(lambda: nf4.dequantize(small, out_dtype))
    note = f"host overhead per call (64x64, wrapper + launch): tilefish {us:.1f} us"
    if F is not None:
        p, s = nf4.to_bnb(small)
        s.dtype = out_dtype
        note += f", bitsandbytes {host_overhead_us(lambda: F.dequantize_4bit(p, s)):.1f} us"
    report.notes.append(note)
    return report
