"""quantize_model / fuse_projections and the W4A16 layers a converted model is made of (CPU: the
reference path; the same checks on the GPU kernels are in test_convert_gpu.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tilefish
from tilefish.convert import ConversionReport, dequantize_model, fuse_projections, quantize_model
from tilefish.nn import FusedW4A16Linear, W4A16Linear, W4A16Slice
from tilefish.ops.w4a16 import W4A16Weight

from conftest import rel_err


class Attention(nn.Module):
    def __init__(self, hidden, kv, bias):
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, kv, bias=bias)
        self.v_proj = nn.Linear(hidden, kv, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, h):
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        return self.o_proj(q * torch.cat([k, v], -1).repeat(1, 1, q.shape[-1] // (2 * k.shape[-1])))


class Block(nn.Module):
    """The projections of a Llama-style decoder layer under their HF names, without the attention math."""

    def __init__(self, hidden=256, kv=64, inter=384, bias=False):
        super().__init__()
        self.self_attn = Attention(hidden, kv, bias)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, inter, bias=False)
        self.mlp.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, h):
        h = h + self.self_attn(h)
        m = self.mlp
        return h + m.down_proj(torch.nn.functional.silu(m.gate_proj(h)) * m.up_proj(h))


class TinyModel(nn.Module):
    def __init__(self, layers=2, bias=False, dtype=torch.float16):
        super().__init__()
        self.layers = nn.ModuleList([Block(bias=bias) for _ in range(layers)])
        self.odd = nn.Linear(256, 100)      # n % 64 != 0: the kernel cannot tile it
        self.lm_head = nn.Linear(256, 512, bias=False)
        self.to(dtype)

    def forward(self, h):
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h), self.odd(h)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyModel(**kw)


def test_quantize_model_converts_skips_and_reports():
    model = _model()
    report = quantize_model(model, fuse=False, skip=("lm_head",))
    assert isinstance(report, ConversionReport)
    assert len(report.converted) == 14 and all(isinstance(model.get_submodule(n), W4A16Linear) for n in report.converted)
    assert report.skipped["lm_head"] == "in skip" and isinstance(model.lm_head, nn.Linear)
    assert "multiple of 64" in report.skipped["odd"] and isinstance(model.odd, nn.Linear)
    assert 0.24 < report.bytes_after / report.bytes_before < 0.3
    assert "lm_head" in str(report) and "0.2" in str(report)


def test_quantize_model_matches_per_layer_conversion():
    """quantize_model gives each layer exactly what W4A16Linear.from_linear gives it."""
    model = _model(bias=True)
    q_proj = W4A16Linear.from_linear(model.layers[0].self_attn.q_proj, group_size=64, symmetric=False)
    quantize_model(model, group_size=64, symmetric=False, fuse=False)
    got = model.layers[0].self_attn.q_proj
    for name in ("packed", "scales", "zeros", "bias"):
        assert torch.equal(getattr(got, name), getattr(q_proj, name)), name


def test_converting_twice_is_a_no_op():
    model = _model()
    quantize_model(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    again = quantize_model(model)
    assert not again.converted and not again.fused
    assert set(again.skipped.values()) >= {"already W4A16"}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


@pytest.mark.parametrize("group,sym,bias", [(128, True, False), (64, False, True), (-1, True, True)])
def test_fused_projections_equal_unfused(group, sym, bias):
    """Fusion keeps every column's quantized values and scale: the reference path, which computes
    each output in float64 and rounds once, gives bit-identical outputs."""
    unfused, fused = _model(bias=bias), _model(bias=bias)
    quantize_model(unfused, group_size=group, symmetric=sym, fuse=False)
    report = quantize_model(fused, group_size=group, symmetric=sym, fuse=True)
    assert set(report.fused) == {f"layers.{i}.{g}" for i in range(2) for g in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
    attn = fused.layers[0].self_attn
    assert isinstance(attn.qkv_proj, FusedW4A16Linear) and isinstance(attn.k_proj, W4A16Slice)
    assert attn.qkv_proj.split_sizes == [256, 64, 64]
    torch.manual_seed(1)
    h = torch.randn(2, 3, 256, dtype=torch.float16)
    for a, b in zip(unfused(h), fused(h)):
        assert torch.equal(a, b)


def test_fused_parts_any_order_and_other_inputs():
    """Each part returns its own columns whatever the call order, and for an input other than the
    one the shared result was computed from."""
    model = _model()
    ref = copy.deepcopy(model)
    quantize_model(ref, fuse=False)
    quantize_model(model)
    attn, ref_attn = model.layers[0].self_attn, ref.layers[0].self_attn
    h1, h2 = torch.randn(4, 256, dtype=torch.float16), torch.randn(4, 256, dtype=torch.float16)
    assert torch.equal(attn.v_proj(h1), ref_attn.v_proj(h1))
    assert torch.equal(attn.q_proj(h2), ref_attn.q_proj(h2))   # another input: recomputed
    assert torch.equal(attn.k_proj(h1), ref_attn.k_proj(h1))
    assert torch.equal(attn.k_proj(h1), ref_attn.k_proj(h1))   # the same part twice
    h1.mul_(2)                                                 # changed in place: recomputed
    assert torch.equal(attn.q_proj(h1), ref_attn.q_proj(h1))
    assert torch.equal(attn.k_proj(h1), ref_attn.k_proj(h1))


def test_act_order_parts_with_different_permutations_stay_unfused():
    model = _model()
    quantize_model(model, fuse=False)
    attn = model.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        layer = getattr(attn, name)
        layer.perm = torch.randperm(256)
    report = fuse_projections(model)
    assert "act-order" in report.unfused["layers.0.self_attn.q_proj, layers.0.self_attn.k_proj, layers.0.self_attn.v_proj"]
    assert isinstance(attn.q_proj, W4A16Linear)
    assert "layers.1.self_attn.qkv_proj" in report.fused   # the other layer still fuses


def test_fused_state_dict_round_trip():
    model = _model(bias=True)
    quantize_model(model, group_size=64, symmetric=False)
    fresh = _model(seed=5, bias=True)
    quantize_model(fresh, group_size=64, symmetric=False)
    fresh.load_state_dict(model.state_dict())
    h = torch.randn(3, 256, dtype=torch.float16)
    for a, b in zip(model(h), fresh(h)):
        assert torch.equal(a, b)


def test_act_order_layer_state_dict_round_trip():
    """An act-order layer's perm (and an asymmetric one's zeros) load into a freshly built layer."""
    lin = nn.Linear(256, 128).half()
    w = tilefish.w4a16.quantize(lin.weight.detach(), 64, symmetric=False)
    w.perm = torch.randperm(256)
    a = W4A16Linear.from_weight(w, lin.bias)
    b = W4A16Linear(256, 128, group_size=64, symmetric=True, dtype=torch.float16)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 256, dtype=torch.float16)
    assert torch.equal(a(x), b(x)) and torch.equal(b.perm, w.perm)
    bad = a.state_dict()
    bad["perm"] = torch.zeros(256, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="perm"):
        W4A16Linear(256, 128, group_size=64, symmetric=False).load_state_dict(bad)


def test_weight_to_dtype_converts_scales_only():
    w = tilefish.w4a16.quantize(torch.randn(128, 256), 64, symmetric=False)
    b = w.to(torch.bfloat16)
    assert b.packed.dtype == torch.int32 and torch.equal(b.packed, w.packed)
    assert b.scales.dtype == torch.bfloat16 and b.zeros.dtype == torch.bfloat16
    assert torch.equal(b.zeros.float(), w.zeros.float())
    assert w.to("cpu", torch.float16).scales.dtype == torch.float16
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        w.to(torch.float32)


def test_bad_inputs_are_clear_errors():
    w = tilefish.w4a16.quantize(torch.randn(128, 256), 128)
    with pytest.raises(ValueError, match="0-D"):
        tilefish.w4a16.matmul(torch.tensor(1.0, dtype=torch.float16), w)
    short = W4A16Weight(w.packed, w.scales, w.zeros, w.group_size, w.n, w.k, torch.arange(255))
    with pytest.raises(ValueError, match=r"perm must be .*\(256,\)"):
        tilefish.w4a16.matmul(torch.randn(2, 256, dtype=torch.float16), short)
    with pytest.raises(ValueError, match="each of 0..255 exactly once"):
        tilefish.w4a16.pack(tilefish.w4a16.unpack(w), torch.zeros(256, dtype=torch.int64))
    layer = W4A16Linear.from_weight(w)
    with pytest.raises(ValueError, match="each of 0..255 exactly once"):
        layer._set(W4A16Weight(w.packed, w.scales, None, 128, 128, 256, torch.full((256,), 3)), None)
    with pytest.raises(ValueError, match="method"):
        quantize_model(_model(), method="w3a16")
    with pytest.raises(ValueError, match="group_size must be"):
        quantize_model(_model(), group_size=100)
    for fn in (quantize_model, fuse_projections, dequantize_model):
        with pytest.raises(TypeError, match="nn.Module"):
            fn("model")
    with pytest.raises(TypeError, match="dtype"):
        quantize_model(_model(), dtype=torch.float32)


def test_linear_compatible_surface():
    """What nn.Linear users read: .weight's dtype / device / shape, and fp32 inputs (cast in and out)."""
    lin = nn.Linear(256, 128).half()
    layer = W4A16Linear.from_linear(lin, group_size=64)
    assert layer.weight.dtype == torch.float16 and layer.weight.device == lin.weight.device
    assert layer.weight.shape == lin.weight.shape and layer.weight.size(1) == 256
    assert rel_err(layer.weight.dequantize(), lin.weight) < 0.15
    x = torch.randn(3, 256)
    y = layer(x)
    assert y.dtype == torch.float32 and torch.equal(y, layer(x.half()).float())
    model = _model()
    quantize_model(model)
    k_proj = model.layers[0].self_attn.k_proj
    assert k_proj.weight.shape == (64, 256) and k_proj.weight.dtype == torch.float16


