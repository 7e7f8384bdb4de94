"""Whole-model conversion: quantize a model's nn.Linear layers and MoE experts in place, and fuse sibling
projections.

    report = tilefish.quantize_model(model)            # every eligible nn.Linear -> W4A16Linear (lm_head too
                                                       # where its error is within the decoder's: lm_head="auto"),
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

from .decoder import is_gated_mlp, restore_forward, use_fused_forward
from .experts import QuantizedExperts, dense_layout, is_dense_experts
from .nn import FusedW4A16Linear, GatedW4A16Linear, NF4Linear, W4A16Linear, W4A16Slice

# Sibling projections fused by default: (parts, in the fused output's column order) -> fused name.
FUSE_GROUPS: dict[tuple[str, ...], str] = {
    ("q_proj", "k_proj", "v_proj"): "qkv_proj",
    ("gate_proj", "up_proj"): "gate_up_proj",
}
GATED_PARTS = ("gate_proj", "up_proj")  # fused as a GatedW4A16Linear in a SiLU-gated MLP (fuse_projections(gated=True))
METHODS = ("w4a16", "nf4", "mxfp4")
CODEBOOK_OF_METHOD = {"w4a16": "int4", "nf4": "nf4", "mxfp4": "mxfp4"}
# each method's own keywords, at their defaults: a non-default value for another method is an error
_W4A16_DEFAULTS = {"group_size": 128, "symmetric": True, "clip_search": True}
_NF4_DEFAULTS = {"blocksize": 64, "double_quant": True}
_OWN_OPTIONS = {"w4a16": _W4A16_DEFAULTS, "nf4": _NF4_DEFAULTS, "mxfp4": {}}
# the names an MoE router has beside its experts: kept dense (it decides which experts run; tiny)
ROUTER_NAMES = ("gate", "router")
# quantize_model's lm_head choices: by the weight error rule, always (where tileable), never
LM_HEAD_CHOICES = ("auto", "quantize", "dense")


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
    lm_head: str = ""       # what became of the output projection, and why (empty: the model has none)
    attention: str = ""     # the attention implementation fuse_model switched to (empty: none switched)
    forward: str = ""       # the fused forward fuse_model gave the decoder layers / MLPs (empty: none)

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
        if self.lm_head:
            lines.append(f"  lm_head: {self.lm_head}")
        if self.attention:
            lines.append(f"  attention: {self.attention}")
        if self.forward:
            lines.append(f"  forward: {self.forward}")
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
                   skip=(), lm_head: str = "auto", fuse: bool = True, dtype: torch.dtype | None = None,
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
    - skip: module names (or their last components, or fnmatch globs) left dense. A layer whose
      shape the kernel cannot tile (out_features % 64, in_features % 128) stays dense with the reason
      in the report, as does any module that is not a plain floating nn.Linear.
    - lm_head: the output projection (what model.get_output_embeddings() returns, else a module named
      lm_head). "auto" (default) quantizes it when its relative weight error ||W - W_q|| / ||W|| is at
      most the largest of the model's other converted nn.Linear layers: a linear map's relative output
      error is about its weight's, and the decoder's layers compound theirs, so the logits then err less
      from the 4-bit lm_head than from the decoder. A tail-heavy lm_head that int4 serves worse stays
      dense, with both errors in report.lm_head. "quantize": always (where tileable); "dense": never.
      A name in skip stays dense whatever lm_head says. A tied lm_head (the embedding's tensor) gets
      its own 4-bit copy; the embedding keeps the dense tensor.
    - fuse: the model's fused forward (fuse_model): q/k/v and gate/up siblings become one matmul each (gate/up
      with the SiLU-mul in its epilogue), Llama-family decoder layers run tilefish.decoder's fused forward (norm
      kernels, residual adds in the epilogues, with a StaticCache the rotary embedding and the cache write as one
      kernel; restore_forward switches back), and a transformers model with
      grouped-query "sdpa" attention switches to "tilefish_sdpa" (the same math without repeating K/V;
      model.set_attn_implementation("sdpa") switches back). A fused nf4 layer is
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
    if lm_head not in LM_HEAD_CHOICES:
        raise ValueError(f"lm_head must be one of {LM_HEAD_CHOICES}; got {lm_head!r}")
    if isinstance(skip, str):
        skip = (skip,)
    report = ConversionReport()
    head_name = _output_projection_name(model)
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
            elif name == head_name and lm_head == "dense":
                report.skipped[name] = "lm_head='dense'"
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
    # the output projection last: "auto" weighs its error against the others'
    names.sort(key=lambda name: name == head_name)
    weigh_head, errors = lm_head == "auto" and head_name in names, []
    for name in names:  # names, not modules: each dense layer is released once replaced
        parent, leaf = _parent(model, name)
        linear = getattr(parent, leaf)
        before = module_bytes(linear)
        if device is not None:
            linear = linear.to(device)  # a copy there; the original goes with the setattr below
        layer, what = _quantize_linear(linear, method, dtype, options)
        if weigh_head:
            error = _relative_weight_error(linear.weight, layer)
            if name != head_name:
                errors.append(error)
            elif not errors or error > max(errors):
                against = f" > the other layers' worst {max(errors):.4f}" if errors else \
                    ", and no other layer converted to weigh it against"
                report.skipped[name] = report.lm_head = f"kept dense (auto): relative weight error {error:.4f}{against}"
                continue
            else:
                report.lm_head = (f"quantized (auto): relative weight error {error:.4f} <= the other layers' "
                                  f"worst {max(errors):.4f}")
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
    if head_name is not None and not report.lm_head:
        if head_name in report.converted:
            report.lm_head = f"quantized (lm_head={lm_head!r})"
        elif type(model.get_submodule(head_name)) is not nn.Linear:
            report.lm_head = f"left as it was: {report.skipped.get(head_name, 'not a plain nn.Linear')}"
        else:
            report.lm_head = f"kept dense: {report.skipped[head_name]}"
    if fuse:
        fuse_model(model, report)
    return report


def _output_projection_name(model: nn.Module) -> str | None:
    """The name of the model's output projection: the nn.Linear get_output_embeddings() returns (HF
    models), else the module named lm_head (or ending in .lm_head), else None."""
    head = None
    if callable(getattr(model, "get_output_embeddings", None)):
        try:
            head = model.get_output_embeddings()
        except (NotImplementedError, AttributeError):  # HF models without a head say so either way
            head = None
    named = None
    for name, module in model.named_modules():
        if head is not None and module is head and isinstance(module, nn.Linear):
            return name
        if named is None and name.rpartition(".")[2] == "lm_head":
            named = name
    return named


def _relative_weight_error(dense: torch.Tensor, layer: W4A16Linear) -> float:
    """||dense - layer's dequantized weight|| / ||dense|| (Frobenius, fp32), a block of rows at a time."""
    quantized = layer.weight.dequantize()
    diff = norm = 0.0
    for a in range(0, dense.shape[0], 8192):
        w = dense[a:a + 8192].detach().float()
        diff += float((w - quantized[a:a + 8192].float()).pow(2).sum())
        norm += float(w.pow(2).sum())
    return (diff / norm) ** 0.5 if norm else 0.0


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


