"""tilefish.load_quantized: HF-format GPTQ / AWQ checkpoints (CPU; a few loaded onto the GPU too).

The checkpoints are written here, packed with plain integer arithmetic from the published format descriptions
(AutoGPTQ / GPTQModel / AutoAWQ; summarized in tilefish.quant.int4's docstring), never with tilefish's own
exporters, so that a packing mistake shared by reader and writer cannot hide. Each loaded model is compared, by its
logits, with an fp32 copy whose Linear weights are the test's own unpacked integers: (q - z) * s.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from conftest import rel_err
from tilefish.checkpoint import CheckpointError, load_quantized
from tilefish.nn import W4A16Linear, W4A16Slice

LOGIT_TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 4e-2}  # fp16/bf16 model vs the fp32 reference
AWQ_NIBBLE_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of an AWQ word holds column AWQ_NIBBLE_COLUMNS[j] of its 8
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ------------------------------------------------------------------------------------------------------------
# the formats, packed here


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0 .. 2**32 - 1 -> the int32 with the same bits (what the checkpoints store)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight: q [k, n] -> [k/8, n]; input row 8r + j sits in bits 4j..4j+3 of word (r, c)."""
    words = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for j in range(8):
        words |= q[j::8].long() << (4 * j)
    return to_int32(words)


