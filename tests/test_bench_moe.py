"""`tilefish bench moe` (bench/moe.py, bench/moe_shapes.py, bench/families/moe.py): its command line, the model
table and the byte accounting of a routing, the case list and its time estimate (the full default set, the
all-families run's quick plan), the whole run on the CPU with the timing faked (rows, ratios, floors, checks), and
on the GPU a tiny layer end to end."""
from __future__ import annotations

import types

import pytest
import torch

from tilefish import cli
from tilefish.bench import moe as bench_moe
from tilefish.bench import moe_shapes, progress, quick
from tilefish.bench.families import FAMILIES
from tilefish.bench.families import moe as family_moe
from tilefish.bench.family import defaults
from tilefish.bench.moe_shapes import MODELS, MoEModel

H100 = types.SimpleNamespace(index=0, name="NVIDIA H100 80GB HBM3", sm_count=132, cc=90, arch="sm_90", major=9,
                             minor=0, smem_per_block_optin=232448)
FAMILY = FAMILIES["moe"]
# Tiny layers of the three transformers experts modules (gpt-oss: transposed, interleaved, biases, swiglu_oai;
# its 192 takes int4 group 64, as 2880 does), in shapes the grouped kernels' GPU tests cover (hidden 256;
# intermediate 128, 256, 192: a half k tile).
TINY = [MoEModel("tiny-qwen", "qwen3_moe", 256, 128, 8, 2, "silu", False, ""),
        MoEModel("tiny-mixtral", "mixtral", 256, 256, 4, 2, "silu", False, ""),
        MoEModel("tiny-oss", "gpt_oss", 256, 192, 4, 2, "swiglu_oai", True, "")]


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def parse(*argv):
    """The namespace `tilefish bench <argv>` hands to its command (which does not run)."""
    seen, saved = [], cli.cmd_bench
    cli.cmd_bench = lambda args: seen.append(args) or 0
    try:
        assert cli.main(["bench", *argv]) == 0
    finally:
        cli.cmd_bench = saved
    return seen[0]


def exit_code_and_err(capsys, *argv) -> tuple[int, str]:
    try:
        rc = cli.main(["bench", *argv])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


# ---- the command line ------------------------------------------------------------------------------------------