def test_autograd_reaches_the_input():
    """Gradients flow to x through the dequantized weight (the weight is frozen), the same in eager
    mode and under torch.compile."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 128).half()
    w = tilefish.w4a16.quantize(lin.weight.detach(), 64)
    w.perm = torch.randperm(256)
    layer = W4A16Linear.from_weight(w, lin.bias.detach())
    dense = layer.weight.dequantize().float()
    x = torch.randn(3, 256, dtype=torch.float16, requires_grad=True)
    g = torch.randn(3, 128)
    layer(x).float().backward(g)
    assert rel_err(x.grad, g @ dense) < 2e-3
    assert not any(t.requires_grad for t in layer.buffers())
    x2 = x.detach().clone().requires_grad_()
    torch.compile(layer, fullgraph=True, backend="aot_eager")(x2).float().backward(g)
    assert torch.equal(x2.grad, x.grad)


def test_quantized_model_compiles_fullgraph():
    model = _model()
    quantize_model(model)
    h = torch.randn(2, 3, 256, dtype=torch.float16)
    with torch.no_grad():
        want = model(h)
        got = torch.compile(model, fullgraph=True, backend="eager")(h)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_hf_llama_quantize_and_fuse():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, vocab_size=320)
    torch.manual_seed(0)
    dense = transformers.LlamaForCausalLM(cfg).half().eval()
    unfused, fused = copy.deepcopy(dense), copy.deepcopy(dense)
    quantize_model(unfused, fuse=False, lm_head="dense")
    report = quantize_model(fused, lm_head="dense")
    assert len(report.fused) == 4 and "lm_head" in report.skipped
    ids = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        ref, a, b = dense(ids).logits, unfused(ids).logits, fused(ids).logits
    assert torch.equal(a, b)
    assert rel_err(b, ref) < 0.3   # 4-bit weights of a random model; the kernel-exact checks are above


def _heads_model(head: str) -> TinyModel:
    """A TinyModel whose decoder weights are Gaussian and whose lm_head is `head`: "uniform" (int4 serves it
    better than any Gaussian layer) or "heavy" (Student-t, 1.5 degrees of freedom: outliers that widen its
    groups' scales, so int4 serves it worse)."""
    model = _model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.02)
        w = model.lm_head.weight
        if head == "uniform":
            w.uniform_(-0.04, 0.04)
        else:
            w.copy_(torch.distributions.StudentT(1.5).sample(w.shape) * 0.02)
    return model