def pack_columns(v: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[rows, n] -> [rows, n/8]; nibble j of word c holds column 8c + order[j] (GPTQ qzeros: in order; AWQ:
    AWQ_NIBBLE_COLUMNS)."""
    words = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for j, column in enumerate(order):
        words |= v[:, column::8].long() << (4 * j)
    return to_int32(words)


@dataclass(frozen=True)
class Fmt:
    """One test checkpoint's format."""

    method: str = "gptq"
    group_size: int = 128
    sym: bool = True
    checkpoint_format: str = "gptq"     # GPTQ "gptq" (v1: stored zero = zero - 1) or "gptq_v2" (stored = zero)
    desc_act: bool = False
    dtype: torch.dtype = torch.float16
    shards: int = 1
    not_convert: tuple[str, ...] = ()

    def quantization_config(self) -> dict:
        common = {"quant_method": self.method, "bits": 4, "group_size": self.group_size,
                  "modules_to_not_convert": list(self.not_convert)}
        if self.method == "awq":
            return {**common, "version": "gemm", "zero_point": True}
        return {**common, "desc_act": self.desc_act, "sym": self.sym, "checkpoint_format": self.checkpoint_format}


def quantize_layer(n: int, k: int, fmt: Fmt, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random stored tensors of an nn.Linear(k, n) in ``fmt`` and the fp32 weight [n, k] they stand for."""
    G = k if fmt.group_size == -1 else fmt.group_size
    groups = k // G
    q = torch.randint(0, 16, (k, n), generator=gen)                       # q[i, c]: input row i, output column c
    if fmt.sym:
        zeros = torch.full((groups, n), 8)
    else:  # v1 stores zero - 1, so it cannot hold a zero point of 0
        low = 1 if fmt.method == "gptq" and fmt.checkpoint_format == "gptq" else 0
        zeros = torch.randint(low, 16, (groups, n), generator=gen)
    scales = ((torch.rand(groups, n, generator=gen) + 0.5) * 0.01).to(fmt.dtype)
    g_idx = torch.arange(k) // G
    if fmt.desc_act:  # act-order: input rows visit the groups in a random order, each group keeping G rows
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    weight = ((q - zeros[g_idx]) * scales.float()[g_idx]).t().contiguous()
    if fmt.method == "awq":
        stored = {"qweight": pack_columns(q, AWQ_NIBBLE_COLUMNS), "qzeros": pack_columns(zeros, AWQ_NIBBLE_COLUMNS),
                  "scales": scales}
    else:
        stored_zeros = zeros - 1 if fmt.checkpoint_format == "gptq" else zeros
        stored = {"qweight": pack_rows(q), "qzeros": pack_columns(stored_zeros), "scales": scales,
                  "g_idx": g_idx.to(torch.int32)}
    return stored, weight


def excluded(name: str, not_convert) -> bool:
    return any(f".{entry}." in f".{name}." for entry in not_convert)


@torch.no_grad()
def write_checkpoint(directory: Path, reference: nn.Module, fmt: Fmt, *, config: dict | None = None,
                     torch_dtype: str | None = "fmt", seed: int = 0) -> Path:
    """Store ``reference`` (fp32) as a checkpoint: every ``*_proj`` Linear quantized in ``fmt``, everything else in
    ``fmt.dtype``; tied tensors once. The reference's own tensors are set to exactly what the checkpoint holds."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    quantized = set()
    for name, module in reference.named_modules():
        if isinstance(module, nn.Linear) and name.endswith("_proj") and not excluded(name, fmt.not_convert):
            stored, weight = quantize_layer(module.out_features, module.in_features, fmt, gen)
            tensors.update({f"{name}.{role}": t for role, t in stored.items()})
            module.weight.copy_(weight)
            quantized.add(f"{name}.weight")
    return save_checkpoint(directory, reference, tensors, quantized, fmt.dtype, fmt.shards, fmt.quantization_config(),
                           config, torch_dtype, gen)


@torch.no_grad()
def save_checkpoint(directory: Path, reference: nn.Module, tensors: dict, quantized: set, dtype: torch.dtype,
                    shards: int, quantization_config: dict, config: dict | None, torch_dtype: str | None,
                    gen: torch.Generator) -> Path:
    """The rest of a test checkpoint, whatever the format of its quantized layers (``tensors`` holds their
    entries, ``quantized`` their weight names): every other tensor in ``dtype`` (tied ones once; the reference set
    to what is stored), one safetensors file or ``shards`` of them round robin with an index, and config.json."""
    seen = set()
    for name, t in reference.state_dict(keep_vars=True).items():
        if name in quantized or id(t) in seen:
            continue
        seen.add(id(t))
        t.mul_(torch.rand(t.shape, generator=gen) + 0.5)                   # no two norms alike
        tensors[name] = t.to(dtype)
        t.copy_(tensors[name])
    directory.mkdir(parents=True, exist_ok=True)
    if shards == 1:
        save_file(tensors, str(directory / SINGLE_FILE))
    else:  # round robin: a layer's entries land in different shards
        names = sorted(tensors)
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        weight_map = {name: files[i % shards] for i, name in enumerate(names)}
        for file in files:
            save_file({n: tensors[n] for n in names if weight_map[n] == file}, str(directory / file))
        (directory / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = dict(config or {}, quantization_config=quantization_config)
    if torch_dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.") if torch_dtype == "fmt" else torch_dtype
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


def edit_tensors(directory: Path, change) -> None:
    path = directory / SINGLE_FILE
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


# ------------------------------------------------------------------------------------------------------------
# models


class TinyNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class TinyBlock(nn.Module):
    def __init__(self, hidden: int, intermediate: int, kv: int):
        super().__init__()
        self.input_layernorm = TinyNorm(hidden)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(hidden, hidden)                 # q/k/v with biases, as in Qwen2
        self.self_attn.k_proj = nn.Linear(hidden, kv)
        self.self_attn.v_proj = nn.Linear(hidden, kv)
        self.self_attn.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.mlp.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.mlp.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, h):
        a, m, x = self.self_attn, self.mlp, self.input_layernorm(h)
        h = h + a.o_proj(a.q_proj(x) * torch.cat([a.k_proj(x), a.v_proj(x)], -1).sigmoid())
        return h + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


class TinyLM(nn.Module):
    """A decoder-shaped module tree named like a Llama checkpoint, for the tests that run without transformers."""

    def __init__(self, hidden=128, intermediate=256, layers=2, kv=64, vocab=256):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(TinyBlock(hidden, intermediate, kv) for _ in range(layers))
        self.model.norm = TinyNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.model.embed_tokens(ids)
        for block in self.model.layers:
            h = block(h)
        return self.lm_head(self.model.norm(h))


def tiny_reference(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def llama_config(tie: bool = False):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=256, tie_word_embeddings=tie)


def llama_reference(config):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().eval()


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out).float()


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def w4a16_layers(model) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (W4A16Linear, W4A16Slice))}