def test_flags_parse_with_their_defaults():
    a = parse("moe")
    assert (a.family, a.models, a.tokens, a.impls, a.graphs, a.quick, a.reps) == ("moe", None, None, None, False,
                                                                                  False, 50)
    a = parse("moe", "--models", "qwen3-30b-a3b,gpt-oss-20b", "--tokens", "1,16", "--impls", "int4,grouped_mm",
              "--graphs", "--quick", "--reps", "9")
    assert (a.models, a.tokens, a.impls, a.graphs, a.quick, a.reps) == ("qwen3-30b-a3b,gpt-oss-20b", "1,16",
                                                                        "int4,grouped_mm", True, True, 9)
    assert [m.name for m in FAMILY._selection(a, a.quick)[0]] == ["qwen3-30b-a3b", "gpt-oss-20b"]
    assert FAMILY._selection(a, a.quick)[1:] == ([1, 16], ["int4", "grouped_mm"])
    models, tokens, impls = FAMILY._selection(parse("moe"), False)
    assert models == list(MODELS.values()) and tokens == [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
    assert impls == ["int4", "nf4", "mxfp4", "bf16", "grouped_mm", "batched_mm", "torch_grouped_mm"]
    models, tokens, impls = FAMILY._selection(parse("moe", "--quick"), True)
    assert [m.name for m in models] == list(family_moe.QUICK_MODELS) and tokens == [1, 16, 256]
    assert impls == ["int4", "mxfp4", "bf16", "grouped_mm"]


@pytest.mark.parametrize("argv, says", [(["--models", "llama-3-8b"], "unknown MoE model"),
                                        (["--impls", "int4,fp8"], "expected a comma-separated list of int4"),
                                        (["--tokens", "0,16"], "positive integers"),
                                        (["--shapes", "4096x4096"], "unrecognized arguments: --shapes"),
                                        (["--m", "1"], "unrecognized arguments: --m"),
                                        (["--layers", "2"], "unrecognized arguments: --layers"),
                                        (["--peers", "marlin"], "unrecognized arguments: --peers")])
def test_bad_values_and_other_families_flags_are_usage_errors(capsys, argv, says):
    rc, err = exit_code_and_err(capsys, "moe", *argv)
    assert rc == 2 and says in err, err


def test_its_flags_without_the_family_name_it(capsys):
    for argv in (["--tokens", "1"], ["--graphs"]):
        rc, err = exit_code_and_err(capsys, *argv)
        assert rc == 2 and f"{argv[0]} applies to one family (tilefish bench moe" in err, err
    rc, err = exit_code_and_err(capsys, "--impls", "int4")  # e2e has --impls too
    assert rc == 2 and "--impls applies to one family (tilefish bench e2e|moe" in err, err


def test_help_shows_only_its_flags(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "moe", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: tilefish bench moe ")
    flags = {f for f in out.split() if f.startswith("--")}
    assert {"--models", "--tokens", "--impls", "--graphs", "--quick", "--reps", "--out"} <= flags
    assert not flags & {"--shapes", "--m", "--layers", "--peers", "--dtypes", "--full", "--variants"}


# ---- the models and the byte accounting ------------------------------------------------------------------------

def test_model_table_matches_the_configs():
    m = MODELS
    assert [(x.hidden, x.inter, x.experts, x.topk, x.activation, x.bias) for x in m.values()] == [
        (4096, 14336, 8, 2, "silu", False), (2048, 768, 128, 8, "silu", False), (4096, 1536, 128, 8, "silu", False),
        (2880, 2880, 32, 4, "swiglu_oai", True), (2880, 2880, 128, 4, "swiglu_oai", True)]
    # int4 group 128 where both sizes allow it; gpt-oss's 2880 takes 64 (and its rows say so)
    assert [x.int4_group() for x in m.values()] == [128, 128, 128, 64, 64]
    assert m["gpt-oss-20b"].label("int4") == "tilefish int4 g64" and m["mixtral-8x7b"].label("int4").endswith("g128")
    # the brief's memory figures: Mixtral's bf16 experts 2.8 GB, Qwen3-235B's 4.8 GB a layer
    assert m["mixtral-8x7b"].layer_bytes("bf16") == 8 * 3 * 4096 * 14336 * 2
    assert round(m["qwen3-235b-a22b"].layer_bytes("bf16") / 1e9, 1) == 4.8
    assert moe_shapes.parse_models("all") == list(m.values()) == moe_shapes.parse_models(None)
    with pytest.raises(ValueError, match="unknown MoE model"):
        moe_shapes.parse_models("mixtral-8x7b,nope")


def test_expert_bytes_are_what_the_kernels_read():
    """One expert's bytes per format = its ExpertWeights tensors' bytes (packed codes + bf16 scales, both
    projections) plus its biases; bf16: 3 H I values."""
    from tilefish.moe import ExpertWeights

    torch.manual_seed(0)
    for model in TINY:
        h, i, e = model.hidden, model.inter, model.experts
        gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
        assert model.expert_bytes("bf16") == 3 * h * i * 2 + model.bias_bytes_per_expert()
        for fmt in ("int4", "nf4", "mxfp4"):
            opts = {"int4": dict(group_size=model.int4_group(), clip_search=False), "nf4": dict(blocksize=64),
                    "mxfp4": {}}[fmt]
            ws = [ExpertWeights.from_weights(w, fmt, dtype=torch.bfloat16, **opts) for w in (gate_up, down)]
            assert ws[0].group_size == ws[1].group_size == model.group(fmt)
            stored = sum(t.numel() * t.element_size() for w in ws for t in (w.packed, w.scales)) // e
            assert model.expert_bytes(fmt) == stored + model.bias_bytes_per_expert(), (model.name, fmt)
    assert MODELS["gpt-oss-20b"].bias_bytes_per_expert() == (2 * 2880 + 2880) * 2


def test_selected_bytes_count_the_distinct_experts_of_the_routing():
    model = MODELS["qwen3-30b-a3b"]
    ids = torch.tensor([[3, 7, 1, 0, 2, 4, 5, 6], [7, 3, 9, 10, 11, 12, 13, 14]])  # 3 and 7 twice
    assert moe_shapes.distinct_experts(ids) == 14 == moe_shapes.distinct_experts(ids.tolist())
    assert moe_shapes.selected_bytes(model, "int4", ids) == 14 * model.expert_bytes("int4")
    assert moe_shapes.selected_bytes(model, "bf16", ids) == 14 * 3 * 2048 * 768 * 2
    nbytes = moe_shapes.selected_bytes(model, "int4", ids)
    assert moe_shapes.floor_us(nbytes, 3000.0) == pytest.approx(nbytes / 3e12 * 1e6)
    # the bench's routing: seeded, K distinct experts a token, softmax weights
    ids, weights = bench_moe.routing(model, 64, "cpu")
    again, _ = bench_moe.routing(model, 64, "cpu")
    assert torch.equal(ids, again) and ids.shape == (64, 8) and ids.dtype == torch.int64
    assert all(len(set(row)) == 8 for row in ids.tolist()) and 0 <= int(ids.min()) and int(ids.max()) < 128
    assert weights.dtype == torch.bfloat16 and torch.allclose(weights.float().sum(1), torch.ones(64), atol=1e-2)
    # uniform routing: the distinct count near its expectation (128 (1 - (120/128)^64) = 127.0)
    assert 120 <= moe_shapes.distinct_experts(ids) <= 128
    assert model.expected_active(1) == pytest.approx(8) and model.expected_active(4096) == pytest.approx(128)


def test_batched_mm_runs_only_where_its_weight_copy_fits():
    mixtral, qwen = MODELS["mixtral-8x7b"], MODELS["qwen3-30b-a3b"]
    assert mixtral.batched_mm_fits(1) and not mixtral.batched_mm_fits(16)
    assert qwen.batched_mm_fits(16) and not qwen.batched_mm_fits(256)
    assert family_moe.runs(mixtral, 16, moe_shapes.IMPLS) == ["int4", "nf4", "mxfp4", "bf16", "grouped_mm",
                                                              "torch_grouped_mm"]


# ---- the case list and its estimate ----------------------------------------------------------------------------

def test_full_default_run_fits_five_minutes_on_an_h100():
    """The complete default set: a case (a progress step) per model x token count, estimated (with its kernels'
    compile on 16 cores) well inside 5 minutes, so that estimation error still leaves it under."""
    args = defaults(FAMILY, reps=50)
    [step] = FAMILY.steps(args, full=True)
    assert [c.label for c in step.cases] == [f"{m} t{t}" for m in MODELS for t in moe_shapes.DEFAULT_TOKENS]
    kernels = bench_moe.kernel_specs(H100, list(MODELS.values()), moe_shapes.DEFAULT_TOKENS, moe_shapes.IMPLS)
    assert step.kernels(H100) == kernels and all(k.supports("sm_90") for k in kernels)
    total = sum(c.weight for c in step.cases) + progress.compile_s(len(kernels), 16)
    assert 60 < total < 200, total
    # the per-model build (weights made and quantized in three formats) is in each model's first case
    first = {c.label: c.weight for c in step.cases}
    assert first["qwen3-235b-a22b t1"] > first["qwen3-235b-a22b t2"] + family_moe.build_s(
        MODELS["qwen3-235b-a22b"], moe_shapes.IMPLS) - 1


def test_quick_plan_is_small_and_its_estimate():
    """The all-families run's MoE step: Qwen3-30B-A3B and gpt-oss-20b at 1, 16, 256 tokens, int4 + mxfp4 against
    transformers' own loop and its grouped_mm; a case each (model, tokens), under 20 s estimated."""
    steps = [s for s in quick.quick_plan(parse()) if s.family == "moe"]
    assert len(steps) == 1
    step = steps[0]
    assert [c.label for c in step.cases] == [f"{m} t{t}" for m in ("qwen3-30b-a3b", "gpt-oss-20b")
                                             for t in (1, 16, 256)]
    estimate = sum(c.weight for c in step.cases)
    assert 5 < estimate < 20, estimate
    kernels = step.kernels(H100)
    fmts = {dict(k.defines).get("TF_W4A16_MXFP4") is not None for k in kernels if "gemm" in k.source}
    assert fmts == {True, False} and len(kernels) <= 20  # int4 and mxfp4 grouped GEMMs, the align / act / combine
    # a case is done at its byte floor row (the last of it): every implementation's row first
    assert not step.counts(types.SimpleNamespace(impl="tilefish int4 g128"))
    assert step.counts(types.SimpleNamespace(impl="byte floor (int4 g128 bytes at the copy rate)"))


def test_the_family_object_keeps_the_bench_modules_numbers():
    assert family_moe.ROUNDS == bench_moe.ROUNDS
    assert set(family_moe.QUICK_IMPLS) <= set(moe_shapes.IMPLS) and set(family_moe.QUICK_MODELS) <= set(MODELS)
    assert FAMILY.headlines(bench_moe.Report("empty")) == [] and FAMILY.heading(bench_moe.Report("e")) == FAMILY.title


# ---- the whole run on the CPU, the timing faked ----------------------------------------------------------------

def fake_times(fns, **kw):
    """Synthetic medians (us): the tilefish formats 10, 20, 30; the peers 40, 50, ... in the order given."""
    return {name: 10.0 * (i + 1) for i, name in enumerate(fns)}


@pytest.mark.skipif(not has_transformers(), reason="needs transformers")
def test_run_on_the_cpu_reports_every_implementation_against_the_floor(monkeypatch):
    monkeypatch.setattr(bench_moe, "copy_bandwidth_gbps", lambda: 3000.0)
    monkeypatch.setattr(bench_moe, "time_alternating_us", fake_times)
    rep = bench_moe.run(models=TINY[::2], tokens=[1, 3], device="cpu", reps=4)
    cases = [(m.name, t) for m in TINY[::2] for t in (1, 3)]
    assert [r.case for r in rep.rows if r.impl.startswith("byte floor")] == [f"{m} t{t}" for m, t in cases]
    for name, t in cases:
        model = next(m for m in TINY if m.name == name)
        rows = [r for r in rep.rows if r.case == f"{name} t{t}"]
        assert [r.impl for r in rows] == [model.label(i) for i in moe_shapes.IMPLS] + [
            f"byte floor ({model.label('int4').removeprefix('tilefish ')} bytes at the copy rate)"]
        distinct = rows[0].extra["selected_experts"]
        assert 1 <= distinct <= min(model.experts, t * model.topk)
        for r in rows[:-1]:
            fmt = r.extra["format"]
            assert r.extra["bytes"] == distinct * model.expert_bytes(fmt)
            assert r.metric == pytest.approx(r.extra["bytes"] / (r.time_us * 1e-6) / 1e9)
            assert r.pct_ceiling == pytest.approx(100 * r.metric / 3000.0)
        ours = rows[0]
        assert ours.ratios == pytest.approx({"bf16": 4.0, "grouped_mm": 5.0, "batched_mm": 6.0, "torch._grouped_mm": 7.0,
                                             "best bf16": 4.0})
        assert rows[2].ratios["best bf16"] == pytest.approx(40.0 / 30.0) and not rows[3].ratios
        floor = rows[-1]
        assert floor.time_us == pytest.approx(moe_shapes.floor_us(distinct * model.expert_bytes("int4"), 3000.0))
        # each implementation's output checked once per model, at the first token count, within tolerance
        if t == 1:
            assert all(r.extra["rel_err"] < bench_moe.CHECK_TOLERANCE for r in rows[:-1])
    assert not any("CHECK FAILED" in r.impl or "FAILED" in n for r in rep.rows for n in rep.notes)
    assert any("tiny-oss (256 / 192) uses group 64" in n for n in rep.notes)
    assert any("quantized on the CPU" in n for n in rep.notes)
    heads = {h["label"]: h for h in FAMILY.headlines(rep)}
    assert heads["1 token, vs best bf16"]["median"] == pytest.approx(2.0) and heads["1 token, vs best bf16"]["n"] == 6
    assert heads["1 token, of copy bandwidth (3,000 GB/s)"]["n"] == 6 and "2-16 tokens, vs grouped_mm" in heads
    assert "| tiny-qwen | int4 g128 4.00x" in FAMILY.summary(rep)
    assert FAMILY.heading(rep) == FAMILY.title + ", tiny-qwen, tiny-oss"


@pytest.mark.skipif(not has_transformers(), reason="needs transformers")
def test_a_failed_check_flags_its_rows_and_the_headlines_skip_them(monkeypatch):
    monkeypatch.setattr(bench_moe, "copy_bandwidth_gbps", lambda: 3000.0)
    monkeypatch.setattr(bench_moe, "time_alternating_us", fake_times)
    monkeypatch.setattr(bench_moe, "CHECK_TOLERANCE", -1.0)  # every output "fails"
    rep = bench_moe.run(models=TINY[:1], tokens=[1, 2], impls=["int4", "bf16"], device="cpu", reps=4)
    assert [r.impl for r in rep.rows if r.case == "tiny-qwen t2"] == [
        "tilefish int4 g128 CHECK FAILED", "bf16 transformers (eager loop) CHECK FAILED",
        "byte floor (int4 g128 bytes at the copy rate)"]
    assert FAMILY.headlines(rep) == [] and quick.problems({"moe": rep})


def test_without_transformers_the_tilefish_and_torch_rows_still_run(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    monkeypatch.setattr(bench_moe, "copy_bandwidth_gbps", lambda: 3000.0)
    monkeypatch.setattr(bench_moe, "time_alternating_us", fake_times)
    rep = bench_moe.run(models=TINY[2:], tokens=[2], impls=["int4", "bf16", "grouped_mm", "torch_grouped_mm"],
                        device="cpu", reps=4)
    assert [r.impl for r in rep.rows] == ["tilefish int4 g64", "bf16 torch._grouped_mm",
                                          "byte floor (int4 g64 bytes at the copy rate)"]
    assert rep.rows[0].extra["rel_err"] < bench_moe.CHECK_TOLERANCE > rep.rows[1].extra["rel_err"]
    assert any("transformers not importable" in n for n in rep.notes)


# ---- the GPU: a tiny layer end to end ----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not has_transformers(), reason="needs transformers")
@pytest.mark.parametrize("graphs", [False, True])
def test_tiny_layer_end_to_end_on_the_gpu(monkeypatch, graphs):
    """The family's run: kernels warmed, the copy ceiling, a tiny Qwen-style and gpt-oss-style layer at 1 and 16
    tokens, every implementation timed (tilefish eager or graphed) and checked, no failure."""
    monkeypatch.setattr(family_moe, "parse_models", lambda text: TINY[::2])
    args = parse("moe", "--models", "all", "--tokens", "1,16", "--reps", "6", *(["--graphs"] if graphs else []))
    rep = FAMILY.run(args)
    floors = [r for r in rep.rows if r.impl.startswith("byte floor")]
    assert [r.case for r in floors] == ["tiny-qwen t1", "tiny-qwen t16", "tiny-oss t1", "tiny-oss t16"]
    ours = [r for r in rep.rows if r.impl.startswith("tilefish")]
    assert len(ours) == 4 * 3 and all(r.time_us > 0 and r.ratios for r in ours)
    assert not quick.problems({"moe": rep}), rep.notes
    if graphs:
        assert all(r.extra["graphed"] for r in ours)
    assert FAMILY.headlines(rep)
