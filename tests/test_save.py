"""tilefish.save_quantized: HF checkpoint directories that load_quantized reads back bit for bit (CPU).

Every round trip compares each quantized Linear's kernel tensors (packed, scales, zero points, perm, bias; a fused
layer's part as its columns) with the loaded ones, and the logits with torch.equal. One test decodes a saved GPTQ
layer with its own few lines, written from the published layout, not with tilefish's unpacking.
"""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file
from torch import nn

import tilefish
from hf_families import build
from tilefish.convert import fuse_projections, quantize_model
from tilefish.nn import FusedW4A16Linear, NF4Linear, W4A16Linear, W4A16Slice

# smaller than hf_families.COMMON (the shapes still tile: in_features % 128, out_features % 64): a round trip
# is then about a second on the CPU reference path (test_single_group_layers_keep_their_group_size: in_features 128).
SMALL = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=1, head_dim=64, vocab_size=256)
FIELDS = ("packed", "scales", "zeros", "perm", "bias")


def hf_model(family: str = "llama", dtype: torch.dtype = torch.float16, **overrides) -> nn.Module:
    """A tiny transformers model with its parameters (biases random) in ``dtype`` and its non-persistent buffers
    (rotary inv_freq) left fp32, as from_pretrained(dtype=...) leaves them and load_quantized rebuilds them."""
    model = build(family, torch.float32, **{**SMALL, **overrides})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
            p.data = p.data.to(dtype)
    return model


def group_ordered_perm(k: int, group: int) -> torch.Tensor:
    """A random act-order permutation with each group's input rows ascending: the order every GPTQ act-order
    checkpoint loads with (a permutation of rows inside a group is the same weight, and g_idx cannot say it)."""
    return torch.cat([chunk.sort().values for chunk in torch.randperm(k).split(group)])


def set_act_order(model: nn.Module, group: int) -> None:
    """A permutation on every W4A16Linear: one per fusion group (q/k/v, gate/up share theirs, so they fuse)."""
    fusion_group = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    for parent in model.modules():
        shared = {}
        for name, layer in parent.named_children():
            if type(layer) is W4A16Linear:
                key = fusion_group.get(name, name)
                if key not in shared:
                    shared[key] = group_ordered_perm(layer.in_features, group)
                layer.perm = shared[key]


def parts(model: nn.Module) -> dict[str, dict]:
    """Every quantized Linear by its checkpoint name -> its kernel tensors (a fused layer's part: its columns; a
    symmetric layer's zero points written out as 8), and an NF4Linear's bitsandbytes entries."""
    out = {}
    for parent_name, parent in model.named_modules():
        for name, child in parent.named_children():
            if isinstance(child, W4A16Slice):  # a fused layer's part as a layer of its own would hold it
                w, bias = child.fused.part_weight(child.index)
            elif type(child) in (W4A16Linear, NF4Linear):
                w, bias = child.weight4, child.bias
            else:
                continue
            zeros = w.zeros if w.zeros is not None else torch.full_like(w.scales, 8)
            out[f"{parent_name}.{name}" if parent_name else name] = {
                "packed": w.packed, "scales": w.scales, "zeros": zeros, "perm": w.perm,
                "bias": None if bias is None else bias.detach(), "codebook": w.codebook,
                "bnb": child.state_dict() if isinstance(child, NF4Linear) else None}
    return out


def assert_same_layers(original: nn.Module, loaded: nn.Module) -> None:
    want, got = parts(original), parts(loaded)
    assert sorted(want) == sorted(got)
    for name, tensors in want.items():
        assert got[name]["codebook"] == tensors["codebook"], name
        for field in FIELDS:
            a, b = tensors[field], got[name][field]
            assert (a is None) == (b is None), f"{name}.{field}"
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), f"{name}.{field}"
        if tensors["bnb"] is not None and got[name]["bnb"] is not None:  # both NF4Linear: bitsandbytes' entries
            assert tensors["bnb"].keys() == got[name]["bnb"].keys(), name
            assert all(torch.equal(t, got[name]["bnb"][k]) for k, t in tensors["bnb"].items()), name


def logits(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) * 7 % 256
    with torch.no_grad():
        return model(ids).logits


def assert_round_trip(model: nn.Module, directory, **save_kwargs) -> dict:
    """Save, load fused and unfused, compare layers and logits exactly; -> the saved config.json."""
    tilefish.save_quantized(model, directory, **save_kwargs)
    expected = logits(model)
    for fuse in (True, False):
        loaded, _ = tilefish.load_quantized(directory, fuse=fuse)
        assert_same_layers(model, loaded)
        assert torch.equal(logits(loaded), expected), f"fuse={fuse}"
    return json.loads((directory / "config.json").read_text())


# ----------------------------------------------------------------------------------------------------------------
# round trips

