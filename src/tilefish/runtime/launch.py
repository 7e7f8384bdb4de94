"""Load compiled kernels into the current device's context and launch them on torch's stream.

Launches never synchronize and never allocate, so they are legal inside CUDA-graph capture.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from .compiler import CompiledKernel, KernelSpec, compile_kernel
from .device import device_info

i32, i64, u32, f32 = np.int32, np.int64, np.uint32, np.float32  # typed scalar kernel arguments

_lock = threading.Lock()
_loaded: dict[tuple[KernelSpec, int], "LoadedKernel"] = {}
_streams: dict[int, object] = {}
# A CUDA context is current per thread: each thread makes the device's primary context current once.
_thread_state = threading.local()
_configs: dict[tuple, object] = {}
_launch_fn = None


def _cuda_launch():
    global _launch_fn
    if _launch_fn is None:
        from cuda.core import launch as fn

        _launch_fn = fn
    return _launch_fn

_DEFAULT_DYN_SMEM = 48 * 1024


class LoadedKernel:
    __slots__ = ("spec", "compiled", "kernel", "device", "_module", "_dyn_smem_limit", "_clusters", "_non_portable")

    def __init__(self, spec: KernelSpec, compiled: CompiledKernel, kernel, module, device: int):
        self.spec, self.compiled, self.kernel, self._module, self.device = spec, compiled, kernel, module, device
        self._dyn_smem_limit = 0  # raised to what a launch needs (cuFuncSetAttribute) on first use
        self._non_portable = False  # clusters above 8 allowed (allow_cluster)
        self._clusters: dict[tuple[int, int, int], int] = {}

    def max_active_clusters(self, cluster: int, block: int, smem: int) -> int:
        """How many clusters of `cluster` blocks can be resident at once (the driver's occupancy
        answer, cached). A persistent kernel must not launch more: with 1 block per SM, not every
        SM can join a cluster (GPCs are not all multiples of the cluster size), and the clusters
        that do not fit would run as a second wave, nearly doubling the time."""
        key = (cluster, block, smem)
        n = self._clusters.get(key)
        if n is None:
            from cuda.core import LaunchConfig

            if smem + self.compiled.resources.static_smem > _DEFAULT_DYN_SMEM:
                self.ensure_dynamic_smem(smem)
            self.allow_cluster(cluster)
            cfg = LaunchConfig(grid=1, cluster=cluster, block=block, shmem_size=smem)
            n = self._clusters[key] = int(self.kernel.occupancy.max_active_clusters(cfg, stream=_stream_for(self.device)))
        return n

    def ensure_dynamic_smem(self, nbytes: int) -> None:
        """Raise the kernel's dynamic shared-memory limit once, when a launch asks above 48 KB."""
        if nbytes <= self._dyn_smem_limit:
            return
        cap = device_info(self.device).smem_per_block_optin - self.compiled.resources.static_smem
        if nbytes > cap:
            raise ValueError(f"{self.spec.name} asks for {nbytes} B of dynamic shared memory; "
                             f"the device allows {cap} B per block")
        from cuda.bindings import driver

        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        h = self.kernel.handle
        if isinstance(h, driver.CUkernel):
            (err,) = driver.cuKernelSetAttribute(attr, nbytes, h, self.device)
        else:
            (err,) = driver.cuFuncSetAttribute(h, attr, nbytes)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuFuncSetAttribute(max dynamic smem={nbytes}) failed for {self.spec.name}: {err}")
        self._dyn_smem_limit = nbytes

    def allow_cluster(self, cluster: int) -> None:
        """Let the kernel launch as clusters of `cluster` blocks: above 8 (the portable limit) sm_90 takes up
        to 16 once the kernel allows non-portable sizes (set once)."""
        if cluster <= 8 or self._non_portable:
            return
        if cluster > 16:
            raise ValueError(f"{self.spec.name}: clusters of {cluster} blocks; sm_90 allows at most 16")
        from cuda.bindings import driver

        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        h = self.kernel.handle
        if isinstance(h, driver.CUkernel):
            (err,) = driver.cuKernelSetAttribute(attr, 1, h, self.device)
        else:
            (err,) = driver.cuFuncSetAttribute(h, attr, 1)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuFuncSetAttribute(non-portable cluster size) failed for {self.spec.name}: {err}")
        self._non_portable = True


def _ensure_context(index: int) -> None:
    """Make device `index`'s primary context (the one torch uses) current in this thread. Per thread:
    a new thread starts with no current context, and torch may serve it from its caches without a
    runtime call that would set one (a TMA descriptor then failed in a worker thread)."""
    ready = getattr(_thread_state, "devices", None)
    if ready is None:
        ready = _thread_state.devices = set()
    if index in ready:
        return
    from cuda.core import Device

    torch.cuda.init()
    Device(index).set_current()
    ready.add(index)


