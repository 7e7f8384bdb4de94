"""The loops users run, on the GPU kernels: a quantized Hugging Face model in eager mode, under
torch.compile in every mode (default, max-autotune-no-cudagraphs, reduce-overhead: CUDA graph trees),
fullgraph=True, through generate() with the dynamic cache and with cache_implementation="static" (HF
compiles the decode step itself, reduce-overhead), captured in a manual CUDA graph, batched with left
padding, and sampling. W4A16 and NF4, fused and not, int4 lm_head or not; then each model family
through HF's static-cache fast path.

A graph break, a recompile on a later step, or CUDA graphs skipped (a silent fallback to eager) fails
the test: torch._dynamo's counters say which happened."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import tilefish
from tilefish.nn import FusedW4A16Linear

from hf_families import FAMILIES, agreeing_steps, build, dense_twin, generate, rel, teacher_forced

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

# method, fuse, skip (lm_head dense or int4), activation dtype
VARIANTS = {
    "w4a16-fused": ("w4a16", True, ("lm_head",), torch.float16),
    "w4a16-unfused-int4-head": ("w4a16", False, (), torch.bfloat16),
    "nf4-fused-int4-head": ("nf4", True, (), torch.bfloat16),
    "nf4-unfused": ("nf4", False, ("lm_head",), torch.float16),
}
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")
PROMPT, NEW = 7, 6
TWIN_TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}   # two layers of 16-bit activations
STEP_TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}   # compiled vs eager: Inductor fuses norms, rotary


def _model(variant: str, family: str = "llama", **config):
    method, fuse, skip, dtype = VARIANTS[variant]
    model = build(family, dtype, "cuda", **config)
    extra = {"clip_search": False} if method == "w4a16" else {}
    tilefish.quantize_model(model, method, fuse=fuse, skip=skip, **extra)
    return model, dtype


@pytest.fixture(autouse=True)
def _fresh_compile_state():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _assert_no_fallback(graphs: int | None = None):
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    skips = counters["inductor"]["cudagraph_skips"]
    assert not skips, f"CUDA graphs skipped {skips} time(s): the compiled step fell back to eager"
    if graphs is not None:
        assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])


def _no_shared_results(model):
    return not any(m.holds_result for m in model.modules() if isinstance(m, FusedW4A16Linear))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_eager_logits_match_the_dense_twin(variant):
    model, dtype = _model(variant)
    ids = torch.randint(3, 512, (2, 11), device="cuda")
    with torch.no_grad():
        assert rel(model(ids).logits, dense_twin(model)(ids).logits) < TWIN_TOL[dtype]


@pytest.mark.parametrize("mode", COMPILE_MODES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_torch_compile_every_mode_fullgraph(variant, mode):
    """torch.compile(model, mode, fullgraph=True): three calls with new inputs of one shape each equal
    the eager forward, compile once, and under reduce-overhead run as CUDA graph trees (no skip)."""
    model, dtype = _model(variant)
    compiled = torch.compile(model, mode=mode, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for call in range(3):
            ids = torch.randint(3, 512, (2, 11), device="cuda")
            got = compiled(ids, use_cache=False).logits.float().clone()  # a graph tree reuses its output
            assert rel(got, model(ids, use_cache=False).logits) < STEP_TOL[dtype], call
    _assert_no_fallback(graphs=1)
    assert _no_shared_results(model)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_generate_dynamic_cache_eager(variant):
    model, dtype = _model(variant)
    ids = torch.randint(3, 512, (2, PROMPT), device="cuda")
    seqs, steps = generate(model, ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    for t, (got, want) in enumerate(zip(steps, teacher_forced(model, seqs, PROMPT))):
        assert rel(got, want) < STEP_TOL[dtype], t


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_generate_static_cache_compiled_by_hf(variant):
    """HF's documented fast path: generate(cache_implementation="static") compiles the decode step with
    mode="reduce-overhead" (CUDA graph trees); fullgraph=True makes a graph break an error. Batch 1, then
    batch 3 with left padding; each step against the eager static-cache run while the tokens agree,
    and against a teacher-forced forward; a second call of the same shape compiles nothing new."""
    from transformers.generation.configuration_utils import CompileConfig

    model, dtype = _model(variant)
    compile_config = CompileConfig(fullgraph=True)
    ids = torch.randint(3, 512, (3, PROMPT), device="cuda")
    mask = torch.ones_like(ids)
    for row, pad in ((1, 2), (2, 4)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    for batch_ids, batch_mask in ((ids[:1], mask[:1]), (ids, mask)):
        kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, cache_implementation="static")
        eager_seqs, eager_steps = generate(model, batch_ids, batch_mask, disable_compile=True, **kw)
        before = counters["stats"]["unique_graphs"]
        seqs, steps = generate(model, batch_ids, batch_mask, compile_config=compile_config, **kw)
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == before + 1, f"{graphs - before} graphs for one batch size's decode steps (1 expected)"
        again, again_steps = generate(model, batch_ids, batch_mask, compile_config=compile_config, **kw)
        assert counters["stats"]["unique_graphs"] == graphs, "the second call of the same shape recompiled"
        assert torch.equal(again, seqs) and all(torch.equal(a, b) for a, b in zip(again_steps, steps))
        for t in range(min(agreeing_steps(seqs, eager_seqs, PROMPT) + 1, NEW)):
            assert rel(steps[t], eager_steps[t]) < STEP_TOL[dtype], (batch_ids.shape[0], t)
        for t, (got, want) in enumerate(zip(steps, teacher_forced(model, seqs, PROMPT, batch_mask))):
            assert rel(got, want) < STEP_TOL[dtype], (batch_ids.shape[0], t)
    _assert_no_fallback()
    assert _no_shared_results(model)


def test_generate_static_cache_past_1024_slots():
    """HF's static-cache fast path over a cache of 1,100+ slots, batch 1 and 2: at 2 KV heads that is 9 two-tile
    chunks a (sequence, head), which sm_90 routes to rope_attention and combines in clusters wider than the
    portable 8, and other GPUs route to rope_cache + SDPA. Each compiled step (graph trees) against a
    teacher-forced forward."""
    from transformers.generation.configuration_utils import CompileConfig

    model, dtype = _model("w4a16-fused", max_position_embeddings=2048)
    prompt = 1100
    for batch in (1, 2):
        ids = torch.randint(3, 512, (batch, prompt), device="cuda")
        seqs, steps = generate(model, ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                               cache_implementation="static", compile_config=CompileConfig(fullgraph=True))
        for t, (got, want) in enumerate(zip(steps, teacher_forced(model, seqs, prompt))):
            assert rel(got, want) < STEP_TOL[dtype], (batch, t)
    _assert_no_fallback()
    assert _no_shared_results(model)


def test_sampling_through_the_static_cache_fast_path():
    from transformers.generation.configuration_utils import CompileConfig

    model, _ = _model("w4a16-fused")
    ids = torch.randint(3, 512, (4, PROMPT), device="cuda")
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=True, top_p=0.9,
                                   temperature=0.7, cache_implementation="static", pad_token_id=0,
                                   compile_config=CompileConfig(fullgraph=True)))
    assert runs[0].shape == (4, PROMPT + NEW) and torch.equal(runs[0], runs[1])
    assert int(runs[0].min()) >= 0 and int(runs[0].max()) < 512
    _assert_no_fallback()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_manual_cuda_graph_of_the_forward(variant):
    """The whole forward captured once with torch.cuda.graph and replayed with new ids copied into the
    static input: each replay equals an eager call on those ids."""
    model, dtype = _model(variant)
    static = torch.randint(3, 512, (2, 11), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad():
        with torch.cuda.stream(side):
            for _ in range(2):
                model(static, use_cache=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = model(static, use_cache=False).logits
        for _ in range(3):
            ids = torch.randint(3, 512, (2, 11), device="cuda")
            static.copy_(ids)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, model(ids, use_cache=False).logits)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_family_through_the_static_cache_fast_path(family):
    """Every family: quantize_model (W4A16, fused where the model has separate projections), logits
    against the dense twin, then generate(cache_implementation="static") compiled by HF (graph trees),
    each step against the eager run and a teacher-forced forward."""
    from transformers.generation.configuration_utils import CompileConfig

    dtype = torch.bfloat16
    model = build(family, dtype, "cuda")
    tilefish.quantize_model(model, clip_search=False)
    ids = torch.randint(3, 512, (2, PROMPT), device="cuda")
    with torch.no_grad():
        assert rel(model(ids).logits, dense_twin(model)(ids).logits) < TWIN_TOL[dtype]
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, cache_implementation="static")
    eager_seqs, eager_steps = generate(model, ids, disable_compile=True, **kw)
    seqs, steps = generate(model, ids, compile_config=CompileConfig(fullgraph=True), **kw)
    for t in range(min(agreeing_steps(seqs, eager_seqs, PROMPT) + 1, NEW)):
        assert rel(steps[t], eager_steps[t]) < STEP_TOL[dtype], t
    for t, (got, want) in enumerate(zip(steps, teacher_forced(model, seqs, PROMPT))):
        assert rel(got, want) < STEP_TOL[dtype], t
    _assert_no_fallback()