INT4_CASES = {
    "sym-g128": (dict(group_size=128, lm_head="dense"), {}),
    "asym-g64-bf16-bias": (dict(group_size=64, symmetric=False, lm_head="dense"),
                           dict(dtype=torch.bfloat16, attention_bias=True)),
    "per-channel": (dict(group_size=-1, symmetric=False, lm_head="dense"), {}),
    "act-order-g32": (dict(group_size=32, symmetric=False, lm_head="dense"), {}),
    "int4-lm-head": (dict(group_size=128, lm_head="quantize"), {}),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("case", INT4_CASES)
def test_int4_round_trip_is_bit_exact(tmp_path, case, fused):
    quantize_kwargs, model_kwargs = INT4_CASES[case]
    model = hf_model(**model_kwargs)
    quantize_model(model, clip_search=False, fuse=False, **quantize_kwargs)
    if case == "act-order-g32":
        set_act_order(model, 32)
    if fused:
        fuse_projections(model)
        assert any(isinstance(m, FusedW4A16Linear) for m in model.modules())
    qc = assert_round_trip(model, tmp_path / "out")["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
    assert qc["group_size"] == quantize_kwargs["group_size"]
    assert qc["sym"] == quantize_kwargs.get("symmetric", True)
    assert qc["desc_act"] == (case == "act-order-g32")
    assert qc["lm_head"] == (case == "int4-lm-head")
    assert qc["modules_to_not_convert"] == ([] if case == "int4-lm-head" else ["lm_head"])


def test_single_group_layers_keep_their_group_size(tmp_path):
    """in_features 128 with group 128 is one scale row, as a per-channel weight has: the loader takes the group
    size from quantization_config, so the layers come back as group-128 layers, not per-channel ones."""
    model = hf_model(hidden_size=128, intermediate_size=128, num_attention_heads=2, head_dim=64)
    quantize_model(model, clip_search=False, group_size=128)
    assert_round_trip(model, tmp_path / "out")
    loaded, _ = tilefish.load_quantized(tmp_path / "out", fuse=False)
    assert {m.group_size for m in loaded.modules() if isinstance(m, W4A16Linear)} == {128}


@pytest.mark.parametrize("double_quant", [True, False], ids=["double-quant", "single"])
def test_nf4_unfused_round_trip_is_bitsandbytes_bit_for_bit(tmp_path, double_quant):
    model = hf_model()
    quantize_model(model, "nf4", double_quant=double_quant, blocksize=256, fuse=False, lm_head="dense")
    qc = assert_round_trip(model, tmp_path / "out")["quantization_config"]
    assert qc["quant_method"] == "bitsandbytes" and qc["load_in_4bit"] and qc["bnb_4bit_quant_type"] == "nf4"
    assert qc["bnb_4bit_use_double_quant"] == double_quant and qc["bnb_4bit_compute_dtype"] == "float16"
    assert qc["llm_int8_skip_modules"] == ["lm_head"]
    loaded, _ = tilefish.load_quantized(tmp_path / "out", fuse=False)
    q_proj = loaded.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, NF4Linear) and q_proj.blocksize == 256 and q_proj.double_quant == double_quant


def test_nf4_fused_round_trip_keeps_the_kernel_tensors(tmp_path):
    model = hf_model(dtype=torch.bfloat16)
    quantize_model(model, "nf4", blocksize=64)  # fused: the layers hold only the kernel tensors
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, FusedW4A16Linear)
    assert_round_trip(model, tmp_path / "out")
    loaded, _ = tilefish.load_quantized(tmp_path / "out", fuse=False)
    k_proj = loaded.model.layers[0].self_attn.k_proj  # written as bitsandbytes nf4: blocks of the group size
    assert isinstance(k_proj, NF4Linear) and k_proj.blocksize == 64 and not k_proj.double_quant
    assert k_proj.orig_dtype == torch.bfloat16


@pytest.mark.parametrize("method", ["w4a16", "nf4"])
def test_phi3_fused_checkpoint_layers_round_trip(tmp_path, method):
    """Phi-3 stores qkv_proj and gate_up_proj as single Linears: they are saved and loaded as such."""
    model = hf_model("phi3")
    quantize_model(model, method, **({"clip_search": False} if method == "w4a16" else {}))
    assert type(model.model.layers[0].self_attn.qkv_proj) in (W4A16Linear, NF4Linear)
    assert_round_trip(model, tmp_path / "out")


def test_zero_point_of_zero_is_saved_as_gptq_v2(tmp_path):
    model = hf_model()
    quantize_model(model, group_size=64, symmetric=False, clip_search=False)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.zeros[0, :5] = 0  # v1 stores zero - 1: 0 does not fit
    qc = assert_round_trip(model, tmp_path / "out")["quantization_config"]
    assert qc["checkpoint_format"] == "gptq_v2" and qc["format"] == "gptq_v2"


