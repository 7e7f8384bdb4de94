"""Load Hugging Face-format GPTQ / AWQ / bitsandbytes 4-bit checkpoints (safetensors) with W4A16Linear layers.

    model, report = tilefish.load_quantized("path/to/Llama-GPTQ")        # builds the model (needs transformers)
    model, report = tilefish.load_quantized(model, "path/to/Llama-GPTQ") # into a model you built (meta is fine)

A checkpoint is a directory holding ``config.json``, whose ``quantization_config`` names the format, and either
``model.safetensors`` or ``model.safetensors.index.json`` plus the shards it names. Read: GPTQ 4-bit
(``checkpoint_format`` "gptq" = v1 zeros, or "gptq_v2"), with or without act-order (``desc_act``), and AWQ 4-bit
GEMM; group sizes -1, 32, 64, 128. The tensor layouts are documented in ``tilefish.quant.int4``. And bitsandbytes
4-bit NF4 (``quant_method`` "bitsandbytes", ``load_in_4bit``, ``bnb_4bit_quant_type`` "nf4", with or without double
quant): each Linear X stores bitsandbytes' Linear4bit entries (``X.weight`` packed bytes, ``X.weight.absmax``,
``X.weight.quant_map``, [``X.weight.nested_absmax``, ``X.weight.nested_quant_map``,]
``X.weight.quant_state.bitsandbytes__nf4`` JSON; layout in ``tilefish.quant.nf4``) and becomes an ``NF4Linear``.

Loading is all or nothing. Every tensor header is checked against the model and the config first; then each new
layer and tensor is built into a staging area, reading one layer's tensors at a time (peak memory: the quantized
model plus one layer); only then is the model changed. After any error the model is exactly as it was.
"""
from __future__ import annotations

import copy
import itertools
import json
import math
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = ["CheckpointError", "QuantFormat", "load_quantized"]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_EXTRA = "pip install tilefish[hf]"
GROUP_SIZES = (-1, 32, 64, 128)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_INDEX_DTYPES = (torch.int32, torch.int64)

# safetensors header dtype codes -> torch dtypes (a code missing here is reported as unsupported)
_SAFETENSORS_DTYPES = {
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}

# the tensors one quantized Linear X stores as X.<role>, and the dtypes each may have
_ROLE_DTYPES = {
    "qweight": (torch.int32,), "qzeros": (torch.int32,), "scales": FLOAT_DTYPES,
    "g_idx": INT_INDEX_DTYPES, "bias": FLOAT_DTYPES,
}
_ROLES = {"gptq": ("qweight", "qzeros", "scales", "g_idx", "bias"), "awq": ("qweight", "qzeros", "scales", "bias")}
# checkpoint_format -> zero convention: v1 stores true zero - 1 (AutoGPTQ), v2 stores the true zero (GPTQModel)
_GPTQ_FORMATS = {"gptq": "v1", "gptq_v2": "v2"}
_WHY_REQUIRED = {"g_idx": "desc_act (act-order) is set in config.json", "bias": "the model's nn.Linear has a bias"}

# bitsandbytes 4-bit: role -> the name under the Linear X of the tensor bitsandbytes' Linear4bit stores
_BNB_QUANT_STATE = "weight.quant_state.bitsandbytes__"
_BNB_ENTRIES = {"weight": "weight", "absmax": "weight.absmax", "quant_map": "weight.quant_map",
                "nested_absmax": "weight.nested_absmax", "nested_quant_map": "weight.nested_quant_map",
                "quant_state": _BNB_QUANT_STATE + "nf4", "bias": "bias"}
_BNB_MARKERS = ("weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
                _BNB_QUANT_STATE)  # an X.<marker...> tensor makes X a bitsandbytes 4-bit layer


class CheckpointError(ValueError):
    """A checkpoint tilefish cannot load; the message names the file, the tensor or config field, and the rule."""


# ----------------------------------------------------------------------------------------------------------------
# the format, from config.json


