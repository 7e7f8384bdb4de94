"""`tilefish bench w4a16 --models`: the real models' shape table (bench/shapes.py), the shape selection
(de-duplication, labels, untileable skips) and the command line, on a machine without a GPU."""
from __future__ import annotations

import pytest

from tilefish import cli
from tilefish.bench import shapes
from tilefish.bench.families import FAMILIES
from tilefish.bench import w4a16 as bench_w4a16

from test_cli import parse  # the namespace `tilefish <argv>` hands to its command


def test_derived_shapes_match_hand_computed_values():
    # Qwen2.5-7B: hidden 3584, intermediate 18944, 28 heads, 4 kv heads, head_dim 128
    assert shapes.MODELS["qwen2.5-7b"].linears() == [
        ("qkv", 3584, 28 * 128 + 2 * 4 * 128),      # 4608
        ("o_proj", 28 * 128, 3584),
        ("gate_up", 3584, 2 * 18944),               # 37888
        ("down", 18944, 3584)]
    # Gemma-2-9B: head_dim 256, 16 heads: the attention width (4096) is not the hidden size (3584)
    assert shapes.MODELS["gemma-2-9b"].linears() == [
        ("qkv", 3584, (16 + 2 * 8) * 256),          # 8192
        ("o_proj", 4096, 3584),
        ("gate_up", 3584, 28672),
        ("down", 14336, 3584)]
    # Gemma-2-27B: head_dim 128, 32 heads, 16 kv heads, hidden 4608
    assert shapes.MODELS["gemma-2-27b"].linears()[:2] == [("qkv", 4608, 64 * 128), ("o_proj", 4096, 4608)]
    # Falcon-40B: 128 heads of 64 in 8 multi-query groups (each 16 q + 1 k + 1 v); a plain 4h MLP
    assert shapes.MODELS["falcon-40b"].linears() == [
        ("qkv", 8192, 8 * (16 + 2) * 64), ("o_proj", 8192, 8192), ("up", 8192, 32768), ("down", 32768, 8192)]
    # gpt-oss-20b: one expert's MLP
    assert shapes.MODELS["gpt-oss-20b"].linears() == [
        ("qkv", 2880, 64 * 64 + 2 * 8 * 64), ("o_proj", 4096, 2880),
        ("expert gate_up", 2880, 5760), ("expert down", 2880, 2880)]


def test_every_model_has_a_source_and_consistent_numbers():
    for name, c in shapes.MODELS.items():
        assert c.source.startswith("https://huggingface.co/") and c.source.endswith("/config.json"), name
        assert c.heads % c.kv_heads == 0, name
        assert name == name.lower()


def test_default_set_reproduces_todays_llama3_shapes():
    assert tuple(shapes.parse_models(None)) == shapes.DEFAULT_MODELS == ("llama-3-8b", "llama-3-70b")
    assert [(s.k, s.n) for s in shapes.union(shapes.DEFAULT_MODELS)] == bench_w4a16.DEFAULT_KN
    kn, labels, skipped = bench_w4a16.select_shapes()
    assert kn == bench_w4a16.DEFAULT_KN and skipped == []
    assert labels[(4096, 6144)] == "llama-3-8b:qkv" and labels[(28672, 8192)] == "llama-3-70b:down"


def test_union_deduplicates_and_labels():
    # Mistral-7B's four weights are Llama-3-8B's; Qwen2.5-72B's attention is Llama-3-70B's, its MLP is not
    got = shapes.union(["llama-3-8b", "mistral-7b-v0.3", "qwen2.5-72b", "llama-3-70b"])
    assert len(got) == 4 + 4 + 2  # 8B (= Mistral), 72B's four, 70B's gate_up and down
    assert len({(s.k, s.n) for s in got}) == len(got)
    by_kn = {(s.k, s.n): s.labels for s in got}
    assert by_kn[(4096, 6144)] == ("llama-3-8b:qkv", "mistral-7b-v0.3:qkv")
    assert by_kn[(8192, 10240)] == ("qwen2.5-72b:qkv", "llama-3-70b:qkv")   # first seen: 72B's
    assert by_kn[(29568, 8192)] == ("qwen2.5-72b:down",)
    assert [(s.k, s.n) for s in got][:4] == bench_w4a16.DEFAULT_KN[:4]      # first-seen order


