"""tilefish.load_quantized on MoE checkpoints (gpt-oss MXFP4; Mixtral GPTQ and Qwen3-MoE AWQ with one quantized
Linear per expert) and compressed-tensors pack-quantized ones (dense and MoE), on the CPU.

As in test_checkpoint.py, every checkpoint is written here from the published format descriptions, with plain
integer arithmetic (OCP MXFP4 as gpt-oss stores it; compressed-tensors' pack_to_int32), never with tilefish's
own code, and each loaded model is compared by its logits with an fp32 model whose weights are the test's own
decoding of the stored integers."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import rel_err
from moe_families import build_moe, experts_modules, moe_config
from test_checkpoint import (LOGIT_TOLERANCE, SINGLE_FILE, Fmt, assert_unchanged, edit_config, edit_tensors,
                             llama_config, llama_reference, logits, pack_columns, quantize_layer, save_checkpoint,
                             snapshot)
from tilefish.checkpoint import CheckpointError, load_quantized
from tilefish.experts import QuantizedExperts
from tilefish.nn import W4A16Linear, W4A16Slice

transformers = pytest.importorskip("transformers")

IDS = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(1))
# OCP MX v1.0 FP4 E2M1, by code: bit 3 the sign, bits 0-2 the magnitude
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def expert_params(model) -> set[str]:
    return {f"{name}.{p}" for name, m in experts_modules(model).items() for p, _ in m.named_parameters()
            if p in ("gate_up_proj", "down_proj")}


def expect_error(directory, *needles, model):
    before = snapshot(model)
    with pytest.raises(CheckpointError) as info:
        load_quantized(model, directory)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert_unchanged(model, before)


# ------------------------------------------------------------------------------------------------------------
# gpt-oss MXFP4


def mxfp4_stored(experts: int, rows: int, cols: int, gen) -> tuple[dict, torch.Tensor]:
    """Random MXFP4 codes of [E, rows, cols] as gpt-oss stores them (blocks [E, rows, cols/32, 16]: two codes a
    byte, the low nibble the even element; scales [E, rows, cols/32]: E8M0 bytes, 2^(s - 127)) and their values."""
    codes = torch.randint(0, 16, (experts, rows, cols), generator=gen)
    scales = torch.randint(118, 124, (experts, rows, cols // 32), generator=gen)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8).reshape(experts, rows, cols // 32, 16)
    values = E2M1[codes] * torch.pow(2.0, scales.double() - 127).float().repeat_interleave(32, -1)
    return {"blocks": blocks, "scales": scales.to(torch.uint8)}, values


def write_gpt_oss(directory, seed=0):
    """A tiny gpt-oss checkpoint: experts in MXFP4, everything else bf16; the fp32 reference set to match."""
    config = moe_config("gpt_oss")
    reference = build_moe("gpt_oss", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    with torch.no_grad():
        for name, experts in experts_modules(reference).items():
            e, hidden, two_i = experts.gate_up_proj.shape
            for proj, rows, cols in (("gate_up_proj", two_i, hidden), ("down_proj", hidden, two_i // 2)):
                stored, values = mxfp4_stored(e, rows, cols, gen)
                tensors[f"{name}.{proj}_blocks"], tensors[f"{name}.{proj}_scales"] = stored["blocks"], stored["scales"]
                getattr(experts, proj).copy_(values.transpose(1, 2))          # gpt-oss computes x @ W: [E, k, n]
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
    save_checkpoint(directory, reference, tensors, expert_params(reference), torch.bfloat16, 1, qc, config.to_dict(),
                    "fmt", gen)
    return reference, tensors


def test_gpt_oss_mxfp4(tmp_path):
    reference, stored = write_gpt_oss(tmp_path)
    model, report = load_quantized(tmp_path)                                # built by transformers from config.json
    experts = experts_modules(model)
    assert type(model) is type(reference) and all(isinstance(m, QuantizedExperts) for m in experts.values())
    assert set(report.converted) == set(experts) and "MXFP4" in next(iter(report.converted.values()))
    assert report.experts_bytes_after / report.experts_bytes_before < 0.3
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16   # listed: stored dense
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.bfloat16]
    # the weights are bit for bit what transformers' own MXFP4 dequantization makes of the same bytes
    integration = pytest.importorskip("transformers.integrations.mxfp4")
    name = "model.layers.1.mlp.experts"
    for proj in ("gate_up_proj", "down_proj"):
        theirs = integration.convert_moe_packed_tensors(stored[f"{name}.{proj}_blocks"], stored[f"{name}.{proj}_scales"])
        ours = getattr(experts[name].to_dense(torch.bfloat16), proj)
        assert torch.equal(theirs.view(torch.int16), ours.detach().view(torch.int16)), proj
    out = model.generate(IDS[:, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 7)


@pytest.mark.parametrize("case", ["scales shape", "blocks dtype", "missing bias", "listed", "fp16"])
def test_gpt_oss_mxfp4_errors(tmp_path, case):
    write_gpt_oss(tmp_path)
    x = "model.layers.0.mlp.experts"
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(moe_config("gpt_oss"))
    if case == "scales shape":
        edit_tensors(tmp_path, lambda t: t.update({f"{x}.down_proj_scales": t[f"{x}.down_proj_scales"][:, :, :2].contiguous()}))
        expect_error(tmp_path, SINGLE_FILE, f"{x}.down_proj_scales", "shape (4, 128, 2)", "(4, 128, 4)", model=model)
    elif case == "blocks dtype":
        edit_tensors(tmp_path, lambda t: t.update({f"{x}.gate_up_proj_blocks": t[f"{x}.gate_up_proj_blocks"].int()}))
        expect_error(tmp_path, f"{x}.gate_up_proj_blocks", "dtype torch.int32", "uint8", model=model)
    elif case == "missing bias":
        edit_tensors(tmp_path, lambda t: t.pop(f"{x}.down_proj_bias"))
        expect_error(tmp_path, f"{x}.down_proj_bias", "missing", model=model)
    elif case == "listed":
        edit_config(tmp_path, modules_to_not_convert=["model.layers.*.mlp.experts"])
        expect_error(tmp_path, "modules_to_not_convert", x, model=model)
    else:  # a scale of 2^20 in an fp16 model: no fp16 number holds 6 x 2^20
        edit_tensors(tmp_path, lambda t: t[f"{x}.down_proj_scales"].__setitem__((0, 0, 0), 147))
        before = snapshot(model)
        with pytest.raises(CheckpointError, match=r"layer 'model.layers.0.mlp.experts'.*2\^20.*float16"):
            load_quantized(model, tmp_path, dtype=torch.float16)
        assert_unchanged(model, before)


# ------------------------------------------------------------------------------------------------------------
# GPTQ / AWQ experts, one Linear per expert and projection


def write_per_expert(directory, family, fmt: Fmt, projections, legacy: str | None = None, seed=0):
    """Every attention projection and every expert's projections quantized in fmt (test_checkpoint's packers),
    experts named <experts>.<e>.<proj>; legacy: the stored name of the model's "mlp" (Mixtral's old
    "block_sparse_moe")."""
    config = moe_config(family)
    reference = build_moe(family, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tensors, quantized = {}, expert_params(reference)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
                stored, weight = quantize_layer(module.out_features, module.in_features, fmt, gen)
                tensors.update({f"{name}.{role}": t for role, t in stored.items()})
                module.weight.copy_(weight)
                quantized.add(f"{name}.weight")
        for name, experts in experts_modules(reference).items():
            e, two_i, hidden = experts.gate_up_proj.shape
            for i in range(e):
                parts = {}
                for proj, (n, k) in zip(projections, ((two_i // 2, hidden), (two_i // 2, hidden), (hidden, two_i // 2))):
                    stored, parts[proj] = quantize_layer(n, k, fmt, gen)
                    tensors.update({f"{name}.{i}.{proj}.{role}": t for role, t in stored.items()})
                gate, up, down = (parts[p] for p in projections)
                experts.gate_up_proj[i] = torch.cat([gate, up])
                experts.down_proj[i] = down
    save_checkpoint(directory, reference, tensors, quantized, fmt.dtype, 1, fmt.quantization_config(),
                    config.to_dict(), "fmt", gen)
    if legacy:
        edit_tensors(directory, lambda t: t.update({k.replace(".mlp.", f".{legacy}."): t.pop(k)
                                                    for k in [k for k in t if ".mlp." in k]}))
    return reference


PER_EXPERT = {
    "mixtral-gptq-legacy-names": ("mixtral", Fmt(group_size=64, sym=False), ("w1", "w3", "w2"), "block_sparse_moe"),
    "qwen3-moe-awq-bf16": ("qwen3_moe", Fmt(method="awq", group_size=128, sym=False, dtype=torch.bfloat16),
                           ("gate_proj", "up_proj", "down_proj"), None),
    "qwen3-moe-gptq-v2-per-channel": ("qwen3_moe", Fmt(group_size=-1, checkpoint_format="gptq_v2"),
                                      ("gate_proj", "up_proj", "down_proj"), None),
}


@pytest.mark.parametrize("case", PER_EXPERT)
def test_per_expert_checkpoints(tmp_path, case):
    family, fmt, projections, legacy = PER_EXPERT[case]
    reference = write_per_expert(tmp_path, family, fmt, projections, legacy)
    if legacy:
        assert any(f".{legacy}." in k for k in load_file(str(tmp_path / SINGLE_FILE)))
    with torch.device("meta"):
        model = type(reference)(moe_config(family))
    _, report = load_quantized(model, tmp_path)
    experts = experts_modules(model)
    assert all(isinstance(m, QuantizedExperts) for m in experts.values()) and set(experts) <= set(report.converted)
    assert experts["model.layers.0.mlp.experts"].gate_up.codebook == "int4"
    assert isinstance(model.model.layers[0].self_attn.q_proj, W4A16Slice)
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[fmt.dtype]


def test_per_expert_errors(tmp_path):
    reference = write_per_expert(tmp_path, "mixtral", Fmt(group_size=64, sym=False), ("w1", "w3", "w2"),
                                 "block_sparse_moe")
    with torch.device("meta"):
        model = type(reference)(moe_config("mixtral"))
    x = "model.layers.1.block_sparse_moe.experts"
    edit_tensors(tmp_path, lambda t: t.pop(f"{x}.3.w2.qweight"))
    expect_error(tmp_path, "experts.3.w2.qweight", "missing", "4 experts", model=model)
    edit_tensors(tmp_path, lambda t: t.update({f"{x}.3.w2.qweight": t[f"{x}.2.w2.qweight"][:8].clone()}))
    expect_error(tmp_path, f"{x}.3.w2.qweight", "shape (8, 128)", "expert 3's down projection", model=model)


def test_act_order_experts_are_refused(tmp_path):
    reference = write_per_expert(tmp_path, "qwen3_moe", Fmt(group_size=32, sym=False, desc_act=True),
                                 ("gate_proj", "up_proj", "down_proj"))
    with torch.device("meta"):
        model = type(reference)(moe_config("qwen3_moe"))
    expect_error(tmp_path, "model.layers.0.mlp.experts", "act-order", model=model)


# ------------------------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized


def ct_layer(n: int, k: int, group: int, sym: bool, actorder: bool, dtype, gen) -> tuple[dict, torch.Tensor]:
    """One Linear(k, n) as compressed-tensors' pack-quantized compressor writes it: signed values v stored as
    v + 8, eight to an int32 along k (element 8c + i in bits 4i..); zero points (asymmetric) likewise but along n;
    g_idx (actorder) the group of each input column; weight_shape (n, k). And the fp32 weight they stand for."""
    g = k if group == -1 else group
    groups = k // g
    v = torch.randint(-8, 8, (n, k), generator=gen)
    scale = ((torch.rand(n, groups, generator=gen) + 0.5) * 0.01).to(dtype)
    zp = torch.zeros(n, groups, dtype=torch.int64) if sym else torch.randint(-8, 8, (n, groups), generator=gen)
    g_idx = torch.arange(k) // g
    if actorder:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    weight = ((v - zp[:, g_idx]) * scale.float()[:, g_idx]).contiguous()
    stored = {"weight_packed": pack_columns(v + 8), "weight_scale": scale,
              "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
    if not sym:
        stored["weight_zero_point"] = pack_columns((zp + 8).t()).t().contiguous()      # [n/8, groups]
    if actorder:
        stored["weight_g_idx"] = g_idx.to(torch.int32)
    return stored, weight


def ct_config(group: int, sym: bool, actorder: bool) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "channel" if group == -1 else "group",
               "group_size": None if group == -1 else group, "dynamic": False, "actorder": "group" if actorder else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


def write_ct(directory, reference, config, group, sym, actorder, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors, quantized = {}, expert_params(reference)
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
                stored, weight = ct_layer(module.out_features, module.in_features, group, sym, actorder, dtype, gen)
                tensors.update({f"{name}.{role}": t for role, t in stored.items()})
                module.weight.copy_(weight)
                quantized.add(f"{name}.weight")
        for name, experts in experts_modules(reference).items():
            e, two_i, hidden = experts.gate_up_proj.shape
            for i in range(e):
                parts = []
                for proj, (n, k) in (("gate_proj", (two_i // 2, hidden)), ("up_proj", (two_i // 2, hidden)),
                                     ("down_proj", (hidden, two_i // 2))):
                    stored, weight = ct_layer(n, k, group, sym, False, dtype, gen)
                    tensors.update({f"{name}.{i}.{proj}.{role}": t for role, t in stored.items()})
                    parts.append(weight)
                experts.gate_up_proj[i] = torch.cat(parts[:2])
                experts.down_proj[i] = parts[2]
    return save_checkpoint(directory, reference, tensors, quantized, dtype, 1, ct_config(group, sym, actorder),
                           config.to_dict(), "fmt", gen)


@pytest.mark.parametrize("group,sym,actorder", [(128, True, False), (32, False, True), (-1, False, False)])
def test_compressed_tensors_dense(tmp_path, group, sym, actorder):
    config = llama_config()
    reference = llama_reference(config)
    write_ct(tmp_path, reference, config, group, sym, actorder)
    model, report = load_quantized(tmp_path)
    assert len(report.converted) == 14 and set(report.skipped) == {"lm_head"}
    q = model.model.layers[0].self_attn.o_proj
    assert isinstance(q, W4A16Linear) and (q.zeros is None) == sym and (q.perm is not None) == actorder
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.bfloat16]


def test_compressed_tensors_moe(tmp_path):
    config = moe_config("qwen3_moe")
    reference = build_moe("qwen3_moe")
    write_ct(tmp_path, reference, config, 64, False, False)
    model, report = load_quantized(tmp_path)
    assert all(isinstance(m, QuantizedExperts) for m in experts_modules(model).values())
    assert report.experts_bytes_before > 0
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.bfloat16]


CT_CONFIG_ERRORS = {
    "8 bits": ({"num_bits": 8}, "weights.num_bits = 8"),
    "tensor strategy": ({"strategy": "tensor"}, "weights.strategy = 'tensor'"),
    "float weights": ({"type": "float"}, "weights.type = 'float'"),
    "group 256": ({"group_size": 256}, "weights.group_size = 256"),
}


@pytest.mark.parametrize("case", CT_CONFIG_ERRORS)
def test_compressed_tensors_config_errors(tmp_path, case):
    change, needle = CT_CONFIG_ERRORS[case]
    config = llama_config()
    reference = llama_reference(config)
    write_ct(tmp_path, reference, config, 64, True, False)
    qc = json.loads((tmp_path / "config.json").read_text())
    qc["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(qc))
    with torch.device("meta"):
        model = type(reference)(config)
    expect_error(tmp_path, "config.json", f"config_groups.group_0.{needle}", model=model)


def test_compressed_tensors_tensor_errors(tmp_path):
    config = llama_config()
    reference = llama_reference(config)
    write_ct(tmp_path, reference, config, 64, False, False)
    with torch.device("meta"):
        model = type(reference)(config)
    o = "model.layers.0.self_attn.o_proj"
    edit_tensors(tmp_path, lambda t: t.pop(f"{o}.weight_zero_point"))
    expect_error(tmp_path, f"{o}.weight_zero_point", "missing", "asymmetric", model=model)
    edit_tensors(tmp_path, lambda t: t.update({f"{o}.weight_zero_point": torch.zeros(16, 2, dtype=torch.int32),
                                               f"{o}.weight_shape": torch.tensor([128, 64])}))
    expect_error(tmp_path, f"{o}", "weight_shape holds [128, 64]", model=model)
    edit_config(tmp_path, format="marlin-24")
    expect_error(tmp_path, "quantization_config.format = 'marlin-24'", model=model)
    edit_config(tmp_path, format="pack-quantized", config_groups={"group_0": {
        "weights": {"num_bits": 4, "strategy": "group", "group_size": 64, "symmetric": False},
        "input_activations": {"num_bits": 8}}})
    expect_error(tmp_path, "input_activations", "not W4A16", model=model)
