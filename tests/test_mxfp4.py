"""MXFP4 (tilefish.quant.mxfp4) on the CPU: the OCP format bit for bit (scale choice, rounding, the gpt-oss
byte order against transformers' own dequantization), the W4A16 layout with codebook "mxfp4" (pack / unpack,
the kernel scales' exactness rule, a CPU W4A16Linear), the E2M1 byte tables of kernels/w4a16/dequant.cuh, and
one kernel of the codebook compiled for sm_80 and sm_90a."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from tilefish.nn import W4A16Linear
from tilefish.ops.w4a16 import pack, unpack
from tilefish.quant import mxfp4
from tilefish.quant.mxfp4 import E2M1_VALUES, MXFP4Weight

DEQUANT_CUH = Path(__file__).resolve().parents[1] / "src" / "tilefish" / "kernels" / "w4a16" / "dequant.cuh"
GRID = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64)


def test_e2m1_values_and_scale_bytes():
    q = MXFP4Weight(torch.arange(16, dtype=torch.uint8).repeat(2).unsqueeze(0), torch.tensor([[127]], dtype=torch.uint8))
    assert q.dequantize().tolist()[0][:16] == list(E2M1_VALUES)
    for s, value in ((127, 1.0), (128, 2.0), (0, 2.0**-127), (254, 2.0**127), (120, 2.0**-7)):
        assert q.__class__(q.codes, torch.tensor([[s]], dtype=torch.uint8)).scales(torch.float64).item() == value
    with pytest.raises(ValueError, match="NaN"):
        MXFP4Weight(q.codes, torch.tensor([[255]], dtype=torch.uint8)).validate()
    with pytest.raises(ValueError, match=r"\[\.\.\., k / 32\]"):
        MXFP4Weight(q.codes, torch.tensor([127, 127], dtype=torch.uint8))


def test_quantize_scale_is_the_ocp_choice_and_rounding_is_nearest_even():
    # each row one block: amax 6 -> scale 2^(2 - 2) = 1; 7 -> 1 (7 saturates to 6); 8 -> 2; 0.375 -> 2^(-2 - 2); 0 -> 1
    rows = []
    for amax in (6.0, 7.0, 8.0, 0.375, 0.0):
        row = torch.zeros(32)
        row[0] = amax
        rows.append(row)
    q = mxfp4.quantize(torch.stack(rows))
    assert [int(s) - 127 for s in q.exponents[:, 0]] == [0, 0, 1, -4, 0]
    assert q.dequantize()[:, 0].tolist() == [6.0, 6.0, 8.0, 0.375, 0.0]
    # ties go to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, -0.1] + [0.0] * 21)
    got = mxfp4.quantize(ties.unsqueeze(0)).dequantize()[0, :11].tolist()
    assert got == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0, 0.0]


def test_quantize_is_the_nearest_value_of_the_grid(seed):
    w = torch.randn(64, 256) * torch.logspace(-3, 1, 64).unsqueeze(1)
    q = mxfp4.quantize(w)
    blocks = w.double().view(64, 8, 32)
    scale = q.scales(torch.float64).unsqueeze(-1)
    candidates = torch.cat([GRID, -GRID[1:]]) * scale.unsqueeze(-1)   # every value the block's scale allows
    best = (blocks.unsqueeze(-1) - candidates).abs().amin(-1)
    err = (q.dequantize(torch.float64).view(64, 8, 32) - blocks).abs()
    assert torch.equal(err, best)                                      # nothing nearer exists
    assert rel_err(q.dequantize(), w) < 0.15


def test_blocks_round_trip_and_byte_order():
    codes = torch.randint(0, 16, (3, 64, 128), dtype=torch.uint8)
    exps = torch.randint(100, 140, (3, 64, 4), dtype=torch.uint8)
    blocks, scales = mxfp4.to_blocks(MXFP4Weight(codes, exps))
    assert blocks.shape == (3, 64, 4, 16) and torch.equal(scales, exps)
    assert torch.equal(blocks[..., 0] & 0xF, codes[..., 0:128:32]) and torch.equal(blocks[..., 0] >> 4, codes[..., 1:128:32])
    back = mxfp4.from_blocks(blocks, scales)
    assert torch.equal(back.codes, codes) and torch.equal(back.exponents, exps)


def test_from_blocks_is_bit_exact_with_transformers():
    """transformers' own gpt-oss dequantization (integrations/mxfp4.py) of the same bytes: [E, rows, cols/32, 16]
    blocks -> [E, cols, rows] bf16 (it transposes to the x @ W layout)."""
    integration = pytest.importorskip("transformers.integrations.mxfp4")
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 64, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 135, (2, 64, 4), dtype=torch.uint8, generator=gen)
    theirs = integration.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    ours = mxfp4.from_blocks(blocks, scales).dequantize(torch.bfloat16).transpose(1, 2)
    assert theirs.shape == ours.shape == (2, 128, 64)
    assert torch.equal(theirs.view(torch.int16), ours.view(torch.int16))   # -0.0 included


def test_kernel_scales_are_exact_or_refused():
    codes = torch.randint(0, 16, (64, 64), dtype=torch.uint8)
    exps = torch.full((64, 2), 127, dtype=torch.uint8)
    exps[3, 1] = 127 + 14                                              # 6 x 2^14 overflows fp16
    q = MXFP4Weight(codes, exps)
    assert torch.equal(mxfp4.kernel_scales(q, torch.bfloat16).double(), q.scales(torch.float64))
    codes[3, 32:] = torch.tensor([6] + [0] * 31, dtype=torch.uint8)    # a 4 x 2^14: no fp16 number either
    with pytest.raises(ValueError, match=r"scale 2\^14 .*float16.*2\^-23 \.\. 2\^13"):
        mxfp4.kernel_scales(MXFP4Weight(codes, exps), torch.float16)
    codes[3, 32:] = torch.tensor([3] + [0] * 31, dtype=torch.uint8)    # 1.5 x 2^14 is one
    assert mxfp4.kernel_scales(MXFP4Weight(codes, exps), torch.float16)[3, 1].item() == 2.0**14
    codes[5, :32] = 8                                                  # an all-(-0) block with an unholdable scale
    exps[5, 0] = 0
    assert mxfp4.kernel_scales(MXFP4Weight(codes, exps), torch.float16)[5, 0].item() == 1.0


def test_w4a16_layout_and_cpu_linear(seed):
    w = torch.randn(128, 256) * 0.03
    q = mxfp4.quantize(w)
    kernel = pack(mxfp4.to_int4_weight(q, torch.bfloat16), codebook="mxfp4")
    assert kernel.codebook == "mxfp4" and kernel.group_size == 32
    assert torch.equal(unpack(kernel).q, q.codes)
    assert torch.equal(kernel.dequantize(torch.float64), q.dequantize(torch.float64))
    layer = W4A16Linear.from_weight(kernel, torch.randn(128) * 0.1)
    x = torch.randn(3, 5, 256)
    want = x.double() @ q.dequantize(torch.float64).t() + layer.bias.double()
    assert rel_err(layer(x), want) < 1e-2                              # bf16 inside
    with pytest.raises(ValueError, match="codebook 'mxfp4' needs group_size 32"):
        W4A16Linear(256, 128, group_size=64, codebook="mxfp4")
    from tilefish.quant.int4 import Int4Weight

    with pytest.raises(ValueError, match="no zero points"):
        pack(Int4Weight(q.codes, torch.ones(128, 8, dtype=torch.bfloat16), torch.zeros(128, 8, dtype=torch.uint8), 32), codebook="mxfp4")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decoder_byte_tables_are_the_e2m1_values(dtype):
    """dequant.cuh's MXFP4Bytes: entries 0-7 in table A, 8-15 reversed in table B, as NF4Bytes."""
    name = "__half" if dtype == torch.float16 else "__nv_bfloat16"
    body = re.search(r"struct MXFP4Bytes<" + re.escape(name) + r"> \{(.*?)\};", DEQUANT_CUH.read_text(), re.S).group(1)
    consts = {k: int(v, 16) for k, v in re.findall(r"(k\w+) = (0x[0-9a-fA-F]+)", body)}
    bits = [int(b) & 0xFFFF for b in torch.tensor(E2M1_VALUES).to(dtype).view(torch.int16).tolist()]

    def word(entries, high):
        return sum(((bits[e] >> (8 if high else 0)) & 0xFF) << (8 * i) for i, e in enumerate(entries))

    for part, high in (("Lo", False), ("Hi", True)):
        assert consts[f"k{part}A0"] == word([0, 1, 2, 3], high)
        assert consts[f"k{part}A1"] == word([4, 5, 6, 7], high)
        assert consts[f"k{part}B0"] == word([15, 14, 13, 12], high)
        assert consts[f"k{part}B1"] == word([11, 10, 9, 8], high)


