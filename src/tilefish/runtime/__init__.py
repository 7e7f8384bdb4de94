"""The only part of tilefish that talks to cuda.core / NVRTC / the CUDA driver."""
from .device import DeviceInfo, GpuSpec, device_info, arch_of
from .compiler import (KernelSpec, CompileError, CompiledKernel, Resources, compile_kernel, compile_many, cache_dir,
                       cache_enabled, is_cached)
from .launch import (cluster_capacity, current_stream_handle, get_kernel, launch, launch_prepared, prepare_launch,
                     i32, i64, u32, f32)
from .tma import tensor_map_2d

__all__ = [
    "DeviceInfo", "GpuSpec", "device_info", "arch_of",
    "KernelSpec", "CompileError", "CompiledKernel", "Resources", "compile_kernel", "compile_many", "cache_dir",
    "cache_enabled", "is_cached",
    "cluster_capacity", "current_stream_handle", "get_kernel", "launch", "launch_prepared", "prepare_launch",
    "i32", "i64", "u32", "f32", "tensor_map_2d",
]
