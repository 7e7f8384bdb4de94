"""Save a quantized model as a Hugging Face checkpoint directory that load_quantized reads back bit for bit.

    tilefish.quantize_model(model)                            # or method "nf4", or a model from load_quantized
    tilefish.save_quantized(model, "out/llama-w4")
    model, report = tilefish.load_quantized("out/llama-w4")   # fuse=True or False: the same layers, bit for bit

The directory holds ``config.json`` (the model's ``config.to_dict()`` when it has a transformers config, with a
``quantization_config``), ``model.safetensors`` or shards named in ``model.safetensors.index.json``, and
``generation_config.json`` when the model has one. Dense tensors (embeddings, norms, a dense lm_head) are saved
as they are, tied ones once (under the name transformers keeps). The 4-bit layers, in one of two formats:

* int4 (``W4A16Linear``; each part of a ``FusedW4A16Linear`` under its own module name, q_proj / k_proj /
  v_proj ...: a fused layer is its parts side by side in whole 64-column strips, so the split is exact): GPTQ
  4-bit, the tensors of ``tilefish.quant.int4.to_gptq`` (qweight, qzeros, scales, g_idx, bias).
  ``checkpoint_format`` "gptq" (v1, stored zero = true zero - 1: what AutoGPTQ, transformers and vLLM read)
  whenever every zero point is 1..15 (a symmetric weight's is 8); a zero point of 0 needs "gptq_v2" (stored =
  true zero; GPTQModel, recent vLLM). ``desc_act`` when a layer has an act-order permutation.
* nf4 (``NF4Linear``): bitsandbytes 4-bit, the layer's own Linear4bit entries, bit for bit. A fused nf4 layer
  (and a plain W4A16Linear with codebook "nf4") keeps only the kernel tensors, the codes and the block scales
  rounded to the activation dtype: each part is written as a bitsandbytes nf4 layer with blocksize = its group
  size and those rounded scales as fp32 absmax, no double quant. Loading it gives the same kernel tensors bit
  for bit, but it is not the original bitsandbytes weight (whose fp32 block scales the fusion dropped).

Every check runs before anything is written; the files go to a temporary directory beside ``path``, which is
renamed into place at the end, so a failure leaves ``path`` as it was.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from torch import nn

from . import __version__
from .checkpoint import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, QuantFormat
from .nn import FusedW4A16Linear, GatedW4A16Linear, NF4Linear, W4A16Linear, W4A16Slice
from .ops.w4a16 import W4A16Weight, unpack
from .quant.int4 import to_gptq
from .quant.nf4 import NF4Weight, to_state_dict

__all__ = ["save_quantized"]

GENERATION_CONFIG_FILE = "generation_config.json"
QUANTIZE_CONFIG_FILE = "quantize_config.json"  # AutoGPTQ-era readers look for the GPTQ config here too
KNOWN_LAYERS = (W4A16Linear, NF4Linear, FusedW4A16Linear, GatedW4A16Linear, W4A16Slice)
# Layers whose weights are in a format of their own (their packages save them), and tilefish's tensor-parallel
# wrappers, which hold one rank's shard: writing their tensors as dense ones would make a wrong checkpoint.
FOREIGN_LAYER_PACKAGES = ("bitsandbytes", "auto_gptq", "gptqmodel", "awq", "optimum", "hqq", "torchao", "quanto",
                          "tilefish.distributed", "tilefish.experts")
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # transformers' max_shard_size units


@dataclasses.dataclass(frozen=True)
class _Part:
    """One quantized Linear as the checkpoint names it: columns [a, b) of ``layer`` (all of them unless fused)."""

    name: str
    layer: W4A16Linear
    columns: tuple[int, int]

    @property
    def method(self) -> str:
        return "bitsandbytes" if self.layer.codebook == "nf4" else "gptq"

    def kernel_weight(self) -> W4A16Weight:
        """Its columns of the layer's kernel tensors (a fused layer's part: FusedW4A16Linear.part_weight, exact)."""
        layer = self.layer
        if isinstance(layer, FusedW4A16Linear):
            return layer.part_weight(layer.bounds.index(self.columns))[0]
        return layer.weight4

    def bias(self) -> torch.Tensor | None:
        layer = self.layer
        if isinstance(layer, FusedW4A16Linear):
            return layer.part_weight(layer.bounds.index(self.columns))[1]
        return None if layer.bias is None else layer.bias.detach()

    def tensors(self, zero_convention: str) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of this Linear, on the layer's device."""
        if isinstance(self.layer, NF4Linear):  # its state dict is bitsandbytes' Linear4bit entries, exact
            return self.layer.state_dict(prefix=f"{self.name}.")
        w = self.kernel_weight()
        q = unpack(w)
        if self.method == "gptq":
            out = {f"{self.name}.{role}": t for role, t in to_gptq(q, zero_convention, perm=w.perm).items()}
        else:  # kernel tensors only: each (row, group) scale is the fp32 absmax of one bitsandbytes block
            codes = q.q.reshape(-1)
            nf4 = NF4Weight(codes=((codes[0::2] << 4) | codes[1::2]).to(torch.uint8), shape=torch.Size((w.n, w.k)),
                            dtype=w.dtype, blocksize=w.group_size, absmax=q.scales.float().reshape(-1).contiguous())
            out = to_state_dict(nf4, f"{self.name}.weight")
        bias = self.bias()
        if bias is not None:
            out[f"{self.name}.bias"] = bias
        return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_layer_type(name: str, module: nn.Module) -> None:
    kind = type(module)
    if isinstance(module, W4A16Linear) and kind not in KNOWN_LAYERS:
        raise TypeError(f"{name or 'model'}: {kind.__name__} is a W4A16Linear subclass save_quantized does not "
                        "know how to write (it writes W4A16Linear, NF4Linear and FusedW4A16Linear)")
    package = kind.__module__
    if any(package == p or package.startswith(p + ".") for p in FOREIGN_LAYER_PACKAGES):
        raise TypeError(f"{name or 'model'}: {kind.__name__} ({package}) is not a layer save_quantized can write "
                        "(it writes tilefish's W4A16Linear / NF4Linear / FusedW4A16Linear and dense modules; a "
                        "tensor-parallel model must be saved before sharding)")