# ------------------------------------------------------------------------------------------------------------
# loading, checked by logits


LLAMA_CASES = {
    "gptq-sym-v1-g128": Fmt(),
    "gptq-asym-v1-g32": Fmt(group_size=32, sym=False),
    "gptq-v2-g64-bf16": Fmt(group_size=64, sym=False, checkpoint_format="gptq_v2", dtype=torch.bfloat16),
    "gptq-act-order-g32": Fmt(group_size=32, sym=False, desc_act=True),
    "gptq-per-channel": Fmt(group_size=-1, sym=False),
    "awq-g128": Fmt(method="awq", sym=False),
    "awq-g64-bf16": Fmt(method="awq", group_size=64, sym=False, dtype=torch.bfloat16),
    "gptq-3-shards-tied": Fmt(group_size=64, shards=3),
}


@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama_logits(tmp_path, case):
    fmt = LLAMA_CASES[case]
    config = llama_config(tie=case.endswith("tied"))
    reference = llama_reference(config)
    directory = write_checkpoint(tmp_path, reference, fmt, config=config.to_dict())

    model, report = load_quantized(directory)

    assert type(model) is type(reference)
    assert len(report.converted) == 14 and set(report.skipped) == {"lm_head"}
    assert all(t.device.type == "cpu" for t in list(model.parameters()) + list(model.buffers()))
    assert model.model.norm.weight.dtype == fmt.dtype and model.lm_head.weight.dtype == fmt.dtype
    if config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    if fmt.desc_act:  # each projection gathers x in its own order: nothing to share
        assert attn.q_proj.perm is not None and not report.fused
        assert any("layers.0.self_attn.q_proj" in group for group in report.unfused)
    else:
        assert set(report.fused) == {f"model.layers.{i}.{p}" for i in range(2)
                                     for p in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
        assert isinstance(attn.q_proj, W4A16Slice)
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[fmt.dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gptq-act-order-g32", "gptq-v2-g64-bf16", "awq-g128", "gptq-3-shards-tied"])
def test_llama_logits_on_the_gpu(tmp_path, case):
    """The same checkpoints loaded straight onto the GPU run the W4A16 kernels (the user's path:
    load, then generate), against the same fp32 reference."""
    fmt = LLAMA_CASES[case]
    config = llama_config(tie=case.endswith("tied"))
    reference = llama_reference(config)
    directory = write_checkpoint(tmp_path, reference, fmt, config=config.to_dict())

    model, _ = load_quantized(directory, device="cuda")

    assert all(t.is_cuda for t in list(model.parameters()) + list(model.buffers()))
    assert rel_err(logits(model, IDS.cuda()).cpu(), logits(reference, IDS)) < LOGIT_TOLERANCE[fmt.dtype]


def test_config_argument_and_package_attribute(tmp_path):
    import tilefish

    config = llama_config()
    reference = llama_reference(config)
    directory = write_checkpoint(tmp_path, reference, Fmt(sym=False), config=config.to_dict())

    model, _ = tilefish.load_quantized(config, directory, dtype=torch.bfloat16)

    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.bfloat16]


def test_fused_and_unfused_loads_agree(tmp_path):
    from transformers import LlamaForCausalLM

    config = llama_config()
    directory = write_checkpoint(tmp_path, llama_reference(config), Fmt(group_size=32), config=config.to_dict())
    with torch.device("meta"):
        unfused = LlamaForCausalLM(config).eval()

    fused, fused_report = load_quantized(directory)
    _, unfused_report = load_quantized(unfused, directory, fuse=False)

    assert len(fused_report.fused) == 4 and not unfused_report.fused
    assert all(type(m) is W4A16Linear for m in w4a16_layers(unfused).values())
    assert rel_err(logits(fused, IDS), logits(unfused, IDS)) < 1e-3


def test_into_meta_module_tree_without_transformers(tmp_path):
    """Any nn.Module whose names match, built on the meta device; q/k/v carry biases."""
    reference = tiny_reference()
    fmt = Fmt(group_size=64, sym=False)
    directory = write_checkpoint(tmp_path, reference, fmt)
    with torch.device("meta"):
        model = TinyLM()

    loaded, report = load_quantized(model, directory)

    assert loaded is model and len(report.converted) == 14
    assert report.bytes_after < report.bytes_before
    assert model.model.layers[1].self_attn.qkv_proj.bias is not None
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.float16]


