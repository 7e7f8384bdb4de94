"""tilefish.load_quantized: Hugging Face bitsandbytes 4-bit (nf4) checkpoints -> NF4Linear (CPU; one onto the GPU).

The checkpoints are written here the way transformers saves a bitsandbytes 4-bit model: config.json's
quantization_config as BitsAndBytesConfig.to_dict() writes it, and per quantized Linear X the entries of
bitsandbytes' Linear4bit state dict (X.weight packed bytes, X.weight.absmax, X.weight.quant_map,
[X.weight.nested_absmax, X.weight.nested_quant_map,] X.weight.quant_state.bitsandbytes__nf4, X.bias), made by
tilefish.nf4.quantize + to_state_dict (byte-compatible with bitsandbytes; tests/test_nf4_format.py checks that
against bitsandbytes itself). The loaded model's logits are compared with an fp32 copy whose Linear weights are the
exact bitsandbytes dequantization of what was written.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from conftest import rel_err
from test_checkpoint import (DOWN, IDS, INDEX_FILE, LOGIT_TOLERANCE, SINGLE_FILE, Q, OneProj, TinyLM, _drop, _set,
                             edit_config, edit_tensors, excluded, expect_error, llama_config, llama_reference, logits,
                             save_checkpoint, tiny_reference)
from tilefish import nf4
from tilefish.checkpoint import load_quantized
from tilefish.nn import FusedW4A16Linear, NF4Linear, W4A16Slice
from tilefish.quant.nf4 import to_state_dict
from tilefish.reference import nf4_dequantize_fp32_chain

QS = "weight.quant_state.bitsandbytes__nf4"


@dataclass(frozen=True)
class Bnb:
    """One test checkpoint's format."""

    blocksize: int = 64
    double_quant: bool = True
    dtype: torch.dtype = torch.float16      # the dense tensors' and the quantized weights' dtype
    compute_dtype: str = "float16"          # bnb_4bit_compute_dtype
    storage: torch.dtype = torch.uint8      # bnb_4bit_quant_storage: the packed bytes' storage dtype
    shards: int = 1
    skip: tuple[str, ...] | None = None     # llm_int8_skip_modules (None, as transformers often writes it)

    def quantization_config(self) -> dict:
        """What transformers' BitsAndBytesConfig.to_dict() writes for a 4-bit model."""
        return {"quant_method": "bitsandbytes", "_load_in_4bit": True, "_load_in_8bit": False,
                "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
                "bnb_4bit_use_double_quant": self.double_quant, "bnb_4bit_compute_dtype": self.compute_dtype,
                "bnb_4bit_quant_storage": str(self.storage).removeprefix("torch."),
                "llm_int8_enable_fp32_cpu_offload": False, "llm_int8_has_fp16_weight": False,
                "llm_int8_skip_modules": None if self.skip is None else list(self.skip), "llm_int8_threshold": 6.0}


