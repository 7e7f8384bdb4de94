"""tilefish.decoder's fused forward on the CPU (the reference ops): which modules get it, and that it computes
transformers' forward bit for bit (the rounding is the same at every step) for every family it covers, in
fp16 and bf16, through a forward, generate() with the cache, hidden states and a backward; that it survives
state dicts, pickling, save / load, dequantize_model and restore_forward; and that anything it does not cover
keeps transformers' forward. The same models on the GPU kernels: test_decoder_gpu.py, test_user_loops.py."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import tilefish
from tilefish.decoder import FusedAttention, FusedDecoderLayer, FusedGatedMLP, restore_forward, use_fused_forward
from tilefish.nn import FusedW4A16Linear, GatedW4A16Linear, W4A16Linear, W4A16Slice

from hf_families import build

transformers = pytest.importorskip("transformers")

FUSED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = (torch.float16, torch.bfloat16)


def _quantized(family, dtype, seed=0, **kw):
    model = build(family, dtype, seed=seed)
    report = tilefish.quantize_model(model, clip_search=False, **kw)
    return model, report


def _ids(seed, batch=2, length=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (batch, length), generator=g)


def _transformers_forward(model):
    """The same quantized model running transformers' own forward."""
    twin = copy.deepcopy(model)
    restore_forward(twin)
    return twin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_fused_forward_is_transformers_forward_bit_for_bit(family, dtype):
    model, report = _quantized(family, dtype)
    layers = model.model.layers
    attentions = len(layers)
    assert report.forward == (f"fused decoder forward: {len(layers)} layer(s), {len(layers)} gated MLP(s), "
                              f"{attentions} attention(s)")
    assert all(isinstance(m, FusedDecoderLayer) and isinstance(m.mlp, FusedGatedMLP) for m in layers)
    assert sum(isinstance(m.self_attn, FusedAttention) for m in layers) == attentions
    assert isinstance(layers[0].mlp.gate_up_proj, GatedW4A16Linear)
    plain, _ = _quantized(family, dtype, fuse=False)  # the same dense weights, every projection its own layer
    twin = _transformers_forward(model)
    for seed in range(2):
        ids = _ids(seed)
        with torch.no_grad():
            got = model(ids, output_hidden_states=True)
            want = twin(ids, output_hidden_states=True)
            assert torch.equal(got.logits, want.logits), f"seed {seed}"
            assert torch.equal(got.logits, plain(ids).logits), f"seed {seed}"
            assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))


@pytest.mark.parametrize("inference_mode", (False, True), ids=("no_grad", "inference_mode"))
@pytest.mark.parametrize("family", ("llama", "qwen3"))
def test_generate_with_the_cache_is_unchanged(family, inference_mode):
    """generate (its own no_grad, or inside torch.inference_mode, whose tensors keep no version counter) gives
    transformers' tokens and logits, dynamic and static cache."""
    model, _ = _quantized(family, torch.float16)
    twin = _transformers_forward(model)
    ids = _ids(3, length=7)
    for cache in (None, "static"):
        kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_logits=True, cache_implementation=cache)
        with torch.inference_mode(inference_mode):
            got = model.generate(ids, **kw)
        want = twin.generate(ids, **kw)
        assert torch.equal(got.sequences, want.sequences), cache
        assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits)), cache


def test_a_backward_takes_transformers_forward():
    """With a gradient wanted the layers run transformers' forward (the fused kernels have no autograd): the
    same loss and input gradient as the restored model's."""
    model, _ = _quantized("llama", torch.float32)  # fp32 model: the 4-bit layers cast in and out
    twin = _transformers_forward(model)
    model.model.embed_tokens.weight.requires_grad_(True)
    twin.model.embed_tokens.weight.requires_grad_(True)
    ids = _ids(4)
    for m in (model, twin):
        m(ids).logits.float().square().mean().backward()
    assert torch.equal(model.model.embed_tokens.weight.grad, twin.model.embed_tokens.weight.grad)


def test_bf16_fused_model_with_grad_wanted_falls_back_and_agrees():
    model, _ = _quantized("qwen2", torch.bfloat16)
    twin = _transformers_forward(model)
    embeds = model.model.embed_tokens(_ids(5)).detach().requires_grad_(True)
    a = model(inputs_embeds=embeds).logits
    b = twin(inputs_embeds=embeds).logits
    assert torch.equal(a, b)
    a.float().sum().backward()
    assert embeds.grad is not None


