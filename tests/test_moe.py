"""The grouped expert op on the CPU (tilefish.moe: ExpertWeights, moe_experts, the reference), the
QuantizedExperts module and quantize_model / dequantize_model on tiny Mixtral, Qwen3-MoE and gpt-oss models.
The same op on the GPU kernel: test_moe_gpu.py."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tilefish.moe as moe
from conftest import TOLERANCE, rel_err
from moe_families import MOE_FAMILIES, build_moe, experts_modules
from tilefish.convert import dequantize_model, quantize_model
from tilefish.experts import QuantizedExperts, dense_layout
from tilefish.ops.expert_weights import ExpertWeights
from tilefish.ops.library import moe_experts_op
from tilefish.quant.int4 import Int4Weight
from tilefish.w4a16 import pack

transformers = pytest.importorskip("transformers")

DTYPES = (torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------------------------------------------
# weights with known values, and the op written out token by token


def int4_experts(e: int, n: int, k: int, group: int, dtype, gen, asym: bool = False):
    """ExpertWeights of random int4 codes and scales, and the dense fp64 weights [E, n, k] they stand for,
    computed here from the integers."""
    groups = k // group
    q = torch.randint(0, 16, (e, n, k), generator=gen, dtype=torch.uint8)
    scales = ((torch.rand(e, n, groups, generator=gen) + 0.5) * 0.02).to(dtype)
    zeros = torch.randint(0, 16, (e, n, groups), generator=gen, dtype=torch.uint8) if asym else None
    z = zeros.double() if asym else torch.full((e, n, groups), 8.0, dtype=torch.float64)
    dense = (q.double() - z.repeat_interleave(group, 2)) * scales.double().repeat_interleave(group, 2)
    weights = ExpertWeights.stack([pack(Int4Weight(q[i], scales[i], None if zeros is None else zeros[i], group))
                                   for i in range(e)])
    return weights, dense


def act(gate, up, activation):
    if activation == "silu":
        return gate * torch.sigmoid(gate) * up
    g = torch.minimum(gate, torch.tensor(7.0, dtype=gate.dtype))
    u = torch.clamp(up, -7.0, 7.0)
    return (u + 1) * g * torch.sigmoid(1.702 * g)


def token_loop(x, ids, weights, gate_up, down, activation, gate_up_bias=None, down_bias=None):
    """The op's definition, one (token, slot) at a time, float64 but the intermediate (in x.dtype)."""
    tokens, hidden = x.shape
    inter = down.shape[2]
    out = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = gate_up[e] @ x[t].double()
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].double()
            a = act(h[:inter], h[inter:], activation).float().to(x.dtype).double()
            y = down[e] @ a
            if down_bias is not None:
                y = y + down_bias[e].double()
            out[t] += float(weights[t, j]) * y
    return out.to(x.dtype)


def routing(tokens: int, experts: int, k: int, gen, dtype=torch.float32):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(dtype)
    return ids, weights