def _weight_error(linear: nn.Linear) -> float:
    """The relative Frobenius error of one layer quantized alone, as quantize_model's defaults do."""
    w = linear.weight.detach().float()
    return float((w - W4A16Linear.from_linear(linear).weight.dequantize().float()).norm() / w.norm())


@pytest.mark.parametrize("head", ["uniform", "heavy"])
def test_lm_head_auto_follows_its_weight_error_against_the_decoders(head):
    """lm_head="auto" (the default): int4 where the output projection's relative weight error is at most the
    largest of the converted decoder layers', else dense, with both errors in the report."""
    model = _heads_model(head)
    decoder = max(_weight_error(m) for n, m in model.named_modules()
                  if isinstance(m, nn.Linear) and n.startswith("layers."))
    own = _weight_error(model.lm_head)
    report = quantize_model(model, fuse=False)
    assert (own <= decoder) == (head == "uniform"), (own, decoder)
    assert len(report.converted) == (15 if head == "uniform" else 14)
    if head == "uniform":
        assert isinstance(model.lm_head, W4A16Linear)
        assert report.lm_head.startswith("quantized (auto)")
    else:
        assert type(model.lm_head) is nn.Linear and report.skipped["lm_head"] == report.lm_head
        assert report.lm_head.startswith("kept dense (auto)")
    assert f"{own:.4f}" in report.lm_head and f"{decoder:.4f}" in report.lm_head
    assert report.lm_head in str(report)


