"""tilefish.decoder's fused forward on the GPU kernels: the same logits as transformers' forward over the same
4-bit layers (within the norms' reordered fp32 sums and the fast silu), eagerly and compiled; the same bits with
programmatic dependent launch on and off; and the kernels a layer launches. The user's loops (generate with
the static cache, every compile mode, CUDA graphs) run the fused forward in test_user_loops.py."""
from __future__ import annotations

import copy

import pytest
import torch

import tilefish
from tilefish.decoder import FusedDecoderLayer
from tilefish.ops import w4a16 as ops

from hf_families import build, rel

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}  # two layers of 16-bit activations, an ulp here and there


def _models(family, dtype, seed=0):
    model = build(family, dtype, "cuda", seed=seed)
    tilefish.quantize_model(model, clip_search=False)
    assert isinstance(model.model.layers[0], FusedDecoderLayer)
    twin = copy.deepcopy(model)
    tilefish.restore_forward(twin)
    return model, twin


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_forward_against_transformers_forward(family, dtype):
    model, twin = _models(family, dtype)
    for seed, (batch, length) in enumerate(((1, 1), (3, 9), (16, 33))):
        torch.manual_seed(seed)
        ids = torch.randint(3, 512, (batch, length), device="cuda")
        with torch.no_grad():
            err = rel(model(ids).logits, twin(ids).logits)
        assert err < TOL[dtype], f"seed {seed}, batch {batch}, length {length}: {err:.2e}"


def test_compiled_fused_forward_and_programmatic_launch_bits():
    """torch.compile (reduce-overhead: CUDA graph trees) of the fused model equals its eager forward within
    the compiled rest's reordering, and with programmatic dependent launch off the bits are the same."""
    model, twin = _models("llama", torch.float16)
    torch.manual_seed(5)
    ids = torch.randint(3, 512, (2, 7), device="cuda")
    with torch.no_grad():
        eager = model(ids).logits
        with ops.launch_policy(ops.LaunchPolicy(programmatic=False)):
            assert torch.equal(model(ids).logits, eager)
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            got = compiled(ids).logits.clone()
        assert rel(got, eager) < TOL[torch.float16]
        assert rel(got, twin(ids).logits) < TOL[torch.float16]
    torch._dynamo.reset()


@pytest.mark.parametrize("sharing", ["alone", "time-sliced"])
def test_static_cache_decode_steps_same_bits_with_and_without_programmatic_launch(sharing, request):
    """Decode steps with a StaticCache (norms, W4A16 GEMMs with their residual and gated epilogues, rope_attention:
    each kernel reading what the one or two ahead wrote), also while other processes share the GPU: with
    programmatic dependent launch the logits and caches equal the same steps without it, bit for bit."""
    from transformers import StaticCache

    if sharing == "time-sliced":
        request.getfixturevalue("time_sliced_gpu")
    model, _ = _models("llama", torch.float16)
    torch.manual_seed(12)
    prompt = torch.randint(3, 512, (2, 5), device="cuda")

    def decode(programmatic):
        cache = StaticCache(config=model.config, max_cache_len=24)
        with torch.no_grad(), ops.launch_policy(ops.LaunchPolicy(programmatic=programmatic)):
            logits = [model(prompt, past_key_values=cache, use_cache=True).logits]
            for _ in range(6):
                ids = logits[-1][:, -1:].argmax(-1)
                logits.append(model(ids, past_key_values=cache, use_cache=True).logits)
        return logits, cache

    want, want_cache = decode(False)
    for i in range(2):
        got, cache = decode(True)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), f"round {i}: logits differ"
        for a, b in zip(cache.layers, want_cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), f"round {i}: cache differs"