def test_what_is_not_covered_keeps_transformers_forward():
    for family in ("gemma2", "phi3"):
        model, report = _quantized(family, torch.float16)
        assert report.forward == ""
        assert not any(isinstance(m, (FusedDecoderLayer, FusedGatedMLP)) for m in model.modules())
    # a dense down projection: neither the MLP nor its layer is fused, gate/up stay a plain fused pair (the
    # attention, whose q / k / v are one fused layer, is)
    model, report = _quantized("llama", torch.float16, skip=("down_proj",))
    assert report.forward == "fused decoder forward: 0 layer(s), 0 gated MLP(s), 2 attention(s)"
    assert type(model.model.layers[0].mlp.gate_up_proj) is FusedW4A16Linear
    # norms in another dtype than the layers: the MLP is fused, the layer is not
    model = build("llama", torch.float16)
    for layer in model.model.layers:
        layer.input_layernorm.float()
    report = tilefish.quantize_model(model, clip_search=False)
    assert report.forward == "fused decoder forward: 0 layer(s), 2 gated MLP(s), 2 attention(s)"
    # fuse_projections alone keeps gate/up side by side (transformers' MLP forward reads its parts as they are)
    model = build("llama", torch.float16)
    tilefish.quantize_model(model, clip_search=False, fuse=False)
    tilefish.convert.fuse_projections(model)
    assert type(model.model.layers[0].mlp.gate_up_proj) is FusedW4A16Linear
    assert use_fused_forward(model) == "fused decoder forward: 0 layer(s), 0 gated MLP(s), 2 attention(s)"
    # q / k / v left apart: nothing to fuse at all
    model = build("llama", torch.float16)
    tilefish.quantize_model(model, clip_search=False, fuse=False)
    assert use_fused_forward(model) is None


def test_restore_and_install_again():
    """restore_forward undoes use_fused_forward (classes and the q / k / v projection's light_ahead hint), and
    installing again gives the same logits."""
    model, _ = _quantized("mistral", torch.float16)
    ids = _ids(6)
    with torch.no_grad():
        fused = model(ids).logits
    fused_qkv = [layer.self_attn.q_proj.fused for layer in model.model.layers]
    assert all(f.light_ahead for f in fused_qkv)  # q / k / v follow the layer's norm (ops.w4a16 light_ahead)
    assert not any(layer.mlp.down_proj.light_ahead for layer in model.model.layers)
    assert restore_forward(model) == 3 * len(model.model.layers)
    assert type(model.model.layers[0]) is transformers.MistralForCausalLM(model.config).model.layers[0].__class__
    assert not any(f.light_ahead for f in fused_qkv)
    assert use_fused_forward(model) == use_fused_forward(model)  # idempotent
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fused)


def test_state_dict_pickle_and_save_load_round_trips(tmp_path):
    model, _ = _quantized("llama", torch.float16)
    ids = _ids(7)
    with torch.no_grad():
        want = model(ids).logits
    # state dict into a model converted the same way (the gated layer's extra state travels with it)
    other, _ = _quantized("llama", torch.float16, seed=1)
    other.load_state_dict(model.state_dict())
    # a whole-model pickle finds the Fused* classes through tilefish.decoder
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.model.layers[0]).__name__ == "FusedLlamaDecoderLayer"
    with torch.no_grad():
        for m in (other, loaded):
            assert torch.equal(m(ids).logits, want)
    # save_quantized writes each part under its own name (gate_proj, up_proj); load_quantized fuses again, to the
    # same 4-bit tensors (the rotary table is rebuilt in fp32 where the test model had cast it to fp16, so the
    # reloaded model is checked against its own transformers forward)
    tilefish.save_quantized(model, tmp_path / "q")
    reloaded, _ = tilefish.load_quantized(tmp_path / "q")
    assert isinstance(reloaded.model.layers[0], FusedDecoderLayer)
    mine = {k: v for k, v in model.state_dict().items() if "layers" in k}
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in mine.items() if isinstance(v, torch.Tensor))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, _transformers_forward(reloaded)(ids).logits)


def test_dequantize_model_gives_the_dense_twin_with_transformers_forward():
    model, _ = _quantized("qwen3", torch.float16)
    twin = _transformers_forward(model)
    tilefish.convert.dequantize_model(twin)
    gated = model.model.layers[0].mlp.gate_up_proj
    dense = twin.model.layers[0].mlp
    assert type(dense).__name__ == "Qwen3MLP" and isinstance(dense.gate_proj, torch.nn.Linear)
    a, b = gated.bounds[0]
    assert torch.equal(dense.gate_proj.weight, gated.weight.dequantize()[a:b])
    assert torch.equal(dense.up_proj.weight, model.model.layers[0].mlp.up_proj.weight.dequantize())
    tilefish.convert.dequantize_model(model)
    assert not any(isinstance(m, (FusedDecoderLayer, FusedGatedMLP, W4A16Linear)) for m in model.modules())


