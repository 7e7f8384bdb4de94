"""The next projection's weights streamed into L2 by the GEMM before it (the last four kernel arguments,
kernels/common/ptx.cuh: l2_prefetch_share).

A decode GEMM's weights do not depend on its input. Between two GEMMs of a layer run latency-bound kernels
(norms, rotary, attention, the activation) during which DRAM idles; each W4A16 launch can therefore ask L2,
once its own loads are issued, for the next GEMM's scales and the start of its packed weights. The next GEMM
then finds those bytes in L2. Nothing waits for the prefetch and nothing reads it but that GEMM: the result is
bitwise the same with or without it, and a wrong guess of the next weight costs bandwidth, not correctness.

At most PREFETCH_L2_SHARE of the device's L2 is asked for, scales first (every CTA of the next GEMM needs its
columns' scales in its first stage), then the packed weights from their start. Only launches of at most
PREFETCH_MAX_M rows prefetch: there DRAM is what bounds a GEMM; a larger one is compute-bound, its x and
output tiles are what L2 should keep, and the next GEMM's weights stream well within its own time.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ...runtime import device_info, i64

PREFETCH_L2_SHARE = 0.5
PREFETCH_MAX_M = 64
NO_PREFETCH = (0, i64(0), 0, i64(0))

_caps: dict[int, int] = {}


class PrefetchTarget(NamedTuple):
    """The next GEMM's weight as prefetch_args reads it (the op passes these two tensors)."""
    packed: torch.Tensor
    scales: torch.Tensor | None


def prefetch_cap(device_index: int) -> int:
    """Bytes one prefetch may ask L2 for on this device."""
    cap = _caps.get(device_index)
    if cap is None:
        cap = _caps[device_index] = int(device_info(device_index).l2_bytes * PREFETCH_L2_SHARE) // 16 * 16
    return cap


def _span(t: torch.Tensor | None, device: torch.device, budget: int) -> tuple[int, int]:
    if t is None or t.device != device or not t.is_contiguous() or t.data_ptr() % 16 or budget < 16:
        return 0, 0
    return t.data_ptr(), min(t.numel() * t.element_size(), budget) // 16 * 16


def prefetch_args(target, device: torch.device, m: int) -> tuple:
    """The kernel's four prefetch arguments for a launch of m rows on `device` followed by a GEMM on `target`
    (anything with `.packed` and `.scales`: a W4A16Weight, a W4A16Linear), or NO_PREFETCH (no target, or
    m > PREFETCH_MAX_M). A tensor on another device, strided or not 16-byte aligned is left out: a hint never
    fails a call."""
    if target is None or m > PREFETCH_MAX_M:
        return NO_PREFETCH
    cap = prefetch_cap(device.index)
    sp, sb = _span(target.scales, device, cap)
    pp, pb = _span(target.packed, device, cap - sb)
    return (pp, i64(pb), sp, i64(sb))
