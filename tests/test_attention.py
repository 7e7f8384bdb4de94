"""tilefish.attention on the CPU: gqa_sdpa_attention_forward against transformers' sdpa_attention_forward
(the folded grouped-query path, and every case it hands back), under torch.compile(fullgraph=True);
tiny GQA models switched by use_gqa_attention against the same models on "sdpa" (StaticCache prefill and
decode steps, generate with the static cache); what use_gqa_attention leaves alone; no leak into a saved
config; `import tilefish` stays free of transformers.

Tolerances: the folded call multiplies groups * t query rows per KV head where "sdpa" multiplies t rows
per (repeated) head, so the CPU GEMMs differ: with t = 1, fp32 MKL takes a matrix-vector kernel for one
row and a matrix-matrix kernel for several (another summation order over head_dim), and the flash kernel's
bf16 blocking depends on the row count. Measured on 300 random shapes: rel. error up to 5.4e-7 in fp32,
1.4e-4 in bf16 (where an output rounds the other way); often bit for bit (t > 1 was in most cases).
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from conftest import rel_err
from hf_families import build, generate

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, StaticCache  # noqa: E402  (loads modeling_utils before any spy)
from transformers.integrations import sdpa_attention as hf_sdpa  # noqa: E402

from tilefish.attention import DESCRIPTION, NAME, gqa_sdpa_attention_forward, use_gqa_attention  # noqa: E402

HF_SDPA = hf_sdpa.sdpa_attention_forward  # the reference, taken before any spy replaces the module's attribute
EPS32, EPS16 = torch.finfo(torch.float32).eps, torch.finfo(torch.bfloat16).eps
FN_TOL = {torch.float32: 16 * EPS32, torch.bfloat16: EPS16 / 16}  # one attention call (see the docstring)
# Logits through two layers: fp32 measured 2e-7 to 4.5e-7; bf16 bit for bit at these sizes, and 1.8e-3 at
# 1,100 positions when one attention output rounded the other way (a quarter of a bf16 ulp, relative).
MODEL_TOL = {torch.float32: 16 * EPS32, torch.bfloat16: EPS16 / 2}

TINY = dict(num_hidden_layers=2, vocab_size=256, max_position_embeddings=64, head_dim=16)
FAMILY_SHAPES = {  # (heads, kv heads): groups 4 and 2
    "llama": dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
}
PROMPT, NEW = 6, 4


def _tiny(family: str, dtype=torch.float32, seed: int = 0, **overrides):
    return build(family, dtype, seed=seed, **{**TINY, **FAMILY_SHAPES[family], **overrides})


class Attn(nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


# transformers 5.24 folds a single query token's heads onto the KV heads itself (pack_gqa), masked or not
HF_PACKS_ONE_TOKEN = hasattr(hf_sdpa, "pack_gqa")


@pytest.fixture
def spy(monkeypatch):
    """Counts transformers' repeat_kv calls and the calls tilefish hands to transformers' sdpa function."""
    assert AttentionInterface._global_mapping["sdpa"] is HF_SDPA  # "sdpa" models keep calling the original
    calls = {"repeat_kv": 0, "delegated": 0}
    real_repeat = hf_sdpa.repeat_kv

    def repeat_kv(*a, **k):
        calls["repeat_kv"] += 1
        return real_repeat(*a, **k)

    def delegated(*a, **k):
        calls["delegated"] += 1
        return HF_SDPA(*a, **k)

    monkeypatch.setattr(hf_sdpa, "repeat_kv", repeat_kv)
    monkeypatch.setattr(hf_sdpa, "sdpa_attention_forward", delegated)
    return calls


def _qkv(b, heads, kv_heads, t, s, d, dtype):
    return (torch.randn(b, heads, t, d, dtype=dtype), torch.randn(b, kv_heads, s, d, dtype=dtype),
            torch.randn(b, kv_heads, s, d, dtype=dtype))


def _mask(kind: str, b: int, heads: int, rows: int, s: int, dtype):
    """A random [b, heads, rows, s] mask with every row attending somewhere: bool, or an additive float
    mask (random biases, the dtype's min where masked)."""
    keep = torch.rand(b, heads, rows, s) > 0.3
    keep[..., torch.randint(0, s, ())] = True
    if kind == "bool":
        return keep
    return torch.where(keep, torch.randn(b, heads, rows, s), torch.finfo(dtype).min).to(dtype)


# ---- the function against transformers' sdpa_attention_forward ---------------------------------------

@pytest.mark.parametrize("t, rows", [(1, 1), (5, 5), (5, 1)], ids=["decode", "prefill", "prefill-broadcast-rows"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_folded_call_matches_transformers_sdpa(dtype, kind, t, rows, spy):
    """8 query heads on 2 KV heads with a head-broadcast mask: the folded path (no repeat_kv, nothing
    handed back) gives transformers' output, shape and layout."""
    b, heads, kv_heads, d = 3, 8, 2, 32
    s = t + int(torch.randint(3, 40, ()))
    q, k, v = _qkv(b, heads, kv_heads, t, s, d, dtype)
    mask = _mask(kind, b, 1, rows, s, dtype)
    module = Attn(heads // kv_heads)
    want, _ = HF_SDPA(module, q, k, v, mask, scaling=d ** -0.5)
    # the reference repeats K and V (transformers >= 5.24 packs a single query token's heads instead)
    assert spy["repeat_kv"] == (0 if t == 1 and HF_PACKS_ONE_TOKEN else 2)
    spy["repeat_kv"] = 0
    got, weights = gqa_sdpa_attention_forward(module, q, k, v, mask, scaling=d ** -0.5,
                                              position_ids=torch.arange(t)[None], use_cache=True)
    assert spy == {"repeat_kv": 0, "delegated": 0}
    assert weights is None and got.shape == (b, t, heads, d) and got.dtype == dtype and got.is_contiguous()
    assert rel_err(got, want) <= FN_TOL[dtype]


CASES = {  # name -> (groups, mask: None / "broadcast" / "per-head", extra kwargs)
    "groups-1": (1, "broadcast", {}),
    "mask-none": (4, None, {}),
    "per-head-mask": (4, "per-head", {}),
    "output-attentions": (4, "broadcast", {"output_attentions": True}),
    "sinks": (4, "broadcast", {"s_aux": "tensor"}),
    "position-bias": (4, "broadcast", {"position_bias": "tensor"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_other_cases_are_handed_to_transformers(case, spy):
    """Anything but a masked, head-broadcast GQA call goes to transformers' function unchanged (bit for bit),
    mask None included (its enable_gqa path, with the causal crop of a longer cache)."""
    groups, mask_kind, extra = CASES[case]
    b, kv_heads, t, s, d = 2, 2, 4, 11, 16
    heads = kv_heads * groups
    q, k, v = _qkv(b, heads, kv_heads, t, s, d, torch.float32)
    mask = None if mask_kind is None else _mask("float", b, heads if mask_kind == "per-head" else 1, t, s,
                                                torch.float32)
    kwargs = {key: (torch.randn(1, heads, t, s) if key == "position_bias" else torch.randn(heads))
              if val == "tensor" else val for key, val in extra.items()}
    module = Attn(groups)
    want, _ = HF_SDPA(module, q, k, v, mask, scaling=0.3, **kwargs)
    got, weights = gqa_sdpa_attention_forward(module, q, k, v, mask, scaling=0.3, **kwargs)
    assert spy["delegated"] == 1
    assert weights is None and torch.equal(got, want)


@pytest.mark.parametrize("t, mask", [(1, True), (6, True), (6, False)], ids=["decode", "prefill", "mask-none"])
def test_compiled_fullgraph_gives_the_same_output(t, mask):
    """torch.compile(fullgraph=True) traces the folded, the compiled-decode (SDPA's enable_gqa) and the
    handed-back paths (no graph break) and computes what the eager call does: bit for bit where it takes
    the same path, within the folded path's tolerance for a decode step."""
    torch._dynamo.reset()
    b, heads, kv_heads, s, d = 2, 8, 2, 13, 16
    q, k, v = _qkv(b, heads, kv_heads, t, s, d, torch.float32)
    m = _mask("bool", b, 1, t, s, torch.float32) if mask else None
    module = Attn(heads // kv_heads)
    kw = dict(scaling=0.25, position_ids=torch.arange(t)[None], use_cache=True)
    try:
        compiled = torch.compile(gqa_sdpa_attention_forward, fullgraph=True, backend="aot_eager")
        got, _ = compiled(module, q, k, v, m, **kw)
    finally:
        torch._dynamo.reset()
    want, _ = gqa_sdpa_attention_forward(module, q, k, v, m, **kw)
    if t == 1 and mask:   # compiled, a decode step takes SDPA's enable_gqa form; eager, the folded one
        assert rel_err(got, want) < 16 * torch.finfo(torch.float32).eps
    else:
        assert torch.equal(got, want)


# ---- switched models against "sdpa" ------------------------------------------------------------------

def _static_cache_steps(model, ids, mask, tokens):
    """Prefill (left-padded, so the mask is materialized) then one decode step per token, on a StaticCache:
    the fp32 logits of each call."""
    cache = StaticCache(config=model.config, max_cache_len=PROMPT + NEW)
    out = []
    with torch.no_grad():
        out.append(model(ids, attention_mask=mask, past_key_values=cache,
                         cache_position=torch.arange(PROMPT)).logits.float())
        for i in range(tokens.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            out.append(model(tokens[:, i:i + 1], attention_mask=mask, past_key_values=cache,
                             cache_position=torch.tensor([PROMPT + i])).logits.float())
    return out


def _left_padded(batch: int = 2):
    ids = torch.randint(3, 256, (batch, PROMPT))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_switched_model_matches_sdpa_on_a_static_cache(family, dtype, seed, spy):
    """Prefill and four decode steps (the same random tokens fed to both): the switched model's logits
    equal the "sdpa" model's, and it never repeats K/V nor hands a call back."""
    ref = _tiny(family, dtype, seed)
    model = copy.deepcopy(ref)
    assert use_gqa_attention(model) == DESCRIPTION
    ids, mask = _left_padded()
    tokens = torch.randint(3, 256, (2, NEW))
    want = _static_cache_steps(ref, ids, mask, tokens)
    assert spy["repeat_kv"] > 0  # the reference repeats K/V on every masked call
    spy["repeat_kv"] = 0
    got = _static_cache_steps(model, ids, mask, tokens)
    assert spy == {"repeat_kv": 0, "delegated": 0}
    for step, (g, w) in enumerate(zip(got, want)):
        assert rel_err(g, w) <= MODEL_TOL[dtype], (family, step)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_static_generate_greedy_gives_the_same_tokens(family, seed):
    """generate(cache_implementation="static"), greedy, batch 2 with left padding: the same tokens, and each
    step's logits within the fp32 tolerance."""
    ref = _tiny(family, torch.float32, seed)
    model = copy.deepcopy(ref)
    use_gqa_attention(model)
    ids, mask = _left_padded()
    kw = dict(max_new_tokens=NEW + 2, min_new_tokens=NEW + 2, do_sample=False, cache_implementation="static")
    seq_ref, steps_ref = generate(ref, ids, mask, **kw)
    seq, steps = generate(model, ids, mask, **kw)
    assert torch.equal(seq, seq_ref)
    for step, (g, w) in enumerate(zip(steps, steps_ref)):
        assert rel_err(g, w) <= MODEL_TOL[torch.float32], step


# ---- use_gqa_attention ---------------------------------------------------------------------------------

def test_use_gqa_attention_switches_once_and_is_idempotent():
    model = _tiny("llama")
    assert model.config._attn_implementation == "sdpa"
    assert use_gqa_attention(model) == DESCRIPTION
    assert model.config._attn_implementation == NAME
    fn = AttentionInterface().get_interface(model.model.layers[0].self_attn.config._attn_implementation,
                                                         None)
    assert fn is gqa_sdpa_attention_forward
    assert use_gqa_attention(model) == DESCRIPTION and model.config._attn_implementation == NAME


def test_use_gqa_attention_leaves_eager_attention_alone():
    model = _tiny("llama", attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert use_gqa_attention(model) is None
    assert model.config._attn_implementation == "eager"


def test_use_gqa_attention_leaves_a_model_that_refuses_it_on_sdpa(monkeypatch):
    """A model whose set_attn_implementation raises part-way (a sub-model that cannot take a registered
    implementation) is switched back to "sdpa" everywhere, and use_gqa_attention says None."""
    model = _tiny("llama")
    switch = type(model).set_attn_implementation

    def refuses(self, name, *a, **k):
        switch(self, name, *a, **k)   # the change lands, then a check fails, as a sub-model's would
        if name == NAME:
            raise ValueError("this sub-model does not support tilefish_sdpa")

    monkeypatch.setattr(type(model), "set_attn_implementation", refuses)
    assert use_gqa_attention(model) is None
    assert model.config._attn_implementation == "sdpa"
    assert model.model.layers[0].self_attn.config._attn_implementation == "sdpa"


def test_use_gqa_attention_leaves_a_model_without_gqa_alone():
    model = _tiny("qwen3", num_key_value_heads=4)
    assert use_gqa_attention(model) is None
    assert model.config._attn_implementation == "sdpa"


class Impostor(nn.Module):
    """Not a transformers model, with a config and a set_attn_implementation that look like one's."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.config = types.SimpleNamespace(_attn_implementation="sdpa", num_attention_heads=8, num_key_value_heads=2)

    def set_attn_implementation(self, name):
        pytest.fail(f"switched a non-transformers module to {name}")


@pytest.mark.parametrize("make", [lambda: nn.Linear(8, 8), lambda: nn.Sequential(nn.Linear(8, 8)), Impostor],
                         ids=["linear", "sequential", "impostor"])
def test_use_gqa_attention_returns_none_for_a_plain_module(make):
    module = make()
    before = copy.deepcopy(module.state_dict())
    assert use_gqa_attention(module) is None
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    if isinstance(module, Impostor):
        assert module.config._attn_implementation == "sdpa"


def test_switch_propagates_to_sub_configs_of_a_composite_model():
    """A vision-language model: the text and vision sub-models and sub-configs follow the switch (the vision
    tower has no GQA, so its calls are handed back to transformers)."""
    text = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14)
    model = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=255)).eval()
    assert use_gqa_attention(model) == DESCRIPTION
    config = model.config
    assert {config._attn_implementation, config.text_config._attn_implementation,
            config.vision_config._attn_implementation, model.model.language_model.config._attn_implementation,
            model.model.vision_tower.config._attn_implementation} == {NAME}


def test_switch_does_not_leak_into_the_saved_config(tmp_path):
    model = _tiny("qwen3")
    use_gqa_attention(model)
    assert NAME not in json.dumps(model.config.to_dict())
    model.save_pretrained(tmp_path)
    assert NAME not in (tmp_path / "config.json").read_text()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config._attn_implementation == "sdpa"


def test_import_tilefish_does_not_import_transformers():
    code = "import sys, tilefish, tilefish.attention; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