def test_real_model_default_dtype_from_scales(tmp_path):
    """No fp16/bf16 torch_dtype in config.json: the scales' dtype; the model's own (CPU) device."""
    reference = tiny_reference()
    directory = write_checkpoint(tmp_path, reference, Fmt(method="awq", group_size=32, sym=False,
                                                          dtype=torch.bfloat16), torch_dtype="float32")
    model = tiny_reference(seed=5)

    load_quantized(model, directory, fuse=False)

    assert model.model.layers[0].mlp.up_proj.scales.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.bfloat16]


def test_modules_to_not_convert_stay_dense(tmp_path):
    reference = tiny_reference()
    directory = write_checkpoint(tmp_path, reference, Fmt(sym=False, not_convert=("mlp.down_proj",)))
    with torch.device("meta"):
        model = TinyLM()

    _, report = load_quantized(model, directory)

    down = model.model.layers[0].mlp.down_proj
    assert type(down) is nn.Linear and down.weight.dtype == torch.float16
    assert report.skipped["model.layers.1.mlp.down_proj"] == "listed in quantization_config.modules_to_not_convert"
    assert len(report.converted) == 12
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.float16]


def test_path_loading_needs_transformers(tmp_path, monkeypatch):
    directory = write_checkpoint(tmp_path, tiny_reference(), Fmt())
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ImportError, match=r"pip install tilefish\[hf\]"):
        load_quantized(directory)


# ------------------------------------------------------------------------------------------------------------
# bad checkpoints: the message names what is wrong, and the model is untouched


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) under every name it has."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def snapshot(model: nn.Module):
    return dict(model.named_modules()), {n: (t, t.detach().clone()) for n, t in model_tensors(model).items()}


def assert_unchanged(model: nn.Module, before) -> None:
    modules, tensors = before
    now = dict(model.named_modules())
    assert now.keys() == modules.keys() and all(now[n] is modules[n] for n in now)
    state = model_tensors(model)
    assert state.keys() == tensors.keys()
    for name, (t, value) in tensors.items():
        assert state[name] is t and (t.device.type == "meta" or torch.equal(t, value)), name


def expect_error(directory: Path, *needles: str, model: nn.Module | None = None) -> None:
    model = model if model is not None else tiny_reference(seed=7)
    before = snapshot(model)
    with pytest.raises(CheckpointError) as info:
        load_quantized(model, directory)
    for needle in needles:
        assert needle in str(info.value)
    assert_unchanged(model, before)


@pytest.fixture
def gptq_dir(tmp_path) -> Path:
    """A valid asymmetric GPTQ v1 checkpoint of TinyLM, group size 64 (2 groups over k = 128, 4 over 256)."""
    return write_checkpoint(tmp_path / "gptq", tiny_reference(), Fmt(group_size=64, sym=False))


@pytest.mark.parametrize("field, value", [
    ("bits", 8), ("bits", 3), ("bits", 2),
    ("checkpoint_format", "marlin"), ("checkpoint_format", "exllama"),
    ("quant_method", "bitsandbytes"), ("group_size", 256),
])
def test_unsupported_gptq_config(gptq_dir, field, value):
    edit_config(gptq_dir, **{field: value})
    expect_error(gptq_dir, "config.json", f"quantization_config.{field} = {value!r}")