def _tied_names(model: nn.Module) -> set[str]:
    """The parameter names transformers drops when saving tied weights (it keeps the other name)."""
    declared = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ()
    return set(declared) if isinstance(declared, (dict, list, tuple, set)) else set()


def _plan(model: nn.Module) -> tuple[list, list[_Part], list[str]]:
    """-> (what to write in model order: _Part or (name, dense tensor)), the quantized parts, the dense Linears.

    Walks every module as state_dict does (shared modules under each of their names), checking each one.
    """
    modules = list(model.named_modules(remove_duplicate=False))
    registered = {id(m) for _, m in modules}
    slice_names: dict[int, dict[int, str]] = {}  # id(fused layer) -> part index -> the name of its W4A16Slice
    for name, module in modules:
        for child_name, child in module.named_children():
            if isinstance(child, W4A16Slice):
                slice_names.setdefault(id(child.fused), {})[child.index] = _join(name, child_name)
    items, parts, dense_linears, dense = [], [], [], {}
    for name, module in modules:
        _check_layer_type(name, module)
        if isinstance(module, W4A16Slice):
            if id(module.fused) not in registered:
                raise ValueError(f"{name}: a W4A16Slice whose FusedW4A16Linear is not in the model")
            continue
        if isinstance(module, W4A16Linear):
            new = [_Part(name, module, (0, module.out_features))]
            if isinstance(module, FusedW4A16Linear):
                names = slice_names.get(id(module), {})
                missing = [i for i in range(len(module.split_sizes)) if i not in names]
                if missing:  # the checkpoint names each part after the slice standing in its place
                    raise ValueError(f"{name}: part {missing[0]} of this FusedW4A16Linear has no W4A16Slice in the "
                                     "model, so it has no module name to be saved under")
                new = [_Part(names[i], module, tuple(bounds)) for i, bounds in enumerate(module.bounds)]
            for tname, t in list(module.named_parameters()) + list(module.named_buffers()):
                if t is not None and t.is_meta:
                    raise ValueError(f"{_join(name, tname)}: on the meta device (no values to save)")
            parts += new
            items += new
            continue
        if isinstance(module, nn.Linear):
            dense_linears.append(name)
        state: dict = {}
        module._save_to_state_dict(state, f"{name}." if name else "", keep_vars=True)  # this module's own entries
        for key, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{key}: extra state of type {type(t).__name__} cannot be saved in safetensors")
            if t.is_meta:
                raise ValueError(f"{key}: on the meta device (no values to save); materialize the model first")
            dense[key] = t
            items.append((key, t))
    # a tensor under several names (tied weights) is saved once, as transformers does: under the first name
    # that the model does not declare as tied to another
    tied, aliases = _tied_names(model), {}
    for key, t in dense.items():
        aliases.setdefault(id(t), []).append(key)
    kept = {next((k for k in names if k not in tied), names[0]) for names in aliases.values()}
    items = [item for item in items if isinstance(item, _Part) or item[0] in kept]
    return items, parts, dense_linears