def test_a_fused_layer_launches_five_tilefish_kernels_around_its_attention():
    """One decode step of a fused layer: two norm kernels and three W4A16 GEMMs (q/k/v, gate/up with the
    activation, down with the residual add) besides the attention's own and o's GEMM: no SiLU kernel."""
    model, _ = _models("llama", torch.float16)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 1, 256, device="cuda", dtype=torch.float16)
    position = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    emb = model.model.rotary_emb(hidden, position)
    with torch.no_grad():
        layer(hidden, attention_mask=None, position_embeddings=emb, position_ids=position)  # plans, kernels loaded
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            layer(hidden, attention_mask=None, position_embeddings=emb, position_ids=position)
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("rms_norm" in n for n in names) == 2, names
    assert sum("w4a16" in n for n in names) == 4, names  # q/k/v, o, gate/up, down
    assert not any("silu" in n.lower() for n in names), names


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_cache_decode_steps_run_rotary_cache_write_and_attention_as_one_kernel_a_layer(family, dtype):
    """With a StaticCache, a decode step of the fused model runs the rotary embedding, the cache write and the
    attention as one rope_attention kernel a layer (no index_copy, no rotary, length or SDPA kernels; Qwen3's
    q / k head norms inside it too), the prompt's fill takes transformers' attention forward, and logits and
    cache follow transformers' forward over the same 4-bit layers step after step."""
    from transformers import StaticCache

    model, twin = _models(family, dtype)
    torch.manual_seed(11)
    prompt = torch.randint(3, 512, (2, 5), device="cuda")
    caches = [StaticCache(config=m.config, max_cache_len=24) for m in (model, twin)]
    with torch.no_grad():
        outs = [m(prompt, past_key_values=c, use_cache=True).logits for m, c in zip((model, twin), caches)]
        for step in range(6):
            ids = outs[1][:, -1:].argmax(-1)  # both models take the same next token
            if step == 5:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    outs[0] = model(ids, past_key_values=caches[0], use_cache=True).logits
                    torch.cuda.synchronize()
                outs[1] = twin(ids, past_key_values=caches[1], use_cache=True).logits
            else:
                outs = [m(ids, past_key_values=c, use_cache=True).logits for m, c in zip((model, twin), caches)]
            err = rel(outs[0], outs[1])
            assert err < TOL[dtype], f"step {step}: {err:.2e}"
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.cumulative_length, b.cumulative_length)
        assert rel(a.keys, b.keys) < TOL[dtype] and rel(a.values, b.values) < TOL[dtype]
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    layers = len(model.model.layers)
    assert sum("rope_attention" in n for n in names) == layers, names
    assert not any("rope_cache" in n or "index_copy" in n.lower() or "indexcopy" in n.lower() for n in names), names
    assert not any(k in n.lower() for n in names for k in ("sdpa", "fmha", "flash")), names


@pytest.mark.parametrize("slots", [1152, 8192])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_steps_past_1024_slots_follow_the_routing(family, slots):
    """Past 1,024 cache slots a decode step takes rope_attention where routes_decode_step says so for this GPU
    (on sm_90 a 1,152-slot cache at 2 kv heads: 9 two-tile chunks in a cluster), else the rope_cache kernel
    and the model's attention function (an 8,192-slot cache: 8 tiles a CTA), one launch of each kind a layer,
    with logits and cache still transformers' forward over the same 4-bit layers."""
    from transformers import StaticCache

    from tilefish.ops import rope_attention as rope_attention_ops

    dtype = torch.float16
    model, twin = _models(family, dtype)
    routed = rope_attention_ops.routes_decode_step(
        2, 2, slots, lambda: rope_attention_ops.device_decode_limits(torch.cuda.current_device(), dtype, 64))
    if torch.cuda.get_device_capability() == (9, 0):
        assert routed == (slots == 1152)
    torch.manual_seed(12)
    prompt = torch.randint(3, 512, (2, 5), device="cuda")
    caches = [StaticCache(config=m.config, max_cache_len=slots) for m in (model, twin)]
    with torch.no_grad():
        outs = [m(prompt, past_key_values=c, use_cache=True).logits for m, c in zip((model, twin), caches)]
        ids = outs[1][:, -1:].argmax(-1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = model(ids, past_key_values=caches[0], use_cache=True).logits
            torch.cuda.synchronize()
        want = twin(ids, past_key_values=caches[1], use_cache=True).logits
    assert rel(got, want) < TOL[dtype]
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.equal(a.cumulative_length, b.cumulative_length)
        assert rel(a.keys, b.keys) < TOL[dtype] and rel(a.values, b.values) < TOL[dtype]
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    layers = len(model.model.layers)
    ran, other = ("rope_attention", "rope_cache") if routed else ("rope_cache", "rope_attention")
    assert sum(ran in n for n in names) == layers, names
    assert not any(other in n for n in names), names
