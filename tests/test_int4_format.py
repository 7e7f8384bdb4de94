"""INT4 weight formats (tilefish.quant.int4): packing bit for bit, checkpoint import/export, RTN quantization."""
from __future__ import annotations

import pytest
import torch

from tilefish.quant.int4 import (
    AWQ_ORDER,
    AWQ_REVERSE_ORDER,
    Int4Weight,
    from_awq,
    from_gptq,
    quantize_rtn,
    to_awq,
    to_gptq,
)

GROUP_SIZES = (-1, 32, 64, 128)


def i32(word: int) -> int:
    """A 32-bit hex literal as the signed int32 value torch stores."""
    return word - (1 << 32) if word >= (1 << 31) else word


def words(*hexes: int) -> list[int]:
    return [i32(h) for h in hexes]


def nib(word: int, j: int) -> int:
    return (word >> (4 * j)) & 0xF


def random_weight(n, k, group_size, symmetric, dtype=torch.float16, gen=None, zero_lo=0) -> Int4Weight:
    G = k if group_size == -1 else group_size
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // G, generator=gen) * 0.1 + 1e-3).to(dtype)
    zeros = None if symmetric else torch.randint(zero_lo, 16, (n, k // G), dtype=torch.uint8, generator=gen)
    return Int4Weight(q, scales, zeros, group_size)


def gptq_dequant_direct(qweight, qzeros, scales, g_idx, zero_convention):
    """Independent, slow GPTQ semantics: W[c, i] = (q(i, c) - z(g_idx[i], c)) * s[g_idx[i], c]."""
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    W = torch.empty(n, k, dtype=torch.float64)
    qw = qweight.tolist()
    qz = qzeros.tolist()
    s = scales.double()
    for i in range(k):
        g = int(g_idx[i])
        for c in range(n):
            q = nib(qw[i // 8][c] & 0xFFFFFFFF, i % 8)
            z = nib(qz[g][c // 8] & 0xFFFFFFFF, c % 8) + (1 if zero_convention == "v1" else 0)
            W[c, i] = (q - z) * s[g, c]
    return W


# ------------------------------------------------------------------------------------------------------------
# hand-built checkpoints


def test_gptq_hand_built_unpacks_to_known_values():
    # k = 32 (4 qweight rows), n = 8, one group (group_size -1); scales all 1/2.
    # qweight[r, c] packs input rows 8r..8r+7 of output column c, row 8r + j in bits 4j..4j+3.
    qweight = torch.zeros(4, 8, dtype=torch.int32)
    qweight[0, 0] = i32(0x76543210)      # rows 0..7 of col 0 = 0,1,...,7
    qweight[1, 0] = i32(0xFEDCBA98)      # rows 8..15 of col 0 = 8..15
    qweight[0, 1] = i32(0x0000000F)      # row 0 of col 1 = 15, rows 1..7 = 0
    qweight[3, 7] = i32(0xA0000001)      # row 24 of col 7 = 1, row 31 = 10
    # qzeros[0, 0] packs the zeros of output columns 0..7, column j in bits 4j..4j+3: v2 zeros 8,1,2,3,4,5,6,7
    qzeros = torch.tensor([[i32(0x76543218)]], dtype=torch.int32)
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)

    w, perm = from_gptq(qweight, qzeros, scales, zero_convention="v2")
    assert perm is None and w.group_size == -1 and (w.n, w.k, w.groups) == (8, 32, 1)
    assert w.q.dtype == torch.uint8 and w.zeros is not None
    assert w.q[0, :16].tolist() == list(range(16)) and w.q[0, 16:].tolist() == [0] * 16
    assert w.q[1, 0] == 15 and w.q[1, 1:].sum() == 0
    assert w.q[7, 24] == 1 and w.q[7, 31] == 10 and int(w.q[7].sum()) == 11
    assert w.zeros[:, 0].tolist() == [8, 1, 2, 3, 4, 5, 6, 7]
    W = w.dequantize()
    assert W[0, 3] == (3 - 8) * 0.5 and W[1, 0] == (15 - 1) * 0.5 and W[7, 31] == (10 - 7) * 0.5

    # the same stored words read as v1: true zero = stored + 1
    w1, _ = from_gptq(qweight, qzeros, scales, zero_convention="v1")
    assert w1.zeros[:, 0].tolist() == [9, 2, 3, 4, 5, 6, 7, 8]
    assert torch.equal(w1.q, w.q)

    # and exporting gives back the exact words
    for conv, ww in (("v2", w), ("v1", w1)):
        out = to_gptq(ww, zero_convention=conv)
        assert torch.equal(out["qweight"], qweight) and torch.equal(out["qzeros"], qzeros)
        assert torch.equal(out["scales"], scales)
        assert out["g_idx"].tolist() == [0] * 32 and out["g_idx"].dtype == torch.int32


def test_gptq_symmetric_checkpoint_detected():
    k, n, G = 64, 16, 32
    qweight = torch.full((k // 8, n), i32(0x89ABCDEF), dtype=torch.int32)
    scales = torch.ones(k // G, n, dtype=torch.bfloat16)
    for conv, word in (("v1", 0x77777777), ("v2", 0x88888888)):
        qzeros = torch.full((k // G, n // 8), i32(word), dtype=torch.int32)
        w, perm = from_gptq(qweight, qzeros, scales, zero_convention=conv)
        assert w.symmetric and w.zeros is None and perm is None and w.group_size == 32
        assert w.q[0, :8].tolist() == [15, 14, 13, 12, 11, 10, 9, 8]
        assert w.scales.dtype == torch.bfloat16
        out = to_gptq(w, zero_convention=conv)
        assert torch.equal(out["qzeros"], qzeros) and torch.equal(out["qweight"], qweight)
    w, _ = from_gptq(qweight, None, scales)
    assert w.symmetric


def test_awq_hand_built_unpacks_to_known_values():
    # AWQ qweight [k, n/8]: nibble j of a word holds column AWQ_ORDER[j] = 0,2,4,6,1,3,5,7 of its 8-block.
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7) and AWQ_REVERSE_ORDER == (0, 4, 1, 5, 2, 6, 3, 7)
    k, n = 32, 16
    qweight = torch.zeros(k, n // 8, dtype=torch.int32)
    qweight[0, 0] = i32(0x75316420)      # row 0, columns 0..7 = 0,1,2,...,7
    qweight[1, 1] = i32(0x0000F000)      # nibble 3 -> column 8 + 6 of row 1 = 15
    qweight[2, 0] = i32(0x000A0000)      # nibble 4 -> column 1 of row 2 = 10
    qzeros = torch.tensor([[i32(0x75316420), i32(0x88888888)]], dtype=torch.int32)
    scales = torch.full((1, n), 0.25, dtype=torch.float16)

    w = from_awq(qweight, qzeros, scales, group_size=-1)
    assert (w.n, w.k, w.groups) == (16, 32, 1)
    assert w.q[:8, 0].tolist() == list(range(8)) and int(w.q[:, 0].sum()) == 28
    assert w.q[14, 1] == 15 and int(w.q[:, 1].sum()) == 15
    assert w.q[1, 2] == 10 and int(w.q[:, 2].sum()) == 10
    assert w.zeros[:, 0].tolist() == list(range(8)) + [8] * 8
    assert w.dequantize()[14, 1] == (15 - 8) * 0.25

    out = to_awq(w)
    assert torch.equal(out["qweight"], qweight) and torch.equal(out["qzeros"], qzeros)
    assert torch.equal(out["scales"], scales)

    # all-8 zeros -> symmetric; export writes the 8s back
    qz8 = torch.full_like(qzeros, i32(0x88888888))
    ws = from_awq(qweight, qz8, scales, group_size=-1)
    assert ws.symmetric and torch.equal(to_awq(ws)["qzeros"], qz8)


def test_awq_matches_autoawq_reference_packer():
    """A loop transcription of AutoAWQ's packing rule (qweight[:, col] |= col_vals[ORDER[i]] << 4i)."""
    gen = torch.Generator().manual_seed(1)
    w = random_weight(24, 64, 32, symmetric=False, gen=gen)
    intweight = w.q.t().to(torch.int64)   # [k, n]
    ref = torch.zeros(64, 3, dtype=torch.int64)
    for col in range(3):
        for i in range(8):
            ref[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
    ref = torch.where(ref >= 2**31, ref - 2**32, ref).to(torch.int32)
    assert torch.equal(to_awq(w)["qweight"], ref)


# ------------------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("zero_convention", ["v1", "v2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gptq_round_trip(group_size, symmetric, zero_convention, dtype):
    seed = GROUP_SIZES.index(group_size) * 8 + symmetric * 4 + (zero_convention == "v1") * 2 + (dtype == torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    # v1 cannot store a zero point of 0
    w = random_weight(32, 256, group_size, symmetric, dtype, gen, zero_lo=1 if zero_convention == "v1" else 0)
    ck = to_gptq(w, zero_convention=zero_convention)
    G = 256 if group_size == -1 else group_size
    assert ck["qweight"].shape == (32, 32) and ck["qzeros"].shape == (256 // G, 4)
    assert all(t.dtype == torch.int32 for t in (ck["qweight"], ck["qzeros"], ck["g_idx"]))
    w2, perm = from_gptq(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], zero_convention=zero_convention)
    assert perm is None and w2.group_size == group_size and w2.symmetric == symmetric
    assert torch.equal(w2.q, w.q) and torch.equal(w2.scales, w.scales)
    assert (w2.zeros is None) if symmetric else torch.equal(w2.zeros, w.zeros)
    assert torch.equal(w2.dequantize(), w.dequantize())
    ref = gptq_dequant_direct(ck["qweight"][:, :2], ck["qzeros"][:, :1], ck["scales"][:, :2], ck["g_idx"],
                              zero_convention)
    assert torch.equal(ref.float(), w.dequantize()[:2])


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_round_trip(group_size, symmetric):
    gen = torch.Generator().manual_seed(7 + group_size)
    w = random_weight(48, 256, group_size, symmetric, torch.float16, gen)
    ck = to_awq(w)
    G = 256 if group_size == -1 else group_size
    assert ck["qweight"].shape == (256, 6) and ck["qzeros"].shape == (256 // G, 6)
    assert ck["scales"].shape == (256 // G, 48)
    w2 = from_awq(ck["qweight"], ck["qzeros"], ck["scales"], group_size=group_size)
    assert torch.equal(w2.q, w.q) and torch.equal(w2.scales, w.scales) and w2.symmetric == symmetric
    assert torch.equal(w2.dequantize(), w.dequantize())
    again = to_awq(w2)
    assert all(torch.equal(again[key], ck[key]) for key in ck)


def test_gptq_awq_cross_conversion():
    gen = torch.Generator().manual_seed(3)
    w = random_weight(16, 128, 64, symmetric=False, gen=gen, zero_lo=1)
    awq = to_awq(w)
    w_a = from_awq(awq["qweight"], awq["qzeros"], awq["scales"], group_size=64)
    g = to_gptq(w_a, "v1")
    w_g, _ = from_gptq(g["qweight"], g["qzeros"], g["scales"], g["g_idx"], zero_convention="v1")
    assert torch.equal(w_g.dequantize(), w.dequantize())


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("zero_convention", ["v1", "v2"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_act_order(group_size, zero_convention, symmetric):
    gen = torch.Generator().manual_seed(group_size * 3 + len(zero_convention) + symmetric)
    n, k = 16, 256
    groups = k // group_size
    # an act-order checkpoint: a random permutation of the trivial g_idx
    g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)
    q = torch.randint(0, 16, (k // 8, n, 8), generator=gen, dtype=torch.int64)
    qweight = (q << (4 * torch.arange(8))).sum(-1)
    qweight = torch.where(qweight >= 2**31, qweight - 2**32, qweight).to(torch.int32)
    lo = 1 if zero_convention == "v1" else 0
    z = torch.full((groups, n // 8, 8), 8, dtype=torch.int64) if symmetric else \
        torch.randint(lo, 16, (groups, n // 8, 8), generator=gen, dtype=torch.int64)
    z = z - (1 if zero_convention == "v1" else 0)
    qzeros = (z << (4 * torch.arange(8))).sum(-1)
    qzeros = torch.where(qzeros >= 2**31, qzeros - 2**32, qzeros).to(torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 0.05 + 0.01).half()

    w, perm = from_gptq(qweight, qzeros, scales, g_idx, zero_convention=zero_convention)
    assert perm is not None and perm.shape == (k,) and w.symmetric == symmetric
    assert torch.equal(torch.sort(perm).values, torch.arange(k))
    # groups are contiguous in the permuted order
    assert torch.equal(g_idx.long()[perm], torch.arange(k) // group_size)
    W_direct = gptq_dequant_direct(qweight, qzeros, scales, g_idx, zero_convention)
    assert torch.equal(w.dequantize(torch.float64), W_direct[:, perm])
    # the op applies x[..., perm]: same product as the checkpoint's own semantics
    x = torch.randn(3, k, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(x[..., perm] @ w.dequantize(torch.float64).T, x @ W_direct.T)
    # export with the permutation gives back the same checkpoint, bit for bit
    ck = to_gptq(w, zero_convention=zero_convention, perm=perm)
    assert torch.equal(ck["qweight"], qweight) and torch.equal(ck["qzeros"], qzeros)
    assert torch.equal(ck["scales"], scales) and torch.equal(ck["g_idx"], g_idx)


def test_gptq_trivial_g_idx_with_explicit_group_size():
    gen = torch.Generator().manual_seed(11)
    w = random_weight(8, 128, 128, symmetric=False, gen=gen)
    ck = to_gptq(w, "v2")
    w2, perm = from_gptq(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], zero_convention="v2", group_size=128)
    assert perm is None and w2.group_size == 128 and torch.equal(w2.q, w.q)
    w3, _ = from_gptq(ck["qweight"], ck["qzeros"], ck["scales"], zero_convention="v2")
    assert w3.group_size == -1 and torch.equal(w3.dequantize(), w.dequantize())


# ------------------------------------------------------------------------------------------------------------
# quantization


def _group_sq_err(w: torch.Tensor, qw: Int4Weight) -> torch.Tensor:
    d = (qw.dequantize(torch.float64) - w.double()).square()
    return d.view(qw.n, qw.groups, qw.group_len).sum(-1)


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_quantize_rtn_error(group_size, symmetric, dtype):
    w = (torch.randn(96, 512) * 0.02).to(dtype)    # fresh random weights every run
    qw = quantize_rtn(w, group_size=group_size, symmetric=symmetric)
    qw.validate()
    assert qw.group_size == group_size and qw.symmetric == symmetric
    assert qw.scales.dtype == (torch.float16 if dtype == torch.float32 else dtype)
    rel = (qw.dequantize(torch.float64) - w.double()).norm() / w.double().norm()
    assert rel < 0.12, f"relative error {rel:.4f}"

    plain = quantize_rtn(w, group_size=group_size, symmetric=symmetric, clip_search=False)
    e_search, e_plain = _group_sq_err(w, qw), _group_sq_err(w, plain)
    assert bool((e_search <= e_plain * (1 + 1e-5) + 1e-12).all()), "clip search worse than no search"
    assert e_search.sum() <= e_plain.sum()


def test_quantize_rtn_extremes_and_scale_dtype():
    w = torch.randn(16, 128)
    w[0] = 0.0                      # an all-zero row
    w[1, :64] = 0.3                 # a constant group
    for sym in (True, False):
        qw = quantize_rtn(w, group_size=64, symmetric=sym, scale_dtype=torch.bfloat16)
        assert qw.scales.dtype == torch.bfloat16
        W = qw.dequantize()
        assert torch.equal(W[0], torch.zeros(128))
        assert torch.isfinite(W).all()
    qa = quantize_rtn(w, group_size=64, symmetric=False, scale_dtype=torch.float16)
    torch.testing.assert_close(qa.dequantize()[1, :64], torch.full((64,), 0.3), atol=1e-3, rtol=0)
    # a symmetric quantization's q uses the full range -8..7
    qs = quantize_rtn(torch.randn(64, 256), group_size=32, symmetric=True, clip_search=False)
    assert int(qs.q.min()) == 0 and int(qs.q.max()) >= 14


def test_int4weight_to_and_repr():
    qw = quantize_rtn(torch.randn(8, 64), group_size=32, symmetric=False)
    q2 = qw.to("cpu", scale_dtype=torch.bfloat16)
    assert q2.scales.dtype == torch.bfloat16 and torch.equal(q2.q, qw.q)
    assert "Int4Weight(n=8, k=64, group_size=32, asymmetric" in repr(qw)


# ------------------------------------------------------------------------------------------------------------
# validation


def test_int4weight_validation_errors():
    q = torch.zeros(8, 64, dtype=torch.uint8)
    s = torch.ones(8, 2, dtype=torch.float16)
    with pytest.raises(TypeError, match="q must have dtype"):
        Int4Weight(q.to(torch.int32), s, None, 32)
    with pytest.raises(TypeError, match="scales must have dtype"):
        Int4Weight(q, s.float(), None, 32)
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4Weight(q, s, None, 16)
    with pytest.raises(ValueError, match="multiple of group_size"):
        Int4Weight(torch.zeros(8, 48, dtype=torch.uint8), s, None, 32)
    with pytest.raises(ValueError, match="scales must have shape"):
        Int4Weight(q, torch.ones(8, 4, dtype=torch.float16), None, 32)
    with pytest.raises(ValueError, match="zeros must have shape"):
        Int4Weight(q, s, torch.zeros(8, 1, dtype=torch.uint8), 32)
    with pytest.raises(TypeError, match="zeros must have dtype"):
        Int4Weight(q, s, torch.zeros(8, 2, dtype=torch.int8), 32)
    with pytest.raises(ValueError, match="2-D"):
        Int4Weight(q.view(-1), s, None, 32)
    bad = Int4Weight(q.clone().fill_(16), s, None, 32)
    with pytest.raises(ValueError, match=r"q values must be in 0\.\.15"):
        bad.validate()
    badz = Int4Weight(q, s, torch.full((8, 2), 20, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match=r"zeros values must be in 0\.\.15"):
        badz.validate()
    with pytest.raises(ValueError, match="finite"):
        Int4Weight(q, s.clone().fill_(float("inf")), None, 32).validate()


def test_quantize_rtn_validation_errors():
    with pytest.raises(TypeError, match="w must have dtype"):
        quantize_rtn(torch.zeros(8, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        quantize_rtn(torch.zeros(64))
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_rtn(torch.zeros(8, 96), group_size=64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_rtn(torch.zeros(8, 96), group_size=48)
    with pytest.raises(TypeError, match="scale_dtype"):
        quantize_rtn(torch.zeros(8, 64), group_size=32, scale_dtype=torch.float32)
    with pytest.raises(ValueError, match="finite"):
        quantize_rtn(torch.full((8, 64), float("nan")), group_size=32)
    with pytest.raises(ValueError, match="shrink_factors"):
        quantize_rtn(torch.zeros(8, 64), group_size=32, shrink_factors=(1.2,))


def test_gptq_validation_errors():
    gen = torch.Generator().manual_seed(5)
    w = random_weight(16, 128, 32, symmetric=False, gen=gen, zero_lo=1)
    ck = to_gptq(w, "v1")
    qw, qz, sc, gi = ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"]
    with pytest.raises(TypeError, match="qweight must have dtype"):
        from_gptq(qw.to(torch.int64), qz, sc)
    with pytest.raises(TypeError, match="qzeros must have dtype"):
        from_gptq(qw, qz.to(torch.int16), sc)
    with pytest.raises(TypeError, match="scales must have dtype"):
        from_gptq(qw, qz, sc.float())
    with pytest.raises(TypeError, match="g_idx must have dtype"):
        from_gptq(qw, qz, sc, gi.float())
    with pytest.raises(ValueError, match="bits=4"):
        from_gptq(qw, qz, sc, bits=8)
    with pytest.raises(ValueError, match="zero_convention"):
        from_gptq(qw, qz, sc, zero_convention="v3")
    with pytest.raises(ValueError, match="scales must have shape"):
        from_gptq(qw, qz, sc[:, :8])
    with pytest.raises(ValueError, match="qzeros must have shape"):
        from_gptq(qw, qz[:2], sc)
    with pytest.raises(ValueError, match="group_size"):
        from_gptq(qw, qz, sc, group_size=64)          # 4 scale rows do not fit k=128 with G=64
    with pytest.raises(ValueError, match="not supported"):
        from_gptq(qw, qz[:, :], torch.ones(8, 16, dtype=torch.float16))  # inferred G = 16
    with pytest.raises(ValueError, match="g_idx must have shape"):
        from_gptq(qw, qz, sc, gi[:64])
    uneven = gi.clone()
    uneven[0] = 1                                     # group 0 has 31 rows, group 1 has 33
    with pytest.raises(ValueError, match="exactly G = 32"):
        from_gptq(qw, qz, sc, uneven)
    out_of_range = gi.clone()
    out_of_range[5] = 4
    with pytest.raises(ValueError, match=r"g_idx values must be in 0\.\.3"):
        from_gptq(qw, qz, sc, out_of_range)
    # a stored nibble 15 means zero point 16 under v1
    with pytest.raises(ValueError, match="zero point of 16"):
        from_gptq(qw, torch.full_like(qz, i32(0xFFFFFFFF)), sc, zero_convention="v1")
    # v1 cannot store zero 0
    w0 = random_weight(16, 128, 32, symmetric=False, gen=gen)
    w0.zeros[0, 0] = 0
    with pytest.raises(ValueError, match="cannot store a zero point of 0"):
        to_gptq(w0, "v1")
    to_gptq(w0, "v2")
    with pytest.raises(TypeError, match="Int4Weight"):
        to_gptq(ck)
    with pytest.raises(ValueError, match="permutation"):
        to_gptq(w, perm=torch.zeros(128, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of 8"):
        to_gptq(random_weight(12, 64, 32, symmetric=True, gen=gen))


def test_awq_validation_errors():
    gen = torch.Generator().manual_seed(6)
    w = random_weight(16, 128, 64, symmetric=False, gen=gen)
    ck = to_awq(w)
    qw, qz, sc = ck["qweight"], ck["qzeros"], ck["scales"]
    with pytest.raises(TypeError, match="qweight must have dtype"):
        from_awq(qw.to(torch.uint8), qz, sc, group_size=64)
    with pytest.raises(TypeError, match="qzeros must have dtype"):
        from_awq(qw, qz.to(torch.int64), sc, group_size=64)
    with pytest.raises(TypeError, match="scales must have dtype"):
        from_awq(qw, qz, sc.double(), group_size=64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        from_awq(qw, qz, sc, group_size=256)
    with pytest.raises(ValueError, match="scales must have shape"):
        from_awq(qw, qz, sc, group_size=32)
    with pytest.raises(ValueError, match="qzeros must have shape"):
        from_awq(qw, qz[:, :1], sc, group_size=64)
    with pytest.raises(ValueError, match="multiple of group_size"):
        from_awq(qw[:96], qz, sc, group_size=64)
    with pytest.raises(TypeError, match="Int4Weight"):
        to_awq(ck)
    with pytest.raises(ValueError, match="multiple of 8"):
        to_awq(random_weight(12, 64, 32, symmetric=True, gen=gen))