@dataclass(frozen=True)
class QuantFormat:
    """What ``quantization_config`` says about the stored 4-bit layers."""

    method: str                                 # "gptq", "awq" or "bitsandbytes" (4-bit nf4)
    group_size: int | None                      # -1 (one group over k), 32, 64, 128; bitsandbytes: None (each
                                                # layer's quant-state JSON holds its blocksize)
    zero_convention: str | None = None          # GPTQ: "v1" or "v2"; AWQ stores true zeros (None)
    desc_act: bool = False                      # GPTQ act-order: every layer must carry g_idx
    modules_to_not_convert: tuple[str, ...] = ()
    skip_field: str = "modules_to_not_convert"  # the config field modules_to_not_convert came from
    compute_dtype: torch.dtype | None = None    # bitsandbytes' bnb_4bit_compute_dtype, when fp16 / bf16

    @classmethod
    def from_config(cls, config: dict, source: str) -> "QuantFormat":
        """Parse the ``quantization_config`` of ``config`` (the dict of ``source``, named in errors)."""
        qc = config.get("quantization_config")
        if not isinstance(qc, dict):
            raise CheckpointError(f"{source}: no quantization_config; not a GPTQ / AWQ checkpoint")

        def fail(field: str, message: str) -> CheckpointError:
            return CheckpointError(f"{source}: quantization_config.{field} = {qc.get(field)!r}: {message}")

        method = qc.get("quant_method")
        if method is None and ("load_in_4bit" in qc or "load_in_8bit" in qc):
            method = "bitsandbytes"  # transformers' early BitsAndBytesConfig wrote no quant_method
        if method not in ("gptq", "awq", "bitsandbytes"):
            raise fail("quant_method", "not supported (tilefish loads 'gptq', 'awq' and 'bitsandbytes' 4-bit nf4)")
        if method == "bitsandbytes":
            return cls._from_bitsandbytes(qc, source, fail)
        if qc.get("bits") != 4:
            raise fail("bits", "only 4-bit checkpoints are supported")
        group_size = qc.get("group_size")
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise fail("group_size", f"the W4A16 kernel supports group sizes {GROUP_SIZES}")
        skip = qc.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise fail("modules_to_not_convert", "must be a list of module names")
        if method == "gptq":
            checkpoint_format = qc.get("checkpoint_format", "gptq")
            if checkpoint_format not in _GPTQ_FORMATS:
                raise fail("checkpoint_format", "not supported (tilefish loads 'gptq' and 'gptq_v2'; marlin and "
                                                "exllama formats are repacked for other kernels)")
            return cls("gptq", group_size, _GPTQ_FORMATS[checkpoint_format], bool(qc.get("desc_act", False)),
                       tuple(skip))
        version = qc.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise fail("version", "not supported (tilefish loads the AWQ 'gemm' layout; gemv, exllama, marlin "
                                  "and ipex are packed differently)")
        if qc.get("zero_point", True) is not True:
            raise fail("zero_point", "AWQ GEMM checkpoints without zero points are not supported")
        return cls("awq", group_size, None, False, tuple(skip))

    @classmethod
    def _from_bitsandbytes(cls, qc: dict, source: str, fail) -> "QuantFormat":
        if qc.get("load_in_8bit") is True:
            raise fail("load_in_8bit", "8-bit (LLM.int8) checkpoints are not supported (tilefish loads bitsandbytes "
                                       "4-bit nf4)")
        if qc.get("load_in_4bit", qc.get("_load_in_4bit")) is not True:
            raise CheckpointError(f"{source}: quantization_config.quant_method = 'bitsandbytes' without load_in_4bit: "
                                  f"true (load_in_4bit = {qc.get('load_in_4bit')!r}); tilefish loads bitsandbytes "
                                  "4-bit nf4 checkpoints")
        quant_type = qc.get("bnb_4bit_quant_type")
        if quant_type != "nf4":
            absent = " (absent: transformers' default, fp4)" if quant_type is None else ""
            raise fail("bnb_4bit_quant_type", f"not supported{absent}; tilefish loads bitsandbytes' 'nf4', not 'fp4'")
        if not isinstance(qc.get("bnb_4bit_use_double_quant", False), bool):
            raise fail("bnb_4bit_use_double_quant", "must be true or false")
        skip = qc.get("llm_int8_skip_modules") or []
        if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
            raise fail("llm_int8_skip_modules", "must be a list of module names")
        compute = getattr(torch, str(qc.get("bnb_4bit_compute_dtype")), None)
        # Whether a layer is double-quantized is read from its own tensors, as bitsandbytes does.
        return cls("bitsandbytes", None, modules_to_not_convert=tuple(skip), skip_field="llm_int8_skip_modules",
                   compute_dtype=compute if compute in ACTIVATION_DTYPES else None)

    def excludes(self, module_name: str) -> bool:
        """Whether ``modules_to_not_convert`` covers the module: an entry matches whole dotted name parts
        (as in transformers, where "lm_head" or "mlp.down_proj" name every module containing them)."""
        return any(f".{entry}." in f".{module_name}." for entry in self.modules_to_not_convert)

    def describe(self) -> str:
        if self.method == "bitsandbytes":
            return "bitsandbytes nf4"
        if self.method == "awq":
            return "AWQ gemm"
        return f"GPTQ {self.zero_convention}" + (", act-order" if self.desc_act else "")