def _check_parts(parts: list[_Part], dense_names: list[str]) -> tuple[str, torch.dtype, str | None]:
    """-> (method, activation dtype, GPTQ zero convention) after every rule of the format, naming the module."""
    if not parts:
        raise ValueError("the model has no quantized layer (W4A16Linear, NF4Linear, FusedW4A16Linear): quantize it "
                         "first (tilefish.quantize_model), or save a dense model with its own save_pretrained")
    by_method: dict[str, _Part] = {}
    for part in parts:
        by_method.setdefault(part.method, part)
    if len(by_method) > 1:  # one quantization_config describes one method
        gptq, nf4 = by_method["gptq"], by_method["bitsandbytes"]
        raise ValueError(f"mixed int4 and nf4 layers ({gptq.name!r} is int4, {nf4.name!r} is nf4): a checkpoint has "
                         "one quantization method; quantize the model with one")
    method = next(iter(by_method))
    taken = {d.rpartition(".")[0] for d in dense_names}  # the modules whose own tensors are saved dense
    for p in parts:
        if p.name in taken:
            raise ValueError(f"{p.name!r}: two things would be saved under this module name")
        taken.add(p.name)
    dtypes = {p.layer.scales.dtype: p.name for p in parts}
    if len(dtypes) > 1:
        raise ValueError(f"the quantized layers have several activation dtypes ({dtypes}); a checkpoint has one "
                         "(config.json's dtype), which load_quantized gives every layer")
    group_sizes = {p.layer.group_size: p.name for p in parts}
    if method == "gptq" and len(group_sizes) > 1:
        raise ValueError(f"the int4 layers have several group sizes ({group_sizes}); a GPTQ checkpoint has one "
                         "quantization_config.group_size")
    convention = "v1" if method == "gptq" else None
    for p in parts:  # each part's own columns, so that an error names the Linear that holds the value
        w = p.kernel_weight()
        if not bool(torch.isfinite(w.scales).all()):
            raise ValueError(f"{p.name}: its scales hold inf or NaN; they must be finite")
        if w.zeros is None:
            continue
        bad = ~((w.zeros == w.zeros.round()) & (w.zeros >= 0) & (w.zeros <= 15))
        if bool(bad.any()):
            raise ValueError(f"{p.name}: zero point {float(w.zeros[bad][0])} is not an integer 0..15; GPTQ stores "
                             "4-bit integer zero points")
        if bool((w.zeros == 0).any()):  # v1 stores zero - 1, so a zero point of 0 needs v2
            convention = "v2"
    return method, next(iter(dtypes)), convention


def _is_symmetric(part: _Part) -> bool:
    zeros = part.kernel_weight().zeros
    return zeros is None or bool((zeros == 8).all())


