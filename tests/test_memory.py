"""Memory: an allocation that fails inside an op (its output, a contiguous copy of x, a W4A16 call's fp32
partial sums) surfaces as torch.OutOfMemoryError, leaves no
half-built state behind, and the next call on the same device works and is correct.

Two ways to make allocations fail: the caching allocator's per-process fraction (set just above what is
reserved now), and, independently of the allocator's own accounting, a tensor filling the GPU's free
memory but a margin. Tests skip with the reason where the allocator cannot be constrained (another
allocator backend, or memory that cannot be filled).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import tilefish
from tilefish import nf4, w4a16
from tilefish.ops import w4a16 as w4ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.reference import w4a16_matmul as ref_w4a16

from conftest import TOLERANCE, rel_err

pytestmark = pytest.mark.gpu

MB = 1 << 20


def _rand(g, *shape, dtype=torch.float16):
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


@contextlib.contextmanager
def memory_cap(headroom: int):
    """Allow the caching allocator only `headroom` bytes more than it has reserved now."""
    if torch.cuda.get_allocator_backend() != "native":
        pytest.skip(f"allocator backend {torch.cuda.get_allocator_backend()!r}: "
                    "set_per_process_memory_fraction does not constrain it")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    frac = (torch.cuda.memory_reserved() + headroom) / total
    torch.cuda.set_per_process_memory_fraction(min(frac, 1.0))
    try:
        probe_ok = True
        try:  # the cap must bite: an allocation of twice the headroom fails
            torch.empty(2 * headroom + 64 * MB, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            probe_ok = False
        if probe_ok:
            pytest.skip("set_per_process_memory_fraction did not constrain the allocator")
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@contextlib.contextmanager
def fill_device(margin: int):
    """Hold a tensor filling all free device memory but `margin` bytes (cudaMalloc itself fails)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free <= margin + 256 * MB:
        pytest.skip(f"only {free // MB} MiB free")
    try:
        hog = torch.empty(free - margin, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("could not allocate the filler tensor")
    try:
        yield
    finally:
        del hog
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _setup(seed=0):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    q = quantize_rtn(_rand(g, 4096, 4096, dtype=torch.float32), 128, False, clip_search=False,
                     scale_dtype=torch.float16)
    p = w4ops.pack(q)
    nq = nf4.quantize(_rand(g, 4096, 4096, dtype=torch.float32), blocksize=64)
    npr = nf4.prepare(nq, torch.float16)
    return g, q, p, nq, npr


def _huge_calls(g, p, npr, nq):
    """Calls whose output alone (>= 1 GiB) cannot fit the headroom given to them."""
    x_tall = _rand(g, 131072, 4096)                           # 1 GiB of x, already allocated
    a16, b16 = _rand(g, 32768, 64), _rand(g, 64, 32768)       # 2 GiB output
    a32, b32 = _rand(g, 16384, 64, dtype=torch.float32), _rand(g, 64, 16384, dtype=torch.float32)
    x_t = _rand(g, 4096, 131072).t()                          # a transposed view: the op copies it
    return {
        "w4a16 output": lambda: w4a16.matmul(x_tall, p),
        "w4a16 copy of a non-contiguous x": lambda: w4a16.matmul(x_t, p),
        "nf4 matmul output": lambda: nf4.matmul(x_tall, npr),
        "hgemm output": lambda: tilefish.hgemm(a16, b16),
        "sgemm output": lambda: tilefish.sgemm(a32, b32),
        "nf4 dequantize output (x16 weights)": lambda: [nf4.dequantize(nq, torch.float32) for _ in range(16)],
    }


def _normal_calls_correct(g, q, p):
    x = _rand(g, 37, 4096)
    out = w4a16.matmul(x, p)
    torch.cuda.synchronize()
    assert rel_err(out, ref_w4a16(x, q)) < TOLERANCE[torch.float16]
    a, b = _rand(g, 100, 256), _rand(g, 256, 72)
    assert rel_err(tilefish.hgemm(a, b), a.double() @ b.double()) < TOLERANCE[torch.float16]


def test_oom_inside_ops_under_fraction_cap_then_recovers():
    g, q, p, nq, npr = _setup()
    calls = _huge_calls(g, p, npr, nq)
    for f in (lambda: w4a16.matmul(_rand(g, 5, 4096), p), lambda: nf4.matmul(_rand(g, 5, 4096), npr),
              lambda: tilefish.hgemm(_rand(g, 64, 64), _rand(g, 64, 64)),
              lambda: tilefish.sgemm(_rand(g, 8, 8, dtype=torch.float32), _rand(g, 8, 8, dtype=torch.float32)),
              lambda: nf4.dequantize(nq, torch.float32)):
        f()  # kernels compiled and loaded before the cap (a module load is not what is tested here)
    with memory_cap(256 * MB):
        for name, f in calls.items():
            with pytest.raises(torch.OutOfMemoryError):
                f()
            torch.cuda.synchronize()  # nothing was launched into a bad state
    _normal_calls_correct(g, q, p)


def test_oom_allocating_a_calls_scratch_then_recovers():
    """A small-m call's fp32 partial sums (allocated per call, MiBs for the skinny / stream-K plans)
    cannot be allocated: OutOfMemoryError before anything launches, for the functional op and for a
    layer; the layers' tile counters stay zero, and later calls on that stream are correct."""
    g, q, p, _, _ = _setup(1)
    x = _rand(g, 8, 4096)
    ws = w4ops.Workspace("cuda")
    ref = w4a16.matmul(x, p, workspace=ws)
    plan = w4ops.LaunchPlan.build(p, None, 8, x.device)
    if plan.partials * 4 < 2 * MB:
        pytest.skip(f"this GPU's plan at m = 8 ({plan.launches[0][0].spec.name}) needs "
                    f"{plan.partials * 4} B of partial sums: too few to test against a cap")
    layer = tilefish.nn.W4A16Linear.from_weight(p)
    assert torch.equal(layer(x), ref)  # the layer's plan for this shape is built and cached
    s = torch.cuda.Stream()
    # room for the [8, 4096] output (64 KiB, from a 2 MiB small-block segment), not for the partials
    with memory_cap(plan.partials * 4 // 2):
        with torch.cuda.stream(s):
            with pytest.raises(torch.OutOfMemoryError):
                w4a16.matmul(x, p, workspace=ws)
            with pytest.raises(torch.OutOfMemoryError):
                layer(x)
        s.synchronize()
    assert int(w4ops.layer_counters(x.device).abs().sum()) == 0 and int(ws.counters.abs().sum()) == 0
    with torch.cuda.stream(s):
        again = w4a16.matmul(x, p, workspace=ws)
        via_layer = layer(x)
    s.synchronize()
    assert torch.equal(again, ref) and torch.equal(via_layer, ref)
    assert rel_err(ref, ref_w4a16(x, q)) < TOLERANCE[torch.float16]


def test_oom_with_device_memory_filled_then_recovers():
    """cudaMalloc itself fails (the device is full, not an allocator cap): still OutOfMemoryError."""
    g, q, p, nq, npr = _setup(2)
    small = {"w4a16": lambda: w4a16.matmul(_rand(g, 3, 4096), p), "hgemm": lambda: tilefish.hgemm(_rand(g, 9, 64),
                                                                                              _rand(g, 64, 16))}
    for f in small.values():
        f()
    torch.cuda.synchronize()
    big = _rand(g, 65536, 4096)  # 512 MiB of x; its [65536, 4096] output needs 512 MiB more
    b_sq = _rand(g, 1024, 1024)
    with fill_device(128 * MB):
        with pytest.raises(torch.OutOfMemoryError):
            w4a16.matmul(big, p)
        with pytest.raises(torch.OutOfMemoryError):
            nf4.matmul(big, npr)
        with pytest.raises(torch.OutOfMemoryError):
            tilefish.hgemm(big.view(-1, 1024), b_sq)  # a [262144, 1024] output: 512 MiB
        torch.cuda.synchronize()
        for f in small.values():  # small calls still fit in the margin
            f()
        torch.cuda.synchronize()
    del big
    _normal_calls_correct(g, q, p)
