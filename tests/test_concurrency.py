"""Concurrency: Python threads, each on its own CUDA stream, running different ops and shapes at once
(W4A16 plans sharing one Workspace's tile counters, which the streams take in turn, or fresh counters;
k splits and stream-K, the skinny kernel, the layers' shared counters, a shared W4A16Linear's plan cache,
NF4, HGEMM, SGEMM): every output bit-identical to a serial run of
the same calls, a hang fails the test (threads joined with a timeout). And CUDA-graph capture of a
sequence of different ops on a side stream, replayed with new inputs, equal to eager results.

TILEFISH_REPEAT=N runs each test N times in a row (e.g. 20 on the device):
  TILEFISH_REPEAT=20 pytest -m gpu tests/test_concurrency.py
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import tilefish
from tilefish import nf4, w4a16
from tilefish.ops import w4a16 as w4ops
from tilefish.ops.w4a16 import launch as w4launch
from tilefish.quant.int4 import quantize_rtn

from conftest import TOLERANCE, rel_err

pytestmark = pytest.mark.gpu

REPEAT = int(os.environ.get("TILEFISH_REPEAT", "1"))
THREADS = 6
ITERS = 25
JOIN_TIMEOUT_S = 120.0


def _rand(g, *shape, dtype=torch.float16):
    return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dtype)


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _w4_weight(g, n, k, group, sym, dtype):
    q = quantize_rtn(_rand(g, n, k, dtype=torch.float32), group, sym, clip_search=False, scale_dtype=dtype)
    return w4ops.pack(q)


_WORKSPACES = []


def _shared_workspace() -> w4ops.Workspace:
    """One Workspace every thread's W4A16 calls share: the streams must take its counters in turn."""
    if not _WORKSPACES:
        _WORKSPACES.append(w4ops.Workspace("cuda"))
    return _WORKSPACES[0]


def _plan_kind(m, p) -> str:
    from tilefish.runtime import device_info

    info = device_info()
    plan = w4ops.choose_plan(m, p.n, p.k, info.sm_count, info.cc, p.group_size, w4launch.device_clusters(info),
                             p.dtype, p.codebook, w4launch._device_table(info))
    kind = type(plan.cfg).__name__
    if plan.cfg.streamk:
        kind += "-streamk"
    if (plan.slices or 1) > 1:
        kind += f"-split{plan.slices}"
    return kind