def test_one_kernel_of_the_codebook_compiles(tmp_path, monkeypatch):
    """-D TF_W4A16_MXFP4 builds the kernels with the E2M1 decoder: one mma.sync kernel for sm_80 and one skinny
    (sm_90a) kernel, no spills; both codebook defines at once are a compile error."""
    pytest.importorskip("cuda.core")
    from dataclasses import replace

    from tilefish.ops.w4a16.configs import CONFIGS, SKINNY_CONFIGS, kernel_spec
    from tilefish.runtime.compiler import CompileError, compile_kernel

    monkeypatch.setenv("TILEFISH_CACHE_DIR", str(tmp_path))
    mma = kernel_spec(torch.bfloat16, CONFIGS[0], 32, False, "mxfp4")
    skinny = kernel_spec(torch.float16, SKINNY_CONFIGS[0], 32, False, "mxfp4")
    assert ("TF_W4A16_MXFP4", "1") in mma.defines and ("TF_W4A16_MXFP4", "1") in skinny.defines
    for spec, arch in ((mma, "sm_80"), (skinny, "sm_90a")):
        res = compile_kernel(spec, arch, use_cache=False).resources
        assert res.spill_stores == 0 and res.spill_loads == 0
    with pytest.raises(CompileError, match="select one codebook"):
        compile_kernel(replace(mma, defines=mma.defines + (("TF_W4A16_NF4", "1"),)), "sm_80", use_cache=False)
