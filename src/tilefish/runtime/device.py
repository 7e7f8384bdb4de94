"""What the current GPU is: arch string, SM count, L2 and shared-memory limits."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    major: int
    minor: int
    sm_count: int
    l2_bytes: int
    smem_per_block_optin: int
    smem_per_sm: int
    total_memory: int

    @property
    def cc(self) -> int:
        """Compute capability as an int, e.g. 90."""
        return self.major * 10 + self.minor

    @property
    def arch(self) -> str:
        """NVRTC target, e.g. 'sm_90'."""
        return f"sm_{self.major}{self.minor}"


@functools.lru_cache(maxsize=None)
def device_info(index: int | None = None) -> DeviceInfo:
    if index is None:
        index = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(index)
    return DeviceInfo(
        index=index,
        name=p.name,
        major=p.major,
        minor=p.minor,
        sm_count=p.multi_processor_count,
        l2_bytes=getattr(p, "L2_cache_size", 0),
        smem_per_block_optin=getattr(p, "shared_memory_per_block_optin", 48 * 1024),
        smem_per_sm=getattr(p, "shared_memory_per_multiprocessor", 0),
        total_memory=p.total_memory,
    )


def arch_of(device: torch.device | int | None = None) -> str:
    if isinstance(device, torch.device):
        device = device.index if device.index is not None else torch.cuda.current_device()
    return device_info(device).arch
