"""The grouped expert GEMMs' pure-Python side (tilefish.ops.moe_kernels) on the CPU: the block table bound, the
configuration and k split of each GEMM, the specs `tilefish compile` builds, the argument checks (before any
launch), and a compile of the new kernels for sm_80 and sm_90 with no spills. The GPU side is
tests/test_moe_kernels_gpu.py."""
from __future__ import annotations

import math
import random

import pytest
import torch

from tilefish.ops import moe_decode as md
from tilefish.ops import moe_kernels as mk
from tilefish.ops.w4a16 import GemmConfig
from tilefish.ops.w4a16.dispatch import KERNEL_STATIC_SMEM
from tilefish.runtime.device import SMEM_PER_BLOCK_BY_CC

H100 = dict(sm_count=132, smem_limit=SMEM_PER_BLOCK_BY_CC[90])
RTX4090 = dict(sm_count=128, smem_limit=SMEM_PER_BLOCK_BY_CC[89])
INT4_G128 = (128, False)


def test_max_blocks_holds_every_routing():
    """The sum over experts of ceil(rows / BM) never passes max_blocks(S, E, BM), whatever the routing."""
    for _ in range(2000):
        experts, block_m = random.choice([1, 2, 8, 32, 128]), random.choice([8, 16, 32])
        slots = random.randint(1, 600)
        ids = [random.randrange(experts) for _ in range(slots)] if random.random() < 0.7 else \
            [random.randrange(min(experts, 3)) for _ in range(slots)]
        counts = [ids.count(e) for e in range(experts)]
        assert sum(-(-c // block_m) for c in counts) <= mk.max_blocks(slots, experts, block_m)
    # the worst case is reached: every expert one row past a whole block
    assert sum(-(-c // 8) for c in [9] * 4) == 8 <= mk.max_blocks(36, 4, 8) == 9


def test_expected_active_experts():
    assert mk.expected_active_experts(1, 4, 32) == pytest.approx(4)
    assert mk.expected_active_experts(1000, 2, 8) == pytest.approx(8)
    assert mk.expected_active_experts(3, 8, 8) == 8
    values = [mk.expected_active_experts(t, 4, 128) for t in range(1, 300)]
    assert all(a < b for a, b in zip(values, values[1:]))
    assert all(v <= min(4 * t, 128) + 1e-9 for t, v in enumerate(values, 1))


@pytest.mark.parametrize("rows, n, want", [
    (1, 2880, GemmConfig(1, 1, 8, 4, swap=True, breg=True)),    # gpt-oss down: 45 x 64 columns
    (1, 5760, GemmConfig(1, 2, 4, 6, swap=True, breg=True)),    # gpt-oss gate_up: 45 x 128
    (8, 4096, GemmConfig(1, 4, 2, 3, swap=True, breg=True)),
    (8.5, 4096, GemmConfig(1, 4, 2, 4)),
    (16, 2880, GemmConfig(1, 1, 8, 4)),
    (12, 5760, GemmConfig(1, 2, 4, 4, breg=True)),
    (17, 28672, GemmConfig(2, 4, 2, 4)),
    (500, 2880, GemmConfig(2, 1, 8, 4)),
])
def test_grouped_config(rows, n, want):
    assert mk.grouped_config(rows, n) == want
    assert n % want.bn == 0


def test_plan_decode_and_prefill():
    # gpt-oss-20b decode (E 32, K 4, H = I = 2880): swap blocks of 8 rows, 4 active experts
    p = mk.plan_grouped(1, 4, 32, 2880, 2880, (32, False), (32, False), **H100)
    assert p.block_m == 8 and p.max_blocks == 1 + 4
    assert p.gate_up.config.swap and p.gate_up.config.bn == 128 and p.gate_up.n_tiles == 45
    assert p.down.config.swap and p.down.config.bn == 64 and p.down.n_tiles == 45
    # Mixtral decode (E 8, K 2, H 4096, I 14336): the down projection's 32 tiles split k 8 ways
    p = mk.plan_grouped(1, 2, 8, 4096, 14336, INT4_G128, INT4_G128, **H100)
    assert p.down.config.bn == 256 and p.down.slices == 8
    assert p.down.tile_counters == p.max_blocks * p.down.n_tiles
    assert p.down.partial_floats == p.down.tile_counters * 8 * p.down.config.bm * 256
    assert p.gate_up.slices == 1 and p.gate_up.partial_floats == p.gate_up.tile_counters == 0
    # a prefill: 32-row tiles, no split, the table sized from S, E and BM only
    p = mk.plan_grouped(4096, 8, 128, 2880, 2880, INT4_G128, INT4_G128, **H100)
    assert p.block_m == 32 and p.max_blocks == 4096 * 8 // 32 + 128
    assert p.gate_up.slices == p.down.slices == 1


# The decode path takes one token of every model of tilefish bench moe, and leaves the grouped path the calls
# of more than 16 slots and those whose experts are shared (Mixtral's 8 experts at 4 tokens).
@pytest.mark.parametrize("tokens, topk, experts, want", [
    (1, 2, 8, True), (2, 2, 8, True), (4, 2, 8, False), (1, 8, 128, True), (2, 8, 128, True), (4, 8, 128, False),
    (1, 4, 32, True), (4, 4, 32, True), (8, 4, 32, False), (1, 4, 128, True), (4, 4, 128, True),
    (8, 4, 128, False), (1, 8, 8, True), (2, 8, 8, False)])
def test_takes_decode_path(tokens, topk, experts, want):
    assert md.takes_decode_path(tokens, topk, experts) is want


@pytest.mark.parametrize("sm_count", [132, 170, 28])
def test_decode_plans_cover_k_and_size_their_scratch(sm_count):
    """Every decode plan's slices cover each k exactly once in whole batches of rows (aligned to the scale
    groups), the workspace holds one fp32 slot per part of every strip, and the counters one per strip."""
    for tokens in (1, 2, 3, 8, 16):
        for topk in (1, 2, 4, 8):
            for hidden, inter in ((2880, 2880), (4096, 14336), (2048, 768), (256, 128), (64, 64), (1024, 4096)):
                p = md.plan_decode(tokens, topk, hidden, inter, sm_count)
                for rows, slices, k, batch in ((p.gate_up_rows, p.gate_up_slices, hidden, md.GATE_UP_ROWS_PER_BATCH),
                                               (p.down_rows, p.down_slices, inter, md.DOWN_ROWS_PER_BATCH)):
                    assert rows % batch == 0 and rows > 0
                    assert (slices - 1) * rows < k // 16 <= slices * rows  # no empty slice, none missing
                slots = tokens * topk
                need_ws = max(slots * inter // 64 * 128 * p.gate_up_slices if p.gate_up_slices > 1 else 0,
                              tokens * hidden // 64 * 64 * topk * p.down_slices if topk * p.down_slices > 1 else 0)
                assert p.workspace_floats == need_ws
                need_counters = max(slots * inter // 64 if p.gate_up_slices > 1 else 0,
                                    tokens * hidden // 64 if topk * p.down_slices > 1 else 0)
                assert p.counters == need_counters
    # one token of Qwen3-30B-A3B on an H100: k split so about 4 CTAs an SM run (8 slots x 12 strip pairs)
    p = md.plan_decode(1, 8, 2048, 768, 132)
    assert p.gate_up_slices * 8 * 12 >= 2 * 132


@pytest.mark.parametrize("gpu", [H100, RTX4090, dict(sm_count=108, smem_limit=SMEM_PER_BLOCK_BY_CC[80])])
def test_plans_fit_and_are_compiled(gpu):
    """Over a sweep of shapes and formats every plan fits the GPU's shared memory, splits k at most once per 4 k
    tiles, and launches only specs kernel_specs(arch) lists (what `tilefish compile` builds)."""
    arch = {SMEM_PER_BLOCK_BY_CC[90]: "sm_90", SMEM_PER_BLOCK_BY_CC[89]: "sm_89", SMEM_PER_BLOCK_BY_CC[80]: "sm_80"}[
        gpu["smem_limit"]]
    specs = set(mk.kernel_specs(arch))
    for tokens in (1, 3, 17, 64, 256, 4096):
        for topk, experts in ((2, 8), (4, 32), (8, 128)):
            for hidden, inter in ((2880, 2880), (4096, 14336), (2048, 768), (256, 128)):
                for (g, zp, book) in mk.FORMATS:
                    p = mk.plan_grouped(tokens, topk, experts, hidden, inter, (g, zp), (g, zp), **gpu)
                    for gemm, n, k in ((p.gate_up, 2 * inter, hidden), (p.down, hidden, inter)):
                        cfg = gemm.config
                        assert n % cfg.bn == 0 and gemm.n_tiles == n // cfg.bn
                        assert gemm.smem + KERNEL_STATIC_SMEM <= gpu["smem_limit"]
                        assert gemm.slices == 1 or math.ceil(k / 128) // gemm.slices >= 4
                        assert mk.block_rows_of(cfg) == p.block_m
                        for dt in (torch.float16, torch.bfloat16):
                            assert mk.grouped_gemm_spec(dt, cfg, g, zp, book) in specs, (cfg, g, zp, book)


def test_kernel_specs():
    for arch in ("sm_80", "sm_86", "sm_90", None):
        specs = mk.kernel_specs(arch)
        assert len(specs) == len(set(specs))
        gemms = [s for s in specs if s.source == "w4a16/gemm.cu"]
        assert gemms and all(("TF_W4A16_GROUPED", "1") in s.defines for s in gemms)
        assert {s.source for s in specs} == {"w4a16/gemm.cu", "moe/align.cu", "moe/act.cu", "moe/combine.cu",
                                             "moe/decode.cu"}
        assert all(s.hot and not s.arch_specific for s in specs)
    assert mk.act_spec(torch.bfloat16, "swiglu_oai").name == "moe_act<__nv_bfloat16, 1>"
    assert mk.align_spec(torch.int64).name == "moe_align<long long>"


# ---- bad inputs: a clear exception before any launch (CPU tensors reach every check but the device's) ----------

def _weights(e=4, hidden=128, inter=64, dtype=torch.float16, group=64, zeros=False, codebook="int4"):
    def one(n, k):
        groups = k // group if group != -1 else 1
        return dict(packed=torch.zeros(e, n // 64, 8 * k, dtype=torch.int32),
                    scales=torch.ones(e, groups, n, dtype=dtype),
                    zeros=torch.full((e, groups, n), 8, dtype=dtype) if zeros else None, n=n, k=k, group_size=group,
                    codebook=codebook)
    return one(2 * inter, hidden), one(hidden, inter)


def _call(**over):
    gate_up, down = _weights()
    args = dict(x=torch.zeros(3, 128, dtype=torch.float16), topk_ids=torch.zeros(3, 2, dtype=torch.int64),
                topk_weights=torch.ones(3, 2), gate_up=gate_up, down=down)
    args.update(over)
    return mk.grouped_experts_cuda(**args)


@pytest.mark.parametrize("over, error, match", [
    (dict(x=torch.zeros(3, 128)), TypeError, "float16 / bfloat16"),
    (dict(x=torch.zeros(3, 2, 128, dtype=torch.float16)), TypeError, r"\[T, H\]"),
    (dict(topk_ids=torch.zeros(3, 2)), ValueError, "topk_ids must be int32 / int64"),
    (dict(topk_ids=torch.zeros(4, 2, dtype=torch.int32)), ValueError, "T = 3"),
    (dict(topk_weights=torch.ones(3, 3)), ValueError, "topk_weights"),
    (dict(activation="gelu"), ValueError, "activation"),
    (dict(gate_up=_weights(hidden=192)[0]), ValueError, "shapes"),
    (dict(down=_weights(e=5)[1]), ValueError, "4 experts, down 5"),
    (dict(gate_up=_weights(dtype=torch.bfloat16)[0]), ValueError, "gate_up.scales must be torch.float16"),
    (dict(gate_up=_weights(codebook="nf4", zeros=True)[0]), ValueError, "codebook 'nf4'"),
    (dict(down=_weights(codebook="mxfp4", group=64)[1]), ValueError, "codebook 'mxfp4'"),
    (dict(down=_weights(codebook="fp8")[1]), ValueError, "codebook 'fp8'"),
    (dict(down={"packed": torch.zeros(1)}), TypeError, "no scales, n, k, group_size"),
    (dict(gate_up_bias=torch.zeros(4, 64, dtype=torch.float16)), ValueError, r"gate_up_bias must be .* \[E, 128\]"),
    (dict(down_bias=torch.zeros(4, 128)), ValueError, "down_bias"),
    (dict(counters=torch.zeros(16)), TypeError, "int32"),
    ({}, ValueError, "runs on CUDA tensors"),
])
def test_bad_inputs_raise_before_any_launch(over, error, match):
    with pytest.raises(error, match=match):
        _call(**over)


def test_bad_weight_layouts():
    gate_up, down = _weights()
    with pytest.raises(ValueError, match="down.packed must be int32"):
        _call(down={**down, "packed": down["packed"][:, :, :-8]})
    with pytest.raises(ValueError, match="contiguous"):
        _call(down={**down, "scales": torch.ones(4, 1, 2 * down["n"], dtype=torch.float16)[:, :, ::2]})
    with pytest.raises(ValueError, match="1 to 2048"):
        g, d = _weights(e=mk.MAX_EXPERTS + 1, hidden=64, inter=64)
        _call(x=torch.zeros(1, 64, dtype=torch.float16), topk_ids=torch.zeros(1, 1, dtype=torch.int32),
              topk_weights=torch.ones(1, 1), gate_up=g, down=d)


def test_a_kept_decode_launch_rejects_other_signatures_before_any_launch(monkeypatch):
    """DecodeLaunch (what QuantizedExperts keeps per call signature) checks each call's shapes, dtypes and
    devices against the signature it was built for: a ValueError, no launch."""
    launched = []
    monkeypatch.setattr(md, "get_kernel", lambda spec, index: spec)
    monkeypatch.setattr(md, "prepare_launch", lambda kernel, grid, block, pdl=False: grid)
    monkeypatch.setattr(md, "launch_prepared", lambda *a: launched.append(a))
    gate_up, down = (mk.stacked_format(w) for w in _weights())
    launch = md.DecodeLaunch(3, 2, torch.float16, torch.int64, torch.float32, gate_up, down, "silu", None, None, 0,
                             132, None)
    x, ids, w = torch.zeros(3, 128, dtype=torch.float16), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    for bad in ((x[:2], ids, w), (x.float(), ids, w), (x, ids[:, :1], w), (x, ids.int(), w), (x, ids, w[:, :1]),
                (x, ids, w.long()), (x, ids, w)):  # the last: right signature, but on the CPU
        with pytest.raises(ValueError, match="this decode launch takes x torch.float16 \\(3, 128\\)"):
            launch(*bad)
    assert not launched


# ---- compile: the new kernels build for sm_80 and sm_90 without spills ----------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_new_kernels_compile_without_spills(arch, tmp_path, monkeypatch):
    from tilefish.runtime import compile_kernel

    monkeypatch.setenv("TILEFISH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "1")
    specs = [mk.align_spec(torch.int32), mk.act_spec(torch.float16, "silu"), mk.combine_spec(torch.bfloat16,
                                                                                            torch.int64),
             mk.grouped_gemm_spec(torch.bfloat16, GemmConfig(1, 2, 4, 6, swap=True, breg=True), 32, False, "mxfp4"),
             mk.grouped_gemm_spec(torch.float16, GemmConfig(2, 1, 8, 4), 128, True),
             md.gate_up_spec(torch.bfloat16, 32, False, "mxfp4", "swiglu_oai", torch.int64),
             md.gate_up_spec(torch.float16, -1, True, "int4", "silu", torch.int32),
             md.down_spec(torch.bfloat16, 64, False, "nf4", torch.int64),
             md.down_spec(torch.float16, 128, True, "int4", torch.int32)]
    for spec in specs:
        r = compile_kernel(spec, arch).resources
        assert r.registers > 0 and not r.spills, (spec.name, r)