def test_parse_models():
    assert shapes.parse_models("all") == list(shapes.MODELS)
    assert shapes.parse_models("Qwen2.5-7B, gemma-2-9b,qwen2.5-7b") == ["qwen2.5-7b", "gemma-2-9b"]
    with pytest.raises(ValueError, match="unknown model.*llama-4.*known: all, llama-3-8b"):
        shapes.parse_models("llama-3-8b,llama-4")


def test_untileable_shapes_marked_and_skipped(capsys):
    assert shapes.marks(2880, 5120) == ["k%128"]
    assert shapes.marks(2880 + 32, 5120 + 32) == ["k%128", "k%64", "n%64"]
    assert shapes.untileable_reason(4096, 6144) is None
    assert "n=100 is not a multiple of 64" in shapes.untileable_reason(4096, 100)
    assert "k=2880 is not a multiple of 128" in shapes.untileable_reason(2880, 5760)
    # k 2880 (an odd number of 64-wide k steps) tiles: the run skips only its group-128 format
    kn, labels, skipped = bench_w4a16.select_shapes(models="gpt-oss-20b")
    assert kn == [(2880, 5120), (4096, 2880), (2880, 5760), (2880, 2880)] and not skipped
    assert labels[(4096, 2880)] == "gpt-oss-20b:o_proj" and labels[(2880, 5760)] == "gpt-oss-20b:expert gate_up"
    # --shapes overrides the models and is checked the same way
    kn, labels, skipped = bench_w4a16.select_shapes(shapes=[(4096, 4096), (4096, 96)], models="all")
    assert kn == [(4096, 4096)] and labels == {} and skipped == ["skipped k4096 n96: untileable, n=96 is not a "
                                                                 "multiple of 64"]
    table = shapes.table()
    assert all(name in table for name in shapes.MODELS)
    flagged = [line for line in table.splitlines() if "skipped" in line]
    assert len(flagged) == 3 and all("group 128 skipped" in line and " 2880 " in line for line in flagged)
    assert "untileable" not in table  # every listed weight runs in some format (k 2880 per channel)


# ---- the command line ----------------------------------------------------------------------------------------



def test_bench_models_flag(monkeypatch):
    a = parse(monkeypatch, "bench", "w4a16")
    assert a.models is None and not a.list_models
    assert parse(monkeypatch, "bench", "w4a16", "--models", "qwen2.5-7b,gemma-2-9b").models == "qwen2.5-7b,gemma-2-9b"
    assert parse(monkeypatch, "bench", "w4a16", "--models", "all").models == "all"
    assert parse(monkeypatch, "bench", "w4a16", "--models", "list").models == "list"
    assert parse(monkeypatch, "bench", "w4a16", "--list-models").list_models


def test_bench_models_flag_rejects_unknown_names(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cmd_bench", lambda args: 0)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "w4a16", "--models", "llama-3-8b,bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--models" in err and "bogus" in err
    assert all(name in err for name in shapes.MODELS)


@pytest.mark.parametrize("argv", [["--list-models"], ["--models", "list"]])
def test_bench_lists_models_without_a_gpu(capsys, argv):
    assert cli.main(["bench", "w4a16", *argv]) == 0
    out = capsys.readouterr().out
    assert "gpt-oss-20b" in out and "qwen2.5-72b" in out and "group 128 skipped" in out


def test_suite_passes_models_and_shapes(monkeypatch):
    calls = []
    monkeypatch.setattr(bench_w4a16, "run", lambda **kw: calls.append(("run", kw)))
    monkeypatch.setattr(bench_w4a16, "sweep", lambda **kw: calls.append(("sweep", kw)))
    argv = ["bench", "w4a16", "--models", "qwen2.5-7b"]
    FAMILIES["w4a16"].run(parse(monkeypatch, *argv))
    FAMILIES["w4a16"].run(parse(monkeypatch, *argv, "--shapes", "4096x4096"))
    FAMILIES["w4a16"].run(parse(monkeypatch, *argv, "--variants"))
    FAMILIES["w4a16"].run(parse(monkeypatch, "bench", "w4a16"))
    assert [(c, kw["models"], kw["shapes"]) for c, kw in calls] == [
        ("run", "qwen2.5-7b", None), ("run", "qwen2.5-7b", [(4096, 4096)]), ("sweep", "qwen2.5-7b", None),
        ("run", None, None)]
