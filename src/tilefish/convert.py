"""Whole-model conversion: quantize a model's nn.Linear layers and MoE experts in place, and fuse sibling
projections.

    report = tilefish.quantize_model(model)            # every eligible nn.Linear -> W4A16Linear (lm_head kept),
                                                       # every experts module -> QuantizedExperts (int4)
    report = tilefish.quantize_model(model, "nf4")     # ... or -> NF4Linear (bitsandbytes NF4, on the same kernels)
    report = tilefish.quantize_model(model, "mxfp4")   # ... or OCP MXFP4 (W4A16Linear with codebook "mxfp4")
    print(report)

Fusion joins sibling projections of one input (attention q/k/v, MLP gate/up) into one W4A16 matmul
whose weights sit side by side along out_features: one launch streams all of them, so a decode step
pays one kernel's fixed cost instead of three (two). Every output column keeps its own quantized
values and scale, so fused and unfused layers compute the same function.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from .experts import QuantizedExperts, dense_layout, is_dense_experts
from .nn import FusedW4A16Linear, NF4Linear, W4A16Linear, W4A16Slice

# Sibling projections fused by default: (parts, in the fused output's column order) -> fused name.
FUSE_GROUPS: dict[tuple[str, ...], str] = {
    ("q_proj", "k_proj", "v_proj"): "qkv_proj",
    ("gate_proj", "up_proj"): "gate_up_proj",
}
METHODS = ("w4a16", "nf4", "mxfp4")
CODEBOOK_OF_METHOD = {"w4a16": "int4", "nf4": "nf4", "mxfp4": "mxfp4"}
# each method's own keywords, at their defaults: a non-default value for another method is an error
_W4A16_DEFAULTS = {"group_size": 128, "symmetric": True, "clip_search": True}
_NF4_DEFAULTS = {"blocksize": 64, "double_quant": True}
_OWN_OPTIONS = {"w4a16": _W4A16_DEFAULTS, "nf4": _NF4_DEFAULTS, "mxfp4": {}}
# the names an MoE router has beside its experts: kept dense (it decides which experts run; tiny)
ROUTER_NAMES = ("gate", "router")


@dataclass
class ConversionReport:
    """What a conversion did, module by module."""
    converted: dict[str, str] = field(default_factory=dict)   # module name -> what it became
    skipped: dict[str, str] = field(default_factory=dict)     # module name -> why it stayed as it was
    fused: dict[str, list[str]] = field(default_factory=dict)  # fused module name -> the parts it replaced
    unfused: dict[str, str] = field(default_factory=dict)     # parts (joined by ", ") -> why they stayed apart
    bytes_before: int = 0   # the converted modules' weights, bias and buffers before ...
    bytes_after: int = 0    # ... and after
    experts_bytes_before: int = 0   # the part of those that are MoE experts modules, before ...
    experts_bytes_after: int = 0    # ... and after

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} module(s), skipped {len(self.skipped)}, "
                 f"fused {len(self.fused)} group(s)"]
        if self.bytes_before:
            lines.append(f"weights of the converted modules: {self.bytes_before / 2**20:,.1f} MiB -> "
                         f"{self.bytes_after / 2**20:,.1f} MiB ({self.bytes_after / self.bytes_before:.2f}x)")
        if self.experts_bytes_before:
            lines.append(f"  of which MoE experts: {self.experts_bytes_before / 2**20:,.1f} MiB -> "
                         f"{self.experts_bytes_after / 2**20:,.1f} MiB "
                         f"({self.experts_bytes_after / self.experts_bytes_before:.2f}x)")
        reasons: dict[str, list[str]] = {}
        for name, why in list(self.skipped.items()) + list(self.unfused.items()):
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            lines.append(f"  not converted or not fused ({why}): {shown}")
        return "\n".join(lines)


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (shared tensors counted once)."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.data_ptr() not in seen or t.device.type == "meta":
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _matches(name: str, patterns) -> bool:
    """A module name matches a pattern equal to it, to its last component(s), or as an fnmatch glob."""
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    head, _, leaf = name.rpartition(".")
    return (model.get_submodule(head) if head else model), leaf


def _why_not_quantizable(module: nn.Linear, method: str, group_size: int, blocksize: int = 64) -> str | None:
    from .ops.nf4 import check_matmul_shape
    from .ops.w4a16 import check_shape

    w = module.weight
    if w.device.type == "meta":
        return "its weight is on the meta device (no values to quantize)"
    if w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"weight dtype {w.dtype} (fp16, bf16 or fp32 needed)"
    try:
        if method == "nf4":
            check_matmul_shape((module.out_features, module.in_features), blocksize)
        else:
            check_shape(module.out_features, module.in_features, _group_of(method, group_size, blocksize))
    except ValueError as e:
        return str(e)
    return None


def _group_of(method: str, group_size: int, blocksize: int) -> int:
    """The kernel scale group a method gives: int4 its group_size, nf4 min(blocksize, 128), mxfp4 32."""
    from .ops.nf4 import scale_group
    from .ops.w4a16.layout import MXFP4_GROUP

    return {"w4a16": group_size, "nf4": scale_group(blocksize), "mxfp4": MXFP4_GROUP}[method]


def _why_not_convertible_experts(module: nn.Module, method: str, group_size: int, blocksize: int) -> str | None:
    """Why a dense experts module cannot be quantized (its layout, dtype, device or shapes), or None."""
    from .ops.w4a16 import check_shape

    try:
        layout = dense_layout(module)
    except ValueError as e:
        return str(e)
    w = module.gate_up_proj
    if w.device.type == "meta":
        return "its weights are on the meta device (no values to quantize)"
    if w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"weight dtype {w.dtype} (fp16, bf16 or fp32 needed)"
    group = _group_of(method, group_size, blocksize)
    try:
        check_shape(2 * layout.intermediate, layout.hidden, group)    # gate_up: [2I, H] per expert
        check_shape(layout.hidden, layout.intermediate, group)        # down:    [H, I]
    except ValueError as e:
        return f"experts [hidden {layout.hidden}, intermediate {layout.intermediate}]: {e}"
    return None


def _is_router(name: str, module: nn.Module, parents: dict[str, nn.Module]) -> bool:
    """An nn.Linear named gate / router beside a dense or quantized experts module."""
    head, _, leaf = name.rpartition(".")
    experts = getattr(parents.get(head), "experts", None)
    return leaf in ROUTER_NAMES and (isinstance(experts, QuantizedExperts) or
                                     (experts is not None and is_dense_experts(experts)))


def _check_method_arguments(method: str, given: dict) -> None:
    """Each method takes its own keywords; the other methods' must stay at their defaults."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    own = _OWN_OPTIONS[method]
    wrong = [f"{k}={given[k]!r}" for options in _OWN_OPTIONS.values() if options is not own
             for k, default in options.items() if given[k] is not default and given[k] != default]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} does not apply to method={method!r} (its options: "
                         f"{', '.join(own) or 'none'})")
    if method == "mxfp4":
        return
    if method == "nf4":
        from .quant.nf4 import SUPPORTED_BLOCKSIZES

        if isinstance(given["blocksize"], bool) or given["blocksize"] not in SUPPORTED_BLOCKSIZES:
            raise ValueError(f"blocksize must be one of {SUPPORTED_BLOCKSIZES}; got {given['blocksize']!r}")
        if not isinstance(given["double_quant"], bool):
            raise TypeError(f"double_quant must be a bool; got {given['double_quant']!r}")
        return
    group_size = given["group_size"]
    if isinstance(group_size, bool) or group_size not in (-1, 32, 64, 128):
        raise ValueError(f"group_size must be -1 (per channel), 32, 64 or 128; got {group_size!r}")
    if not isinstance(given["symmetric"], bool):
        raise TypeError(f"symmetric must be a bool; got {given['symmetric']!r}")