def get_kernel(spec: KernelSpec, device: torch.device | int | None = None) -> LoadedKernel:
    """The loaded kernel for this device, compiling (or reading the disk cache) on first use."""
    if isinstance(device, torch.device):
        device = device.index
    index = torch.cuda.current_device() if device is None else device
    key = (spec, index)
    k = _loaded.get(key)
    if k is not None:
        return k
    with _lock:
        if (k := _loaded.get(key)) is not None:
            return k
        from cuda.core import ObjectCode

        with torch.cuda.device(index):
            _ensure_context(index)
            compiled = compile_kernel(spec, device_info(index).arch)
            module = ObjectCode.from_cubin(compiled.cubin, name=spec.source)
            kernel = module.get_kernel(compiled.lowered_name)
        k = LoadedKernel(spec, compiled, kernel, module, index)
        _loaded[key] = k
        return k


_capacity: dict[tuple[int, int, int], tuple[tuple[int, int], ...]] = {}


def cluster_capacity(device: torch.device | int | None, block: int, smem: int,
                     sizes: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8)) -> tuple[tuple[int, int], ...]:
    """((cluster size, clusters resident at once), ...) for a kernel of `block` threads and `smem`
    bytes of dynamic shared memory, from the driver's occupancy answer for an empty kernel (sm_90+;
    cached per device). With one CTA an SM this is the GPC layout: on the H200 66 / 39 / 30 / 15
    clusters of 2 / 3 / 4 / 8."""
    if not 1 <= block <= 1024 or smem < 0:
        raise ValueError(f"cluster_capacity needs 1 <= block <= 1024 threads and smem >= 0, got {block}, {smem}")
    if isinstance(device, torch.device):
        device = device.index
    index = torch.cuda.current_device() if device is None else device
    key = (index, block, smem)
    if key not in _capacity:  # the empty kernel's spec says sm_90+: older GPUs get a ValueError naming it
        kern = get_kernel(KernelSpec("probes/cluster_capacity.cu", "tf_cluster_capacity", min_sm=90), index)
        _capacity[key] = tuple((c, kern.max_active_clusters(c, block, smem)) for c in sizes)
    return _capacity[key]


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """cudaStream_t of torch's current stream (the raw getter skips ~10 us of Python wrappers)."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _stream_for(device_index: int):
    handle = current_stream_handle(device_index)
    s = _streams.get(handle)
    if s is None:
        from cuda.core import Stream

        s = Stream.from_handle(handle)
        _streams[handle] = s
    return s


def prepare_launch(kernel: LoadedKernel, grid, block, smem: int = 0, cluster: int = 1, pdl: bool = False):
    """The launch configuration of `kernel` for this grid (an int or a tuple, counting blocks), block,
    dynamic shared memory and cluster size, with the kernel's shared-memory limit raised where it
    needs more than the default (once). cluster > 1 groups that many consecutive blocks along x into
    a thread-block cluster (grid[0] must be a multiple of it). pdl: programmatic dependent launch
    (sm_90+; ignored below): the kernel may start before the one ahead of it in the stream ends, so it
    must call grid_dependency_wait (kernels/common/ptx.cuh) before touching memory that kernel writes
    or reads. Memoized: cheap to call per launch."""
    if smem + kernel.compiled.resources.static_smem > _DEFAULT_DYN_SMEM:  # the 48 KB default covers both
        kernel.ensure_dynamic_smem(smem)
    if cluster > 8:  # per kernel, so outside the memo, which kernels share
        kernel.allow_cluster(cluster)
    pdl = pdl and device_info(kernel.device).cc >= 90
    key = (grid, block, smem, cluster, pdl)
    cfg = _configs.get(key)
    if cfg is None:
        from cuda.core import LaunchConfig

        if len(_configs) > 4096:  # shapes vary without bound in some workloads; keep the memo small
            _configs.clear()
        if cluster > 1:  # cuda.core counts clusters, not blocks, in `grid` when a cluster is given
            g = (grid,) if isinstance(grid, int) else tuple(grid)
            if g[0] % cluster:
                raise ValueError(f"grid.x = {g[0]} is not a multiple of the cluster size {cluster}")
            cfg = LaunchConfig(grid=(g[0] // cluster,) + g[1:], cluster=cluster, block=block, shmem_size=smem,
                               programmatic_stream_serialization=pdl)
        else:
            cfg = LaunchConfig(grid=grid, block=block, shmem_size=smem, programmatic_stream_serialization=pdl)
        _configs[key] = cfg
    return cfg


def launch_prepared(kernel: LoadedKernel, config, *args) -> None:
    """Launch with a configuration from prepare_launch on torch.cuda.current_stream() of the kernel's device.

    Pointer arguments are plain ints (tensor.data_ptr()); other scalars must be typed
    (i32 / u32 / f32), because a bare Python int is passed as a 64-bit value.  cuda.core
    TensorMapDescriptor arguments (runtime.tma) are passed by value.
    """
    _cuda_launch()(_stream_for(kernel.device), config, kernel.kernel, *args)


def launch(kernel: LoadedKernel, grid, block, *args, smem: int = 0, cluster: int = 1) -> None:
    """prepare_launch + launch_prepared in one call."""
    launch_prepared(kernel, prepare_launch(kernel, grid, block, smem, cluster), *args)
