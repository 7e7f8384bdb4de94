"""The built-in Llama decoder (tilefish.models.llama) and the end-to-end benchmark harness (bench/e2e.py),
on CPU with a tiny config; one GPU test runs the whole benchmark on a tiny config."""
from __future__ import annotations

import argparse
import json
import sys
import weakref

import pytest
import torch

from tilefish.bench import e2e
from tilefish.bench.families import FAMILIES
from tilefish.bench.report import Report
from tilefish.models.llama import LlamaConfig, LlamaForCausalLM, hf_config

from conftest import rel_err

CPU = torch.device("cpu")
TINY = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, vocab_size=512, rope_theta=10000.0, max_position_embeddings=256)


@pytest.fixture(autouse=True)
def fast_quantize(monkeypatch):
    """W4A16 conversion without the clip search (11 candidate scales per group): the CPU tests time
    the harness, not the quantizer. Other methods (nf4) pass through unchanged."""
    import tilefish.convert

    quantize_model = tilefish.convert.quantize_model

    def fast(model, **kw):
        if kw.get("method", "w4a16") == "w4a16":
            kw.setdefault("clip_search", False)
        return quantize_model(model, **kw)

    monkeypatch.setattr(tilefish.convert, "quantize_model", fast)


def tiny_model(dtype=torch.float32, seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(TINY, CPU, dtype).eval()


def count_graphs():
    """A torch.compile backend that runs the graph as traced and records it."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend, graphs


@torch.no_grad()
def test_config_llama3_8b():
    c = LlamaConfig.llama3_8b(layers=4)
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.rope_theta, c.rms_norm_eps) == (4096, 14336, 4, 32, 8, 128, 128256, 500000.0, 1e-5)


@torch.no_grad()
def test_random_init_on_target_dtype():
    m = tiny_model(torch.float16)
    assert {p.dtype for p in m.parameters()} == {torch.float16}
    assert m.model.rotary_emb.inv_freq.dtype == torch.float32
    assert abs(m.model.layers[0].mlp.up_proj.weight.float().std().item() - 0.02) < 2e-3
    assert torch.equal(m.model.norm.weight, torch.ones_like(m.model.norm.weight))


@torch.no_grad()
def test_builtin_matches_transformers():
    transformers = pytest.importorskip("transformers")
    ours = tiny_model()
    theirs = transformers.LlamaForCausalLM(hf_config(TINY)).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)  # and back: the same keys and shapes
    ids = torch.randint(TINY.vocab_size, (2, 13))
    ours.setup_cache(2, 32)
    assert rel_err(ours(ids, torch.arange(13)), theirs(ids).logits) < 1e-5


@torch.no_grad()
def test_static_cache_decode_matches_full_forward():
    m = tiny_model()
    ids = torch.randint(TINY.vocab_size, (2, 9))
    m.setup_cache(2, 16)
    full = m(ids, torch.arange(9))
    m.setup_cache(2, 16)
    m(ids[:, :8], torch.arange(8))
    step = m(ids[:, 8:], torch.tensor([8]))
    assert rel_err(step[:, 0], full[:, 8]) < 1e-5
    # The same step again writes the same cache slot and gives the same logits (what a graph replay does).
    assert torch.equal(m(ids[:, 8:], torch.tensor([8])), step)
    assert rel_err(m(ids[:, :8], torch.arange(8), logits_to_keep=1), full[:, 7:8]) < 1e-5


@torch.no_grad()
def test_compile_fullgraph_traces_decode_step():
    m = tiny_model()
    ids = torch.randint(TINY.vocab_size, (2, 1))
    m.setup_cache(2, 16)
    m(torch.randint(TINY.vocab_size, (2, 5)), torch.arange(5))
    eager = m(ids, torch.tensor([5]))
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    assert torch.equal(compiled(ids, torch.tensor([5])), eager)


@pytest.mark.parametrize("kind", ["builtin", "hf"])
@torch.no_grad()
def test_layer_compile_shares_one_graph_w4a16(kind):
    """Each decoder layer compiled on its own (fullgraph), after W4A16 conversion with fused q/k/v and
    gate/up: the layers trace to one graph, and the compiled step matches the eager one."""
    if kind == "hf":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    runner = (e2e._HF if kind == "hf" else e2e._Builtin)(TINY, CPU)
    e2e._convert(runner, "w4a16", lm_head="dense")
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


@pytest.mark.parametrize("kind", ["builtin", "hf"])
@torch.no_grad()
def test_runner_step_matches_full_forward(kind):
    """The benchmark's step (both model kinds): prefill then decode through the static cache agree with
    a forward over the whole sequence, and repeating a step (as a graph replay does) changes nothing."""
    if kind == "hf":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    runner = (e2e._HF if kind == "hf" else e2e._Builtin)(TINY, CPU)
    ids = torch.randint(TINY.vocab_size, (1, 9))
    runner.setup(1, 64)
    full = runner.step(ids, torch.arange(9), logits_to_keep=0)
    if kind == "hf":
        assert rel_err(full, runner.model(ids).logits) < 1e-3
    runner.setup(1, 64)
    runner.step(ids[:, :8], torch.arange(8))
    first = runner.step(ids[:, 8:], torch.tensor([8]))
    again = runner.step(ids[:, 8:], torch.tensor([8]))
    assert rel_err(first[:, 0], full[:, 8]) < 2e-3
    assert torch.equal(first, again)


def test_weight_bytes_counts_shared_storage_once_and_quant_state():
    lin = torch.nn.Linear(64, 32, bias=False)
    tied = torch.nn.ModuleDict({"a": lin, "b": lin})
    assert e2e.weight_bytes(tied) == 64 * 32 * 4

    class QuantState:  # bitsandbytes' shape: tensors and a nested state as attributes
        def __init__(self, absmax, state2=None):
            self.absmax, self.code, self.state2, self.shape = absmax, torch.zeros(16), state2, torch.Size((32, 64))

    w = torch.nn.Parameter(torch.zeros(1024, 1, dtype=torch.uint8), requires_grad=False)
    w.quant_state = QuantState(torch.zeros(32, dtype=torch.uint8), QuantState(torch.zeros(1)))
    holder = torch.nn.Module()
    holder.weight = w
    assert e2e.weight_bytes(holder) == 1024 + 32 + 16 * 4 + 4 + 16 * 4


@pytest.mark.parametrize("impl", ["fp16", "w4a16"])
def test_decode_bytes_are_the_layers_the_lm_head_and_the_cache_slots(impl):
    """decode_bytes against the tensors themselves: the decoder layers' and lm_head's storage, and the KV cache a
    decode step over `context` cached tokens allocates (every slot is read)."""
    torch.manual_seed(0)
    runner = e2e._Builtin(TINY, torch.device("cpu"))
    with torch.no_grad():
        e2e._convert(runner, impl, "quantize")
    batch, context = 3, 70
    runner.setup(batch, e2e._round_up(context + 1, e2e.CACHE_ALIGN))
    cache = sum(t.numel() * t.element_size() for t in runner.kv_tensors())
    layers, head = e2e.weight_bytes(runner.model.model.layers), e2e.weight_bytes(runner.model.lm_head)
    assert e2e.decode_bytes(TINY, layers, head, batch, context) == layers + head + cache
    runner.free()


def test_progress_without_rich_prints_a_line_per_step(monkeypatch, capsys):
    from tilefish.bench.progress import InnerProgress  # the bench functions' own steps (bench e2e, bench nf4's matmul)

    monkeypatch.setitem(sys.modules, "rich.progress", None)  # import fails: the plain fallback
    with InnerProgress(2) as progress:
        progress.step("fp16: build")
        progress.step("fp16 eager decode 1")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[1/2] fp16: build") and out[0].endswith("ETA ?)")
    assert out[1].startswith("[2/2] fp16 eager decode 1") and "ETA 0 s" in out[1]


def test_fit_layers():
    cfg = LlamaConfig.llama3_8b()
    assert e2e._fit_layers(cfg, 64 * 576, 78 << 30) >= 32
    few = e2e._fit_layers(cfg, 64 * 576, 16 << 30)
    assert 0 < few < 32
    assert e2e._fit_layers(cfg, 64 * 576, 4 << 30) == 0


@pytest.mark.parametrize("kind,modes", [("builtin", ("eager", "compiled")), ("hf", ("eager",))])
def test_run_on_cpu(kind, modes, tmp_path):
    """The whole harness on CPU (no CUDA graph, perf_counter timing); the hf kind's compiled layers are
    covered by test_layer_compile_shares_one_graph_w4a16."""
    if kind == "hf":
        pytest.importorskip("transformers")
    rep = e2e.run(batches=(2,), prefill=(8,), context=8, modes=modes, impls=e2e.IMPLS, model=kind,
                  reps=1, config=TINY, device="cpu", backend="eager")
    dense = ["fp16"] + (["fp16 + tilefish attention"] if kind == "hf" else [])   # builtin: no K/V repeat to remove
    impls = (dense + ["tilefish w4a16"] + (["tilefish w4a16, transformers' layer forward"] if kind == "hf" else [])
             + (["bitsandbytes nf4"] if e2e._bnb_problem() is None else [])
             + (["tilefish nf4"] if e2e._tilefish_nf4_problem() is None else []))
    if kind == "builtin":  # no K/V repeat to remove, no transformers layer forward
        assert any(n.startswith("fp16-gqa skipped: ") for n in rep.notes), rep.notes
        assert any(n.startswith("w4a16-hf skipped: ") for n in rep.notes), rep.notes
    if e2e._tilefish_nf4_problem() is not None:  # tilefish.quantize_model(method="nf4") not in this build
        assert any(n.startswith("tilefish-nf4 skipped: ") for n in rep.notes), rep.notes
    assert len(rep.rows) == len(modes) * 2 * len(impls)
    assert {r.impl for r in rep.rows} == set(impls)
    assert {r.case for r in rep.rows} == {c for m in modes for c in (f"{m} decode b2 ctx8", f"{m} prefill 8")}
    for r in rep.rows:
        assert r.unit == "tok/s" and r.time_us > 0 and r.extra["model"] == kind and r.extra["mode"] in modes
        assert r.metric == pytest.approx((2 if r.extra["phase"] == "decode" else 8) / (r.extra["ms_per_step"] * 1e-3))
        assert r.pct_ceiling is None and r.extra["copy_gbps"] is None   # no copy ceiling off the GPU
        assert (r.extra["bytes_per_step"] is not None) == (r.extra["phase"] == "decode")
        if r.impl == "fp16":
            assert r.ratios == {} and r.extra["logits_rel_err"] == 0.0
        elif r.impl == "fp16 + tilefish attention":   # the same weights; attention's rounding only
            assert r.ratios == {} and r.extra["logits_rel_err"] < 1e-2
        else:
            assert set(r.ratios) == set(dense) and r.extra["layer_bytes_ratio"] < 0.3
            assert 0 < r.extra["logits_rel_err"] < 1.0   # 4-bit weights vs fp16 (random model, 2 layers)
            if r.impl == "tilefish w4a16":
                assert r.extra["kernel_rel_err"] < e2e.LARGE_REL_ERR
            if r.impl == "tilefish nf4" and r.extra["kernel_rel_err"] is not None:  # None: no dense twin (noted)
                assert r.extra["kernel_rel_err"] < e2e.LARGE_REL_ERR
    assert any("relative error" in n for n in rep.notes)
    rep.to_json(tmp_path / "e2e.json")
    assert json.loads((tmp_path / "e2e.json").read_text())["rows"][0]["unit"] == "tok/s"
    assert len(Report.from_json(tmp_path / "e2e.json").rows) == len(rep.rows)


def test_run_reports_a_failing_variant_and_keeps_the_rest(monkeypatch):
    """A variant that fails mid-way keeps the rows it finished; the failure is a note, not a crash."""
    from tilefish.nn import W4A16Linear

    measure = e2e._measure

    def failing(runner, phase, *args):
        if phase == "prefill" and any(isinstance(m, W4A16Linear) for m in runner.model.modules()):
            raise RuntimeError("kernel exploded\nsecond line")
        return measure(runner, phase, *args)

    monkeypatch.setattr(e2e, "_measure", failing)
    rep = e2e.run(batches=(2,), prefill=(8,), context=8, modes=("eager",), impls=("fp16", "w4a16"), model="builtin",
                  reps=1, config=TINY, device="cpu")
    assert sorted((r.case, r.impl) for r in rep.rows) == [("eager decode b2 ctx8", "fp16"),
                                                         ("eager decode b2 ctx8", "tilefish w4a16"),
                                                         ("eager prefill 8", "fp16")]
    assert any(n.startswith("w4a16 FAILED") and n.endswith("RuntimeError: kernel exploded") for n in rep.notes)


def test_run_frees_each_variant_before_building_the_next(monkeypatch):
    """Peak memory stays one model: when a variant is built, the previous one is gone."""
    built = []

    class Tracked(e2e._Builtin):
        def __init__(self, *args):
            assert all(ref() is None for ref in built), "the previous variant's model is still alive"
            super().__init__(*args)
            built.append(weakref.ref(self.model))

    monkeypatch.setattr(e2e, "_Builtin", Tracked)
    rep = e2e.run(batches=(2,), prefill=(), context=8, modes=("eager",), impls=("fp16", "w4a16"), model="builtin",
                  reps=1, config=TINY, device="cpu")
    assert len(built) == 2 and len(rep.rows) == 2


def test_tilefish_nf4_conversion_call(monkeypatch):
    """The tilefish-nf4 variant asks quantize_model for NF4 with bitsandbytes' defaults (blocksize 64,
    double quant), fused like W4A16, with the lm_head choice passed on (--lm-head)."""
    import tilefish.convert

    calls = []
    monkeypatch.setattr(tilefish.convert, "quantize_model",
                        lambda model, **kw: calls.append(kw) or tilefish.convert.ConversionReport())
    runner = e2e._Builtin(TINY, CPU)
    summary = e2e._convert(runner, "tilefish-nf4", lm_head="dense")
    assert calls[-1] == dict(method="nf4", blocksize=64, double_quant=True, fuse=True, lm_head="dense")
    assert "tilefish NF4 (blocksize 64, double quant)" in summary
    e2e._convert(runner, "tilefish-nf4", lm_head="quantize")
    assert calls[-1] == dict(method="nf4", blocksize=64, double_quant=True, fuse=True, lm_head="quantize")


def test_tilefish_nf4_skipped_with_a_note_when_quantize_model_lacks_nf4(monkeypatch):
    import tilefish.convert

    monkeypatch.setattr(tilefish.convert, "METHODS", ("w4a16",))
    assert "method='nf4'" in e2e._tilefish_nf4_problem()
    rep = e2e.run(batches=(2,), prefill=(), context=8, modes=("eager",), impls=("fp16", "tilefish-nf4"),
                  model="builtin", reps=1, config=TINY, device="cpu")
    assert [r.impl for r in rep.rows] == ["fp16"]
    assert any(n.startswith("tilefish-nf4 skipped: tilefish.quantize_model has no method='nf4'") for n in rep.notes)


@torch.no_grad()
def test_tilefish_nf4_variant_checks(monkeypatch):
    """The tilefish-nf4 variant's rows and logits checks (its dense twin; bitsandbytes nf4's logits), on
    stand-ins: quantize_model(method="nf4") converts to W4A16 here, and the "bitsandbytes" variant leaves
    the model dense, so its logits are fp16's."""
    import tilefish.convert

    quantize_model = tilefish.convert.quantize_model

    def as_w4a16(model, method, blocksize, double_quant, fuse, **kw):
        assert (method, blocksize, double_quant, fuse) == ("nf4", 64, True, True)
        return quantize_model(model, fuse=fuse, **kw)

    monkeypatch.setattr(tilefish.convert, "quantize_model", as_w4a16)
    monkeypatch.setattr(e2e, "_tilefish_nf4_problem", lambda: None)
    monkeypatch.setattr(e2e, "_bnb_problem", lambda: None)
    monkeypatch.setattr(e2e, "_to_nf4", lambda layers: None)
    # lm_head dense: bitsandbytes' model keeps it dense, so only then are the two the same NF4 weights
    rep = e2e.run(batches=(2,), prefill=(), context=8, modes=("eager",), impls=("fp16", "nf4", "tilefish-nf4"),
                  model="builtin", reps=1, config=TINY, device="cpu", lm_head="dense")
    assert [r.impl for r in rep.rows] == ["fp16", "bitsandbytes nf4", "tilefish nf4"]
    ours = rep.rows[2].extra
    assert rep.rows[2].ratios.keys() == {"fp16"} and ours["layer_bytes_ratio"] < 0.3
    assert ours["kernel_rel_err"] < e2e.LARGE_REL_ERR
    assert ours["bnb_nf4_rel_err"] == pytest.approx(ours["logits_rel_err"]) and ours["bnb_nf4_rel_err"] > 0
    line, = [n for n in rep.notes if n.startswith("tilefish-nf4 (")]
    assert "vs bitsandbytes nf4 on the same NF4 weights" in line and "dense twin" in line
    assert rep.rows[1].extra["bnb_nf4_rel_err"] is None