# ----------------------------------------------------------------------------------------------------------------
# the safetensors files


@dataclass(frozen=True)
class _TensorInfo:
    file: str                           # the file holding the tensor (named in errors)
    shape: tuple[int, ...]
    dtype: torch.dtype | str            # str: a safetensors dtype code torch has no counterpart for here


class _Checkpoint:
    """The tensors of a checkpoint directory: every header is read on opening, data one tensor at a time."""

    def __init__(self, directory: Path, stack: ExitStack):
        self._directory, self._stack = directory, stack
        self._handles = {}                                  # file name -> open safe_open handle
        self.tensors: dict[str, _TensorInfo] = {}
        if (directory / SINGLE_FILE).is_file():
            self.source = SINGLE_FILE                       # the file errors about the whole checkpoint name
            self._add_file(SINGLE_FILE, None)
        elif (directory / INDEX_FILE).is_file():
            self.source = INDEX_FILE
            for shard, names in self._read_index().items():
                self._add_file(shard, names)
        else:
            raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found (tilefish loads "
                                  "safetensors checkpoints)")

    def _read_index(self) -> dict[str, list[str]]:
        """shard file -> the tensor names the index places in it; every shard must exist."""
        try:
            weight_map = json.loads((self._directory / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{INDEX_FILE}: unreadable index, no weight_map ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{INDEX_FILE}: weight_map must map tensor names to shard file names")
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
        for shard, names in shards.items():
            if not (self._directory / shard).is_file():
                raise CheckpointError(f"{INDEX_FILE}: weight_map puts tensor {names[0]!r} in shard {shard!r}, "
                                      f"which does not exist in {self._directory}")
        return shards

    def _add_file(self, file: str, names: list[str] | None) -> None:
        """Open one file and record the headers of ``names`` (all of its tensors when None)."""
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError as e:
            raise ImportError(f"tilefish.load_quantized reads safetensors files; {HF_EXTRA}") from e
        try:
            handle = self._stack.enter_context(safe_open(str(self._directory / file), framework="pt"))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: not a readable safetensors file, corrupt or truncated ({e})") from e
        self._handles[file] = handle
        present = handle.keys()
        for name in present if names is None else names:
            if name not in present:
                raise CheckpointError(f"{INDEX_FILE}: weight_map puts tensor {name!r} in {file}, which has no "
                                      "such tensor")
            piece = handle.get_slice(name)
            code = piece.get_dtype()
            self.tensors[name] = _TensorInfo(file, tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(code, code))

    def where(self, name: str) -> str:
        return f"{self.tensors[name].file}: tensor {name!r}"

    def load(self, name: str) -> torch.Tensor:
        return self._handles[self.tensors[name].file].get_tensor(name)


# ----------------------------------------------------------------------------------------------------------------
# planning: everything checked from the headers, before any data is read


def _expected_shapes(fmt: QuantFormat, k: int, n: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """role -> (shape, its formula) for a Linear(k, n)."""
    groups = 1 if fmt.group_size == -1 else k // fmt.group_size
    qweight = ((k // 8, n), "[k/8, n]") if fmt.method == "gptq" else ((k, n // 8), "[k, n/8]")
    return {"qweight": qweight, "qzeros": ((groups, n // 8), "[k/G, n/8]"), "scales": ((groups, n), "[k/G, n]"),
            "g_idx": ((k,), "[k]"), "bias": ((n,), "[n]")}


def _check_tileable(name: str, linear: nn.Linear, where: str) -> None:
    """The W4A16 kernels tile n by 64 and k by 64 (ops/w4a16/layout.py check_shape; the group size is
    checked against k where the scales are read)."""
    from .ops.w4a16.layout import K_MULTIPLE

    n, k = linear.out_features, linear.in_features
    if n % 64 or k % K_MULTIPLE:
        raise CheckpointError(f"{where}: the W4A16 kernel cannot tile nn.Linear {name!r} (in_features k = {k}, "
                              f"out_features n = {n}): it needs n % 64 == 0 and k % {K_MULTIPLE} == 0")


def _plan_layer(name: str, linear: nn.Linear, ckpt: _Checkpoint, fmt: QuantFormat) -> dict[str, str]:
    """role -> checkpoint tensor name for the quantized Linear ``name``, after checking every header."""
    qweight = f"{name}.qweight"
    _check_tileable(name, linear, ckpt.where(qweight))
    k, n = linear.in_features, linear.out_features
    required = {"qweight", "qzeros", "scales"} | ({"g_idx"} if fmt.desc_act else set())
    if linear.bias is not None:
        required.add("bias")
    expected = _expected_shapes(fmt, k, n)
    tensors = {}
    for role in _ROLES[fmt.method]:
        tname = f"{name}.{role}"
        info = ckpt.tensors.get(tname)
        if info is None:
            if role in required:
                raise CheckpointError(f"{ckpt.tensors[qweight].file}: tensor {tname!r} is missing "
                                      f"({_WHY_REQUIRED.get(role, 'every quantized layer stores it')})")
            continue
        where = ckpt.where(tname)
        if role == "bias" and linear.bias is None:
            raise CheckpointError(f"{where}: the model's nn.Linear {name!r} has no bias")
        if info.dtype not in _ROLE_DTYPES[role]:
            want = " or ".join(str(d).removeprefix("torch.") for d in _ROLE_DTYPES[role])
            raise CheckpointError(f"{where}: dtype {info.dtype} is wrong; {fmt.method.upper()} {role} is {want}")
        shape, formula = expected[role]
        if info.shape != shape:
            context = (f"group_size {fmt.group_size} (config.json quantization_config.group_size)"
                       if role in ("qzeros", "scales") else f"the model's nn.Linear {name!r}")
            raise CheckpointError(
                f"{where}: shape {info.shape} disagrees with in_features k = {k}, out_features n = {n} of nn.Linear "
                f"{name!r}: {fmt.method.upper()} {role} is {formula} = {shape} for {context}")
        tensors[role] = tname
    return tensors


def _quantized_names(ckpt: _Checkpoint, fmt: QuantFormat) -> dict[str, str]:
    """Quantized Linear name X -> a tensor that marks it: X.qweight (GPTQ / AWQ), any X.weight.<bitsandbytes
    entry> (bitsandbytes)."""
    names = {}
    for tname in ckpt.tensors:
        if fmt.method != "bitsandbytes":
            if tname.endswith(".qweight"):
                names[tname[: -len(".qweight")]] = tname
            continue
        for marker in _BNB_MARKERS:
            head, found, _ = tname.partition("." + marker)
            if found and (marker == _BNB_QUANT_STATE or tname.endswith("." + marker)):
                names.setdefault(head, tname)
    return names


def _plan_layers(model: nn.Module, ckpt: _Checkpoint, fmt: QuantFormat) -> dict[str, dict[str, str]]:
    """Quantized Linear name -> role -> its tensor: every X whose X.qweight (GPTQ / AWQ) or bitsandbytes
    X.weight.* entries are in the checkpoint."""
    modules = dict(model.named_modules())
    layers = {}
    for name, tname in _quantized_names(ckpt, fmt).items():
        if fmt.excludes(name):
            raise CheckpointError(f"{ckpt.where(tname)}: the layer is quantized, but config.json's "
                                  f"quantization_config.{fmt.skip_field} lists it "
                                  f"({list(fmt.modules_to_not_convert)})")
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            found = "nothing" if module is None else type(module).__name__
            raise CheckpointError(f"{ckpt.where(tname)}: the model has no nn.Linear named {name!r} (found {found})")
        plan = _plan_bnb_layer if fmt.method == "bitsandbytes" else _plan_layer
        layers[name] = plan(name, module, ckpt, fmt)
    if not layers:
        marker = "X.weight.quant_state.bitsandbytes__nf4" if fmt.method == "bitsandbytes" else "X.qweight"
        raise CheckpointError(f"{ckpt.source}: no {marker} tensor, though {CONFIG_FILE} has a quantization_config")
    return layers


def _read_quant_state(ckpt: _Checkpoint, tname: str) -> dict:
    """A bitsandbytes quant-state tensor: UTF-8 JSON bytes (a few hundred; read while planning)."""
    info = ckpt.tensors[tname]
    if info.dtype != torch.uint8 or len(info.shape) != 1:
        raise CheckpointError(f"{ckpt.where(tname)}: dtype {info.dtype}, shape {info.shape}; bitsandbytes stores "
                              "its quant state as 1-D uint8 JSON bytes")
    try:
        meta = json.loads(bytes(ckpt.load(tname).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{ckpt.where(tname)}: not valid UTF-8 JSON ({e})") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{ckpt.where(tname)}: holds JSON {type(meta).__name__}, not an object")
    return meta


def _plan_bnb_layer(name: str, linear: nn.Linear, ckpt: _Checkpoint, fmt: QuantFormat) -> dict[str, str]:
    """role -> checkpoint tensor name for the bitsandbytes 4-bit Linear ``name``, after checking the headers and
    its quant-state JSON against the model (the values are checked when the layer is built)."""
    from .quant.nf4 import NESTED_BLOCKSIZE, SUPPORTED_BLOCKSIZES

    tensors = {role: f"{name}.{entry}" for role, entry in _BNB_ENTRIES.items()}
    qs = tensors["quant_state"]
    if qs not in ckpt.tensors:
        other = sorted(t for t in ckpt.tensors if t.startswith(f"{name}.{_BNB_QUANT_STATE}"))
        if other:
            raise CheckpointError(f"{ckpt.where(other[0])}: quant type {other[0].rpartition('__')[2]!r} is not "
                                  "supported; tilefish loads bitsandbytes' nf4 (not fp4)")
        marker = _quantized_names(ckpt, fmt)[name]
        raise CheckpointError(f"{ckpt.tensors[marker].file}: tensor {qs!r} is missing (every bitsandbytes 4-bit "
                              f"layer stores it; {marker!r} is there)")
    where = ckpt.where(qs)
    _check_tileable(name, linear, where)
    k, n = linear.in_features, linear.out_features
    meta = _read_quant_state(ckpt, qs)

    def bad(field: str, rule: str) -> CheckpointError:
        return CheckpointError(f"{where}: JSON {field} = {meta.get(field)!r}: {rule}")

    if meta.get("quant_type") != "nf4":
        raise bad("quant_type", "tilefish loads bitsandbytes' nf4")
    if meta.get("shape") != [n, k]:
        raise bad("shape", f"the model's nn.Linear {name!r} is [out_features, in_features] = [{n}, {k}]")
    blocksize = meta.get("blocksize")
    if isinstance(blocksize, bool) or blocksize not in SUPPORTED_BLOCKSIZES:
        raise bad("blocksize", f"bitsandbytes block sizes are {SUPPORTED_BLOCKSIZES}")
    if meta.get("dtype") not in ("float16", "bfloat16", "float32"):
        raise bad("dtype", "must name float16, bfloat16 or float32")
    nested = "nested_offset" in meta
    nblocks = n * k // blocksize  # exact: the tileable n and k make n k a multiple of 8192
    expected = {"weight": None, "absmax": ((torch.uint8,) if nested else FLOAT_DTYPES, (nblocks,)),
                "quant_map": ((torch.float32,), (16,))}
    if nested:
        expected |= {"nested_absmax": ((torch.float32,), (-(-nblocks // NESTED_BLOCKSIZE),)),
                     "nested_quant_map": ((torch.float32,), (256,))}
    if linear.bias is not None:
        expected["bias"] = (FLOAT_DTYPES, (n,))
    for role in ("nested_absmax", "nested_quant_map", "bias"):  # stored but not expected
        if role not in expected and tensors[role] in ckpt.tensors:
            why = (f"the model's nn.Linear {name!r} has no bias" if role == "bias" else
                   f"the quant state {qs!r} has no nested_offset (not double-quantized)")
            raise CheckpointError(f"{ckpt.where(tensors[role])}: unexpected: {why}")
    planned = {"quant_state": qs}
    for role, rule in expected.items():
        tname = tensors[role]
        info = ckpt.tensors.get(tname)
        if info is None:
            why = {"bias": _WHY_REQUIRED["bias"], "nested_absmax": f"{qs!r} has nested_offset (double quant)",
                   "nested_quant_map": f"{qs!r} has nested_offset (double quant)"}.get(
                role, "every bitsandbytes 4-bit layer stores it")
            raise CheckpointError(f"{ckpt.tensors[qs].file}: tensor {tname!r} is missing ({why})")
        if role == "weight":  # packed codes, two a byte, in any storage dtype (bitsandbytes' quant_storage)
            size = getattr(info.dtype, "itemsize", None)
            if size is None or math.prod(info.shape) * size != n * k // 2:
                raise CheckpointError(f"{ckpt.where(tname)}: dtype {info.dtype}, shape {info.shape} does not hold "
                                      f"n * k / 2 = {n * k // 2} bytes (two NF4 codes a byte) for nn.Linear {name!r} "
                                      f"(in_features k = {k}, out_features n = {n})")
        else:
            dtypes, shape = rule
            if info.dtype not in dtypes:
                want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise CheckpointError(f"{ckpt.where(tname)}: dtype {info.dtype} is wrong; bitsandbytes {role} is {want}")
            if info.shape != shape:
                raise CheckpointError(f"{ckpt.where(tname)}: shape {info.shape} is wrong; bitsandbytes {role} is "
                                      f"{shape} for nn.Linear {name!r} (n = {n}, k = {k}, blocksize {blocksize}"
                                      f"{', double quant' if nested else ''})")
        planned[role] = tname
    return planned


def _plan_dense(state: dict[str, torch.Tensor], ckpt: _Checkpoint, taken: set[str]) -> dict[str, list[str]]:
    """Checkpoint tensor -> the model's state names it fills (several where parameters are tied).

    ``state`` is the model's state dict (keep_vars) less the quantized Linears; ``taken`` the checkpoint names the
    quantized layers use. Every state entry must come from the checkpoint, and every checkpoint tensor must land.
    """
    aliases: dict[int, list[str]] = {}                      # tied parameters share one tensor object
    for name, t in state.items():
        aliases.setdefault(id(t), []).append(name)
    plan, used = {}, set(taken)
    for names in aliases.values():
        stored = [n for n in names if n in ckpt.tensors]
        if not stored:
            raise CheckpointError(f"{ckpt.source}: tensor {names[0]!r} is missing (the model has it"
                                  f"{', tied to ' + ', '.join(names[1:]) if len(names) > 1 else ''})")
        source, target = stored[0], state[names[0]]
        info = ckpt.tensors[source]
        if not isinstance(info.dtype, torch.dtype) or info.dtype.is_floating_point != target.is_floating_point():
            raise CheckpointError(f"{ckpt.where(source)}: dtype {info.dtype} is wrong for the model's {target.dtype} "
                                  f"{'parameter' if isinstance(target, nn.Parameter) else 'buffer'}")
        if info.shape != tuple(target.shape):
            raise CheckpointError(f"{ckpt.where(source)}: shape {info.shape} disagrees with the model's "
                                  f"{tuple(target.shape)}")
        plan[source] = names
        used.update(stored)
    unexpected = [n for n in ckpt.tensors if n not in used]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{ckpt.where(unexpected[0])}: the model has no parameter or buffer of that name{more}")
    return plan


# ----------------------------------------------------------------------------------------------------------------
# staging: new layers and tensors, built without touching the model


def _build_layer(name: str, tensors: dict[str, torch.Tensor], fmt: QuantFormat, dtype: torch.dtype):
    from .nn import NF4Linear, W4A16Linear

    if fmt.method == "bitsandbytes":  # the entries under their checkpoint names: nf4.from_state_dict checks values
        entries = {f"{name}.{_BNB_ENTRIES[role]}": t for role, t in tensors.items()}
        return NF4Linear.from_state_dict(entries, prefix=f"{name}.", dtype=dtype)
    scales = tensors["scales"].to(dtype)
    bias = tensors.get("bias")
    bias = None if bias is None else bias.to(dtype)
    if fmt.method == "gptq":
        return W4A16Linear.from_gptq(tensors["qweight"], tensors["qzeros"], scales, tensors.get("g_idx"), bias,
                                     zero_convention=fmt.zero_convention, group_size=fmt.group_size)
    return W4A16Linear.from_awq(tensors["qweight"], tensors["qzeros"], scales, bias, group_size=fmt.group_size)


def _stage_layers(plan, ckpt, fmt, device, dtype) -> dict[str, nn.Module]:
    staged = {}
    for name, roles in plan.items():
        tensors = {role: ckpt.load(tname).to(device) for role, tname in roles.items()}
        try:
            staged[name] = _build_layer(name, tensors, fmt, dtype)
        except (ValueError, TypeError) as e:        # values the headers cannot show: zeros, g_idx groups
            files = sorted({ckpt.tensors[t].file for t in roles.values()})
            raise CheckpointError(f"{', '.join(files)}: layer {name!r} ({', '.join(roles.values())}): {e}") from e
    return staged


def _stage_dense(plan, state, ckpt, device, dtype) -> dict[str, torch.Tensor]:
    """model state name -> the tensor to assign (a Parameter where the model has one, shared by tied names)."""
    staged = {}
    for source, names in plan.items():
        t = ckpt.load(source)
        target = state[names[0]]
        t = t.to(device=device, dtype=dtype if t.is_floating_point() else target.dtype)
        if isinstance(target, nn.Parameter):
            t = nn.Parameter(t, requires_grad=target.requires_grad and t.is_floating_point())
        staged.update(dict.fromkeys(names, t))
    return staged


def _stage_volatile_buffers(model: nn.Module, device) -> dict[str, torch.Tensor]:
    """Non-persistent buffers (in no checkpoint, e.g. rotary inv_freq) moved to ``device``, their dtype kept.

    A model built on the meta device has them on meta: transformers models recompute them in ``_init_weights``
    (as ``from_pretrained`` does), which is run here on a copy of the parameter-free module that owns them.
    """
    staged = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        volatile = {b: t for b, t in module._buffers.items()
                    if t is not None and b in module._non_persistent_buffers_set}
        on_meta = [b for b, t in volatile.items() if t.device.type == "meta"]
        fresh = _recompute_buffers(model, module, on_meta, device) if on_meta else {}
        for b, t in volatile.items():
            value = fresh.get(b) if b in on_meta else t.to(device)
            if value is None:
                raise CheckpointError(f"buffer {prefix + b!r} is on the meta device and in no checkpoint (it is not "
                                      "persistent); build the model with real buffers")
            staged[prefix + b] = value
    return staged


def _recompute_buffers(model, module, names, device) -> dict[str, torch.Tensor]:
    """The buffers ``names`` of ``module`` that ``model._init_weights`` sets (finite after it), on ``device``."""
    init = getattr(model, "_init_weights", None)
    if (init is None or next(module.parameters(), None) is not None
            or not all(module._buffers[b].is_floating_point() for b in names)):
        return {}
    clone = copy.deepcopy(module).to_empty(device=device)
    with torch.no_grad():
        for b in names:
            clone._buffers[b].fill_(float("nan"))       # what _init_weights leaves alone stays NaN
        init(clone)
    return {b: clone._buffers[b] for b in names if bool(torch.isfinite(clone._buffers[b]).all())}


# ----------------------------------------------------------------------------------------------------------------
# the entry point


def _import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"tilefish.load_quantized(path) builds the model with transformers, which is not "
                          f"installed: {HF_EXTRA}") from e
    return transformers


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a checkpoint directory")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e


def _resolve(model_or_path, path):
    """-> (model or None to build, its transformers config or None, checkpoint directory)."""
    if isinstance(model_or_path, nn.Module):
        if path is None:
            raise TypeError("load_quantized(model, path): the checkpoint directory is missing")
        return model_or_path, None, Path(path)
    if isinstance(model_or_path, (str, os.PathLike)):
        if path is not None:
            raise TypeError("load_quantized(path): give the checkpoint directory once")
        return None, None, Path(model_or_path)
    transformers = _import_transformers()
    if isinstance(model_or_path, transformers.PretrainedConfig):
        if path is None:
            raise TypeError("load_quantized(config, path): the checkpoint directory is missing")
        return None, model_or_path, Path(path)
    raise TypeError(f"load_quantized takes an nn.Module, a transformers config or a checkpoint directory; "
                    f"got {type(model_or_path).__name__}")


def _build_model(directory: Path, config) -> nn.Module:
    transformers = _import_transformers()
    if config is None:
        config = transformers.AutoConfig.from_pretrained(str(directory))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval()


def _default_device(model: nn.Module) -> torch.device:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None and first.device.type != "meta" else torch.device("cpu")


def _default_dtype(config: dict, ckpt: _Checkpoint, layers: dict[str, dict[str, str]],
                   fmt: QuantFormat) -> torch.dtype:
    """config.json's torch_dtype (or dtype) when fp16 / bf16, else the dtype of the stored scales (fp16 if fp32);
    bitsandbytes: else bnb_4bit_compute_dtype, else the weights' dtype its quant state records, when fp16 / bf16."""
    name = config.get("torch_dtype", config.get("dtype"))
    if name in ("float16", "bfloat16"):
        return getattr(torch, name)
    first = next(iter(layers.values()))
    if fmt.method == "bitsandbytes":
        recorded = getattr(torch, _read_quant_state(ckpt, first["quant_state"])["dtype"])
        return fmt.compute_dtype or (recorded if recorded in ACTIVATION_DTYPES else torch.float16)
    scales = ckpt.tensors[first["scales"]].dtype
    return scales if scales in ACTIVATION_DTYPES else torch.float16


def _describe_layer(layer, fmt: QuantFormat) -> str:
    from .nn import NF4Linear

    if isinstance(layer, NF4Linear):
        kind = f"NF4 blocksize {layer.blocksize}{' double-quant' if layer.double_quant else ''}"
    else:
        kind = f"W4A16 g{layer.group_size} {'sym' if layer.zeros is None else 'asym'}"
    return f"{kind} {layer.in_features}->{layer.out_features} ({fmt.describe()})"


def load_quantized(model_or_path, path=None, *, device=None, dtype: torch.dtype | None = None, fuse: bool = True):
    """Load a GPTQ / AWQ / bitsandbytes 4-bit checkpoint directory (HF format) with its quantized Linears as
    ``W4A16Linear`` (GPTQ / AWQ) or ``NF4Linear`` (bitsandbytes nf4).

    ``load_quantized(path)`` or ``load_quantized(config, path)`` builds the model with transformers
    (``AutoModelForCausalLM.from_config`` on the meta device; ``pip install tilefish[hf]``).
    ``load_quantized(model, path)`` loads into ``model`` (any nn.Module whose names match the checkpoint's; it may
    be on the meta device), in place: each ``nn.Linear`` X with ``X.qweight`` stored becomes a ``W4A16Linear``
    (with bitsandbytes ``X.weight.quant_state.bitsandbytes__nf4`` and the other Linear4bit entries: an
    ``NF4Linear``), every other checkpoint tensor is assigned to the model (tied parameters stay tied). Linears
    named in ``modules_to_not_convert`` (bitsandbytes: ``llm_int8_skip_modules``) must be stored dense.

    device: where everything goes; default the model's device, or the CPU for a meta model.
    dtype: the activation dtype (fp16 / bf16) of every floating tensor; default config.json's ``torch_dtype`` if it
        is one of those, else the stored scales' dtype (bitsandbytes: ``bnb_4bit_compute_dtype``, else the weights'
        recorded dtype, when fp16 / bf16; else fp16).
    fuse: fuse q/k/v and gate/up projections afterwards (``tilefish.convert.fuse_projections``). Fused bitsandbytes
        layers hold the kernel layout (their state dict is tilefish's, not bitsandbytes'); fuse=False keeps
        ``NF4Linear``s, whose state dicts are bitsandbytes' again.

    Returns ``(model, report)``, a ``tilefish.convert.ConversionReport``. Raises ``CheckpointError`` (a ValueError)
    naming the file, tensor or config field for anything it cannot load, and then leaves the model untouched.
    """
    from .convert import ConversionReport, fuse_projections, module_bytes

    if dtype is not None and dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16 (the activation dtype); got {dtype}")
    model, hf_config, directory = _resolve(model_or_path, path)
    config = _read_config(directory)
    fmt = QuantFormat.from_config(config, CONFIG_FILE)
    if model is None:
        model = _build_model(directory, hf_config)
    device = torch.device(device) if device is not None else _default_device(model)

    with ExitStack() as stack:
        ckpt = _Checkpoint(directory, stack)
        layer_plan = _plan_layers(model, ckpt, fmt)
        dtype = dtype or _default_dtype(config, ckpt, layer_plan, fmt)
        state = {name: t for name, t in model.state_dict(keep_vars=True).items()
                 if name.rpartition(".")[0] not in layer_plan}
        dense_plan = _plan_dense(state, ckpt, {t for roles in layer_plan.values() for t in roles.values()})
        volatile = _stage_volatile_buffers(model, device)
        layers = _stage_layers(layer_plan, ckpt, fmt, device, dtype)
        tensors = _stage_dense(dense_plan, state, ckpt, device, dtype)

    # everything is built: from here on nothing can fail
    linears = [model.get_submodule(name) for name in layers]
    dense_bytes = sum((m.in_features + (m.bias is not None)) * m.out_features for m in linears) * dtype.itemsize
    for name, value in itertools.chain(layers.items(), tensors.items(), volatile.items()):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, value)

    report = ConversionReport(
        converted={name: _describe_layer(layer, fmt) for name, layer in layers.items()},
        skipped={name: (f"listed in quantization_config.{fmt.skip_field}" if fmt.excludes(name)
                        else "stored dense in the checkpoint")
                 for name, module in model.named_modules() if isinstance(module, nn.Linear)},
        bytes_before=dense_bytes, bytes_after=sum(module_bytes(layer) for layer in layers.values()))
    if fuse:
        fuse_projections(model, report)
    return model, report
