"""`tilefish bench e2e --arch qwen3-8b`: transformers' Qwen3ForCausalLM with Qwen3-8B's shapes through the harness
(bench/e2e.py) and the generate() client (bench/e2e_generate.py), the Llama's variants; on the CPU with a tiny config
(the tilefish variant's attention, per-head q / k norms and all, takes the fused forward), on the GPU both loops on
a tiny config."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tilefish.bench import e2e, e2e_generate, e2e_models  # noqa: E402
from tilefish.bench.e2e_models import Qwen3DenseConfig  # noqa: E402
from tilefish.bench.families import FAMILIES  # noqa: E402
from tilefish.bench.report import Report  # noqa: E402

from test_cli import parse  # noqa: E402  (the namespace a command line hands to its command)

TINY = Qwen3DenseConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=256)


def test_qwen3_8b_shapes():
    c = e2e_models.default_config("qwen3-8b")
    assert c == Qwen3DenseConfig.qwen3_8b(36) and e2e_models.arch_of(c) is e2e_models.QWEN3
    hf = c.hf_config()
    assert type(hf).__name__ == "Qwen3Config"
    assert (hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.num_attention_heads,
            hf.num_key_value_heads, hf.head_dim, hf.vocab_size, hf.rms_norm_eps, hf.tie_word_embeddings,
            hf.rope_parameters["rope_theta"]) == (4096, 12288, 36, 32, 8, 128, 151936, 1e-6, False, 1e6)
    assert e2e_models.default_config("qwen3-8b", 8).num_hidden_layers == 8
    assert e2e_models.hf_class_name(c) == "Qwen3ForCausalLM"


def test_harness_on_cpu_runs_the_llamas_variants_on_qwen3():
    rep = e2e.run(arch="qwen3-8b", batches=(2,), prefill=(8,), context=8, modes=("eager",), impls=("fp16", "w4a16"),
                  reps=1, config=TINY, device="cpu", backend="eager")
    assert {r.case for r in rep.rows} == {"qwen3-8b eager decode b2 ctx8", "qwen3-8b eager prefill 8"}
    assert {r.impl for r in rep.rows} == {"fp16", "tilefish w4a16"}
    for r in rep.rows:
        assert r.extra["arch"] == "qwen3-8b" and r.extra["dtype"] == "fp16"
        assert (r.extra["bytes_per_step"] is not None) == (r.extra["phase"] == "decode")
        assert set(r.ratios) == (set() if r.impl == "fp16" else {"fp16"})
    assert any("transformers Qwen3ForCausalLM" in n for n in rep.notes), rep.notes
    # the tilefish variant's layers, attention included, run the fused forward
    assert any("fused decoder forward: 2 layer(s), 2 gated MLP(s), 2 attention(s)" in n for n in rep.notes), rep.notes


def test_family_runs_the_llamas_variants_for_qwen3(monkeypatch):
    calls = []
    monkeypatch.setattr(e2e, "run", lambda **kw: calls.append(("harness", kw)) or Report("e2e"))
    monkeypatch.setattr(e2e_generate, "run", lambda **kw: calls.append(("generate", kw)) or kw["report"])
    FAMILIES["e2e"].run(parse(monkeypatch, "bench", "e2e", "--arch", "qwen3-8b", "--batches", "1", "--prefill", "",
                              "--modes", "compiled", "--generate-batches", "1"))
    (h, hk), (g, gk) = calls
    assert (h, g) == ("harness", "generate") and hk["arch"] == gk["arch"] == "qwen3-8b"
    assert hk["impls"] == list(e2e.IMPLS) and sorted(gk["impls"]) == sorted(e2e_generate.IMPLS)
    assert hk["layers"] is None  # the whole model (36 layers; fewer if the GPU cannot hold them)


# ---- GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_both_loops_on_gpu():
    rep = e2e.run(arch="qwen3-8b", batches=(1, 4), prefill=(64,), context=64, reps=5, config=TINY,
                  impls=("fp16", "w4a16", "w4a16-hf"))
    assert not [n for n in rep.notes if "FAILED" in n or "LARGE" in n], rep.notes
    assert len(rep.rows) == 2 * 3 * 3
    rep = e2e_generate.run(arch="qwen3-8b", batches=(1,), impls=["fp16", "w4a16"], new_tokens=6, prompt=5, reps=1,
                           config=TINY, report=rep)
    assert not [n for n in rep.notes if "FAILED" in n], rep.notes
    rows = {r.impl: r for r in rep.rows if r.case == "qwen3-8b generate decode b1"}
    assert set(rows) == {"fp16", "tilefish w4a16"} and "fp16" in rows["tilefish w4a16"].ratios
