"""The only part of tilefish that talks to cuda.core / NVRTC / the CUDA driver."""
from .device import DeviceInfo, device_info, arch_of
from .compiler import KernelSpec, CompileError, CompiledKernel, compile_kernel, cache_dir
from .launch import (cluster_capacity, current_stream_handle, get_kernel, launch, launch_prepared, prepare_launch,
                     i32, i64, u32, f32)
from .tma import tensor_map_2d

__all__ = [
    "DeviceInfo", "device_info", "arch_of",
    "KernelSpec", "CompileError", "CompiledKernel", "compile_kernel", "cache_dir",
    "cluster_capacity", "current_stream_handle", "get_kernel", "launch", "launch_prepared", "prepare_launch",
    "i32", "i64", "u32", "f32", "tensor_map_2d",
]
