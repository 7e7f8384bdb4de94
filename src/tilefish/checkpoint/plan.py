"""Planning and staging: what the checkpoint's tensors become, checked from the headers before any data is
read (plan_layers, plan_dense), then built without touching the model (stage_*), one layer's tensors at a time."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from .bnb import BNB_MARKERS, BNB_QUANT_STATE, plan_bnb_layer
from .experts import MXFP4_SUFFIXES, build_experts, expert_linear, plan_experts, plan_mxfp4_experts
from .files import CONFIG_FILE, _Checkpoint
from .formats import CheckpointError, QuantFormat
from .linears import MARKER, SCALES, build_linear, plan_linear


@dataclass
class Planned:
    """One module of the model the checkpoint replaces: a quantized nn.Linear or a dense experts module."""

    kind: str                   # "linear" or "experts"
    tensors: dict[str, str]     # role -> checkpoint tensor name
    scales: str | None = None   # a tensor whose dtype is the checkpoint's activation dtype (None: no float scales)


def quantized_names(ckpt: _Checkpoint, fmt: QuantFormat) -> dict[str, str]:
    """Quantized module name X -> a tensor that marks it: X.qweight (GPTQ / AWQ), X.weight_packed
    (compressed-tensors), any X.weight.<bitsandbytes entry>, X.{gate_up,down}_proj_{blocks,scales} (MXFP4
    experts: X is the experts module). Per-expert Linears are named as stored (X.experts.<e>.<proj>)."""
    names = {}
    for tname in ckpt.tensors:
        if fmt.method == "bitsandbytes":
            for marker in BNB_MARKERS:
                head, found, _ = tname.partition("." + marker)
                if found and (marker == BNB_QUANT_STATE or tname.endswith("." + marker)):
                    names.setdefault(head, tname)
        elif fmt.method == "mxfp4":
            for proj in ("gate_up_proj", "down_proj"):
                for suffix in MXFP4_SUFFIXES:
                    if tname.endswith(f".{proj}{suffix}"):
                        names.setdefault(tname[: -len(f".{proj}{suffix}")], tname)
        elif tname.endswith("." + MARKER[fmt.method]):
            names[tname[: -len(MARKER[fmt.method]) - 1]] = tname
    return names


def plan_layers(model: nn.Module, ckpt: _Checkpoint, fmt: QuantFormat) -> dict[str, Planned]:
    """Every module the checkpoint stores quantized -> its Planned: nn.Linears, and dense experts modules (from
    MXFP4 experts tensors or from per-expert Linears)."""
    from ..experts import is_dense_experts

    modules = dict(model.named_modules())
    layers, per_expert = {}, {}
    for name, tname in quantized_names(ckpt, fmt).items():
        if fmt.excludes(name):
            raise CheckpointError(f"{ckpt.where(tname)}: the layer is quantized, but config.json's "
                                  f"quantization_config.{fmt.skip_field} lists it "
                                  f"({list(fmt.modules_to_not_convert)})")
        module = modules.get(name)
        if fmt.method == "mxfp4":
            if module is None or not is_dense_experts(module):
                found = "nothing" if module is None else type(module).__name__
                raise CheckpointError(f"{ckpt.where(tname)}: MXFP4 tensors of experts, but the model has no experts "
                                      f"module (3-D gate_up_proj / down_proj) named {name!r} (found {found})")
            layers[name] = Planned("experts", plan_mxfp4_experts(name, module, tname, ckpt))
            continue
        parts = expert_linear(name)
        if module is None and parts is not None and is_dense_experts(modules.get(parts[0])):
            if fmt.method == "bitsandbytes":
                raise CheckpointError(f"{ckpt.where(tname)}: bitsandbytes 4-bit experts are not supported")
            per_expert.setdefault(parts[0], {})[parts[1:]] = tname
            continue
        if not isinstance(module, nn.Linear):
            found = "nothing" if module is None else type(module).__name__
            raise CheckpointError(f"{ckpt.where(tname)}: the model has no nn.Linear named {name!r} (found {found})")
        if fmt.method == "bitsandbytes":
            layers[name] = Planned("linear", plan_bnb_layer(name, module, ckpt, fmt))
        else:
            roles = plan_linear(name, module.in_features, module.out_features, module.bias is not None, ckpt, fmt)
            layers[name] = Planned("linear", roles, roles[SCALES[fmt.method]])
    for name, stored in per_expert.items():
        roles = plan_experts(name, modules[name], stored, ckpt, fmt)
        layers[name] = Planned("experts", roles, roles[f"0.gate.{SCALES[fmt.method]}"])
    if not layers:
        marker = {"bitsandbytes": "X.weight.quant_state.bitsandbytes__nf4", "mxfp4": "X.gate_up_proj_blocks"}.get(
            fmt.method, f"X.{MARKER.get(fmt.method)}")
        raise CheckpointError(f"{ckpt.source}: no {marker} tensor, though {CONFIG_FILE} has a quantization_config")
    return layers


def plan_dense(state: dict[str, torch.Tensor], ckpt: _Checkpoint, taken: set[str]) -> dict[str, list[str]]:
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


def stage_layers(plan: dict[str, Planned], model: nn.Module, ckpt: _Checkpoint, fmt: QuantFormat, device,
                 dtype: torch.dtype) -> dict[str, nn.Module]:
    staged = {}
    for name, planned in plan.items():
        tensors = {role: ckpt.load(tname).to(device) for role, tname in planned.tensors.items()}
        module = model.get_submodule(name)
        try:
            if planned.kind == "experts":
                staged[name] = build_experts(name, module, tensors, fmt, dtype)
            else:
                staged[name] = build_linear(name, tensors, fmt, dtype, module)
        except (ValueError, TypeError) as e:        # values the headers cannot show: zeros, g_idx groups, scales
            files = sorted({ckpt.tensors[t].file for t in planned.tensors.values()})
            shown = list(planned.tensors.values())
            more = f" and {len(shown) - 4} more" if len(shown) > 4 else ""
            raise CheckpointError(f"{', '.join(files)}: layer {name!r} ({', '.join(shown[:4])}{more}): {e}") from e
    return staged


def stage_dense(plan, state, ckpt, device, dtype) -> dict[str, torch.Tensor]:
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


def stage_volatile_buffers(model: nn.Module, device) -> dict[str, torch.Tensor]:
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