@pytest.mark.parametrize("field, value", [
    ("version", "gemv"), ("version", "exllama"), ("version", "marlin"), ("version", "ipex"), ("zero_point", False),
])
def test_unsupported_awq_config(tmp_path, field, value):
    directory = write_checkpoint(tmp_path, tiny_reference(), Fmt(method="awq", sym=False))
    edit_config(directory, **{field: value})
    expect_error(directory, "config.json", f"quantization_config.{field} = {value!r}")


def test_awq_version_spelled_in_capitals(tmp_path):
    reference = tiny_reference()
    directory = write_checkpoint(tmp_path, reference, Fmt(method="awq", sym=False))
    edit_config(directory, version="GEMM")
    model = tiny_reference(seed=3)
    load_quantized(model, directory)
    assert rel_err(logits(model, IDS), logits(reference, IDS)) < LOGIT_TOLERANCE[torch.float16]


Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.1.mlp.down_proj"


def _set(name, value):
    def change(tensors):
        tensors[name] = value
    return change


def _drop(name):
    def change(tensors):
        del tensors[name]
    return change


def _stored_zero_15(tensors):  # v1 stores zero - 1: a nibble 15 would mean a zero point of 16
    tensors[f"{DOWN}.qzeros"] = torch.full_like(tensors[f"{DOWN}.qzeros"], 0x7FFFFFFF)


TENSOR_ERRORS = {
    # name: (change to the stored tensors, what the message names)
    "qweight shape vs the Linear": (_set(f"{Q}.qweight", torch.zeros(16, 256, dtype=torch.int32)),
                                    (f"{Q}.qweight", "shape (16, 256)", "out_features n = 128")),
    "scales rows vs group_size": (_set(f"{Q}.scales", torch.ones(4, 128, dtype=torch.float16)),
                                  (f"{Q}.scales", "shape (4, 128)", "group_size 64")),
    "qzeros columns": (_set(f"{Q}.qzeros", torch.zeros(2, 8, dtype=torch.int32)), (f"{Q}.qzeros", "shape (2, 8)")),
    "g_idx length": (_set(f"{Q}.g_idx", torch.zeros(64, dtype=torch.int32)), (f"{Q}.g_idx", "shape (64,)")),
    "missing qzeros": (_drop(f"{Q}.qzeros"), (f"{Q}.qzeros", "missing")),
    "missing scales": (_drop(f"{DOWN}.scales"), (f"{DOWN}.scales", "missing")),
    "missing bias": (_drop(f"{Q}.bias"), (f"{Q}.bias", "missing")),
    "missing norm": (_drop("model.norm.weight"), ("model.norm.weight", "missing")),
    "qweight dtype": (_set(f"{Q}.qweight", torch.zeros(16, 128)), (f"{Q}.qweight", "dtype torch.float32")),
    "scales dtype": (_set(f"{Q}.scales", torch.ones(2, 128, dtype=torch.int32)), (f"{Q}.scales", "dtype torch.int32")),
    "embedding dtype": (_set("model.embed_tokens.weight", torch.zeros(256, 128, dtype=torch.int32)),
                        ("model.embed_tokens.weight", "dtype torch.int32")),
    "embedding shape": (_set("model.embed_tokens.weight", torch.zeros(200, 128, dtype=torch.float16)),
                        ("model.embed_tokens.weight", "shape (200, 128)")),
    "bias the Linear lacks": (_set(f"{DOWN}.bias", torch.zeros(128, dtype=torch.float16)), (f"{DOWN}.bias", "no bias")),
    "unexpected tensor": (_set("model.rotary.inv_freq", torch.ones(16)), ("model.rotary.inv_freq",)),
    "qweight of no Linear": (_set("model.norm.qweight", torch.zeros(16, 128, dtype=torch.int32)),
                             ("model.norm.qweight", "no nn.Linear")),
    # found only when building, after other layers were built: the staging keeps the model untouched
    "v1 zero nibble 15": (_stored_zero_15, (DOWN, "qzeros", "15")),
    "g_idx with uneven groups": (_set(f"{DOWN}.g_idx", torch.zeros(256, dtype=torch.int32)), (DOWN, "g_idx")),
}