def fuse_model(model: nn.Module, report: ConversionReport | None = None) -> ConversionReport:
    """A model's fused forward: fuse_projections (q/k/v, gate/up as one W4A16 matmul each; gate/up of a SiLU-gated
    MLP as a GatedW4A16Linear), tilefish.decoder's fused forward for the Llama-family decoder layers, gated MLPs and
    attentions (restore_forward undoes it), and a transformers model's grouped-query "sdpa" attention switched to
    tilefish.attention's "tilefish_sdpa" (K/V read in place instead of repeated for every query head: at batch
    16 that copy outweighs a layer's GEMMs). Anything else is left as it is; report.attention and
    report.forward say what was switched."""
    from .attention import use_gqa_attention

    report = fuse_projections(model, report, gated=True)
    report.forward = use_fused_forward(model) or report.forward
    report.attention = use_gqa_attention(model) or report.attention
    return report


def fuse_projections(model: nn.Module, report: ConversionReport | None = None,
                     groups: dict[tuple[str, ...], str] | None = None, gated: bool = False) -> ConversionReport:
    """In every module that holds all the parts of a group (default FUSE_GROUPS: q/k/v, gate/up) as
    W4A16Linears, put one FusedW4A16Linear under the group's fused name and a W4A16Slice in each
    part's place. gated: gate/up of a SiLU-gated MLP (decoder.is_gated_mlp) become a GatedW4A16Linear,
    whose kernel can apply the activation (the fused MLP forward's; transformers' own forward reads its
    parts through a reordering copy). Groups that cannot fuse stay as they are, with the reason in the report."""
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
            if gated and part_names == GATED_PARTS and is_gated_mlp(parent) and fused.split_sizes[0] == fused.split_sizes[1]:
                fused = GatedW4A16Linear.from_fused(fused)
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
    restore_forward(model)  # the fused forwards run on the 4-bit layers
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, W4A16Slice):
                bias = child.fused.part_weight(child.index)[1]
            elif type(child) in (W4A16Linear, NF4Linear):
                bias = child.bias
            else:
                continue
            weight = child.weight.dequantize()
            linear = nn.Linear(child.in_features, child.out_features, bias=bias is not None,
                               device=weight.device, dtype=dtype or weight.dtype)
            with torch.no_grad():
                linear.weight.copy_(weight)
                if bias is not None:
                    linear.bias.copy_(bias)
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