def test_gated_layer_parts_weight_and_bias_are_the_parts_order():
    torch.manual_seed(0)
    gate, up = (torch.nn.Linear(256, 128, bias=True).half() for _ in range(2))
    parts = [W4A16Linear.from_linear(p) for p in (gate, up)]
    fused = tilefish.convert.fuse(parts)
    gated = GatedW4A16Linear.from_fused(fused)
    x = torch.randn(3, 256, dtype=torch.float16)
    assert torch.equal(gated(x), fused(x))
    assert torch.equal(gated.forward_gated(x), torch.nn.functional.silu(parts[0](x)) * parts[1](x))
    for i in (0, 1):
        w, bias = gated.part_weight(i)
        assert torch.equal(W4A16Linear.from_weight(w, bias)(x), parts[i](x))
        assert torch.equal(W4A16Slice(gated, i).weight.dequantize(), parts[i].weight.dequantize())
    back = gated.ungated()
    assert torch.equal(back.packed, fused.packed) and torch.equal(back.bias, fused.bias)
    with pytest.raises(RuntimeError, match="_extra_state"):
        fused.load_state_dict(gated.state_dict())
    with pytest.raises(RuntimeError, match="_extra_state"):
        gated.load_state_dict(fused.state_dict())
    with pytest.raises(ValueError, match="two parts of one width"):
        GatedW4A16Linear.from_fused(tilefish.convert.fuse(parts + [W4A16Linear.from_linear(gate)]))


@pytest.mark.parametrize("family", ("llama", "qwen2", "mistral", "qwen3"))
def test_static_cache_decode_steps_take_the_rope_cache_op(family, monkeypatch):
    """The fused attention writes the cache with tilefish.ops.rope_cache exactly when the cache is a StaticCache's
    plain StaticLayer already filled (decode steps after the prompt), and transformers' forward writes it
    otherwise (the prompt, a DynamicCache, Mistral's sliding-window layers); logits bit for bit either way (Qwen3:
    its per-head q / k norms inside the op)."""
    from transformers import DynamicCache, StaticCache

    from tilefish.ops import rope_cache as rope_ops

    calls = []
    impl = rope_ops.rope_cache_impl
    monkeypatch.setattr(rope_ops, "rope_cache_impl", lambda *a, **k: calls.append(a[0].shape) or impl(*a, **k))
    model, _ = _quantized(family, torch.float16)
    twin = _transformers_forward(model)
    sliding = getattr(model.config, "sliding_window", None) is not None and family == "mistral"
    for make in (lambda m: StaticCache(config=m.config, max_cache_len=20), lambda m: DynamicCache()):
        calls.clear()
        caches = [make(m) for m in (model, twin)]
        ids = _ids(8, length=6)
        with torch.no_grad():
            for step in range(4):
                got, want = (m(ids, past_key_values=c, use_cache=True).logits for m, c in zip((model, twin), caches))
                assert torch.equal(got, want), f"step {step}"
                ids = want[:, -1:].argmax(-1)
        static = isinstance(caches[0], StaticCache) and not sliding
        assert len(calls) == (3 * len(model.model.layers) if static else 0), (family, type(caches[0]).__name__)
        assert all(shape[1] == 1 for shape in calls)  # decode steps only: the prompt filled the cache



def test_qwen3_moe_attention_takes_the_fused_forward_bit_for_bit():
    """Qwen3-MoE's attention (per-head q / k norms, as Qwen3's) takes the fused attention forward while its sparse
    MoE layers keep transformers' layer forward: decode steps through a StaticCache run the rope_cache op and give
    transformers' logits bit for bit."""
    from transformers import StaticCache

    from moe_families import build_moe

    model = build_moe("qwen3_moe", torch.float16)
    report = tilefish.quantize_model(model, clip_search=False)
    layers = len(model.model.layers)
    assert report.forward == f"fused decoder forward: 0 layer(s), 0 gated MLP(s), {layers} attention(s)"
    assert all(isinstance(m.self_attn, FusedAttention) for m in model.model.layers)
    twin = _transformers_forward(model)
    caches = [StaticCache(config=m.config, max_cache_len=16) for m in (model, twin)]
    ids = torch.randint(3, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for step in range(4):
            got, want = (m(ids, past_key_values=c, use_cache=True).logits for m, c in zip((model, twin), caches))
            assert torch.equal(got, want), f"step {step}"
            ids = want[:, -1:].argmax(-1)