@pytest.mark.parametrize("case", TENSOR_ERRORS)
def test_bad_tensor(gptq_dir, case):
    change, needles = TENSOR_ERRORS[case]
    edit_tensors(gptq_dir, change)
    expect_error(gptq_dir, SINGLE_FILE, *needles)


def test_act_order_needs_g_idx(tmp_path):
    directory = write_checkpoint(tmp_path, tiny_reference(), Fmt(group_size=32, sym=False, desc_act=True))
    edit_tensors(directory, _drop(f"{Q}.g_idx"))
    expect_error(directory, SINGLE_FILE, f"{Q}.g_idx", "missing", "desc_act")


def test_quantized_layer_listed_in_modules_to_not_convert(gptq_dir):
    edit_config(gptq_dir, modules_to_not_convert=["o_proj"])
    expect_error(gptq_dir, SINGLE_FILE, "self_attn.o_proj.qweight", "modules_to_not_convert")


def test_bad_tensor_into_meta_model(gptq_dir):
    edit_tensors(gptq_dir, _stored_zero_15)
    with torch.device("meta"):
        model = TinyLM()
    expect_error(gptq_dir, DOWN, model=model)


@pytest.mark.parametrize("damage", ["corrupt header", "truncated"])
def test_damaged_file(gptq_dir, damage):
    path = gptq_dir / SINGLE_FILE
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"{not json" + data[17:] if damage == "corrupt header" else data[:-1000])
    expect_error(gptq_dir, SINGLE_FILE, "corrupt or truncated")


def test_index_names_a_missing_shard(tmp_path):
    directory = write_checkpoint(tmp_path, tiny_reference(), Fmt(shards=2))
    (directory / "model-00002-of-00002.safetensors").unlink()
    expect_error(directory, INDEX_FILE, "model-00002-of-00002.safetensors", "does not exist")


def test_index_names_a_tensor_its_shard_lacks(tmp_path):
    directory = write_checkpoint(tmp_path, tiny_reference(), Fmt(shards=2))
    index = json.loads((directory / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00002.safetensors"
    index["weight_map"]["model.extra"] = "model-00001-of-00002.safetensors"
    (directory / INDEX_FILE).write_text(json.dumps(index))
    expect_error(directory, INDEX_FILE, "has no such tensor")


def test_no_safetensors(gptq_dir):
    (gptq_dir / SINGLE_FILE).unlink()
    expect_error(gptq_dir, SINGLE_FILE, INDEX_FILE, "found")


def test_no_config(gptq_dir):
    (gptq_dir / "config.json").unlink()
    expect_error(gptq_dir, "config.json", "unreadable")
    expect_error(gptq_dir / "nowhere", "nowhere", "not a checkpoint directory")


def test_meta_buffer_no_checkpoint_can_fill(gptq_dir):
    """A non-persistent buffer is in no checkpoint: on the meta device it has no values to load (transformers
    models recompute theirs; a plain module cannot)."""
    with torch.device("meta"):
        model = TinyLM()
        model.model.register_buffer("inv_freq", torch.ones(16), persistent=False)
    expect_error(gptq_dir, "model.inv_freq", "meta device", model=model)


class OneProj(nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.down_proj = nn.Linear(k, n, bias=False)


@pytest.mark.parametrize("k, n", [(128, 96), (160, 64)])  # n % 64, k % 64 (k = 192 tiles: an odd count of 64-k steps)
def test_shape_the_kernel_cannot_tile(tmp_path, k, n):
    directory = write_checkpoint(tmp_path, OneProj(k, n), Fmt(group_size=32))
    expect_error(directory, SINGLE_FILE, "down_proj.qweight", "cannot tile", f"k = {k}", f"n = {n}",
                 model=OneProj(k, n))


def test_bad_arguments(gptq_dir):
    with pytest.raises(TypeError, match="dtype"):
        load_quantized(tiny_reference(), gptq_dir, dtype=torch.float32)
    with pytest.raises(TypeError, match="missing"):
        load_quantized(tiny_reference())