def _workloads(seed: int):
    """Named closures over fixed inputs, one per op / plan kind. On Hopper the W4A16 shapes are ones
    where the dispatcher picks the skinny stream-K kernel (m <= 16 on a large weight), a wgmma k split
    and wgmma stream-K (checked below, and forced as well so the paths run whatever the dispatcher's
    tables say); the mma.sync kernel with a k split runs forced everywhere."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    f16, bf16 = torch.float16, torch.bfloat16
    big = _w4_weight(g, 8192, 4096, 128, True, f16)          # skinny at m <= 16 on sm_90
    mid = _w4_weight(g, 6144, 4096, 128, False, bf16)
    small = _w4_weight(g, 512, 2048, 64, False, f16)
    pc = _w4_weight(g, 4096, 4096, -1, True, f16)
    xs = {m: _rand(g, m, 4096) for m in (1, 4, 13, 16)}
    xm = {m: _rand(g, m, 4096, dtype=bf16) for m in (40, 200, 700)}
    x_small = _rand(g, 24, 2048)
    x_pc = _rand(g, 64, 4096)
    bias = _rand(g, 6144, dtype=bf16)
    nq = nf4.quantize(_rand(g, 2048, 4096, dtype=torch.float32), blocksize=64)
    np_ = nf4.prepare(nq, bf16)
    x_nf4 = {m: _rand(g, m, 4096, dtype=bf16) for m in (3, 130)}
    a16, b16 = _rand(g, 333, 1000), _rand(g, 1000, 520)
    a32, b32 = _rand(g, 257, 300, dtype=torch.float32), _rand(g, 300, 129, dtype=torch.float32)
    layer = tilefish.nn.W4A16Linear.from_weight(_w4_weight(g, 1024, 1024, 128, True, f16), _rand(g, 1024))
    x_layer = {m: _rand(g, m, 1024) for m in (2, 48)}
    ws = _shared_workspace()
    work = {
        **{f"w4a16 m{m} 8192x4096 (skinny at m<=16)": (lambda x=x: w4a16.matmul(x, big, workspace=ws))
           for m, x in xs.items()},
        **{f"w4a16 m{m} 6144x4096 bf16 asym bias": (lambda x=x: w4a16.matmul(x, mid, bias, workspace=ws))
           for m, x in xm.items()},
        "w4a16 m13 fresh counters": lambda: w4a16.matmul(xs[13], big),
        "w4a16 m64 per-channel": lambda: w4a16.matmul(x_pc, pc, workspace=ws),
        "w4a16 mma.sync split 3": lambda: w4ops.matmul_impl(x_small, small, cfg=w4ops.GemmConfig(2, 1, 8, 4), slices=3,
                                                            workspace=ws),
        "nf4 matmul m3": lambda: nf4.matmul(x_nf4[3], np_, workspace=ws),
        "nf4 matmul m130": lambda: nf4.matmul(x_nf4[130], np_),
        "nf4 dequantize": lambda: nf4.dequantize(nq, bf16),
        "hgemm 333x520x1000": lambda: tilefish.hgemm(a16, b16),
        "hgemm nk": lambda: tilefish.hgemm(a16, b16.t().contiguous(), b_transposed=True),
        "sgemm 257x129x300": lambda: tilefish.sgemm(a32, b32),
        "W4A16Linear m2": lambda: layer(x_layer[2]),
        "W4A16Linear m48": lambda: layer(x_layer[48]),
    }
    if _hopper():
        work.update({
            "w4a16 wgmma split 3 forced": lambda: w4ops.matmul_impl(xm[40], mid, cfg=w4ops.HopperConfig(64, 2, 1, 8),
                                                                    slices=3, workspace=ws),
            "w4a16 wgmma split 5 workspace": lambda: w4ops.matmul_impl(x_small, small, cfg=w4ops.HopperConfig(16, 4, 1, 8),
                                                                       slices=5, workspace=ws),
            "w4a16 wgmma stream-K forced": lambda: w4ops.matmul_impl(xm[200], mid, cfg=w4ops.HopperConfig(64, 2, 2, 6, True),
                                                                     ctas=97, workspace=ws),
            "w4a16 skinny forced 31 ctas": lambda: w4ops.matmul_impl(xs[13], big, cfg=w4ops.SkinnyConfig(16, 2, 2, 6, 2),
                                                                     ctas=31, workspace=ws),
        })
    kinds = {m: _plan_kind(m, big) for m in xs} | {m: _plan_kind(m, mid) for m in xm}
    return work, kinds, layer


def _run_threads(target, n, timeout=JOIN_TIMEOUT_S):
    errors, threads = [], []

    def wrap(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append((i, e))

    for i in range(n):
        t = threading.Thread(target=wrap, args=(i,), daemon=True, name=f"tilefish-worker-{i}")
        threads.append(t)
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {timeout} s (a hang?): {alive}"
    if errors:
        i, e = errors[0]
        raise AssertionError(f"thread {i} failed ({len(errors)} failed): {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("rep", range(REPEAT))
def test_threads_own_streams_bit_identical_to_serial(rep):
    work, kinds, layer = _workloads(1000 + rep)
    print("W4A16 dispatcher plans:", kinds)
    if _hopper():
        assert any("Skinny" in v for v in kinds.values()), kinds
    names = list(work)
    # serial: warm (compile, workspaces, plans) and the expected bits, on the default stream
    for f in work.values():
        f()
    torch.cuda.synchronize()
    expected = {k: f() for k, f in work.items()}
    torch.cuda.synchronize()
    for k, f in work.items():
        assert torch.equal(f(), expected[k]), f"{k}: not deterministic even serially"

    def worker(i):
        s = torch.cuda.Stream()
        order = names[i % len(names):] + names[:i % len(names)]  # each thread starts elsewhere
        with torch.cuda.stream(s):
            for it in range(ITERS):
                outs = [(k, work[k]()) for k in (order if (it + i) % 2 == 0 else order[::-1])]
                s.synchronize()
                for k, o in outs:
                    if not torch.equal(o, expected[k]):
                        raise AssertionError(f"{k}: differs from the serial run (iteration {it}, stream {i}); "
                                             f"max |diff| {(o.float() - expected[k].float()).abs().max().item()}")

    _run_threads(worker, THREADS)
    torch.cuda.synchronize()
    for counters in (_shared_workspace().counters, w4ops.layer_counters(layer.packed.device)):
        assert int(counters.abs().sum()) == 0, "tile counters must be back at zero after every launch"


@pytest.mark.parametrize("rep", range(REPEAT))
def test_threads_shared_layer_plan_cache_new_streams(rep):
    """One W4A16Linear used from many threads, each on a new stream and shape mix: the per-(shape,
    stream) plan cache fills concurrently; results equal the serial ones."""
    g = torch.Generator(device="cuda")
    g.manual_seed(77 + rep)
    layer = tilefish.nn.W4A16Linear.from_weight(_w4_weight(g, 4096, 2048, 64, False, torch.float16),
                                                _rand(g, 4096))
    xs = [_rand(g, m, 2048) for m in (1, 3, 8, 16, 17, 64, 300)]
    expected = [layer(x) for x in xs]
    torch.cuda.synchronize()

    def worker(i):
        for it in range(8):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                outs = [layer(x) for x in (xs if (i + it) % 2 else xs[::-1])]
                s.synchronize()
            for o in outs:
                e = next(e for e in expected if e.shape == o.shape)
                assert torch.equal(o, e), f"thread {i} iteration {it}: m={o.shape[0]} differs from the serial run"

    _run_threads(worker, 8)
    torch.cuda.synchronize()
    assert int(w4ops.layer_counters(layer.packed.device).abs().sum()) == 0, "the layers' tile counters must be back at zero"


@pytest.mark.parametrize("rep", range(REPEAT))
def test_cuda_graph_of_op_sequence_replayed_with_new_inputs(rep):
    """W4A16 (skinny / wgmma / mma.sync by m), NF4 matmul and dequantize, HGEMM and SGEMM captured in one
    graph on a side stream; each replay after copying new inputs into the static buffers equals eager."""
    g = torch.Generator(device="cuda")
    g.manual_seed(500 + rep)
    f16, bf16 = torch.float16, torch.bfloat16
    p_big = _w4_weight(g, 8192, 4096, 128, True, f16)
    p_mid = _w4_weight(g, 2048, 2048, -1, False, bf16)
    nq = nf4.quantize(_rand(g, 1024, 2048, dtype=torch.float32), blocksize=64)
    np_ = nf4.prepare(nq, bf16)
    static = {"x1": _rand(g, 4, 4096), "x2": _rand(g, 96, 2048, dtype=bf16), "x3": _rand(g, 9, 2048, dtype=bf16),
              "a16": _rand(g, 200, 512), "b16": _rand(g, 512, 264), "a32": _rand(g, 65, 130, dtype=torch.float32),
              "b32": _rand(g, 130, 33, dtype=torch.float32)}
    deq = torch.empty(1024, 2048, dtype=bf16, device="cuda")
    bias = _rand(g, 2048, dtype=bf16)

    def seq(t, deq_out):
        return [w4a16.matmul(t["x1"], p_big), w4a16.matmul(t["x2"], p_mid, bias), nf4.matmul(t["x3"], np_),
                nf4.dequantize(nq, bf16, out=deq_out), tilefish.hgemm(t["a16"], t["b16"]),
                tilefish.sgemm(t["a32"], t["b32"])]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        seq(static, deq)  # warm-up on the capture stream: compile, load, this stream's workspace
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        outs = seq(static, deq)
    torch.cuda.synchronize()
    for i in range(4):
        fresh = {k: torch.randn(v.shape, generator=g, device="cuda", dtype=torch.float32).to(v.dtype)
                 for k, v in static.items()}
        for k, v in fresh.items():
            static[k].copy_(v)
        deq.fill_(float("nan"))
        for o in outs:
            o.fill_(float("nan"))  # poison: every replay must rewrite every output
        graph.replay()
        torch.cuda.synchronize()
        eager = seq(fresh, torch.empty_like(deq))
        torch.cuda.synchronize()
        for j, (o, e) in enumerate(zip(outs, eager)):
            assert not torch.isnan(o).any(), f"replay {i}: output {j} has unwritten (NaN) elements"
            assert torch.equal(o, e), f"replay {i}: output {j} differs from eager (rel err {rel_err(o, e):.3g})"
        assert torch.equal(deq, eager[3])
    # sanity against the reference for one replay's W4A16 output
    from tilefish.ops.w4a16 import unpack
    from tilefish.reference import w4a16_matmul

    assert rel_err(outs[0], w4a16_matmul(static["x1"], unpack(p_big))) < TOLERANCE[f16]