def test_lm_head_quantize_dense_and_skip():
    """lm_head="quantize" converts a tail-heavy head that auto keeps dense; "dense" never converts it; a name
    in skip keeps it dense whatever lm_head says; anything else is a ValueError before any change."""
    model = _heads_model("heavy")
    report = quantize_model(model, lm_head="quantize")
    assert isinstance(model.lm_head, W4A16Linear) and "lm_head" in report.converted
    model = _heads_model("uniform")
    report = quantize_model(model, lm_head="dense")
    assert type(model.lm_head) is nn.Linear and report.skipped["lm_head"] == "lm_head='dense'"
    model = _heads_model("uniform")
    report = quantize_model(model, lm_head="quantize", skip=("lm_head",))
    assert type(model.lm_head) is nn.Linear and report.skipped["lm_head"] == "in skip"
    model = _heads_model("uniform")
    with pytest.raises(ValueError, match="lm_head must be one of"):
        quantize_model(model, lm_head="int4")
    assert not any(isinstance(m, W4A16Linear) for m in model.modules())


def test_lm_head_auto_finds_the_output_projection_by_get_output_embeddings():
    """A model whose output projection is not named lm_head: the one get_output_embeddings() returns is the
    one the rule weighs (converted last, against every other layer)."""
    class Renamed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _heads_model("heavy")
            self.body.to_vocab = self.body.lm_head
            del self.body.lm_head

        def get_output_embeddings(self):
            return self.body.to_vocab

    model = Renamed()
    report = quantize_model(model)
    assert type(model.body.to_vocab) is nn.Linear and report.lm_head.startswith("kept dense (auto)")
    assert report.skipped["body.to_vocab"] == report.lm_head