def test_suite_maps_cli_flags(monkeypatch):
    calls = []
    monkeypatch.setattr(e2e, "run", lambda **kw: calls.append(kw) or Report("e2e"))
    args = argparse.Namespace(family="e2e", layers=4, batches="1,8", prefill="128", context=256, modes="eager",
                              model="builtin", lm_head="quantize", impls="fp16,w4a16", reps=7)
    FAMILIES["e2e"].run(args)
    assert calls[-1] == dict(layers=4, batches=[1, 8], prefill=[128], context=256, modes=["eager"],
                             impls=["fp16", "w4a16"], model="builtin", lm_head="quantize", reps=7, arch="llama3-8b")
    args.family = None  # the all-families run: reduced, and says so
    FAMILIES["e2e"].run(args)
    reduced = calls[-1]
    assert reduced["layers"] == 8 and reduced["batches"] == [1, 16] and reduced["modes"] == ["compiled"]
    assert reduced["prefill"] == [] and "reduced" in reduced["title_note"]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["builtin", "hf"])
def test_run_on_gpu(kind):
    if kind == "hf":
        pytest.importorskip("transformers")
    rep = e2e.run(batches=(1, 4), prefill=(64,), context=64, model=kind, reps=5, config=TINY)
    impls = len(e2e.IMPLS) - (0 if e2e._bnb_problem() is None else 1)  # "nf4" is bitsandbytes'
    impls -= 2 if kind == "builtin" else 0  # fp16-gqa and w4a16-hf need transformers' model
    assert len(rep.rows) == 2 * 3 * impls, rep.notes
    assert not [n for n in rep.notes if "FAILED" in n or "LARGE" in n], rep.notes
    assert all(r.time_us > 0 and r.metric > 0 for r in rep.rows)


