"""TMA tensor maps (CUtensorMap) for Hopper kernels, built with cuda.core and cached.

A tensor map describes a 2-D row-major matrix in global memory (base pointer, rows, columns, row
pitch, element type) and the box one TMA instruction copies, with its shared-memory swizzle. The
kernel receives it by value as a `const __grid_constant__ tf::TmaDesc` (kernels/common/hopper.cuh).

The map is built from a tiny __cuda_array_interface__ holder, not from the torch tensor: a
cuda.core TensorMapDescriptor keeps a reference to the object it was made from, and caching
descriptors made from tensors would keep those tensors alive. A map depends only on the numbers
in the cache key, so reusing one for a new tensor at the same address and shape is exact.
"""
from __future__ import annotations

import torch

from .launch import _ensure_context  # descriptors are created in the device's primary context

_TYPESTR = {torch.float16: "<f2", torch.bfloat16: "<u2"}  # CAI has no bf16; the map's type is explicit


class _ArrayView:
    """Just enough of __cuda_array_interface__ (v3) to describe a device matrix, owning nothing."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, rows: int, cols: int, pitch: int, typestr: str, itemsize: int):
        self.__cuda_array_interface__ = {
            "shape": (rows, cols), "strides": (pitch * itemsize, itemsize), "typestr": typestr,
            "data": (ptr, False), "version": 3,
        }


def _tensor_map(device: int, ptr: int, rows: int, cols: int, pitch: int, dtype: torch.dtype,
                box_rows: int, box_cols: int, swizzle: int):
    from cuda.core.utils import StridedMemoryView
    from cuda.core._tensor_map import TensorMapDataType, TensorMapL2Promotion, TensorMapSwizzle

    dtypes = {torch.float16: TensorMapDataType.FLOAT16, torch.bfloat16: TensorMapDataType.BFLOAT16}
    swizzles = {0: TensorMapSwizzle.NONE, 32: TensorMapSwizzle.SWIZZLE_32B,
                64: TensorMapSwizzle.SWIZZLE_64B, 128: TensorMapSwizzle.SWIZZLE_128B}
    holder = _ArrayView(ptr, rows, cols, pitch, _TYPESTR[dtype], 2)
    view = StridedMemoryView.from_cuda_array_interface(holder, stream_ptr=-1)
    return view.as_tensor_map(box_dim=(box_rows, box_cols), data_type=dtypes[dtype],
                              swizzle=swizzles[swizzle], l2_promotion=TensorMapL2Promotion.L2_256B)


_maps: dict[tuple, object] = {}


def _cached_map(key: tuple, device: int, ptr: int, rows: int, cols: int, pitch: int, dtype: torch.dtype,
                box_rows: int, box_cols: int, swizzle: int):
    _ensure_context(device)
    m = _tensor_map(device, ptr, rows, cols, pitch, dtype, box_rows, box_cols, swizzle)
    if len(_maps) >= 512:  # addresses and shapes vary without bound in some workloads
        _maps.clear()
    _maps[key] = m
    return m


def tensor_map_2d(t: torch.Tensor, box_rows: int, box_cols: int, swizzle: int = 128):
    """Tensor map of a 2-D row-major fp16/bf16 CUDA matrix (unit column stride, 16-byte aligned
    pointer and row pitch); one TMA copy moves a box_rows x box_cols box, zero-filling outside t."""
    # Fast path, once per call of every Hopper op: everything the map and the checks below depend
    # on is in the key, so a hit needs no re-check (an lru_cache behind the checks cost ~3.5 us).
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device(), box_rows, box_cols, swizzle)
    m = _maps.get(key)
    if m is not None:
        return m
    if t.dtype not in _TYPESTR:
        raise TypeError(f"tensor maps here take float16 or bfloat16, got {t.dtype}")
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"a tensor map needs a 2-D matrix with unit column stride, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")
    pitch = t.stride(0)
    if t.data_ptr() % 16 or (pitch * t.element_size()) % 16:
        raise ValueError("TMA needs a 16-byte aligned base pointer and row pitch")
    if t.device.type != "cuda":
        raise ValueError(f"a tensor map needs a CUDA tensor, got one on {t.device}")
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _cached_map(key, index, t.data_ptr(), t.shape[0], t.shape[1], max(pitch, t.shape[1]), t.dtype,
                       box_rows, box_cols, swizzle)


def tensor_map_rows(ptr: int, rows: int, cols: int, dtype: torch.dtype, device: int, box_rows: int, box_cols: int,
                    swizzle: int = 128):
    """tensor_map_2d of a contiguous [rows, cols] matrix at `ptr` on CUDA device `device`, for callers
    that checked it already (16-byte aligned pointer and row: cols * 2 % 16 == 0): the per-call fast
    path of a planned launch, with no tensor to inspect."""
    key = (ptr, rows, cols, dtype, device, box_rows, box_cols, swizzle)
    m = _maps.get(key)
    if m is None:
        if dtype not in _TYPESTR or ptr % 16 or (cols * 2) % 16:
            raise ValueError(f"a TMA map needs a float16/bfloat16 matrix with a 16-byte aligned pointer and row, "
                             f"got {dtype}, pointer % 16 = {ptr % 16}, {cols} columns")
        m = _cached_map(key, device, ptr, rows, cols, cols, dtype, box_rows, box_cols, swizzle)
    return m
