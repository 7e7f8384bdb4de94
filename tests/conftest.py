"""Shared test helpers: the gpu marker, per-dtype tolerances, relative error, NaN poisoning, ulps."""
from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Relative-error tolerances ||out - ref|| / ||ref|| for matmul-like ops, by output dtype.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none visible to torch)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (unwritten elements?)"
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN so unwritten elements cannot pass a check."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(-1)
    return t


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of a and b's (same) floating dtype."""
    assert a.dtype == b.dtype
    itype = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    bits = a.element_size() * 8

    def ordered(x):  # map float bits to a monotonic integer line (sign-magnitude -> two's complement)
        i = x.contiguous().view(itype).to(torch.int64)
        return torch.where(i < 0, -(i & ((1 << (bits - 1)) - 1)), i)

    return (ordered(a) - ordered(b)).abs()


@pytest.fixture
def cuda():
    if not HAS_CUDA:
        pytest.skip("needs an NVIDIA GPU")
    return torch.device("cuda")
