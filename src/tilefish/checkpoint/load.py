"""load_quantized: the entry point (the package docstring has the formats)."""
from __future__ import annotations

import itertools
import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from .bnb import read_quant_state
from .files import CONFIG_FILE, HF_EXTRA, _Checkpoint
from .formats import ACTIVATION_DTYPES, CheckpointError, QuantFormat
from .plan import Planned, plan_dense, plan_layers, stage_dense, stage_layers, stage_volatile_buffers


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


def _default_dtype(config: dict, ckpt: _Checkpoint, layers: dict[str, Planned], fmt: QuantFormat) -> torch.dtype:
    """config.json's torch_dtype (or dtype) when fp16 / bf16, else the dtype of the stored scales (fp16 if fp32);
    bitsandbytes: else bnb_4bit_compute_dtype, else the weights' dtype its quant state records, when fp16 / bf16;
    MXFP4 (power-of-two byte scales): else bf16, which holds every MXFP4 scale."""
    name = config.get("torch_dtype", config.get("dtype"))
    if name in ("float16", "bfloat16"):
        return getattr(torch, name)
    first = next(iter(layers.values()))
    if fmt.method == "bitsandbytes":
        recorded = getattr(torch, read_quant_state(ckpt, first.tensors["quant_state"])["dtype"])
        return fmt.compute_dtype or (recorded if recorded in ACTIVATION_DTYPES else torch.float16)
    if first.scales is None:
        return torch.bfloat16
    scales = ckpt.tensors[first.scales].dtype
    return scales if scales in ACTIVATION_DTYPES else torch.float16


def _describe_layer(layer, fmt: QuantFormat) -> str:
    from ..experts import QuantizedExperts
    from ..nn import NF4Linear

    if isinstance(layer, QuantizedExperts):
        return f"experts {layer.extra_repr()} ({fmt.describe()})"
    if isinstance(layer, NF4Linear):
        kind = f"NF4 blocksize {layer.blocksize}{' double-quant' if layer.double_quant else ''}"
    else:
        kind = f"W4A16 g{layer.group_size} {'sym' if layer.zeros is None else 'asym'}"
    return f"{kind} {layer.in_features}->{layer.out_features} ({fmt.describe()})"


def _dense_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """What the module's parameters take in dtype (an nn.Linear's or an experts module's; it may be on meta)."""
    return sum(p.numel() for p in module.parameters()) * dtype.itemsize


def load_quantized(model_or_path, path=None, *, device=None, dtype: torch.dtype | None = None, fuse: bool = True):
    """Load a GPTQ / AWQ / compressed-tensors / bitsandbytes 4-bit / gpt-oss MXFP4 checkpoint directory (HF format)
    with its quantized Linears as ``W4A16Linear`` (GPTQ / AWQ / compressed-tensors) or ``NF4Linear`` (bitsandbytes
    nf4), and its quantized MoE experts as ``tilefish.experts.QuantizedExperts`` (MXFP4, or one GPTQ / AWQ /
    compressed-tensors Linear per expert and projection) in place of the model's dense experts modules.

    ``load_quantized(path)`` or ``load_quantized(config, path)`` builds the model with transformers
    (``AutoModelForCausalLM.from_config`` on the meta device; ``pip install tilefish[hf]``).
    ``load_quantized(model, path)`` loads into ``model`` (any nn.Module whose names match the checkpoint's; it may
    be on the meta device), in place: each ``nn.Linear`` X with ``X.qweight`` stored becomes a ``W4A16Linear``
    (with bitsandbytes ``X.weight.quant_state.bitsandbytes__nf4`` and the other Linear4bit entries: an
    ``NF4Linear``; with compressed-tensors ``X.weight_packed``: a ``W4A16Linear``), each dense experts module X
    with ``X.gate_up_proj_blocks`` (MXFP4) or ``X.<e>.w1 / w3 / w2`` (or ``gate_proj / up_proj / down_proj``)
    quantized Linears stored becomes a ``QuantizedExperts`` (a legacy ``block_sparse_moe`` path is read as the
    model's ``mlp``), every other checkpoint tensor is assigned to the model (tied parameters stay tied). Modules
    named in ``modules_to_not_convert`` (bitsandbytes: ``llm_int8_skip_modules``; compressed-tensors: ``ignore``)
    must be stored dense. Act-order (g_idx) experts are not supported.

    device: where everything goes; default the model's device, or the CPU for a meta model.
    dtype: the activation dtype (fp16 / bf16) of every floating tensor; default config.json's ``torch_dtype`` if it
        is one of those, else the stored scales' dtype (bitsandbytes: ``bnb_4bit_compute_dtype``, else the weights'
        recorded dtype, when fp16 / bf16; else fp16; MXFP4: else bf16).
    fuse: the fused forward afterwards (``tilefish.convert.fuse_model``: q/k/v and gate/up projections fused, a
        grouped-query "sdpa" attention switched to "tilefish_sdpa", which does not repeat K/V). Fused bitsandbytes
        layers hold the kernel layout (their state dict is tilefish's, not bitsandbytes'); fuse=False keeps
        ``NF4Linear``s, whose state dicts are bitsandbytes' again.

    Returns ``(model, report)``, a ``tilefish.convert.ConversionReport``. Raises ``CheckpointError`` (a ValueError)
    naming the file, tensor or config field for anything it cannot load, and then leaves the model untouched.
    """
    from ..convert import ConversionReport, fuse_model, module_bytes
    from ..experts import QuantizedExperts, is_dense_experts

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
        ckpt.rename_to_model(model)
        layer_plan = plan_layers(model, ckpt, fmt)
        dtype = dtype or _default_dtype(config, ckpt, layer_plan, fmt)
        state = {name: t for name, t in model.state_dict(keep_vars=True).items()
                 if name.rpartition(".")[0] not in layer_plan}
        dense_plan = plan_dense(state, ckpt, {t for p in layer_plan.values() for t in p.tensors.values()})
        volatile = stage_volatile_buffers(model, device)
        layers = stage_layers(layer_plan, model, ckpt, fmt, device, dtype)
        tensors = stage_dense(dense_plan, state, ckpt, device, dtype)

    # everything is built: from here on nothing can fail
    replaced = {name: model.get_submodule(name) for name in layers}
    dense_bytes = {name: _dense_bytes(m, dtype) for name, m in replaced.items()}
    for name, value in itertools.chain(layers.items(), tensors.items(), volatile.items()):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, value)

    experts = [name for name, layer in layers.items() if isinstance(layer, QuantizedExperts)]
    report = ConversionReport(
        converted={name: _describe_layer(layer, fmt) for name, layer in layers.items()},
        skipped={name: (f"listed in quantization_config.{fmt.skip_field}" if fmt.excludes(name)
                        else "stored dense in the checkpoint")
                 for name, module in model.named_modules()
                 if isinstance(module, nn.Linear) or is_dense_experts(module)},
        bytes_before=sum(dense_bytes.values()), bytes_after=sum(module_bytes(layer) for layer in layers.values()),
        experts_bytes_before=sum(dense_bytes[name] for name in experts),
        experts_bytes_after=sum(module_bytes(layers[name]) for name in experts))
    if fuse:
        fuse_model(model, report)
    return model, report