def test_tied_lm_head_gets_its_own_int4_copy():
    """An HF model with tied embeddings: a quantized lm_head is a W4A16Linear of its own; the embedding keeps the
    dense tensor, and the logits match the dense twin's. (lm_head="quantize": whether "auto" quantizes a random
    head depends on the draw, since its error and the decoder's worst are close; test_lm_head_auto_* test that.)"""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, vocab_size=384, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).half().eval()
    embedding = model.model.embed_tokens.weight.detach().clone()
    report = quantize_model(model, lm_head="quantize")
    assert isinstance(model.lm_head, W4A16Linear) and report.lm_head.startswith("quantized")
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    ids = torch.randint(0, 384, (2, 7))
    with torch.no_grad():
        got = model(ids).logits
        dequantize_model(model)
        twin = model(ids).logits
    assert rel_err(got, twin) < 1e-2


def test_dequantize_model_is_the_dense_twin():
    """dequantize_model puts back nn.Linears with the exactly dequantized weights: the twin computes
    what the quantized model computes, up to fp16 rounding of the matmul."""
    model = _model(bias=True)
    quantize_model(model, group_size=64, symmetric=False, lm_head="quantize")
    h = torch.randn(2, 3, 256, dtype=torch.float16)
    want = model(h)
    assert dequantize_model(model) == 15   # 14 decoder projections and lm_head
    assert not any(isinstance(m, (W4A16Linear, W4A16Slice)) for m in model.modules())
    assert type(model.layers[0].self_attn.k_proj) is nn.Linear and not hasattr(model.layers[0].self_attn, "qkv_proj")
    for a, b in zip(want, model(h)):
        assert rel_err(b, a) < 2e-3



@pytest.mark.parametrize("cast", ["float", "double", "to_float32"])
def test_cast_to_another_dtype_keeps_the_16bit_tensors(cast):
    """.float() / .double() / .to(torch.float32) on a quantized model: the 4-bit layers keep their fp16
    kernel dtype (a W4A16Linear and an NF4Linear alike), the rest of the model takes the cast, and the
    model still runs, fp32 inputs cast in and out of the 4-bit layers."""
    model = _model()
    quantize_model(model, fuse=False, lm_head="dense")
    nf4_layer = tilefish.nn.NF4Linear.from_linear(nn.Linear(256, 128).half())
    before = {n: t.clone() for n, t in list(model.named_buffers()) + list(nf4_layer.named_buffers())}
    for m in (model, nf4_layer):
        getattr(m, cast)() if cast != "to_float32" else m.to(torch.float32)
    target = torch.float64 if cast == "double" else torch.float32
    assert model.lm_head.weight.dtype == target  # the dense layers follow the cast
    q = model.layers[0].self_attn.q_proj
    assert q.weight.dtype == torch.float16 and q.scales.dtype == torch.float16 and nf4_layer.scales.dtype == torch.float16
    for n, t in list(model.named_buffers()) + list(nf4_layer.named_buffers()):
        assert t.dtype == before[n].dtype and torch.equal(t, before[n]), n
    h = torch.randn(2, 3, 256, dtype=target)
    out = model(h)
    assert out[0].dtype == target
    x = torch.randn(4, 256, dtype=torch.float16)
    assert torch.equal(q(x), W4A16Linear.from_weight(q.weight4)(x))  # the same layer as before the cast
    assert nf4_layer(x).dtype == torch.float16


def test_dequantize_model_of_an_fp32_model_stays_fp32():
    """A quantized fp32 model (16-bit 4-bit layers inside): its dense twin is fp32 and runs."""
    model = _model(dtype=torch.float32)
    quantize_model(model, group_size=64)
    h = torch.randn(2, 3, 256)
    want = model(h)
    dequantize_model(model)
    assert model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    for a, b in zip(want, model(h)):
        assert a.dtype == b.dtype == torch.float32 and rel_err(b, a) < 5e-3
    twin16 = _model(dtype=torch.float32)
    quantize_model(twin16, group_size=64)
    dequantize_model(twin16, dtype=torch.float16)
    assert twin16.layers[0].self_attn.q_proj.weight.dtype == torch.float16
