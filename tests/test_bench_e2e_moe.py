"""`tilefish bench e2e --arch qwen3-moe`: the Qwen3-MoE decoder (bench/e2e_models.py) through the harness
(bench/e2e.py) and the generate() client (bench/e2e_generate.py), on CPU with a tiny config (bf16, eager and
compiled with the "eager" backend); the GPU tests run both loops on a two-layer model of realistic widths."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tilefish import cli  # noqa: E402
from tilefish.bench import e2e, e2e_generate, e2e_models  # noqa: E402
from tilefish.bench.e2e_models import MoEConfig  # noqa: E402
from tilefish.bench.families import FAMILIES  # noqa: E402
from tilefish.bench.report import Report  # noqa: E402
from tilefish.experts import QuantizedExperts  # noqa: E402
from tilefish.nn import W4A16Linear  # noqa: E402

from test_cli import parse  # noqa: E402  (the namespace a command line hands to its command)

CPU = torch.device("cpu")
# The smallest shapes every projection of which converts: the kernels tile n % 64 and k % group (128 for int4 g128:
# hidden and moe_intermediate are both a down or gate_up k).
TINY = MoEConfig(hidden_size=128, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=256)
# GPU: two layers of realistic widths (Qwen3-30B-A3B's attention and expert widths, fewer experts and a smaller vocab)
SMALL = MoEConfig(num_hidden_layers=2, num_experts=32, num_experts_per_tok=8, vocab_size=8192,
                  max_position_embeddings=1024)
MOE_LABELS = e2e_models.MOE_LABELS


def count_graphs():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


# ---- the model --------------------------------------------------------------------------------------------------

def test_qwen3_30b_a3b_shapes_and_memory():
    c = e2e_models.default_config("qwen3-moe")
    assert c == MoEConfig.qwen3_30b_a3b(48)
    hf = c.hf_config()
    assert (hf.hidden_size, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.num_attention_heads,
            hf.num_key_value_heads, hf.head_dim, hf.vocab_size, hf.norm_topk_prob, hf.num_hidden_layers,
            hf.decoder_sparse_step, hf.mlp_only_layers, hf.tie_word_embeddings) == (
        2048, 128, 8, 768, 32, 4, 128, 151936, True, 48, 1, [], False)
    assert e2e_models.default_config("qwen3-moe", 8).num_hidden_layers == 8
    layer = 2 * e2e_models.layer_params(c)
    assert 1.2e9 < layer < 1.3e9 and 2 * e2e_models.experts_params(c) == 128 * 3 * 2048 * 768 * 2
    # 48 layers (60 GB) fit an 80 GB H100; 16 GB holds a few
    assert e2e._fit_layers(c, 64 * 576, 78 << 30) >= 48
    assert 0 < e2e._fit_layers(c, 64 * 576, 16 << 30) < 12
    # batched_mm's gathered weights: decode batches up to 16 (1.2 GB), not 64 (4.8 GB) nor a 512-token prompt
    assert e2e_models.batched_mm_fits(c, 16) and not e2e_models.batched_mm_fits(c, 64)
    assert not e2e_models.batched_mm_fits(c, 512)
    assert e2e_models.arch_of(c) is e2e_models.QWEN3_MOE and e2e_models.arch_of(e2e_models.default_config(
        "llama3-8b")) is e2e_models.LLAMA


@torch.no_grad()
def test_build_convert_and_dense_twin():
    """The runner builds transformers' Qwen3MoeForCausalLM in bf16 with grouped_mm experts (transformers'
    default); int4 turns every experts module into QuantizedExperts and the attention Linears into W4A16Linears
    (q/k/v fused), leaving the routers and lm_head; dequantize_model gives back the dense experts."""
    from tilefish.convert import dequantize_model
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

    torch.manual_seed(0)
    runner = e2e._HF(TINY, CPU)
    model = runner.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._experts_implementation == "grouped_mm"
    dense_experts = e2e.experts_bytes(model)
    assert dense_experts == 2 * 2 * 3 * 8 * 128 * 128
    summary = e2e._convert(runner, "int4", lm_head="dense")
    assert "2 experts modules -> QuantizedExperts int4 g128" in summary and "8 linears" in summary
    experts = e2e_models.experts_modules(model)
    assert len(experts) == 2 and all(isinstance(m, QuantizedExperts) for m in experts)
    assert all(m.dtype == torch.bfloat16 and m.gate_up.group_size == 128 for m in experts)
    for layer in model.model.layers:
        assert isinstance(layer.mlp.gate, qm.Qwen3MoeTopKRouter) and layer.mlp.gate.weight.dtype == torch.bfloat16
        assert isinstance(layer.self_attn.o_proj, W4A16Linear)
    assert type(model.lm_head) is torch.nn.Linear
    assert e2e.experts_bytes(model) < 0.27 * dense_experts
    quantized = e2e._logits(runner, TINY.vocab_size, CPU)
    dequantize_model(model)
    assert all(type(m) is qm.Qwen3MoeExperts for m in e2e_models.experts_modules(model))
    assert e2e._rel(quantized, e2e._logits(runner, TINY.vocab_size, CPU)) < e2e.LARGE_REL_ERR


@pytest.mark.parametrize("impl", ["bf16", "bf16-batched", "int4", "mxfp4"])
@torch.no_grad()
def test_layers_compile_fullgraph_to_one_graph(impl):
    """Each decoder layer compiled on its own with fullgraph=True (the router's softmax / top-k, the experts:
    transformers' grouped_mm and batched_mm, tilefish's op through its fake implementation): one graph shared by
    the layers, and the compiled step matches the eager one."""
    torch.manual_seed(0)
    runner = e2e._HF(TINY, CPU)
    e2e._convert(runner, impl, lm_head="dense")
    ids, pos = torch.randint(TINY.vocab_size, (2, 1)), torch.tensor([7])
    runner.setup(2, 64)
    for t in runner.kv_tensors():
        t.normal_()
    eager = runner.step(ids, pos)
    backend, graphs = count_graphs()
    torch._dynamo.reset()
    for layer in runner.model.model.layers:
        layer.compile(fullgraph=True, dynamic=False, backend=backend)
    assert torch.equal(runner.step(ids, pos), eager)
    assert len(graphs) == 1
    torch._dynamo.reset()


@torch.no_grad()
def test_transformers_own_experts_loop_does_not_trace_fullgraph():
    """Why the dense rows run grouped_mm / batched_mm: the experts module's own loop (experts implementation
    "eager") reads the hit experts on the host."""
    torch.manual_seed(0)
    runner = e2e._HF(TINY, CPU)
    runner.model.set_experts_implementation("eager")
    mlp = runner.model.model.layers[0].mlp
    torch._dynamo.reset()
    with pytest.raises(Exception, match="data-dependent|Data-dependent|nonzero"):
        torch.compile(mlp, fullgraph=True, backend="eager")(torch.randn(1, 1, TINY.hidden_size, dtype=torch.bfloat16))
    torch._dynamo.reset()


# ---- the harness ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_report():
    """The whole harness on CPU, both modes, every MoE variant (one run shared by the tests below)."""
    return e2e.run(arch="qwen3-moe", batches=(2,), prefill=(8,), context=8, modes=("eager", "compiled"), reps=1,
                   config=TINY, device="cpu", backend="eager")


def test_run_on_cpu(cpu_report):
    rep = cpu_report
    assert rep.title.startswith("End-to-end decoder, Qwen3-30B-A3B shapes, 2 layers, hf model, bf16 activations")
    assert len(rep.rows) == 2 * 2 * 4
    assert {r.impl for r in rep.rows} == set(MOE_LABELS.values())
    assert {r.case for r in rep.rows} == {f"qwen3-moe {m} {c}" for m in ("eager", "compiled")
                                         for c in ("decode b2 ctx8", "prefill 8")}
    for r in rep.rows:
        x = r.extra
        assert x["arch"] == "qwen3-moe" and x["dtype"] == "bf16" and x["model"] == "hf" and x["layers"] == 2
        assert r.unit == "tok/s" and r.time_us > 0
        if x["impl_key"] in ("bf16", "bf16-batched"):
            assert r.ratios == {} and x["layer_bytes_ratio"] == 1.0
            assert x["logits_rel_err"] < 1e-2  # the two dense implementations agree
        else:
            dense = {d: next(o for o in rep.rows if o.case == r.case and o.extra["impl_key"] == d).time_us
                     for d in ("bf16", "bf16-batched")}
            assert set(r.ratios) == {"bf16 grouped_mm", "bf16 batched_mm", "best bf16"}
            assert r.ratios["bf16 grouped_mm"] == pytest.approx(dense["bf16"] / r.time_us)
            assert r.ratios["best bf16"] == pytest.approx(min(dense.values()) / r.time_us)
            assert x["experts_bytes_ratio"] < 0.3 and x["layer_bytes_ratio"] < 0.3
            assert 0 < x["logits_rel_err"] < 1.0
            assert x["kernel_rel_err"] is not None and x["kernel_rel_err"] < e2e.LARGE_REL_ERR  # the twin was built
    notes = "\n".join(rep.notes)
    assert "'grouped_mm', transformers' default" in notes and "bf16 (dense, transformers' grouped_mm experts)" in notes
    assert "bf16-batched (dense, transformers' batched_mm experts)" in notes
    assert "2 experts modules -> QuantizedExperts int4 g128" in notes and "QuantizedExperts mxfp4" in notes
    assert "dense twin" in notes and "no dense twin" not in notes and "FAILED" not in notes
    assert any(n.startswith("tilefish int4 g128 weights:") and ", experts " in n for n in rep.notes)


def test_headlines_and_heading(cpu_report):
    fam = FAMILIES["e2e"]
    assert fam.heading(cpu_report) == "End-to-end decoder, Qwen3-30B-A3B shapes, 2 layers"
    labels = [h["label"] for h in fam.headlines(cpu_report)]
    assert "tilefish int4 g128 vs best bf16, qwen3-moe compiled decode b2" in labels
    assert len(labels) == 2 * 2 * 2  # the two quantized variants' rows


def test_batched_mm_skips_the_cases_its_gather_cannot_hold(monkeypatch):
    one_expert = 3 * TINY.hidden_size * TINY.moe_intermediate_size * 2
    monkeypatch.setattr(e2e_models, "BATCHED_MM_MAX_BYTES", 2 * 2 * one_expert)  # decode b2 (4 slots), not 8 tokens
    rep = e2e.run(arch="qwen3-moe", batches=(2,), prefill=(8,), context=8, modes=("eager",),
                  impls=("bf16", "bf16-batched", "int4"), reps=1, config=TINY, device="cpu")
    assert sorted((r.case, r.extra["impl_key"]) for r in rep.rows) == [
        ("qwen3-moe eager decode b2 ctx8", "bf16"), ("qwen3-moe eager decode b2 ctx8", "bf16-batched"),
        ("qwen3-moe eager decode b2 ctx8", "int4"), ("qwen3-moe eager prefill 8", "bf16"),
        ("qwen3-moe eager prefill 8", "int4")]
    prefill = next(r for r in rep.rows if r.case.endswith("prefill 8") and r.extra["impl_key"] == "int4")
    assert set(prefill.ratios) == {"bf16 grouped_mm", "best bf16"}
    assert any(n.startswith("bf16-batched not timed at eager prefill 8: transformers' batched_mm") for n in rep.notes)


def test_run_rejects_what_the_moe_model_cannot_run():
    with pytest.raises(ValueError, match="needs --model hf"):
        e2e.run(arch="qwen3-moe", model="builtin", config=TINY, device="cpu")
    with pytest.raises(ValueError, match="unknown modes or impls"):
        e2e.run(arch="qwen3-moe", impls=("w4a16",), config=TINY, device="cpu")
    with pytest.raises(ValueError, match="unknown arch"):
        e2e.run(arch="mixtral", device="cpu")
    with pytest.raises(ValueError, match="with a MoEConfig"):
        e2e.run(arch="llama3-8b", config=TINY, device="cpu")


# ---- the generate() client (times on CUDA only; its model building and rows here) ------------------------------

@torch.no_grad()
def test_generate_builds_the_moe_variants():
    model, summary = e2e_generate._build(TINY, "bf16", CPU, 0, "dense")
    assert "batched_mm for the decode steps" in summary and "_optimize_model_for_decode" not in vars(model)
    model, summary = e2e_generate._build(TINY, "bf16-grouped", CPU, 0, "dense")
    assert "grouped_mm" in summary and vars(model)["_optimize_model_for_decode"]().__class__.__name__ == "nullcontext"
    ids = torch.randint(3, TINY.vocab_size, (1, 5))
    assert e2e_generate._generate(model, ids, 3).shape == (1, 8)  # generate() with its decode switch off
    model, summary = e2e_generate._build(TINY, "int4", CPU, 0, "dense")
    assert "QuantizedExperts int4 g128" in summary
    assert all(isinstance(m, QuantizedExperts) for m in e2e_models.experts_modules(model))
    assert e2e_generate._generate(model, ids, 3).shape == (1, 8)
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="needs a GPU"):
        e2e_generate.run(arch="qwen3-moe", device="cpu")


def test_generate_rows_and_ratios():
    def result(ms):
        return {"ms_per_token": ms, "gpu_ms_per_token": ms * 0.9, "host_ms_per_token": ms * 0.1, "setup_s": 1.0,
                "generate_s": 1.0, "prefill_s": 0.1}

    results = {"bf16": {1: result(4.0)}, "bf16-grouped": {1: result(5.0)}, "int4": {1: result(1.0)}}
    info = {i: {"summary": i, "model_bytes": 1 << 30, "logits_rel_err_vs_dense": None if i == "bf16" else 0.2}
            for i in results}
    rep = Report("generate")
    e2e_generate._add_rows(rep, TINY, results, info, new_tokens=8, prompt=4)
    rows = {r.extra["impl_key"]: r for r in rep.rows}
    assert {r.case for r in rep.rows} == {"qwen3-moe generate decode b1"}
    assert rows["int4"].impl == "tilefish int4 g128" and rows["bf16"].impl == "bf16 batched_mm"
    assert rows["int4"].ratios == {"bf16 batched_mm": 4.0, "bf16 grouped_mm": 5.0, "best bf16": 4.0}
    assert rows["bf16"].ratios == {} and rows["bf16-grouped"].ratios == {}
    assert rows["int4"].extra["arch"] == "qwen3-moe" and rows["int4"].extra["dtype"] == "bf16"
    assert FAMILIES["e2e"].headlines(rep)[0]["label"] == "tilefish int4 g128 vs best bf16, qwen3-moe generate decode b1"


# ---- the command line -------------------------------------------------------------------------------------------

def test_cli_arch_flag(monkeypatch, capsys):
    assert parse(monkeypatch, "bench", "e2e").arch == "llama3-8b"
    a = parse(monkeypatch, "bench", "e2e", "--arch", "qwen3-moe", "--layers", "8", "--batches", "1", "--prefill",
              "2048", "--modes", "compiled", "--impls", "bf16,bf16-batched,int4,bf16-grouped")
    assert (a.arch, a.layers, a.batches, a.prefill, a.impls) == ("qwen3-moe", 8, "1", "2048",
                                                                "bf16,bf16-batched,int4,bf16-grouped")
    for bad in (["--arch", "mixtral"], ["--arch", "qwen3-moe", "--impls", "int3"], ["--layers", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", "e2e", *bad])
        assert e.value.code == 2 and bad[-2] in capsys.readouterr().err


def test_family_maps_the_moe_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(e2e, "run", lambda **kw: calls.append(("harness", kw)) or Report("e2e"))
    monkeypatch.setattr(e2e_generate, "run", lambda **kw: calls.append(("generate", kw)) or kw["report"])
    run = lambda *argv: (calls.clear(), FAMILIES["e2e"].run(parse(monkeypatch, "bench", "e2e", *argv)))[1]  # noqa
    run("--arch", "qwen3-moe", "--layers", "8", "--batches", "1", "--prefill", "2048", "--modes", "compiled",
        "--generate-batches", "1", "--new-tokens", "64")
    (h, hk), (g, gk) = calls
    assert (h, g) == ("harness", "generate")
    assert hk["arch"] == gk["arch"] == "qwen3-moe" and hk["layers"] == gk["layers"] == 8
    assert hk["impls"] == ["bf16", "bf16-batched", "int4", "mxfp4"] and hk["batches"] == [1]
    assert hk["prefill"] == [2048] and hk["modes"] == ["compiled"]
    assert sorted(gk["impls"]) == ["bf16", "bf16-grouped", "int4", "mxfp4"]
    assert gk["batches"] == [1] and gk["new_tokens"] == 64
    run("--arch", "qwen3-moe", "--impls", "bf16-grouped,int4")  # each loop takes the variants it has
    assert [(loop, kw["impls"]) for loop, kw in calls] == [("harness", ["int4"]), ("generate", ["bf16-grouped", "int4"])]
    assert calls[0][1]["layers"] is None  # the whole model (48 layers; fewer if the GPU cannot hold them)
    with pytest.raises(ValueError, match="nothing to run"):
        run("--arch", "qwen3-moe", "--impls", "w4a16,fp16")
    with pytest.raises(ValueError, match="Llama only"):
        run("--arch", "qwen3-moe", "--tp", "1,2")


# ---- GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_harness_on_gpu():
    """Both modes (compiled: per-layer inductor + one CUDA graph a step) on two layers of realistic widths; the
    quantized variants' logits against their dense twins within the Llama path's bound."""
    rep = e2e.run(arch="qwen3-moe", batches=(1, 4), prefill=(64,), context=64, reps=5, config=SMALL)
    assert not [n for n in rep.notes if "FAILED" in n or "LARGE" in n], rep.notes
    # every variant in both modes at both decode batches; bf16-batched sits out the 64-token prompt, whose gathered
    # copies of the selected experts (64 x 8 x 9.4 MB of bf16) pass the 4 GiB it may take, and a note says so
    cases = {(r.extra["mode"], r.extra["phase"], r.extra["batch"], r.extra["tokens"]) for r in rep.rows}
    assert len(cases) == 2 * 3, cases
    for mode, phase, batch, tokens in cases:
        impls = sorted(r.extra["impl_key"] for r in rep.rows if (r.extra["mode"], r.extra["phase"], r.extra["batch"],
                                                                r.extra["tokens"]) == (mode, phase, batch, tokens))
        want = ["bf16", "bf16-batched", "int4", "mxfp4"] if phase == "decode" else ["bf16", "int4", "mxfp4"]
        assert impls == want, (mode, phase, impls)
    assert any("bf16-batched not timed" in n for n in rep.notes), rep.notes
    for r in rep.rows:
        assert r.time_us > 0 and r.metric > 0
        if r.extra["impl_key"] in e2e_models.MOE_QUANTIZED:
            assert r.extra["kernel_rel_err"] < e2e.LARGE_REL_ERR and "best bf16" in r.ratios


@pytest.mark.gpu
def test_generate_on_gpu():
    """generate() with the static cache and HF's own compile: every MoE variant a row, no failure, the 4-bit
    variants' logits near the dense model's (two layers of 4-bit rounding)."""
    rep = e2e_generate.run(arch="qwen3-moe", batches=(1, 3), new_tokens=6, prompt=5, reps=1, config=SMALL)
    assert not [n for n in rep.notes if "FAILED" in n], rep.notes
    assert sorted((r.extra["impl_key"], r.extra["batch"]) for r in rep.rows) == sorted(
        (i, b) for i in e2e_models.MOE_GENERATE_IMPLS for b in (1, 3))
    for r in rep.rows:
        assert r.extra["ms_per_token"] > 0 and r.extra["gpu_ms_per_token"] is not None, r
        if r.extra["impl_key"] in e2e_models.MOE_QUANTIZED:
            assert set(r.ratios) == {"bf16 batched_mm", "bf16 grouped_mm", "best bf16"}
            assert r.extra["logits_rel_err_vs_dense"] < 0.5
