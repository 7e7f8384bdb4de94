"""The model families people run (Llama, Mistral, Qwen2 / Qwen3, Gemma 2 / 3, Phi-3) through tilefish on
the CPU (the reference path): quantize_model's report, fused projections, logits against the dense twin,
and generate() with the dynamic and the static cache, each decode step against a teacher-forced forward.
One compiled generate (torch.compile fullgraph, the static cache) checks that the quantized model traces
without a graph break. The same loops on the GPU kernels, in every compile mode: test_user_loops.py."""
from __future__ import annotations

import pytest
import torch

import tilefish
from tilefish.nn import FusedW4A16Linear, NF4Linear, W4A16Linear, W4A16Slice

from hf_families import FAMILIES, agreeing_steps, build, dense_twin, generate, rel, teacher_forced

transformers = pytest.importorskip("transformers")

# The 4-bit layers compute in fp16 (fp32 inputs are cast in and the result back): a model's logits
# against its dense twin differ by that rounding through two layers (measured 6e-4 to 9e-4).
TWIN_TOL = 5e-3
STEP_TOL = 5e-3   # a decode step's logits against the teacher-forced forward (same weights, same rounding)
PROMPT, NEW = 7, 5


def _quantized(family: str, method: str = "w4a16", **kw):
    model = build(family)
    extra = {"clip_search": False} if method == "w4a16" else {}
    report = tilefish.quantize_model(model, method, **extra, **kw)
    return model, report


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_conversion_report_and_fused_projections(family):
    model, report = _quantized(family)
    layers = model.model.layers
    decoder = [n for n in report.converted if n.startswith("model.layers.")]
    if family == "phi3":  # qkv_proj and gate_up_proj are single Linears already: converted, nothing to fuse
        assert not report.fused
        assert isinstance(layers[0].self_attn.qkv_proj, W4A16Linear)
        assert isinstance(layers[0].mlp.gate_up_proj, W4A16Linear)
        assert len(decoder) == 4 * len(layers)
    else:
        assert set(report.fused) == {f"model.layers.{i}.{g}" for i in range(len(layers))
                                     for g in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
        assert isinstance(layers[0].self_attn.qkv_proj, FusedW4A16Linear)
        assert isinstance(layers[0].self_attn.k_proj, W4A16Slice)
        assert len(decoder) == 7 * len(layers)
    assert isinstance(model.lm_head, W4A16Linear) == report.lm_head.startswith("quantized")
    fp16_bytes = report.bytes_before // 2  # the tiny models are fp32; 4-bit weights with fp16 scales vs fp16
    assert 0.24 < report.bytes_after / fp16_bytes < 0.32


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_logits_match_the_dense_twin(family):
    model, _ = _quantized(family)
    twin = dense_twin(model)
    ids = torch.randint(3, 512, (2, 9))
    with torch.no_grad():
        assert rel(model(ids).logits, twin(ids).logits) < TWIN_TOL


@pytest.mark.parametrize("cache", [None, "static"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_generate_steps_match_teacher_forcing(family, cache):
    """generate() (greedy, batch 2) with the dynamic or the static cache: every decode step's logits equal
    a full forward's at that position, so the cache path runs the same 4-bit layers on m = 2 rows."""
    model, _ = _quantized(family)
    ids = torch.randint(3, 512, (2, PROMPT))
    seqs, steps = generate(model, ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           cache_implementation=cache)
    assert seqs.shape == (2, PROMPT + NEW) and torch.equal(seqs[:, :PROMPT], ids)
    for t, (got, want) in enumerate(zip(steps, teacher_forced(model, seqs, PROMPT))):
        assert rel(got, want) < STEP_TOL, (family, cache, t)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_family_nf4_generate(family):
    model, report = _quantized(family, "nf4", fuse=False)
    assert isinstance(model.model.layers[0].self_attn.q_proj, NF4Linear) and not report.fused
    ids = torch.randint(3, 512, (1, PROMPT))
    seqs, steps = generate(model, ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    for t, (got, want) in enumerate(zip(steps, teacher_forced(model, seqs, PROMPT))):
        assert rel(got, want) < STEP_TOL, t
    with torch.no_grad():
        assert rel(model(ids).logits, dense_twin(model)(ids).logits) < TWIN_TOL


def test_left_padded_batch_generate():
    """Batch 3 with left padding (prompts of 7, 5 and 3 tokens): every step of every row equals the
    teacher-forced forward under the same mask and positions."""
    model, _ = _quantized("llama")
    ids = torch.randint(3, 512, (3, PROMPT))
    mask = torch.ones_like(ids)
    for row, pad in ((1, 2), (2, 4)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    seqs, steps = generate(model, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           cache_implementation="static")
    for t, (got, want) in enumerate(zip(steps, teacher_forced(model, seqs, PROMPT, mask))):
        assert rel(got, want) < STEP_TOL, t


def test_sampling_generate_runs_and_is_seeded():
    model, _ = _quantized("llama")
    ids = torch.randint(3, 512, (2, PROMPT))
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, top_k=20,
                                   temperature=0.8, pad_token_id=0))
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (2, PROMPT + NEW)


def test_compiled_static_generate_traces_without_graph_breaks():
    """HF's own fast path (static cache, the forward compiled by generate) with fullgraph=True, on the
    CPU (compile_config._compile_all_devices): no graph break, one graph for every decode step, the
    fused layers keep no shared result afterwards, and the compiled steps equal the eager ones."""
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    model, _ = _quantized("llama")
    model.to(torch.bfloat16)
    ids = torch.randint(3, 512, (1, PROMPT))
    eager_seqs, eager_steps = generate(model, ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                       cache_implementation="static")
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    seqs, steps = generate(model, ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                           cache_implementation="static", compile_config=compile_config)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not any(m.holds_result for m in model.modules() if isinstance(m, FusedW4A16Linear))
    same = agreeing_steps(seqs, eager_seqs, PROMPT)
    for t in range(min(same + 1, NEW)):
        assert rel(steps[t], eager_steps[t]) < 2e-2, t  # bf16: Inductor fuses the norms and rotary