def quantize_model(model: nn.Module, method: str = "w4a16", *, group_size: int = 128, symmetric: bool = True,
                   skip=("lm_head",), fuse: bool = True, dtype: torch.dtype | None = None,
                   clip_search: bool = True, device=None, blocksize: int = 64,
                   double_quant: bool = True) -> ConversionReport:
    """Replace every eligible nn.Linear of `model` (any module tree) in place by a W4A16Linear
    (method "w4a16" or "mxfp4") or an NF4Linear (method "nf4"), and every MoE experts module (transformers 5:
    3-D gate_up_proj / down_proj; Mixtral, Qwen-MoE, gpt-oss ...) by a tilefish.experts.QuantizedExperts of
    the same method (its router stays dense).

    - "w4a16": round-to-nearest int4 with `group_size` (-1 per channel, 32, 64, 128), symmetric
      or with zero points, each group's scale chosen by a clip search (clip_search=False: plain range).
    - "nf4": bitsandbytes' NF4 (tilefish.nf4.quantize: same bytes as bitsandbytes' quantize_4bit) with
      `blocksize` (32 ... 4096) and `double_quant` (the block scales quantized again, as bitsandbytes'
      compress_statistics); the layers export to bitsandbytes state dicts. group_size, symmetric and
      clip_search do not apply to it (nor blocksize / double_quant to "w4a16"): a value other than the
      default is a ValueError rather than silently ignored. Experts keep only the kernel form (codes and
      the block absmax rounded to dtype as group scales), as a fused nf4 layer does.
    - "mxfp4": OCP MXFP4 (tilefish.quant.mxfp4: E2M1 codes, a power-of-two scale per 32 weights); no
      options. With fp16 activations a scale fp16 cannot hold exactly is a ValueError (use bf16).
    - Experts: an experts module whose shapes the kernel cannot tile, whose activation is not SiLU (or
      gpt-oss's SwiGLU), or which holds other tensors stays dense, with the reason in the report; an nn.Linear
      router (named gate / router beside the experts) stays dense too.
    - Either runs where the weights are (CUDA, or CPU for the reference path), one layer at a time, and
      drops each dense weight once its layer is converted: the peak is about one layer above the result.
    - skip: module names (or their last components, or fnmatch globs) left dense; lm_head by default.
      A layer whose shape the kernel cannot tile (out_features % 64, in_features % 128) stays dense
      with the reason in the report, as does any module that is not a plain floating nn.Linear.
    - fuse: q/k/v and gate/up siblings become one matmul each (fuse_projections). A fused nf4 layer is
      a FusedW4A16Linear with codebook "nf4": its state dict is tilefish's kernel layout (packed,
      scales), not bitsandbytes' (fuse=False keeps bitsandbytes-exportable NF4Linears).
    - dtype: the activation dtype (the scales'); default the weight's if fp16/bf16, else fp16.
    - device: where the converted layers go (default: where each weight is). A model on the CPU
      converts layer by layer on the GPU with device="cuda": the GPU then holds the quantized
      layers and one dense layer at a time, never the dense model; model.to(device) afterwards
      moves what stayed dense (embeddings, norms, lm_head).
    - Converting an already converted model is a no-op for its W4A16 / NF4 layers (reported as skipped).
    Returns the ConversionReport."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_method_arguments(method, dict(group_size=group_size, symmetric=symmetric, clip_search=clip_search,
                                         blocksize=blocksize, double_quant=double_quant))
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be torch.float16 or torch.bfloat16 (the activation dtype); got {dtype}")
    if isinstance(skip, str):
        skip = (skip,)
    report = ConversionReport()
    names, experts = [], []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if isinstance(module, NF4Linear):
            report.skipped[name] = "already NF4"
        elif isinstance(module, (W4A16Linear, W4A16Slice)):
            report.skipped[name] = "already W4A16"
        elif isinstance(module, QuantizedExperts):
            report.skipped[name] = "already quantized experts"
        elif is_dense_experts(module):
            if _matches(name, skip):
                report.skipped[name] = "in skip"
            elif (why := _why_not_convertible_experts(module, method, group_size, blocksize)) is not None:
                report.skipped[name] = why
            else:
                experts.append(name)
        elif isinstance(module, nn.Linear):
            if _matches(name, skip):
                report.skipped[name] = "in skip"
            elif _is_router(name, module, modules):
                report.skipped[name] = "an MoE router (kept dense)"
            elif type(module) is not nn.Linear:
                report.skipped[name] = f"{type(module).__name__} is not a plain nn.Linear"
            elif (why := _why_not_quantizable(module, method, group_size, blocksize)) is not None:
                report.skipped[name] = why
            else:
                names.append(name)
    del modules
    options = dict(group_size=group_size, symmetric=symmetric, clip_search=clip_search, blocksize=blocksize,
                   double_quant=double_quant)
    for name in names:  # names, not modules: each dense layer is released once replaced
        parent, leaf = _parent(model, name)
        linear = getattr(parent, leaf)
        before = module_bytes(linear)
        if device is not None:
            linear = linear.to(device)  # a copy there; the original goes with the setattr below
        layer, what = _quantize_linear(linear, method, dtype, options)
        setattr(parent, leaf, layer)
        del linear
        report.bytes_before += before
        report.bytes_after += module_bytes(layer)
        report.converted[name] = f"{what} {layer.in_features}->{layer.out_features}"
    for name in experts:
        parent, leaf = _parent(model, name)
        dense = getattr(parent, leaf)
        before = module_bytes(dense)
        layer = QuantizedExperts.from_dense(dense.to(device) if device is not None else dense,
                                            CODEBOOK_OF_METHOD[method], dtype=dtype, **_experts_options(method, options))
        setattr(parent, leaf, layer)
        del dense
        after = module_bytes(layer)
        report.bytes_before += before
        report.bytes_after += after
        report.experts_bytes_before += before
        report.experts_bytes_after += after
        report.converted[name] = f"experts {layer.extra_repr()}"
    if fuse:
        fuse_projections(model, report)
    return report


def _quantize_linear(linear: nn.Linear, method: str, dtype, options: dict) -> tuple[nn.Module, str]:
    """One nn.Linear quantized by `method`, and how the report describes it."""
    if method == "nf4":
        layer = NF4Linear.from_linear(linear, blocksize=options["blocksize"], double_quant=options["double_quant"],
                                      dtype=dtype)
        return layer, f"NF4 blocksize {options['blocksize']}{' double-quant' if options['double_quant'] else ''}"
    if method == "mxfp4":
        from .quant import mxfp4
        from .ops.w4a16 import pack

        dtype = dtype or (linear.weight.dtype if linear.weight.dtype in (torch.float16, torch.bfloat16)
                          else torch.float16)
        q = mxfp4.to_int4_weight(mxfp4.quantize(linear.weight.detach()), dtype)
        return W4A16Linear.from_weight(pack(q, codebook="mxfp4"), linear.bias), "MXFP4"
    layer = W4A16Linear.from_linear(linear, group_size=options["group_size"], symmetric=options["symmetric"],
                                    dtype=dtype, clip_search=options["clip_search"])
    return layer, f"W4A16 g{options['group_size']} {'sym' if options['symmetric'] else 'asym'}"


def _experts_options(method: str, options: dict) -> dict:
    """The ExpertWeights.from_weights keywords of `method`."""
    return {name: options[name] for name in _OWN_OPTIONS[method]}


def _why_not_fusable(parts: list[W4A16Linear]) -> str | None:
    first = parts[0]
    for p in parts:
        if type(p) not in (W4A16Linear, NF4Linear):
            return f"{type(p).__name__} is not a plain W4A16Linear or NF4Linear"
        if p.codebook != first.codebook:  # one kernel reads every column with one table
            return "different codebooks (int4 and nf4)"
        if p.in_features != first.in_features:
            return "different in_features"
        if p.group_size != first.group_size:
            return "different group sizes"
        if p.scales.dtype != first.scales.dtype or p.packed.device != first.packed.device:
            return "different dtypes or devices"
    perms = [p.perm for p in parts]
    if any(q is not None for q in perms):
        if any(q is None for q in perms) or not all(torch.equal(q, perms[0]) for q in perms[1:]):
            return "act-order permutations differ (each part gathers x in its own order)"
    return None


def fuse(parts: list[W4A16Linear]) -> FusedW4A16Linear:
    """One FusedW4A16Linear holding `parts`' weights side by side along out_features (exact: the
    packed layout and the scales are per 64-column strip, and every part is whole strips). NF4Linear
    parts give a fused layer with codebook "nf4" holding their kernel tensors (packed, the rounded
    group scales); their bitsandbytes block scales are not kept."""
    first = parts[0]
    device, dtype = first.packed.device, first.scales.dtype
    asym = any(p.zeros is not None for p in parts)
    has_bias = any(p.bias is not None for p in parts)
    fused = FusedW4A16Linear(first.in_features, [p.out_features for p in parts], group_size=first.group_size,
                             bias=has_bias, symmetric=not asym, dtype=dtype, device="meta",
                             act_order=first.perm is not None, codebook=first.codebook)
    fused.packed = torch.cat([p.packed for p in parts], 0)
    fused.scales = torch.cat([p.scales for p in parts], 1)
    if asym:  # a symmetric part's zero point is 8, written out
        fused.zeros = torch.cat([p.zeros if p.zeros is not None else torch.full_like(p.scales, 8) for p in parts], 1)
    fused.perm = first.perm
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() if p.bias is not None else
                                             torch.zeros(p.out_features, dtype=dtype, device=device) for p in parts]),
                                  requires_grad=False)
    return fused


def fuse_projections(model: nn.Module, report: ConversionReport | None = None,
                     groups: dict[tuple[str, ...], str] | None = None) -> ConversionReport:
    """In every module that holds all the parts of a group (default FUSE_GROUPS: q/k/v, gate/up) as
    W4A16Linears, put one FusedW4A16Linear under the group's fused name and a W4A16Slice in each
    part's place. Groups that cannot fuse stay as they are, with the reason in the report."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    report = report if report is not None else ConversionReport()
    groups = FUSE_GROUPS if groups is None else groups
    for parent_name, parent in list(model.named_modules()):
        for part_names, fused_name in groups.items():
            parts = [getattr(parent, p, None) for p in part_names]
            if not all(isinstance(p, W4A16Linear) for p in parts):
                continue
            full = [f"{parent_name}.{p}" if parent_name else p for p in part_names]
            where = f"{parent_name}.{fused_name}" if parent_name else fused_name
            why = _why_not_fusable(parts)
            if why is None and hasattr(parent, fused_name):
                why = f"{where} already exists"
            if why is not None:
                report.unfused[", ".join(full)] = why
                continue
            fused = fuse(parts)
            setattr(parent, fused_name, fused)
            for i, p in enumerate(part_names):
                setattr(parent, p, W4A16Slice(fused, i))
            W4A16Slice.share_within(parent, part_names[0])
            report.fused[where] = full
    return report


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """The inverse of quantize_model, in place: every W4A16Linear, NF4Linear and W4A16Slice becomes an
    nn.Linear holding its exactly dequantized weight (in the original input order) and bias; fused
    layers are dropped; every QuantizedExperts becomes the dense experts module it was converted from
    (QuantizedExperts.to_dense: its class, attributes and weight layout, the dequantized weights). For export, and for telling the kernels' error from the 4-bit weights' (a
    quantized model against its dense twin). An NF4Linear gives bitsandbytes' exact dequantization
    (fp32 value times fp32 block absmax, rounded once), which differs from what the kernels multiply
    by (the absmax rounded to the activation dtype) by at most an ulp or so per weight; a fused nf4
    slice has only the latter.

    dtype: the new layers' dtype. Default: the dtype of the model's other floating-point parameters
    (a quantized fp32 model's twin is fp32, so its forward runs as before), or each layer's own 16-bit
    dtype where the model has no other. Returns how many layers it replaced."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
    dtype = dtype or _dense_dtype(model)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, W4A16Slice):
                owner, (a, b) = child.fused, child.fused.bounds[child.index]
            elif type(child) in (W4A16Linear, NF4Linear):
                owner, (a, b) = child, (0, child.out_features)
            else:
                continue
            weight = child.weight.dequantize()
            linear = nn.Linear(child.in_features, child.out_features, bias=owner.bias is not None,
                               device=weight.device, dtype=dtype or weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(weight)
                if owner.bias is not None:
                    linear.bias.copy_(owner.bias[a:b])
            setattr(parent, name, linear)
            replaced += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantizedExperts):
                setattr(parent, name, child.to_dense(dtype))
                replaced += 1
    for parent in list(model.modules()):
        W4A16Slice.stop_sharing(parent)
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedW4A16Linear):
                delattr(parent, name)
    return replaced


def _dense_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the first floating-point parameter outside the 4-bit layers, or None."""
    quantized = {id(t) for m in model.modules() if isinstance(m, W4A16Linear) for t in m.parameters()}
    return next((p.dtype for p in model.parameters() if p.is_floating_point() and id(p) not in quantized), None)