def test_any_act_order_permutation_saves_the_same_weight(tmp_path):
    """A permutation that is not in GPTQ's group order comes back in it: each layer's weight is bit for bit the
    same, and its permutation is the original with each group's rows sorted."""
    model = hf_model()
    quantize_model(model, group_size=64, clip_search=False, fuse=False)
    down = model.model.layers[0].mlp.down_proj
    down.perm = torch.randperm(down.in_features)
    tilefish.save_quantized(model, tmp_path / "out")
    loaded, _ = tilefish.load_quantized(tmp_path / "out", fuse=False)
    back = loaded.model.layers[0].mlp.down_proj
    assert torch.equal(back.weight.dequantize(), down.weight.dequantize())
    assert torch.equal(back.perm, torch.cat([g.sort().values for g in down.perm.split(64)]))
    torch.testing.assert_close(logits(loaded), logits(model), rtol=1e-3, atol=1e-3)


# ----------------------------------------------------------------------------------------------------------------
# the files


def decode_gptq_v1(qweight, qzeros, scales, g_idx) -> torch.Tensor:
    """The published GPTQ layout: qweight [k/8, n] holds input row 8r+j of column c in bits 4j..4j+3 of word
    (r, c); qzeros [groups, n/8] holds column 8c+j's zero - 1 in bits 4j..4j+3 of word (g, c); row i uses
    group g_idx[i]. -> W [n, k] = (q - zero) * scale, in fp32."""
    shifts = torch.arange(0, 32, 4)
    q = ((qweight.long()[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])
    zeros = ((qzeros.long()[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1) + 1
    g = g_idx.long()
    return ((q - zeros[g]) * scales.float()[g]).t()


def test_gptq_tensors_decode_by_the_published_layout(tmp_path):
    model = hf_model()
    quantize_model(model, group_size=64, symmetric=False, clip_search=False, fuse=False)
    set_act_order(model, 64)
    fuse_projections(model)
    tilefish.save_quantized(model, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    for name in ("self_attn.k_proj", "mlp.up_proj", "mlp.down_proj"):  # parts of fused layers, and a plain one
        prefix = f"model.layers.0.{name}"
        module = model.get_submodule(prefix)
        w = decode_gptq_v1(*(saved[f"{prefix}.{role}"] for role in ("qweight", "qzeros", "scales", "g_idx")))
        assert saved[f"{prefix}.g_idx"].dtype == torch.int32
        assert torch.equal(w.to(torch.float16), module.weight.dequantize()), name


def test_config_and_files(tmp_path):
    model = hf_model(tie_word_embeddings=True)  # lm_head (dense) is the embedding's tensor
    quantize_model(model, clip_search=False, lm_head="dense")
    tilefish.save_quantized(model, tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors", "quantize_config.json"]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "float16" and config["tie_word_embeddings"] is True
    # quantize_model's fused forward switched the attention to tilefish_sdpa: a name no other reader knows
    assert model.config._attn_implementation == "tilefish_sdpa" and "tilefish_sdpa" not in json.dumps(config)
    assert json.loads((tmp_path / "out" / "quantize_config.json").read_text()) == config["quantization_config"]
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved  # tied: saved once
    assert not any(key.endswith((".packed", "qkv_proj.qweight")) for key in saved)  # parts, not the fused layer
    loaded, _ = tilefish.load_quantized(tmp_path / "out")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(logits(loaded), logits(model))


def test_quantized_lm_head_unties_the_embeddings(tmp_path):
    model = hf_model(tie_word_embeddings=True)
    quantize_model(model, clip_search=False, skip=())
    config = assert_round_trip(model, tmp_path / "out")
    assert config["tie_word_embeddings"] is False and config["quantization_config"]["lm_head"] is True


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile imports torch.jit
def test_compiled_model_is_saved_as_the_model_it_wraps(tmp_path):
    model = hf_model()
    quantize_model(model, clip_search=False)
    tilefish.save_quantized(torch.compile(model), tmp_path / "out")
    assert not any("_orig_mod" in key for key in load_file(tmp_path / "out" / "model.safetensors"))
    loaded, _ = tilefish.load_quantized(tmp_path / "out")
    assert_same_layers(model, loaded)


def test_small_max_shard_size_writes_shards_and_an_index(tmp_path):
    model = hf_model()
    quantize_model(model, group_size=64, clip_search=False)
    assert_round_trip(model, tmp_path / "out", max_shard_size="60KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "out" / "model.safetensors").exists()
    stored = {}
    for shard in shards:
        stored.update(dict.fromkeys(load_file(tmp_path / "out" / shard), shard))
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for shard in shards for t in load_file(tmp_path / "out" / shard).values())


# ----------------------------------------------------------------------------------------------------------------
# errors: raised before anything is written, and nothing half-written


@pytest.fixture
def quantized():
    model = hf_model()
    quantize_model(model, clip_search=False)
    return model


def test_bad_arguments(tmp_path, quantized):
    with pytest.raises(TypeError, match="nn.Module"):
        tilefish.save_quantized("model", tmp_path / "out")
    with pytest.raises(TypeError, match="path"):
        tilefish.save_quantized(quantized, 3)
    with pytest.raises(ValueError, match="max_shard_size"):
        tilefish.save_quantized(quantized, tmp_path / "out", max_shard_size="5 parsecs")
    assert list(tmp_path.iterdir()) == []


def test_model_with_nothing_quantized(tmp_path):
    with pytest.raises(ValueError, match="no quantized layer"):
        tilefish.save_quantized(hf_model(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_mixed_int4_and_nf4_layers(tmp_path):
    model = hf_model()
    quantize_model(model, clip_search=False, skip=("lm_head", "*.mlp.*"))
    quantize_model(model, "nf4")  # the MLP
    with pytest.raises(ValueError, match=r"mixed int4 and nf4 .*self_attn.*mlp"):
        tilefish.save_quantized(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_zero_point_that_is_not_a_4bit_integer(tmp_path):
    model = hf_model()
    quantize_model(model, group_size=64, symmetric=False, clip_search=False)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.zeros[1, 3] = 3.5
    rule = r"model\.layers\.0\.mlp\.down_proj: zero point 3\.5 is not an integer 0\.\.15"
    with pytest.raises(ValueError, match=rule):
        tilefish.save_quantized(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def custom_w4a16_subclass() -> nn.Module:
    class CustomW4A16(W4A16Linear):
        pass

    return CustomW4A16.from_linear(nn.Linear(256, 256).half(), group_size=128)


def bitsandbytes_linear4bit() -> nn.Module:
    return pytest.importorskip("bitsandbytes").nn.Linear4bit(256, 256, bias=False)


@pytest.mark.parametrize("make, kind", [(custom_w4a16_subclass, "CustomW4A16"),
                                        (bitsandbytes_linear4bit, "Linear4bit")], ids=["subclass", "bitsandbytes"])
def test_unknown_layer_type(tmp_path, quantized, make, kind):
    quantized.model.layers[0].mlp.down_proj = make()
    with pytest.raises(TypeError, match=rf"model\.layers\.0\.mlp\.down_proj: {kind}"):
        tilefish.save_quantized(quantized, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_meta_tensor(tmp_path, quantized):
    quantized.model.norm.weight = nn.Parameter(torch.empty(256, device="meta"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: on the meta device"):
        tilefish.save_quantized(quantized, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_directory_needs_overwrite(tmp_path, quantized):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        tilefish.save_quantized(quantized, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    tilefish.save_quantized(quantized, out, overwrite=True)  # replaces the whole directory
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    loaded, _ = tilefish.load_quantized(out)
    assert torch.equal(logits(loaded), logits(quantized))


def test_empty_existing_directory_is_used(tmp_path, quantized):
    (tmp_path / "out").mkdir()
    tilefish.save_quantized(quantized, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").exists()


def failing_writer(monkeypatch, after: int):
    """Make the safetensors writer raise on its call number after + 1 (after writing what it was given)."""
    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        calls.append(filename)
        if len(calls) > after:
            raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    return calls


def test_failure_while_writing_leaves_nothing_behind(tmp_path, quantized, monkeypatch):
    calls = failing_writer(monkeypatch, after=1)
    with pytest.raises(OSError, match="disk full"):
        tilefish.save_quantized(quantized, tmp_path / "new" / "out", max_shard_size="60KB")
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []  # no directory, no temporary one, no parent


def hf_model_quantized_differently() -> nn.Module:
    model = hf_model(seed=1)
    quantize_model(model, group_size=32, clip_search=False)
    return model


def test_failure_while_overwriting_keeps_the_old_directory(tmp_path, quantized, monkeypatch):
    out = tmp_path / "out"
    tilefish.save_quantized(quantized, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    failing_writer(monkeypatch, after=0)
    with pytest.raises(OSError, match="disk full"):
        tilefish.save_quantized(hf_model_quantized_differently(), out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.gpu
def test_cuda_model_saves_the_same_tensors(tmp_path):
    model = hf_model()
    quantize_model(model, group_size=64, symmetric=False, clip_search=False)
    tilefish.save_quantized(model.cuda(), tmp_path / "out")
    on_cpu, _ = tilefish.load_quantized(tmp_path / "out", device="cpu")
    assert_same_layers(model.cpu(), on_cpu)