@torch.no_grad()
def write_bnb_checkpoint(directory: Path, reference: nn.Module, fmt: Bnb, *, config: dict | None = None,
                         torch_dtype: str | None = "fmt", seed: int = 0) -> Path:
    """Store ``reference`` (fp32) as a bitsandbytes 4-bit checkpoint: every ``*_proj`` Linear not in fmt.skip
    quantized to NF4 (its weight first rounded to fmt.dtype, as a model loaded in that dtype is), everything else
    in fmt.dtype; tied tensors once. The reference's tensors are set to exactly what the checkpoint holds: a
    quantized weight to its bitsandbytes dequantization in fp32 (NF4 value times block absmax, exact)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    quantized = set()
    for name, module in reference.named_modules():
        if isinstance(module, nn.Linear) and name.endswith("_proj") and not excluded(name, fmt.skip or ()):
            q = nf4.quantize(module.weight.to(fmt.dtype), fmt.blocksize, fmt.double_quant)
            entries = to_state_dict(q, f"{name}.weight")
            packed = entries[f"{name}.weight"]
            entries[f"{name}.weight"] = packed.reshape(-1).view(fmt.storage).reshape(-1, 1).clone()
            tensors.update(entries)
            module.weight.copy_(nf4_dequantize_fp32_chain(q, torch.float32))
            quantized.add(f"{name}.weight")
    return save_checkpoint(directory, reference, tensors, quantized, fmt.dtype, fmt.shards, fmt.quantization_config(),
                           config, torch_dtype, gen)


def stored(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def nf4_layers(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (NF4Linear, FusedW4A16Linear, W4A16Slice))}


# ------------------------------------------------------------------------------------------------------------
# loading, checked by logits


LLAMA_CASES = {
    "dq-b64-fp16": Bnb(),
    "single-b64-bf16": Bnb(double_quant=False, dtype=torch.bfloat16, compute_dtype="bfloat16"),
    "dq-b128-bf16": Bnb(blocksize=128, dtype=torch.bfloat16, compute_dtype="bfloat16"),
    "single-b32-fp16": Bnb(blocksize=32, double_quant=False),
    "dq-b256-fp16": Bnb(blocksize=256),
    "storage-bf16": Bnb(storage=torch.bfloat16),
    "3-shards-tied": Bnb(shards=3, skip=("lm_head",)),
}


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama_logits(tmp_path, case):
    fmt = LLAMA_CASES[case]
    config = llama_config(tie=case.endswith("tied"))
    reference = llama_reference(config)
    directory = write_bnb_checkpoint(tmp_path, reference, fmt, config=config.to_dict())

    model, report = load_quantized(directory)

    assert type(model) is type(reference)
    assert len(report.converted) == 14 and set(report.skipped) == {"lm_head"}
    assert report.converted["model.layers.0.self_attn.o_proj"] == (
        f"NF4 blocksize {fmt.blocksize}{' double-quant' if fmt.double_quant else ''} 128->128 (bitsandbytes nf4)")
    assert set(report.fused) == {f"model.layers.{i}.{p}" for i in range(2)
                                 for p in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
    assert all(t.device.type == "cpu" for t in list(model.parameters()) + list(model.buffers()))
    assert model.model.norm.weight.dtype == fmt.dtype and model.lm_head.weight.dtype == fmt.dtype
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    o_proj = model.model.layers[1].self_attn.o_proj
    assert type(o_proj) is NF4Linear and o_proj.scales.dtype == fmt.dtype
    assert model.model.layers[0].mlp.gate_up_proj.codebook == "nf4"
    # the unfused layers hold the checkpoint's bitsandbytes weight bit for bit (storage dtype aside)
    ckpt = stored(directory)
    for key, value in o_proj.state_dict().items():
        want = ckpt[f"model.layers.1.self_attn.o_proj.{key}"]
        if key == "weight":
            want = want.reshape(-1).view(torch.uint8).reshape(-1, 1)
        assert value.dtype == want.dtype and torch.equal(value, want), key
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[fmt.dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dq-b64-fp16", "single-b64-bf16", "3-shards-tied"])
def test_llama_logits_on_the_gpu(tmp_path, case):
    """Loaded straight onto the GPU: the W4A16 kernels with NF4 codes, against the same fp32 reference."""
    fmt = LLAMA_CASES[case]
    config = llama_config(tie=case.endswith("tied"))
    reference = llama_reference(config)
    directory = write_bnb_checkpoint(tmp_path, reference, fmt, config=config.to_dict())

    model, _ = load_quantized(directory, device="cuda")

    assert all(t.is_cuda for t in list(model.parameters()) + list(model.buffers()))
    assert rel_err(logits(model, IDS.cuda()).cpu(), logits(reference, IDS)) < LOGIT_TOLERANCE[fmt.dtype]
    unfused, _ = load_quantized(directory, device="cuda", fuse=False)
    assert rel_err(logits(unfused, IDS.cuda()).cpu(), logits(reference, IDS)) < LOGIT_TOLERANCE[fmt.dtype]


def test_fused_and_unfused_loads_agree(tmp_path):
    from transformers import LlamaForCausalLM

    config = llama_config()
    directory = write_bnb_checkpoint(tmp_path, llama_reference(config), Bnb(), config=config.to_dict())
    with torch.device("meta"):
        unfused = LlamaForCausalLM(config).eval()

    fused, fused_report = load_quantized(directory)
    _, unfused_report = load_quantized(unfused, directory, fuse=False)

    assert len(fused_report.fused) == 4 and not unfused_report.fused
    layers = nf4_layers(unfused)
    assert len(layers) == 14 and all(type(m) is NF4Linear for m in layers.values())
    # fusion keeps every column's codes and kernel scale: the reference path gives the same logits
    assert torch.equal(logits(fused, IDS), logits(unfused, IDS))


def test_into_meta_module_tree_without_transformers(tmp_path):
    """Any nn.Module whose names match, built on the meta device; q/k/v carry biases."""
    reference = tiny_reference()
    directory = write_bnb_checkpoint(tmp_path, reference, Bnb(blocksize=128, double_quant=False))
    with torch.device("meta"):
        model = TinyLM()

    loaded, report = load_quantized(model, directory)

    assert loaded is model and len(report.converted) == 14
    assert report.bytes_after < report.bytes_before
    assert model.model.layers[1].self_attn.qkv_proj.bias is not None
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.float16]


def test_skip_modules_stay_dense(tmp_path):
    reference = tiny_reference()
    directory = write_bnb_checkpoint(tmp_path, reference, Bnb(skip=("lm_head", "mlp.down_proj")))
    with torch.device("meta"):
        model = TinyLM()

    _, report = load_quantized(model, directory)

    down = model.model.layers[0].mlp.down_proj
    assert type(down) is nn.Linear and down.weight.dtype == torch.float16
    assert report.skipped["model.layers.1.mlp.down_proj"] == "listed in quantization_config.llm_int8_skip_modules"
    assert report.skipped["lm_head"] == "listed in quantization_config.llm_int8_skip_modules"
    assert len(report.converted) == 12
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.float16]


@pytest.mark.parametrize("torch_dtype,compute,weights,want", [
    ("float32", "bfloat16", torch.float16, torch.bfloat16),   # bnb_4bit_compute_dtype
    ("float32", "float32", torch.bfloat16, torch.bfloat16),   # the weights' recorded dtype
    (None, "float32", torch.float32, torch.float16),          # neither 16-bit: fp16
])
def test_default_dtype(tmp_path, torch_dtype, compute, weights, want):
    reference = tiny_reference()
    directory = write_bnb_checkpoint(tmp_path, reference, Bnb(dtype=weights, compute_dtype=compute),
                                     torch_dtype=torch_dtype)
    model = tiny_reference(seed=5)

    load_quantized(model, directory, fuse=False)

    assert model.model.layers[0].mlp.up_proj.scales.dtype == want
    assert model.model.layers[0].mlp.up_proj.orig_dtype == weights
    assert model.model.embed_tokens.weight.dtype == want
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[want]


def test_dtype_argument(tmp_path):
    reference = tiny_reference()
    directory = write_bnb_checkpoint(tmp_path, reference, Bnb())
    model = tiny_reference(seed=5)
    load_quantized(model, directory, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.qkv_proj.scales.dtype == torch.bfloat16
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.bfloat16]


def test_quant_method_absent_as_early_transformers_wrote_it(tmp_path):
    reference = tiny_reference()
    directory = write_bnb_checkpoint(tmp_path, reference, Bnb())
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]["quant_method"]
    (directory / "config.json").write_text(json.dumps(config))
    model = tiny_reference(seed=5)
    load_quantized(model, directory)
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.float16]


# ------------------------------------------------------------------------------------------------------------
# bad checkpoints: the message names what is wrong, and the model is untouched


@pytest.fixture
def bnb_dir(tmp_path) -> Path:
    """A valid double-quantized bitsandbytes checkpoint of TinyLM (q/k/v with biases), blocksize 64."""
    return write_bnb_checkpoint(tmp_path / "bnb", tiny_reference(), Bnb())


@pytest.fixture
def single_dir(tmp_path) -> Path:
    return write_bnb_checkpoint(tmp_path / "single", tiny_reference(), Bnb(double_quant=False))


@pytest.mark.parametrize("field, value, needle", [
    ("bnb_4bit_quant_type", "fp4", "not 'fp4'"),
    ("bnb_4bit_quant_type", None, "transformers' default"),
    ("load_in_8bit", True, "8-bit"),
    ("bnb_4bit_use_double_quant", "yes", "true or false"),
    ("llm_int8_skip_modules", "lm_head", "list of module names"),
])
def test_unsupported_config(bnb_dir, field, value, needle):
    edit_config(bnb_dir, **{field: value})
    expect_error(bnb_dir, "config.json", f"quantization_config.{field} = {value!r}", needle)


def test_bitsandbytes_without_load_in_4bit(bnb_dir):
    edit_config(bnb_dir, load_in_4bit=False, _load_in_4bit=False)
    expect_error(bnb_dir, "config.json", "quantization_config.quant_method = 'bitsandbytes'", "load_in_4bit")


def _json(name, **changes):
    def change(tensors):
        meta = json.loads(bytes(tensors[f"{name}.{QS}"].tolist()))
        meta.update(changes)
        tensors[f"{name}.{QS}"] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    return change


def _rename(old, new):
    def change(tensors):
        tensors[new] = tensors.pop(old)
    return change


def _double_quant_map(tensors):
    tensors[f"{DOWN}.weight.quant_map"] = tensors[f"{DOWN}.weight.quant_map"] * 2


TENSOR_ERRORS = {
    # name: (change to the stored tensors, what the message names)
    "missing absmax": (_drop(f"{Q}.weight.absmax"), (f"{Q}.weight.absmax", "missing")),
    "missing quant state": (_drop(f"{Q}.{QS}"), (f"{Q}.{QS}", "missing")),
    "missing packed weight": (_drop(f"{DOWN}.weight"), (f"{DOWN}.weight'", "missing")),
    "missing nested absmax": (_drop(f"{Q}.weight.nested_absmax"), (f"{Q}.weight.nested_absmax", "missing",
                                                                   "double quant")),
    "missing bias": (_drop(f"{Q}.bias"), (f"{Q}.bias", "missing", "has a bias")),
    "fp4 quant state": (_rename(f"{Q}.{QS}", f"{Q}.weight.quant_state.bitsandbytes__fp4"), ("fp4", Q)),
    "JSON quant_type": (_json(Q, quant_type="fp4"), (f"{Q}.{QS}", "quant_type = 'fp4'")),
    "JSON shape": (_json(Q, shape=[128, 256]), (f"{Q}.{QS}", "shape = [128, 256]", "[128, 128]")),
    "JSON blocksize": (_json(Q, blocksize=48), (f"{Q}.{QS}", "blocksize = 48")),
    "JSON dtype": (_json(Q, dtype="int8"), (f"{Q}.{QS}", "dtype = 'int8'")),
    "corrupt JSON": (_set(f"{Q}.{QS}", torch.tensor(list(b'{"quant_type": '), dtype=torch.uint8)),
                     (f"{Q}.{QS}", "not valid UTF-8 JSON")),
    "JSON dtype of the tensor": (_set(f"{Q}.{QS}", torch.zeros(8, dtype=torch.int32)), (f"{Q}.{QS}", "uint8")),
    "absmax shape": (_set(f"{Q}.weight.absmax", torch.zeros(100, dtype=torch.uint8)),
                     (f"{Q}.weight.absmax", "shape (100,)", "(256,)")),
    "absmax dtype": (_set(f"{Q}.weight.absmax", torch.zeros(256)), (f"{Q}.weight.absmax", "dtype torch.float32")),
    "nested absmax shape": (_set(f"{Q}.weight.nested_absmax", torch.ones(3)), (f"{Q}.weight.nested_absmax", "(1,)")),
    "packed bytes": (_set(f"{Q}.weight", torch.zeros(100, 1, dtype=torch.uint8)),
                     (f"{Q}.weight", "8192 bytes", "(100, 1)")),
    "bias shape": (_set(f"{Q}.bias", torch.zeros(64, dtype=torch.float16)), (f"{Q}.bias", "shape (64,)")),
    "bias the Linear lacks": (_set(f"{DOWN}.bias", torch.zeros(128, dtype=torch.float16)), (f"{DOWN}.bias", "no bias")),
    "quantized, but no Linear": (_set("model.norm.weight.absmax", torch.zeros(1, dtype=torch.uint8)),
                                 ("model.norm", "no nn.Linear")),
    "missing norm": (_drop("model.norm.weight"), ("model.norm.weight", "missing")),
    # found only when building, after other layers were built: the staging keeps the model untouched
    "quant_map not NF4": (_double_quant_map, (DOWN, "quant_map is not the NF4 table")),
}


@pytest.mark.parametrize("case", TENSOR_ERRORS)
def test_bad_tensor(bnb_dir, case):
    change, needles = TENSOR_ERRORS[case]
    edit_tensors(bnb_dir, change)
    expect_error(bnb_dir, SINGLE_FILE, *needles)


def test_nested_entries_in_a_single_level_checkpoint(single_dir, bnb_dir):
    nested = load_file(str(bnb_dir / SINGLE_FILE))[f"{Q}.weight.nested_absmax"]
    edit_tensors(single_dir, _set(f"{Q}.weight.nested_absmax", nested))
    expect_error(single_dir, SINGLE_FILE, f"{Q}.weight.nested_absmax", "unexpected", "no nested_offset")


def test_quantized_layer_listed_in_skip_modules(bnb_dir):
    edit_config(bnb_dir, llm_int8_skip_modules=["o_proj"])
    expect_error(bnb_dir, SINGLE_FILE, "self_attn.o_proj", "llm_int8_skip_modules")


def test_no_quantized_layer(tmp_path):
    directory = write_bnb_checkpoint(tmp_path, tiny_reference(), Bnb(skip=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                           "gate_proj", "up_proj", "down_proj")))
    expect_error(directory, SINGLE_FILE, "no X.weight.quant_state.bitsandbytes__nf4 tensor")


def test_fp16_overflowing_block_scale(tmp_path):
    """A block absmax past fp16's range cannot be an fp16 kernel scale: an error naming the layer (bf16 works)."""
    reference = tiny_reference()
    with torch.no_grad():
        reference.model.layers[0].mlp.up_proj.weight[0, 0] = 1e5
    directory = write_bnb_checkpoint(tmp_path, reference, Bnb(dtype=torch.float32, compute_dtype="float32"),
                                     torch_dtype=None)
    expect_error(directory, "model.layers.0.mlp.up_proj", "does not fit torch.float16")
    model = tiny_reference(seed=5)
    load_quantized(model, directory, dtype=torch.bfloat16)
    assert model.model.layers[0].mlp.gate_up_proj.scales.dtype == torch.bfloat16