def _is_lm_head(model: nn.Module, name: str) -> bool:
    """GPTQModel and vLLM read quantization_config.lm_head: whether the output projection is quantized."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        head = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        head = None
    return name.rpartition(".")[2] == "lm_head" or (head is not None and head is model.get_submodule(name))


def _quantization_config(model: nn.Module, parts: list[_Part], method: str, dtype: torch.dtype,
                         convention: str | None, dense_linears: list[str]) -> dict:
    skip = sorted(set(dense_linears))  # every dense Linear, so that loaders keep exactly those dense
    if method == "bitsandbytes":  # the keys transformers' BitsAndBytesConfig.to_dict() writes
        double_quant = any(isinstance(p.layer, NF4Linear) and p.layer.double_quant for p in parts)
        return {"quant_method": "bitsandbytes", "_load_in_8bit": False, "_load_in_4bit": True,
                "llm_int8_threshold": 6.0, "llm_int8_skip_modules": skip, "llm_int8_enable_fp32_cpu_offload": False,
                "llm_int8_has_fp16_weight": False, "bnb_4bit_quant_type": "nf4",
                "bnb_4bit_use_double_quant": double_quant, "bnb_4bit_compute_dtype": str(dtype).removeprefix("torch."),
                "bnb_4bit_quant_storage": "uint8", "load_in_4bit": True, "load_in_8bit": False}
    checkpoint_format = "gptq" if convention == "v1" else "gptq_v2"
    return {"quant_method": "gptq", "bits": 4, "group_size": parts[0].layer.group_size,
            "desc_act": any(p.layer.perm is not None for p in parts), "sym": all(map(_is_symmetric, parts)),
            "checkpoint_format": checkpoint_format, "format": checkpoint_format,  # "format": transformers 5's name
            "lm_head": any(_is_lm_head(model, p.name) for p in parts),
            "pack_dtype": "int32", "modules_to_not_convert": skip, "meta": {"quantizer": [f"tilefish:{__version__}"]}}


def _model_config(model: nn.Module, qc: dict, dtype: torch.dtype) -> dict:
    hf_config = getattr(model, "config", None)
    config = hf_config.to_dict() if callable(getattr(hf_config, "to_dict", None)) else {}
    if config:
        config["architectures"] = [type(model).__name__]  # as save_pretrained writes it (vLLM needs it)
    config["dtype"] = str(dtype).removeprefix("torch.")   # load_quantized's default dtype, transformers 5's key
    if "torch_dtype" in config:
        config["torch_dtype"] = config["dtype"]
    if config.get("tie_word_embeddings"):  # a quantized lm_head is no longer the embedding's tensor
        try:
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        except (AttributeError, NotImplementedError):
            tied = True
        config["tie_word_embeddings"] = tied
    config["quantization_config"] = qc
    return config


def _size_in_bytes(size) -> int:
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and (m := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)) \
            and m.group(2).lower() in SIZE_UNITS:
        value = int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"max_shard_size must be a number of bytes or a string such as '5GB', '500MB', '2GiB'; "
                         f"got {size!r}")
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive; got {size!r}")
    return value


def _to_host(t: torch.Tensor) -> torch.Tensor:
    # a fresh contiguous CPU copy: safetensors refuses views and tensors sharing memory
    return t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)


def _write_tensors(items: list, directory: Path, max_bytes: int, convention: str | None) -> None:
    """Shards of at most max_bytes (a layer's tensors stay together; one bigger than that gets a shard of its
    own), each written as soon as it is full: host memory holds about one shard."""
    from safetensors import torch as safetensors_torch  # looked up per call, so tests can make it fail

    shards, weight_map, shard, shard_bytes, total = [], {}, {}, 0, 0

    def flush():
        file = f"shard-{len(shards):05d}.partial"
        safetensors_torch.save_file(shard, str(directory / file), metadata={"format": "pt"})
        shards.append((file, list(shard)))

    for item in items:
        tensors = item.tensors(convention) if isinstance(item, _Part) else {item[0]: item[1]}
        tensors = {key: _to_host(t) for key, t in tensors.items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if shard and shard_bytes + size > max_bytes:
            flush()
            shard, shard_bytes = {}, 0
        shard.update(tensors)
        shard_bytes += size
        total += size
    flush()
    if len(shards) == 1:
        os.rename(directory / shards[0][0], directory / SINGLE_FILE)
        return
    for i, (file, keys) in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.rename(directory / file, directory / name)
        weight_map.update(dict.fromkeys(keys, name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _check_target(target: Path, overwrite: bool) -> None:
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise FileExistsError(f"{target} exists and is a file or a symbolic link; save_quantized writes (or with "
                              "overwrite=True replaces) a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target} exists and is not empty; pass overwrite=True to replace it")


def _move_into_place(staging: Path, target: Path, overwrite: bool) -> None:
    """Rename the finished directory to target; an existing one is moved aside first and deleted last."""
    _check_target(target, overwrite)  # again: something may have appeared while writing
    if not target.exists():
        os.rename(staging, target)
        return
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def save_quantized(model: nn.Module, path, *, max_shard_size: int | str = "5GB", overwrite: bool = False) -> Path:
    """Save a model with tilefish 4-bit layers as a Hugging Face checkpoint directory at ``path``, which
    ``tilefish.load_quantized(path, fuse=True or False)`` loads back bit for bit (the layers' packed, scales,
    zeros, perm and bias tensors, so the logits too), and other tools load as GPTQ / bitsandbytes nf4.

    - int4 layers (W4A16Linear, FusedW4A16Linear parts under their own names) are written as GPTQ 4-bit
      (``checkpoint_format`` "gptq" = v1 zeros when every zero point is 1..15, else "gptq_v2"; g_idx on every
      layer, act-order ones permuted); NF4Linear as bitsandbytes 4-bit nf4, its own Linear4bit entries; a fused
      nf4 layer's parts as bitsandbytes nf4 layers whose fp32 absmax are the kernel's rounded group scales
      (exact for the kernels, not the original bitsandbytes weight). ``modules_to_not_convert``
      (``llm_int8_skip_modules``) lists every Linear left dense. The module docstring has the details.
    - Dense tensors are saved as they are, tied ones once. load_quantized gives every floating tensor one dtype
      (config.json's ``dtype``, written as the quantized layers' activation dtype): dense tensors of another
      dtype come back in that one. An act-order layer comes back with its permutation in GPTQ's order (each
      group's input rows ascending, as every GPTQ load gives): the same weight, bit for bit.
    - max_shard_size: bytes, or a string such as "5GB" / "500MB" / "2GiB"; more than that is written as shards
      ``model-00001-of-0000N.safetensors`` and an index, a layer's tensors in one shard.
    - overwrite: replace an existing non-empty directory ``path`` (an empty one is always fine). The new
      directory is written beside it and swapped in; the old one is deleted only after that.
    - The model may be on CPU or CUDA; each tensor is copied to the host as it is written (host memory: about
      one shard). The model is not changed. A torch.compile'd model is saved as the model it wraps.

    Raises TypeError / ValueError naming the module and the rule for anything it cannot write exactly (mixed int4
    and nf4 layers, several group sizes or activation dtypes, a zero point that is not an integer 0..15, an
    unknown layer type, a model with no quantized layer, tensors on the meta device), and FileExistsError for an
    existing non-empty ``path`` without overwrite: all before anything is written. On any failure while writing,
    the temporary directory is removed and ``path`` is left as it was. Returns the directory's path.
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: its names carry a "_orig_mod." prefix
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike (a directory), got {type(path).__name__}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    max_bytes = _size_in_bytes(max_shard_size)
    target = Path(os.path.abspath(os.fspath(path)))
    _check_target(target, overwrite)

    items, parts, dense_linears = _plan(model)
    method, dtype, convention = _check_parts(parts, [item[0] for item in items if not isinstance(item, _Part)])
    qc = _quantization_config(model, parts, method, dtype, convention, dense_linears)
    fmt = QuantFormat.from_config({"quantization_config": qc}, "save_quantized")  # what the loader will read
    listed = [p.name for p in parts if fmt.excludes(p.name)]
    if listed:
        raise ValueError(f"{listed[0]}: a quantized layer whose name a dense Linear's name covers (loaders would "
                         f"keep it dense: {fmt.skip_field} {list(fmt.modules_to_not_convert)})")
    files = {CONFIG_FILE: json.dumps(_model_config(model, qc, dtype), indent=2, sort_keys=True) + "\n"}
    if method == "gptq":
        files[QUANTIZE_CONFIG_FILE] = json.dumps(qc, indent=2, sort_keys=True) + "\n"
    generation = getattr(model, "generation_config", None)
    if callable(getattr(generation, "to_json_string", None)):
        files[GENERATION_CONFIG_FILE] = generation.to_json_string(use_diff=True)

    # everything is checked: write into a staging directory beside target (same file system: rename is atomic)
    created = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with torch.no_grad():
            _write_tensors(items, staging, max_bytes, convention)
        for name, text in files.items():
            (staging / name).write_text(text)
        _move_into_place(staging, target, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for directory in created:  # the parents this call made, innermost first, if still empty
            try:
                directory.rmdir()
            except OSError:
                break
        raise
    return target
