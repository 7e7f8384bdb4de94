"""What a GPU is: the current one (device_info: arch string, SM count, L2 and shared-memory limits), or
one described without being present (GpuSpec), which the dispatchers plan for the same way."""
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


# Opt-in shared memory per block by compute capability (CUDA programming guide, "Technical
# Specifications"): what a kernel may ask for when a GPU is described, not queried.
SMEM_PER_BLOCK_BY_CC = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 103: 232448,
                        110: 232448, 120: 101376, 121: 101376}
# Cluster capacity ((size, clusters resident at once with one CTA an SM), ...) of a described sm_90 GPU:
# the H200's (H100 SXM: the same GPC layout). A present GPU's is measured (launch.cluster_capacity).
HOPPER_CLUSTERS = ((2, 66), (3, 39), (4, 30), (5, 22), (6, 17), (7, 15), (8, 15))


@dataclass(frozen=True)
class GpuSpec:
    """A GPU as the dispatchers see it: name (selects its shipped tuned tables), SM count, compute
    capability (e.g. 90), opt-in shared memory per block in bytes (default from cc) and, on sm_90,
    its cluster capacity (default HOPPER_CLUSTERS). Describe one that is not present to inspect or
    test its plans on any machine, e.g. GpuSpec("NVIDIA GeForce RTX 4090", 128, 89)."""

    name: str
    sm_count: int
    cc: int
    smem_per_block: int | None = None
    clusters: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GpuSpec name must be a non-empty str, got {self.name!r}")
        for field_name in ("sm_count", "cc"):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GpuSpec {field_name} must be a positive int, got {v!r}")
        if self.cc < 80:
            raise ValueError(f"tilefish runs on sm_80 and newer; GpuSpec cc={self.cc}")
        if self.smem_per_block is None:
            if self.cc not in SMEM_PER_BLOCK_BY_CC:
                raise ValueError(f"no default shared memory per block for cc {self.cc}: pass smem_per_block= "
                                 f"(bytes; known: {sorted(SMEM_PER_BLOCK_BY_CC)})")
            object.__setattr__(self, "smem_per_block", SMEM_PER_BLOCK_BY_CC[self.cc])
        elif isinstance(self.smem_per_block, bool) or not isinstance(self.smem_per_block, int) \
                or self.smem_per_block < 48 * 1024:
            raise ValueError(f"GpuSpec smem_per_block must be an int of at least 49152 bytes, got {self.smem_per_block!r}")
        if self.clusters is None:
            object.__setattr__(self, "clusters", HOPPER_CLUSTERS if self.cc == 90 else ())
        else:
            object.__setattr__(self, "clusters", tuple((int(a), int(b)) for a, b in self.clusters))

    @property
    def arch(self) -> str:
        return f"sm_{self.cc}"

    @classmethod
    def current(cls, device: torch.device | int | None = None) -> "GpuSpec":
        """The GPU `device` (default torch's current one), its cluster capacity measured."""
        if isinstance(device, torch.device):
            device = device.index
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU is visible: describe one instead, e.g. "
                               "tilefish.GpuSpec('NVIDIA H100 80GB HBM3', 132, 90)")
        return _current_spec(torch.cuda.current_device() if device is None else device)

    @classmethod
    def of(cls, info) -> "GpuSpec":
        """The spec of a device_info() answer: GpuSpec.current() where CUDA is up, else built from its
        fields (cluster capacity: the default), for callers handed a described device."""
        if torch.cuda.is_available():
            return _current_spec(info.index)
        return cls(getattr(info, "name", "") or "unnamed GPU", info.sm_count, info.cc,
                   getattr(info, "smem_per_block_optin", 0) or None)


@functools.lru_cache(maxsize=None)
def _current_spec(index: int) -> GpuSpec:
    info = device_info(index)
    clusters = ()
    if info.cc == 90:
        from .launch import cluster_capacity

        clusters = cluster_capacity(index, 384, 116 * 1024)  # one CTA an SM (ops/w4a16 ONE_CTA_PER_SM_SMEM)
    return GpuSpec(info.name, info.sm_count, info.cc, info.smem_per_block_optin, clusters)