def test_sharded_with_a_missing_shard(tmp_path):
    directory = write_bnb_checkpoint(tmp_path, tiny_reference(), Bnb(shards=2))
    (directory / "model-00002-of-00002.safetensors").unlink()
    expect_error(directory, INDEX_FILE, "model-00002-of-00002.safetensors", "does not exist")


def test_sharded_error_names_the_shard(tmp_path):
    directory = write_bnb_checkpoint(tmp_path, tiny_reference(), Bnb(shards=3))
    index = json.loads((directory / INDEX_FILE).read_text())
    shard = index["weight_map"][f"{Q}.weight.absmax"]
    tensors = load_file(str(directory / shard))
    tensors[f"{Q}.weight.absmax"] = torch.zeros(7, dtype=torch.uint8)
    save_file(tensors, str(directory / shard))
    expect_error(directory, shard, f"{Q}.weight.absmax", "shape (7,)")


@pytest.mark.parametrize("k, n", [(128, 96), (160, 64)])  # n % 64, k % 64 (k = 192 tiles)
def test_shape_the_kernel_cannot_tile(tmp_path, k, n):
    directory = write_bnb_checkpoint(tmp_path, OneProj(k, n), Bnb())
    expect_error(directory, SINGLE_FILE, "down_proj", "cannot tile", f"k = {k}", f"n = {n}", model=OneProj(k, n))