# ------------------------------------------------------------------------------------------------------------
# the op against the token loop


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True), ("silu", True)])
def test_reference_matches_the_token_loop(dtype, activation, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    e, hidden, inter = 6, 128, 64
    gate_up, gu = int4_experts(e, 2 * inter, hidden, 64, dtype, gen)
    down, dn = int4_experts(e, hidden, inter, 32, dtype, gen, asym=True)
    x = (torch.randn(7, hidden, generator=gen) * 2).to(dtype)       # odd token count
    ids, weights = routing(7, e, 3, gen)
    ids[0, 1] = ids[0, 0]                                            # one token picks an expert twice
    gb = (torch.randn(e, 2 * inter, generator=gen) * 0.1).to(dtype) if bias else None
    db = (torch.randn(e, hidden, generator=gen) * 0.1).to(dtype) if bias else None
    got = moe.moe_experts(x, ids, weights, gate_up, down, activation, gb, db)
    want = token_loop(x, ids, weights, gu, dn, activation, gb, db)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_err(got, want) < TOLERANCE[dtype]


def test_reference_edge_cases(seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up, gu = int4_experts(4, 128, 128, 128, torch.float16, gen)
    down, dn = int4_experts(4, 128, 64, 64, torch.float16, gen)
    x = torch.randn(5, 128, generator=gen).half()
    one = torch.full((5, 2), 3)                                      # one expert takes every token, twice
    w = torch.rand(5, 2, generator=gen)
    assert rel_err(moe.moe_experts(x, one, w, gate_up, down), token_loop(x, one, w, gu, dn, "silu")) < 2e-3
    ids32 = one.to(torch.int32)                                      # int32 ids, fp16 routing weights
    assert torch.equal(moe.moe_experts(x, ids32, w.half(), gate_up, down),
                       moe.moe_experts(x, one, w.half().float(), gate_up, down))
    empty = moe.moe_experts(x[:0], one[:0], w[:0], gate_up, down)   # no tokens
    assert empty.shape == (0, 128) and empty.dtype == torch.float16
    zero_weights = moe.moe_experts(x, one, torch.zeros(5, 2), gate_up, down)
    assert not zero_weights.any()


def test_op_rejects_bad_input_naming_the_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up, _ = int4_experts(4, 128, 128, 128, torch.float16, gen)
    down, _ = int4_experts(4, 128, 64, 64, torch.float16, gen)
    x = torch.randn(3, 128).half()
    ids, w = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    cases = [
        (dict(x=x.float()), TypeError, "float16 or bfloat16"),
        (dict(x=x.bfloat16()), TypeError, "convert the weights"),
        (dict(x=x[:, :64]), ValueError, "hidden size 64"),
        (dict(ids=ids.float()), TypeError, "int32 or int64"),
        (dict(ids=ids[:2]), ValueError, r"\[tokens, K\]"),
        (dict(w=w[:, :1]), ValueError, "topk_ids' shape"),
        (dict(ids=torch.tensor([[0, 1], [2, 4], [0, 0]])), ValueError, r"topk_ids\[1, 1\] = 4 is not an expert"),
        (dict(ids=torch.tensor([[0, -1], [2, 3], [0, 0]])), ValueError, r"\[0, 4\)"),
        (dict(activation="gelu"), ValueError, "activation must be one of"),
        (dict(gb=torch.zeros(4, 64, dtype=torch.float16)), ValueError, r"gate_up_bias must be a torch.float16 tensor \[E, 128\]"),
        (dict(db=torch.zeros(4, 128)), ValueError, "down_bias must be a torch.float16"),
        (dict(down=gate_up), ValueError, "2 x down's k"),
    ]
    for change, error, match in cases:
        a = dict(x=x, ids=ids, w=w, gate_up=gate_up, down=down, activation="silu", gb=None, db=None) | change
        with pytest.raises(error, match=match):
            moe.moe_experts(a["x"], a["ids"], a["w"], a["gate_up"], a["down"], a["activation"], a["gb"], a["db"])
    with pytest.raises(TypeError, match="ExpertWeights"):
        moe.moe_experts(x, ids, w, gate_up.expert(0), down)


def test_custom_op_opcheck_and_compile(seed):
    """The custom op's schema and fake implementation (torch.library.opcheck), and torch.compile(fullgraph)
    tracing it (the aot_eager backend: the graph, without Inductor's C++ build)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up, _ = int4_experts(4, 128, 128, 64, torch.bfloat16, gen, asym=True)
    down, _ = int4_experts(4, 128, 64, 64, torch.bfloat16, gen)
    x = torch.randn(5, 128, generator=gen).bfloat16()
    ids, w = routing(5, 4, 2, gen)
    gb = torch.randn(4, 128, generator=gen).bfloat16()
    args = (x, ids, w, gate_up.packed, gate_up.scales, gate_up.zeros, down.packed, down.scales, down.zeros, gb, None,
            64, 64, "int4", "int4", 64, "silu")
    torch.library.opcheck(moe_experts_op, args, test_utils=("test_schema", "test_faketensor",
                                                            "test_aot_dispatch_static"))
    eager = moe.moe_experts(x, ids, w, gate_up, down, "silu", gb)
    fn = torch.compile(lambda x, ids, w: moe.moe_experts(x, ids, w, gate_up, down, "silu", gb), fullgraph=True,
                       backend="aot_eager")
    assert torch.equal(fn(x, ids, w), eager)


# ------------------------------------------------------------------------------------------------------------
# ExpertWeights


@pytest.mark.parametrize("codebook", ["int4", "nf4", "mxfp4"])
def test_expert_weights_from_weights_is_per_expert_quantization(codebook, seed):
    from tilefish import nf4, w4a16
    from tilefish.quant import mxfp4

    torch.manual_seed(seed)
    w = torch.randn(3, 128, 256, dtype=torch.bfloat16) * 0.05
    stacked = ExpertWeights.from_weights(w, codebook)
    assert stacked.packed.shape == (3, 2, 8 * 256) and stacked.dtype == torch.bfloat16
    for e in range(3):
        if codebook == "int4":
            one = w4a16.quantize(w[e], 128)
        elif codebook == "nf4":
            one = nf4.prepare(nf4.quantize(w[e], 64)).kernel
        else:
            one = pack(mxfp4.to_int4_weight(mxfp4.quantize(w[e]), torch.bfloat16), codebook="mxfp4")
        got = stacked.expert(e)
        assert got.codebook == codebook and got.group_size == one.group_size
        assert torch.equal(got.packed, one.packed) and torch.equal(got.scales, one.scales)
    dense = stacked.dequantize()
    assert dense.shape == (3, 128, 256)
    assert torch.equal(dense[1], stacked.expert(1).dequantize())
    assert torch.equal(stacked.dequantize(experts=[2]), dense[2:])
    assert rel_err(dense, w.float()) < 0.15                         # 4-bit rounding of a Gaussian weight


def test_expert_weights_reject_what_the_kernel_cannot_read():
    w = torch.randn(2, 128, 128)
    with pytest.raises(ValueError, match="group_size, symmetric and clip_search are int4 options"):
        ExpertWeights.from_weights(w, "mxfp4", group_size=64)
    with pytest.raises(ValueError, match="blocksize and double_quant are nf4 options"):
        ExpertWeights.from_weights(w, "int4", blocksize=128)
    with pytest.raises(ValueError, match="multiple of 64"):
        ExpertWeights.from_weights(torch.randn(2, 100, 128), "int4")
    with pytest.raises(TypeError, match=r"\[E, n, k\]"):
        ExpertWeights.from_weights(w[0], "int4")
    a, b = ExpertWeights.from_weights(w, "int4"), ExpertWeights.from_weights(w, "int4", group_size=64)
    with pytest.raises(ValueError, match="share all of these"):
        ExpertWeights.stack([a.expert(0), b.expert(1)])
    with pytest.raises(ValueError, match=r"packed must be \[E, n/64, 8k\]"):
        ExpertWeights(a.packed[:, :1], a.scales, None, 128, 128, 128)
    with pytest.raises(ValueError, match="codebook 'mxfp4' needs group_size 32"):
        ExpertWeights(a.packed, a.scales, None, 128, 128, 128, "mxfp4")
    with pytest.raises(IndexError):
        a.expert(2)


# ------------------------------------------------------------------------------------------------------------
# QuantizedExperts and whole models


# A quantized model against its dense twin (the same 4-bit weights, dequantized, in transformers' own experts
# module): the experts compute in fp16 (the fp32 model's inputs cast in, the activation and the result rounded
# to fp16), so the logits differ by that rounding through two layers: measured 5e-5 .. 3e-4.
TWIN_TOL = 2e-3
# Against the original weights: 4-bit rounding moves each expert weight by ~10% (relative RMS, measured
# 0.09 nf4 .. 0.11 mxfp4, WEIGHT_TOL), each expert's output by about sqrt(2) x that through its two matmuls; the
# residual stream dilutes it in the logits (measured 0.02 .. 0.03 for Mixtral and Qwen3-MoE, 0.10 .. 0.15 for
# gpt-oss, whose experts, with their biases, carry most of its residual stream). LOGIT_TOL bounds that.
WEIGHT_TOL = 0.15
LOGIT_TOL = 0.3
METHODS = ("w4a16", "nf4", "mxfp4")


def _converted(family, method, **kw):
    model = build_moe(family)
    original = copy.deepcopy(model)
    extra = {"clip_search": False} if method == "w4a16" else {}
    report = quantize_model(model, method, **extra, **kw)
    return model, original, report


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
@pytest.mark.parametrize("method", METHODS)
def test_every_experts_module_is_converted_and_matches_its_twin(family, method):
    model, original, report = _converted(family, method, skip=("lm_head", "*_proj"))   # the experts alone
    experts = experts_modules(model)
    assert experts and all(isinstance(m, QuantizedExperts) for m in experts.values())
    assert set(report.converted) == set(experts)
    twin = copy.deepcopy(model)
    assert dequantize_model(twin) == len(experts)
    for name, dense in experts_modules(twin).items():
        assert type(dense) is type(experts_modules(original)[name])   # transformers' own module back
        layout = dense_layout(dense)
        assert rel_err(layout.gate_up(dense), layout.gate_up(experts_modules(original)[name])) < WEIGHT_TOL
    ids = torch.randint(3, 256, (2, 9))
    with torch.no_grad():
        got, want, orig = model(ids).logits, twin(ids).logits, original(ids).logits
    assert rel_err(got, want) < TWIN_TOL
    assert rel_err(got, orig) < LOGIT_TOL


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_whole_model_report_bytes_and_generate(family):
    model, _, report = _converted(family, "w4a16", dtype=torch.bfloat16)
    assert report.experts_bytes_before and "of which MoE experts" in str(report)
    bf16_bytes = report.experts_bytes_before // 2                   # the tiny models are fp32
    assert report.experts_bytes_after / bf16_bytes <= 0.3
    router = "router" if family == "gpt_oss" else "gate"
    assert not any(name.endswith(f"mlp.{router}") for name in report.converted)
    prompt = torch.randint(3, 256, (2, 6))
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 10)
    with torch.no_grad():                                            # the last step against a full forward
        full = model(out[:, :-1]).logits[:, -1].argmax(-1)
    assert torch.equal(full, out[:, -1])


def test_gpt_oss_interleave_and_bias_are_mapped(seed):
    """gpt-oss stores gate_up transposed with gate / up interleaved and a bias: the quantized module must give
    what the dense module gives with the same (dequantized) weights, and to_dense must give those back."""
    model = build_moe("gpt_oss", dtype=torch.bfloat16)
    dense = model.model.layers[0].mlp.experts
    q = QuantizedExperts.from_dense(dense, "mxfp4")
    back = q.to_dense()
    assert back.gate_up_proj.shape == dense.gate_up_proj.shape and back.down_proj.shape == dense.down_proj.shape
    assert torch.equal(back.gate_up_proj_bias, dense.gate_up_proj_bias.to(torch.bfloat16))
    x = torch.randn(11, 128, dtype=torch.bfloat16)
    ids, w = routing(11, 4, 2, torch.Generator().manual_seed(seed), torch.bfloat16)
    with torch.no_grad():
        assert rel_err(q(x, ids, w), back(x, ids, w)) < 1e-2   # bf16 rounding of transformers' steps
    assert q.num_experts == 4 and q.intermediate_size == 128 and q.hidden_size == 128
    assert QuantizedExperts.from_dense(back, "mxfp4").gate_up.packed.equal(q.gate_up.packed)   # a fixed point


def test_state_dict_round_trip(seed):
    model = build_moe("qwen3_moe")
    a = QuantizedExperts.from_dense(model.model.layers[0].mlp.experts, "int4", group_size=64, symmetric=False,
                                    clip_search=False)
    b = QuantizedExperts.from_dense(model.model.layers[1].mlp.experts, "int4", group_size=64, symmetric=False,
                                    clip_search=False)
    state = a.state_dict()
    assert set(state) == {"gate_up_packed", "gate_up_scales", "gate_up_zeros", "down_packed", "down_scales",
                          "down_zeros"}
    b.load_state_dict(state)
    x = torch.randn(4, 128)
    ids, w = routing(4, 8, 2, torch.Generator().manual_seed(seed))
    assert torch.equal(a(x, ids, w), b(x, ids, w))
    assert a(x, ids, w).dtype == torch.float32                      # fp32 in, fp32 out (fp16 inside)
    assert a.float().dtype == torch.float16 and a.bfloat16().dtype == torch.bfloat16


class _GeluExperts(nn.Module):
    def __init__(self, e=2, hidden=128, inter=64):
        super().__init__()
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.randn(e, hidden, inter))
        self.act_fn = nn.GELU()


class _MoeBlock(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.gate = nn.Linear(128, 64, bias=False)                 # a router that happens to be tileable
        self.experts = experts


def test_conversion_skips_what_it_cannot_run_with_the_reason():
    class Plain(_GeluExperts):
        def __init__(self, inter=128):
            super().__init__(inter=inter)
            self.act_fn = nn.SiLU()

    model = nn.ModuleDict({"gelu": _MoeBlock(_GeluExperts()), "odd": _MoeBlock(Plain(inter=48)),
                           "ok": _MoeBlock(Plain())})
    report = quantize_model(model, clip_search=False)
    assert "act_fn is GELU" in report.skipped["gelu.experts"]
    assert "multiple of 64" in report.skipped["odd.experts"]
    assert isinstance(model["ok"].experts, QuantizedExperts) and "ok.experts" in report.converted
    assert report.skipped["ok.gate"] == "an MoE router (kept dense)" and type(model["ok"].gate) is nn.Linear
    assert quantize_model(model).skipped["ok.experts"] == "already quantized experts"
    with pytest.raises(ValueError, match="act_fn is GELU"):
        QuantizedExperts.from_dense(_GeluExperts())
    with pytest.raises(ValueError, match="does not apply to method='mxfp4'"):
        quantize_model(model, "mxfp4", group_size=64)
