"""W4A16 kernel layout on the CPU: the packed words hold exactly the nibbles the kernel's fragment map expects."""
from __future__ import annotations

import pytest
import torch

from tilefish import w4a16
from tilefish.ops import w4a16 as ops
from tilefish.quant.int4 import Int4Weight, quantize_rtn


def test_fragment_map_nibble_by_nibble():
    n, k = 128, 256
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    p = ops.pack(Int4Weight(q, torch.ones(n, 1, dtype=torch.float16), None, -1))
    words = p.packed.view(n // 64, k // 16, 32, 4).to(torch.int64) & 0xFFFFFFFF  # strip-major
    for r in range(k // 16):
        for S in range(n // 64):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for j in range(4):
                    w = int(words[S, r, lane, j])
                    for nib in range(8):
                        b, h, a = nib >> 2, (nib >> 1) & 1, nib & 1
                        col, kk = 64 * S + 16 * j + 8 * h + g, 16 * r + 8 * a + 2 * t + b
                        assert (w >> (4 * nib)) & 0xF == int(q[col, kk])


@pytest.mark.parametrize("group", [-1, 32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_pack_unpack_round_trip(group, sym):
    q = quantize_rtn(torch.randn(192, 384), group, sym)
    u = ops.unpack(ops.pack(q))
    assert torch.equal(u.q, q.q) and torch.equal(u.scales, q.scales)
    assert (q.zeros is None and u.zeros is None) or torch.equal(u.zeros, q.zeros)


def test_grouped_scale_permutation():
    q = quantize_rtn(torch.randn(128, 256), 128, True)
    p = ops.pack(q)
    # lane g of strip S reads 8 consecutive scales: subtiles s = 0..7 -> column 64 S + 8 s + g
    for S in range(2):
        for g in range(8):
            for s in range(8):
                assert p.scales[0, 64 * S + 8 * g + s] == q.scales[64 * S + 8 * s + g, 0]


def test_cpu_matmul_runs_reference_and_shapes():
    w = w4a16.quantize(torch.randn(64, 128), group_size=-1)
    y = w4a16.matmul(torch.randn(2, 5, 128, dtype=torch.float16), w)
    assert y.shape == (2, 5, 64) and y.dtype == torch.float16


def test_bad_shapes_rejected():
    with pytest.raises(ValueError, match="multiple of 64"):
        w4a16.quantize(torch.randn(96, 128), 128)
    for k in (96, 130):  # k must be a multiple of 64, whatever the group
        with pytest.raises(ValueError, match=f"k \\(in_features\\) to be a multiple of 64; got k={k}"):
            ops.check_shape(64, k, -1)
    with pytest.raises(ValueError, match="group_size=128 needs k .* multiple of it; got k=192"):
        ops.check_shape(64, 192, 128)
    with pytest.raises(ValueError):  # quantize itself needs whole groups
        w4a16.quantize(torch.randn(64, 192), 128)


@pytest.mark.parametrize("k", [64, 192, 832, 2880, 4544])
@pytest.mark.parametrize("group", [-1, 32, 64])
def test_k_multiple_of_64_accepted(k, group):
    """k % 64 == 0 (Falcon-7B's 4544, gpt-oss's 2880): packs, round-trips, validates and runs (CPU: the
    reference); the kernels take the odd last 64-wide k step as a half tile / stage."""
    ops.check_shape(128, k, group)
    torch.manual_seed(k + group)
    q = quantize_rtn(torch.randn(128, k), group, False, scale_dtype=torch.float16)
    p = ops.pack(q)
    u = ops.unpack(p)
    assert torch.equal(u.q, q.q) and torch.equal(u.scales, q.scales) and torch.equal(u.zeros, q.zeros)
    x = torch.randn(3, k, dtype=torch.float16)
    y = w4a16.matmul(x, p)
    assert y.shape == (3, 128)
    from tilefish.reference import w4a16_matmul as ref_matmul
    assert torch.equal(y, ref_matmul(x, q))


def test_half_k_tile_counts():
    """The launchers count the mma.sync kernel's k tiles and the skinny kernel's stages with a half
    last one: ceil(k / 128)."""
    from tilefish.ops.w4a16.layout import K_MULTIPLE

    assert K_MULTIPLE == 64 and ops.BK == 128
    assert -(-192 // ops.BK) == 2 and -(-64 // ops.BK) == 1 and -(-4544 // ops.BK) == 36


def test_layer_state_dict_round_trip():
    from tilefish.nn import W4A16Linear

    lin = torch.nn.Linear(256, 128)
    a = W4A16Linear.from_linear(lin, group_size=64, symmetric=False)
    b = W4A16Linear(256, 128, group_size=64, symmetric=False, dtype=torch.float16)
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 256, dtype=torch.float16)
    assert torch.equal(a(x), b(x))


def test_opcheck_w4a16_op_on_the_cpu_reference():
    p = w4a16.quantize(torch.randn(64, 128), group_size=64, symmetric=False)
    from tilefish.ops import library

    x = torch.randn(3, 128, dtype=torch.float16)
    torch.library.opcheck(library.w4a16_matmul_op, (x, p.packed, p.scales, p.zeros, p.perm, None, p.group_size, p.n, p.k,
                                                   p.codebook))


def test_workspace_arguments_are_checked_before_any_launch():
    """A Workspace is validated where it is made and where it is passed: a wrong type, size or device is a
    clear error naming the rule (the CUDA check of its device is in test_w4a16_gpu's workspace users)."""
    import tilefish
    from tilefish.ops.w4a16.workspace import check_counters

    w = tilefish.w4a16.quantize(torch.randn(128, 256), 128, clip_search=False)
    x = torch.randn(3, 256, dtype=torch.float16)
    with pytest.raises(TypeError, match="tilefish.w4a16.Workspace"):
        tilefish.w4a16.matmul(x, w, workspace=torch.zeros(16, dtype=torch.int32))
    for slots in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="slots must be a positive int"):
            tilefish.w4a16.Workspace("cpu", slots)
    ws = tilefish.w4a16.Workspace("cpu", 64)
    assert ws.counters.dtype == torch.int32 and int(ws.counters.abs().sum()) == 0 and "64 tile counters" in repr(ws)
    assert torch.equal(tilefish.w4a16.matmul(x, w, workspace=ws), tilefish.w4a16.matmul(x, w))  # CPU: unused
    with pytest.raises(ValueError, match="the workspace is on cpu"):
        check_counters(ws.counters, torch.device("cuda", 0))
    with pytest.raises(TypeError, match="1-D int32"):
        check_counters(torch.zeros(4), torch.device("cpu"))
