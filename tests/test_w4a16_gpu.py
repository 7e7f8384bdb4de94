"""W4A16 tensor-core GEMM against the float64 reference: shapes, m, dtypes, groups, zero points, bias."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tilefish
from tilefish import w4a16
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import quantize_rtn
from tilefish.reference import w4a16_matmul as ref_matmul

from conftest import TOLERANCE, rel_err

pytestmark = pytest.mark.gpu

MS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 128, 257, 1024]
SMALL_KN = [(128, 64), (256, 192), (384, 128), (1024, 320)]
LLAMA_KN = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192),
            (8192, 57344), (28672, 8192)]


def _case(k, n, group, sym, dtype):
    w = torch.randn(n, k, device="cuda", dtype=torch.float32) * (0.5 + torch.rand(()).item())
    q = quantize_rtn(w, group, sym, scale_dtype=dtype, clip_search=False)
    return q, ops.pack(q)


def _poison_allocator(rows, cols, dtype):
    """Leave a NaN block of the output's size in the caching allocator: the op's torch.empty output
    reuses it, so an element the kernel fails to write shows up as NaN (rel_err rejects NaN)."""
    torch.full((rows, cols), float("nan"), device="cuda", dtype=dtype)


def _cc() -> int:
    return torch.cuda.get_device_capability()[0] * 10 + torch.cuda.get_device_capability()[1]


def _grid(cfg, n):
    """n as the plan argument cfg takes: its k split, or for a stream-K configuration its CTA count."""
    return {"ctas": n} if cfg.streamk else {"slices": n}


_WORKSPACE = []


def _workspace() -> ops.Workspace:
    """One workspace the checks share (its tile counters must be back at zero after every launch);
    calls made without it take fresh zeroed counters."""
    if not _WORKSPACE:
        _WORKSPACE.append(ops.Workspace("cuda"))
    return _WORKSPACE[0]


def _assert_counters_zero(what="tile counters must be reset by every launch"):
    torch.cuda.synchronize()
    assert int(_workspace().counters.abs().sum()) == 0, what


def _check(x, q, p, bias=None, **kw):
    ref = ref_matmul(x.reshape(-1, q.k), q, bias).reshape(*x.shape[:-1], q.n)
    _poison_allocator(x.numel() // q.k, q.n, x.dtype)
    out = ops.matmul_impl(x, p, bias, workspace=_workspace(), **kw)
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = rel_err(out, ref)
    assert err < TOLERANCE[x.dtype], err
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [-1, 32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("k,n", SMALL_KN)
def test_small_shapes_all_m(k, n, sym, group, dtype):
    q, p = _case(k, n, group, sym, dtype)
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
        _check(x, q, p, bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,n", LLAMA_KN)
def test_llama_shapes(k, n, dtype):
    for group, sym in ((128, True), (-1, True), (128, False)):
        q, p = _case(k, n, group, sym, dtype)
        for m in (1, 16, 33, 257):
            _check(torch.randn(m, k, device="cuda", dtype=dtype), q, p)


def test_every_config_and_forced_split_k():
    q, p = _case(1024, 256, 128, False, torch.float16)
    for m in (37, 5):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
        for cfg in ops.CONFIGS:
            if cfg.swap and m > 8:
                with pytest.raises(ValueError, match="m <= 8"):
                    ops.matmul_impl(x, p, cfg=cfg)
                continue
            for slices in (1, 2, 3, 8):
                _check(x, q, p, cfg=cfg, slices=slices)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or _cc() != 90, reason="the wgmma kernel needs sm_90")


@hopper
def test_hopper_every_config_and_split():
    """Every wgmma configuration, m below / at / across its tile, k split 1..all stages (stream-K:
    grids of as many CTAs)."""
    q, p = _case(1024, 512, 128, False, torch.float16)
    for cfg in ops.HOPPER_CONFIGS:
        for m in (1, 9, cfg.mt, cfg.mt + 5, 2 * cfg.mt + 3):
            x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
            for slices in (1, 2, 3, 16):
                _check(x, q, p, torch.randn(512, device="cuda", dtype=torch.float16) if m % 2 else None,
                       cfg=cfg, **_grid(cfg, slices))


@hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [-1, 128])
def test_hopper_split_k_cluster_and_workspace(group, dtype):
    """k splits of 2..8 run as one thread-block cluster whose CTAs add their partials through
    distributed shared memory; with the policy's DSMEM split off (and for wider splits) they go
    through the global workspace. Both against the reference, bitwise repeatable, m below / across
    tiles, bias."""
    q, p = _case(2048, 512, group, group == 128, dtype)
    cluster_runs = 0
    for cfg in (ops.HopperConfig(16, 4, 1, 8), ops.HopperConfig(64, 4, 1, 6), ops.HopperConfig(128, 2, 2, 6),
                ops.HopperConfig(256, 1, 2, 5), ops.HopperConfig(128, 1, 2, 6), ops.HopperConfig(64, 2, 1, 8)):
        for m in (5, cfg.mt + 3):
            x = torch.randn(m, 2048, device="cuda", dtype=dtype)
            bias = torch.randn(512, device="cuda", dtype=dtype) if m % 2 else None
            for slices in (2, 3, 5, 8):
                for dsmem in (True, False):
                    policy = ops.LaunchPolicy(dsmem_split=dsmem)
                    out = _check(x, q, p, bias, cfg=cfg, slices=slices, policy=policy)
                    with ops.launch_policy(policy):  # the active policy reaches the launch like the argument
                        assert torch.equal(out, ops.matmul_impl(x, p, bias, cfg=cfg, slices=slices))
                    plan = ops.LaunchPlan.build(p, bias, m, x.device, cfg, slices, policy=policy)
                    clusters = ops.hopper_split_uses_clusters(cfg, m, 512, 2048, slices, group, group != 128, dtype,
                                                              x.device, policy)  # what the launch decided
                    assert clusters == (plan.geometry.cluster > 1) and (dsmem or not clusters)
                    cluster_runs += clusters
    assert cluster_runs > 0, "the DSMEM path ran"


@hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [-1, 32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_hopper_groups_zero_points_dtypes(group, sym, dtype):
    q, p = _case(768, 256, group, sym, dtype)
    for cfg in (ops.HopperConfig(32, 4, 1, 6), ops.HopperConfig(128, 2, 1, 4), ops.HopperConfig(64, 2, 2, 6),
                ops.HopperConfig(64, 2, 2, 6, True), ops.HopperConfig(128, 2, 1, 3, True)):
        for m in (17, 100):
            _check(torch.randn(m, 768, device="cuda", dtype=dtype), q, p, cfg=cfg, **_grid(cfg, 1 + m % 3))


@hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sym", [True, False])
def test_hopper_partial_last_wave_as_its_own_launch(sym, dtype):
    """A whole-tile plan of a two-CTA-an-SM config on a per-channel weight whose partial last wave
    fills most SMs runs that wave as a second launch (tile_base > 0): m not a multiple of the tile,
    zero points, bias; the same bits as one launch."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = ops.HopperConfig(128, 2, 1, 4)
    k, n = 128, 128 * 24
    m_tiles = -(-(2 * sms + sms * 3 // 4) // 24)  # 24 column tiles: a full wave of 2 x SMs slots + 3/4 SMs
    m = m_tiles * 128 - 37
    tiles = m_tiles * 24
    assert ops.separate_tail(cfg, tiles, 1, 1, -1, not sym, sms) == tiles - 2 * sms > sms // 2
    group = -1
    q, p = _case(k, n, group, sym, dtype)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    assert len(ops.LaunchPlan.build(p, bias, m, x.device, cfg, slices=1).launches) == 2
    out = _check(x, q, p, bias, cfg=cfg, slices=1)
    never = ops.LaunchPolicy(separate_tail="never")
    assert len(ops.LaunchPlan.build(p, bias, m, x.device, cfg, slices=1, policy=never).launches) == 1
    assert torch.equal(out, ops.matmul_impl(x, p, bias, cfg=cfg, slices=1, policy=never))


@hopper
def test_hopper_long_k_ring_wrap_and_big_m():
    """k of 224 stages wraps every ring many times; m = 1024 walks many m tiles."""
    q, p = _case(14336, 256, 128, True, torch.bfloat16)
    for m, slices in ((24, 1), (24, 5), (1024, 1)):
        _check(torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16), q, p, slices=slices)


@hopper
def test_hopper_config_wider_than_n_runs_a_ragged_tile():
    """A 256-column configuration forced on n = 192 (one ragged tile of three strips): correct; the
    n % 64 rule itself is the layout's (check_shape)."""
    q, p = _case(256, 192, 128, True, torch.float16)
    x = torch.randn(40, 256, device="cuda", dtype=torch.float16)
    out = ops.matmul_impl(x, p, cfg=ops.HopperConfig(32, 4, 1, 6))
    assert rel_err(out, ref_matmul(x, q)) < TOLERANCE[torch.float16]
    with pytest.raises(ValueError, match="multiple of 64"):
        ops.check_shape(160, 256, 128)


@hopper
def test_hopper_stream_k_any_grid_deterministic_counters_reset():
    """The wgmma kernel's stream-K schedule with grids that cut tiles anywhere (1 CTA, primes, fewer
    CTAs than tiles, more CTAs than k stages of a tile, up to one unit per CTA): correct with a
    fresh x every launch, bitwise repeatable, and every tile counter back at zero afterwards."""
    q, p = _case(2048, 512, 64, False, torch.float16)
    for cfg in [c for c in ops.HOPPER_CONFIGS if c.streamk]:
        if 512 % cfg.bn:
            continue
        for m in (cfg.mt - 3, 2 * cfg.mt + 5):
            bias = torch.randn(512, device="cuda", dtype=torch.float16)
            for ctas in (None, 1, 2, 7, 13, 31, 131, 263, 100000):
                x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
                out = _check(x, q, p, bias, cfg=cfg, ctas=ctas)
                assert torch.equal(out, ops.matmul_impl(x, p, bias, cfg=cfg, ctas=ctas, workspace=_workspace()))
    _assert_counters_zero("stream-K tile counters must be reset by every launch")


@hopper
def test_hopper_stream_k_peek_or_slot_bitwise_repeatable():
    """Stream-K: a CTA's last segment that starts its tile first reads the tile counter; if every
    other contributor is in, it adds their slots to its partial in registers, else it stores its
    slot and takes the counter. Which one runs depends on the arrival order (no build forces the
    slot path), so grids where a tile's contributors end together are launched many times: both
    paths add the same terms in the same k order, so every launch must give the same bits."""
    q, p = _case(2048, 512, 64, False, torch.float16)
    for cfg in [c for c in ops.HOPPER_CONFIGS if c.streamk and 512 % c.bn == 0]:
        for m in (cfg.mt - 3, 2 * cfg.mt + 5):
            for ctas in (None, 7, 13, 131):
                x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
                bias = torch.randn(512, device="cuda", dtype=torch.float16)
                first = _check(x, q, p, bias, cfg=cfg, ctas=ctas)
                for _ in range(10):
                    again = ops.matmul_impl(x, p, bias, cfg=cfg, ctas=ctas, workspace=_workspace())
                    assert torch.equal(again, first), (cfg.label(), m, ctas)
    _assert_counters_zero("stream-K tile counters must be reset by every launch")


@hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hopper_stream_k_llama_shapes(dtype):
    """Stream-K at the benchmark's mid shapes (tiles that do not fill a wave), grouped and
    per-channel, symmetric and asymmetric."""
    for (k, n), (group, sym) in zip([(4096, 6144), (8192, 10240), (14336, 4096)], [(128, True), (-1, True), (128, False)]):
        q, p = _case(k, n, group, sym, dtype)
        for cfg in (ops.HopperConfig(64, 2, 2, 6, True), ops.HopperConfig(128, 1, 2, 6, True)):
            for m in (64, 128, 200, 256):
                _check(torch.randn(m, k, device="cuda", dtype=dtype), q, p, cfg=cfg)


@hopper
def test_skinny_every_config_and_cta_count():
    """Every stream-K configuration, m from 1 to its tile, any grid (1 CTA up to more CTAs than units:
    whole tiles, tiles split 2..n ways, CTAs inside one tile)."""
    q, p = _case(1024, 512, 128, False, torch.float16)
    for cfg in ops.SKINNY_CONFIGS + [dataclasses.replace(c, staged=True) for c in ops.SKINNY_CONFIGS]:
        for m in sorted({1, 3, cfg.mt // 2 + 1, cfg.mt}):
            x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
            bias = torch.randn(512, device="cuda", dtype=torch.float16) if m % 2 else None
            for ctas in (None, 1, 5, 31, 1000):
                _check(x, q, p, bias, cfg=cfg, ctas=ctas)
        with pytest.raises(ValueError, match=f"m <= {cfg.mt}"):
            ops.matmul_impl(torch.randn(cfg.mt + 1, 1024, device="cuda", dtype=torch.float16), p, cfg=cfg)


@hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [-1, 32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_skinny_groups_zero_points_dtypes(group, sym, dtype):
    q, p = _case(768, 256, group, sym, dtype)
    for cfg in (ops.SkinnyConfig(8, 4, 2, 4, 2), ops.SkinnyConfig(8, 4, 1, 3, 2), ops.SkinnyConfig(16, 2, 2, 6, 2),
                ops.SkinnyConfig(32, 2, 4, 8, 1), ops.SkinnyConfig(8, 4, 1, 3, 2, staged=True),
                ops.SkinnyConfig(16, 4, 1, 4, 2, staged=True)):
        for m in (1, cfg.mt):
            _check(torch.randn(m, 768, device="cuda", dtype=dtype), q, p, cfg=cfg, ctas=7)


@hopper
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_skinny_fixup_many_slots(dtype):
    """One tile split over up to 64 CTAs: the last arriver's fixup sums more slots than it has loads
    in flight (several batches); run by the finisher warp mid-stream or by the consumers at the
    end, whichever segment happens to arrive last; threads holding more than one float4 of the
    tile from m = 3 (one-warp configuration), 16-row tiles too."""
    q, p = _case(8192, 256, 128, True, dtype)
    for cfg, ms in ((ops.SkinnyConfig(8, 4, 2, 4, 2), (1, 2, 8)), (ops.SkinnyConfig(8, 4, 1, 3, 2), (1, 2, 5, 8)),
                    (ops.SkinnyConfig(16, 2, 2, 6, 2), (1, 11, 16))):
        for m in ms:
            for ctas in (64, 41, 17):
                x = torch.randn(m, 8192, device="cuda", dtype=dtype)
                out = _check(x, q, p, cfg=cfg, ctas=ctas)
                # The staged-fixup build: the same sums in the same order, through shared memory in
                # batches (64 slots of up to 8 KB are more than one batch holds).
                _poison_allocator(m, 256, dtype)
                staged = ops.matmul_impl(x, p, cfg=dataclasses.replace(cfg, staged=True), ctas=ctas)
                assert torch.equal(staged, out), (cfg.label(), m, ctas)


@hopper
def test_skinny_fresh_inputs_every_launch():
    """A shared-memory race (stage released before the warp's ldmatrix finished) showed only on the
    first launch after x changed: repeats with the same x read back identical stale values. So: new
    x every launch, checked every launch, at the shape and grid that exposed it, with a bound near
    the fp16 output rounding (2.9e-4 here; the race gave 2e-3 .. 4e-3)."""
    q, p = _case(8192, 57344, 128, True, torch.float16)
    for cfg in (ops.SkinnyConfig(16, 4, 1, 4, 2), ops.SkinnyConfig(16, 2, 2, 6, 2), ops.SkinnyConfig(8, 4, 2, 4, 2),
                ops.SkinnyConfig(8, 4, 1, 3, 2)):
        for _ in range(6):
            x = torch.randn(cfg.mt, 8192, device="cuda", dtype=torch.float16)
            out = ops.matmul_impl(x, p, cfg=cfg)
            assert rel_err(out, ref_matmul(x, q)) < 6e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,sym", [(-1, False), (32, True), (128, False)])
def test_swapped_operands_small_m(group, sym, dtype):
    q, p = _case(2048, 512, group, sym, dtype)
    for m in range(1, 9):
        for cfg in (c for c in ops.CONFIGS if c.swap):
            x = torch.randn(m, 2048, device="cuda", dtype=dtype)
            _check(x, q, p, torch.randn(512, device="cuda", dtype=dtype), cfg=cfg, slices=1 + m % 3)


def test_leading_dims_and_bias():
    q, p = _case(256, 128, 64, True, torch.bfloat16)
    x = torch.randn(2, 3, 5, 256, device="cuda", dtype=torch.bfloat16)
    _check(x, q, p, torch.randn(128, device="cuda", dtype=torch.bfloat16))


def test_strided_inputs():
    """Non-contiguous x and bias views give the same result as their contiguous copies."""
    q, p = _case(256, 128, 128, True, torch.float16)
    x = torch.randn(6, 512, device="cuda", dtype=torch.float16)[:, ::2]
    bias = torch.randn(256, device="cuda", dtype=torch.float16)[::2]
    out = _check(x, q, p, bias)
    assert torch.equal(out, ops.matmul_impl(x.contiguous(), p, bias.contiguous()))


def test_deterministic_and_many_launches_with_changing_shapes():
    """Bitwise-identical repeats; split-k counters never get stuck across shape changes."""
    cases = [_case(k, n, 128, True, torch.float16) for k, n in ((4096, 256), (1024, 128), (8192, 64))]
    firsts = {}
    for it in range(30):
        for i, (q, p) in enumerate(cases):
            m = (1, 16, 24)[(it + i) % 3]
            torch.manual_seed(i * 100 + m)
            x = torch.randn(m, q.k, device="cuda", dtype=torch.float16)
            out = ops.matmul_impl(x, p)
            if (i, m) in firsts:
                assert torch.equal(out, firsts[(i, m)])
            else:
                firsts[(i, m)] = out
                assert rel_err(out, ref_matmul(x, q)) < TOLERANCE[torch.float16]


@pytest.mark.parametrize("m", [8, 12, 40])
def test_two_streams_at_once(m):
    q, p = _case(4096, 256, 128, True, torch.float16)
    xs = [torch.randn(m, 4096, device="cuda", dtype=torch.float16) for _ in range(2)]
    refs = [ops.matmul_impl(x, p) for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [None, None]
    for _ in range(20):
        for i, s in enumerate(streams):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs[i] = ops.matmul_impl(xs[i], p)
        torch.cuda.synchronize()
        for o, r in zip(outs, refs):
            assert torch.equal(o, r)


@pytest.mark.parametrize("m", [4, 12, 48])
def test_cuda_graph(m):
    q, p = _case(2048, 256, 128, False, torch.bfloat16)
    x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w4a16.matmul(x, p)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = w4a16.matmul(x, p)
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out, ref_matmul(x, q)) < TOLERANCE[torch.bfloat16]


def test_torch_compile_fullgraph():
    q, p = _case(512, 128, 128, True, torch.float16)
    f = torch.compile(lambda x: w4a16.matmul(x, p) * 2, fullgraph=True)
    x = torch.randn(5, 512, device="cuda", dtype=torch.float16)
    assert rel_err(f(x), ref_matmul(x, q).float() * 2) < TOLERANCE[torch.float16]


def test_linear_layer_and_gptq_act_order():
    lin = torch.nn.Linear(512, 256, bias=True).cuda().half()
    layer = tilefish.nn.W4A16Linear.from_linear(lin, group_size=128)
    x = torch.randn(3, 7, 512, device="cuda", dtype=torch.float16)
    y = layer(x)
    assert rel_err(y, lin(x)) < 0.15  # 4-bit quantization error, not kernel error
    from tilefish.quant import int4
    q = quantize_rtn(torch.randn(256, 512, device="cuda"), 128, False, scale_dtype=torch.float16)
    perm = torch.randperm(512, device="cuda")
    ckpt = int4.to_gptq(q, "v1", perm=perm)
    g = tilefish.nn.W4A16Linear.from_gptq(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"])
    x2 = torch.randn(9, 512, device="cuda", dtype=torch.float16)
    inv = torch.argsort(perm)
    # checkpoint semantics: W_ckpt[:, perm] == q.dequantize(), so x @ W_ckpt^T == x[:, perm] @ q^T
    assert rel_err(g(x2), ref_matmul(x2[:, perm], q)) < TOLERANCE[torch.float16]
    del inv


def test_bad_inputs():
    q, p = _case(256, 128, 128, True, torch.float16)
    x = torch.randn(4, 256, device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        w4a16.matmul(x.float(), p)
    with pytest.raises(TypeError, match="scales"):
        w4a16.matmul(x.bfloat16(), p)
    with pytest.raises(ValueError, match="k=255"):
        w4a16.matmul(x[:, :255], p)
    with pytest.raises(ValueError, match="device"):
        w4a16.matmul(x.cpu(), p)
    with pytest.raises(ValueError, match="bias"):
        w4a16.matmul(x, p, torch.zeros(127, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="multiple of 64"):
        w4a16.quantize(torch.randn(100, 256, device="cuda"), 128)
    with pytest.raises(ValueError, match="multiple of 64"):
        w4a16.quantize(torch.randn(128, 200, device="cuda"), -1)
    q192, p192 = _case(192, 128, 64, True, torch.float16)
    p192 = dataclasses.replace(p192, group_size=128, scales=p192.scales[:1].contiguous())
    with pytest.raises(ValueError, match="group_size=128 needs k"):  # before any launch
        ops.matmul_impl(torch.randn(4, 192, device="cuda", dtype=torch.float16), p192)
    with pytest.raises(TypeError):
        w4a16.matmul(x, q)


@hopper
def test_cluster_capacity_is_what_the_kernels_get():
    """The dispatcher plans with runtime.cluster_capacity (an empty kernel's occupancy answer at one
    CTA an SM); the launcher asks the wgmma kernel itself. Both must agree, or the time model
    would price a split as a DSMEM fixup that then runs through the workspace (or the reverse)."""
    from tilefish.runtime import cluster_capacity, get_kernel

    caps = dict(cluster_capacity(torch.cuda.current_device(), 384, ops.ONE_CTA_PER_SM_SMEM))
    print("cluster capacity", caps)
    for cfg in (ops.HopperConfig(64, 2, 1, 8), ops.HopperConfig(128, 2, 2, 6), ops.HopperConfig(32, 4, 1, 6)):
        kern = get_kernel(ops.kernel_spec(torch.float16, cfg, 128, False))
        smem = max(cfg.smem_bytes(128, False), ops.ONE_CTA_PER_SM_SMEM)
        for size in (2, 3, 4, 6, 8):
            assert kern.max_active_clusters(size, cfg.threads, smem) == caps[size], (cfg.label(), size)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132 and "H200" in torch.cuda.get_device_name():
        assert caps == dict(ops.H200_CLUSTERS)



# ---- k % 64 == 0: an odd number of 64-wide k steps (the mma.sync kernel's half last k tile, the
# skinny kernel's half last stage; the wgmma kernel's 64-wide stages cover it exactly) ----------------------------

ODD_K = [64, 192, 832, 2880, 4544]
ODD_K_MS = [1, 5, 16, 33, 130]


def _odd_k_case(k, n, group, sym, dtype, seed, perm=False):
    torch.manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.float32) * (0.5 + torch.rand(()).item())
    q = quantize_rtn(w, group, sym, scale_dtype=dtype, clip_search=False)
    order = torch.randperm(k, device="cuda") if perm else None
    return q, ops.pack(q, order)


def _odd_k_check(x, q, p, bias, seed, **kw):
    """Against the float64 reference (act order: x's columns gathered), output poisoned, the seed in the message."""
    xr = x if p.perm is None else x[:, p.perm]
    ref = ref_matmul(xr, q, bias)
    _poison_allocator(x.shape[0], q.n, x.dtype)
    out = ops.matmul_impl(x, p, bias, workspace=_workspace(), **kw)
    err = rel_err(out, ref)
    assert err < TOLERANCE[x.dtype], f"rel err {err}: k={q.k} n={q.n} m={x.shape[0]} group={q.group_size} " \
                                     f"asym={q.zeros is not None} {x.dtype} seed={seed} {kw}"
    return out


def _odd_k_cases():
    """(k, group, sym, dtype, perm) combinations: every k with both dtypes, per-channel and group 64,
    symmetric and asymmetric, act order on some."""
    for i, k in enumerate(ODD_K):
        for j, (group, sym, dtype) in enumerate(((-1, True, torch.float16), (64, False, torch.bfloat16),
                                                 (64, True, torch.float16), (-1, False, torch.bfloat16))):
            yield k, group, sym, dtype, (i + j) % 3 == 0


@pytest.mark.parametrize("k,group,sym,dtype,perm", list(_odd_k_cases()))
def test_odd_k_dispatcher_and_mma_sync(k, group, sym, dtype, perm):
    """The dispatcher's plan and the mma.sync kernel's families (tiles, register ring, swapped
    operands, 16/32-row tiles) with k splits that put the half tile in a slice of its own or inside
    one, bias on odd m."""
    n, seed = 256, k * 10 + group
    q, p = _odd_k_case(k, n, group, sym, dtype, seed, perm)
    for m in ODD_K_MS:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
        _odd_k_check(x, q, p, bias, seed)
        for cfg in (ops.GemmConfig(1, 2, 4, 4), ops.GemmConfig(2, 1, 8, 6), ops.GemmConfig(1, 4, 2, 8),
                    ops.GemmConfig(1, 2, 4, 4, True, True), ops.GemmConfig(1, 1, 8, 4, True),
                    ops.GemmConfig(1, 2, 4, 4, False, True)):
            if cfg.swap and m > 8:
                continue
            for slices in (1, 2, 3, 8):
                _odd_k_check(x, q, p, bias, seed, cfg=cfg, slices=slices)


@hopper
@pytest.mark.parametrize("k,group,sym,dtype,perm", list(_odd_k_cases()))
def test_odd_k_hopper_tiles_split_clusters_and_stream_k(k, group, sym, dtype, perm):
    """The wgmma kernel at k % 128 == 64: whole tiles, k slices through DSMEM clusters and through the
    workspace (the policy's DSMEM split off), stream-K grids that cut tiles anywhere; counters reset."""
    n, seed = 512, k * 10 + group + 1
    q, p = _odd_k_case(k, n, group, sym, dtype, seed, perm)
    for m in ODD_K_MS:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
        for cfg in (ops.HopperConfig(64, 2, 1, 8), ops.HopperConfig(128, 2, 2, 6), ops.HopperConfig(16, 4, 1, 8)):
            for slices in (1, 2, 3, 5):
                for dsmem in (True, False):
                    _odd_k_check(x, q, p, bias, seed, cfg=cfg, slices=slices, policy=ops.LaunchPolicy(dsmem_split=dsmem))
        for cfg in (ops.HopperConfig(64, 2, 2, 6, True), ops.HopperConfig(128, 1, 2, 6, True),
                    ops.HopperConfig(16, 4, 1, 8, True)):
            for ctas in (None, 1, 7, 13, 100000):
                _odd_k_check(x, q, p, bias, seed, cfg=cfg, ctas=ctas)
    _assert_counters_zero("tile counters must be reset by every launch")


@hopper
@pytest.mark.parametrize("k,group,sym,dtype,perm", list(_odd_k_cases()))
def test_odd_k_skinny_register_and_staged_fixups(k, group, sym, dtype, perm):
    """The skinny kernel's half last stage: one warp a strip and several, 8/16/32-row tiles, register
    and staged (shared-memory) fixups, grids from 1 CTA to more CTAs than units."""
    n, seed = 512, k * 10 + group + 2
    q, p = _odd_k_case(k, n, group, sym, dtype, seed, perm)
    cfgs = (ops.SkinnyConfig(8, 4, 1, 3, 2), ops.SkinnyConfig(8, 4, 2, 4, 2), ops.SkinnyConfig(16, 2, 2, 6, 2),
            ops.SkinnyConfig(32, 2, 4, 8, 1), ops.SkinnyConfig(8, 4, 1, 3, 2, staged=True),
            ops.SkinnyConfig(16, 4, 1, 4, 2, staged=True), ops.SkinnyConfig(8, 2, 4, 8, 2, staged=True))
    for m in ODD_K_MS:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
        for cfg in cfgs:
            if m > cfg.mt:
                continue
            for ctas in (None, 1, 3, 7, 31, 1000):
                _odd_k_check(x, q, p, bias, seed, cfg=cfg, ctas=ctas)


# ---- a ragged last column tile: n % 64 == 0 but not a multiple of the wgmma tile's width (gpt-oss's
# n 2880 in 128-column tiles); the missing strips load copies of the last valid one and are never stored --------

RAGGED_N = [192, 320, 2880, 4544]
RAGGED_MS = [1, 17, 130, 300]


@hopper
@pytest.mark.parametrize("n", RAGGED_N)
@pytest.mark.parametrize("group,sym,dtype", [(-1, True, torch.float16), (128, False, torch.bfloat16),
                                             (32, True, torch.bfloat16), (-1, False, torch.float16)])
def test_ragged_last_column_tile(n, group, sym, dtype):
    """Every wgmma path with n % BN != 0: whole-k tiles, k splits through DSMEM clusters and the
    workspace, stream-K, 128-, 256- and 512-column tiles; per-channel scales and bias read only valid
    columns; the columns past n are never written (the output's neighbours are checked)."""
    k, seed = 1024, n + group
    q, p = _odd_k_case(k, n, group, sym, dtype, seed, perm=(n == 320))
    cfgs = [c for c in (ops.HopperConfig(128, 2, 2, 6), ops.HopperConfig(64, 4, 1, 6), ops.HopperConfig(16, 4, 2, 8),
                        ops.HopperConfig(256, 1, 2, 5), ops.HopperConfig(64, 2, 2, 6, True),
                        ops.HopperConfig(128, 2, 2, 5, True)) if n % c.bn]
    assert cfgs
    for m in RAGGED_MS:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
        _odd_k_check(x, q, p, bias, seed)  # the dispatcher's plan
        for cfg in cfgs:
            if cfg.streamk:
                for ctas in (None, 1, 7, 100000):
                    _odd_k_check(x, q, p, bias, seed, cfg=cfg, ctas=ctas)
                continue
            for slices in (1, 3):
                for dsmem in (True, False):
                    _odd_k_check(x, q, p, bias, seed, cfg=cfg, slices=slices, policy=ops.LaunchPolicy(dsmem_split=dsmem))
    # nothing past the output is written: a store past column n of the last row would land in a
    # guard row after it (the launch writes into a buffer one row longer than m)
    for cfg in cfgs:
        m = 130
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        x = x if p.perm is None else x.index_select(1, p.perm).contiguous()  # the op's act-order gather
        buf = torch.full((m + 1, n), 7.0, device="cuda", dtype=dtype)
        plan = ops.LaunchPlan.build(p, None, m, x.device, cfg, None if cfg.streamk else 1, None,
                                    _workspace().counters)
        plan.launch(x.data_ptr(), buf.data_ptr())
        assert torch.all(buf[m] == 7.0), cfg.label()
        assert rel_err(buf[:m], ref_matmul(x, q, None)) < TOLERANCE[dtype], f"{cfg.label()} seed={seed}"
    _assert_counters_zero("tile counters must be reset by every launch")