@pytest.mark.gpu
def test_generate_client_on_gpu():
    """The generate() client on a tiny config: every variant that can run here gives a row per batch
    size with its wall / GPU / host split, the 4-bit ones a ratio to their dense dtype, nothing fails."""
    pytest.importorskip("transformers")
    from tilefish.bench import e2e_generate

    impls = [i for i in e2e_generate.IMPLS if e2e_generate.unavailable(i) is None]
    rep = e2e_generate.run(batches=(1, 3), impls=impls, new_tokens=6, prompt=5, reps=1, config=TINY)
    assert not [n for n in rep.notes if "FAILED" in n], rep.notes
    assert sorted((r.extra["impl_key"], r.extra["batch"]) for r in rep.rows) == sorted(
        (i, b) for i in impls for b in (1, 3))
    for r in rep.rows:
        assert r.extra["ms_per_token"] > 0 and r.extra["gpu_ms_per_token"] is not None, r
        dense = e2e_generate.LABELS[e2e_generate.DENSE[e2e_generate.DTYPES[r.extra["impl_key"]]]]
        assert r.impl == dense or dense in r.ratios, (r.impl, r.ratios)
    errs = [r.extra["logits_rel_err_vs_dense"] for r in rep.rows if r.extra["logits_rel_err_vs_dense"] is not None]
    assert errs and max(errs) < 0.5, errs  # two layers of 4-bit rounding, far from unrelated logits (~1.4)


def test_cli_knows_every_variant_of_both_loops():
    """--impls is checked at parse time against lists the CLI keeps without importing the loops: they name
    the same variants the loops run."""
    from tilefish.bench import e2e_generate
    from tilefish.bench.families import e2e as cli_e2e

    assert cli_e2e.HARNESS_IMPLS == e2e.IMPLS and cli_e2e.GENERATE_IMPLS == e2e_generate.IMPLS

