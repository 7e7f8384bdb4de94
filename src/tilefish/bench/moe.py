"""`tilefish bench moe`: one MoE layer's experts, the router's output given, tilefish's grouped 4-bit expert op
(tilefish.moe.moe_experts on int4 / NF4 / MXFP4 experts) against transformers' bf16 experts module of the same
model (its own forward, and its grouped_mm / batched_mm experts implementations) and torch._grouped_mm, at
decode and prefill token counts, all in one process, against the byte floor.

Per model (bench/moe_shapes.py: Mixtral-8x7B, Qwen3-30B-A3B, Qwen3-235B-A22B, gpt-oss-20b / 120b) one layer is
built at a time on the GPU and freed before the next: transformers' experts module (MixtralExperts /
Qwen3MoeExperts / GptOssExperts, made from a one-layer config on the meta device, then given random bf16 weights
on the GPU), and tilefish's weights quantized from it on the GPU (QuantizedExperts.from_dense, the conversion
users run; its time is in the notes). Per token count, a seeded routing (K distinct experts a token drawn
uniformly, softmax weights over them), one input, and every implementation timed in alternating rounds
(time_alternating_us: CUDA events, L2 flushed, the median). A row's GB/s is over the bytes of the experts the
routing selects (the distinct selected experts x one expert's bytes in the row's format: 4-bit codes and scales
for tilefish, bf16 for the peers, biases for gpt-oss), and its % of the copy bandwidth measured in the same
process is how close it comes to the byte floor (those bytes at that rate). Each implementation's output is
checked once per model, at the smallest token count, against a float64 reference of its own weights.
"""
from __future__ import annotations

import copy
import math
import time

import torch

from .ceilings import copy_bandwidth_gbps
from .moe_shapes import (BATCHED_MM_MAX_BYTES, BEST_BF16, DEFAULT_TOKENS, IMPLS, NF4_BLOCKSIZE, PEER_IMPLS,
                         RATIO_NAMES, TILEFISH_IMPLS, MoEModel, distinct_experts, floor_us, parse_models)
from .report import Report, Row
from .timing import time_alternating_us

DTYPE = torch.bfloat16
ROUNDS = 3               # alternating rounds per case (each runs every implementation in turn)
CHECK_TOLERANCE = 2e-2   # relative error (norm) against the float64 reference of the row's own weights
SEED = 0
TRANSFORMERS_CLASSES = {"mixtral": ("MixtralConfig", "transformers.models.mixtral.modeling_mixtral", "MixtralExperts"),
                        "qwen3_moe": ("Qwen3MoeConfig", "transformers.models.qwen3_moe.modeling_qwen3_moe",
                                      "Qwen3MoeExperts"),
                        "gpt_oss": ("GptOssConfig", "transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts")}


# ---- the layer: transformers' bf16 experts module and tilefish's 4-bit weights of it ---------------------------

def experts_config(model: MoEModel, implementation: str = "eager"):
    """A one-layer transformers config of the model's family with its expert shapes, experts implementation
    `implementation` ("eager": the module's own forward; "grouped_mm", "batched_mm")."""
    import importlib
    import warnings

    import transformers

    config_name, _, _ = TRANSFORMERS_CLASSES[model.family]
    shapes = {"mixtral": dict(intermediate_size=model.inter, num_local_experts=model.experts, hidden_act="silu"),
              "qwen3_moe": dict(moe_intermediate_size=model.inter, num_experts=model.experts, hidden_act="silu"),
              "gpt_oss": dict(intermediate_size=model.inter, num_local_experts=model.experts,
                              layer_types=["full_attention"])}[model.family]
    importlib.import_module(TRANSFORMERS_CLASSES[model.family][1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = getattr(transformers, config_name)(hidden_size=model.hidden, num_hidden_layers=1,
                                                    num_experts_per_tok=model.topk, **shapes)
    config._experts_implementation = implementation
    return config


class PlainExperts(torch.nn.Module):
    """Where transformers is not importable: the experts as tilefish's op takes them (gate_up [E, 2I, H], gate rows
    first; down [E, H, I]; biases [E, 2I] / [E, H]), with the activation QuantizedExperts.from_dense reads (act_fn
    SiLU, or gpt-oss's alpha and limit). No forward: only tilefish and torch._grouped_mm rows run on it."""

    def __init__(self, model: MoEModel):
        super().__init__()
        from ..ops.moe import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

        e, h, i = model.experts, model.hidden, model.inter
        self.gate_up_proj = torch.nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = torch.nn.Parameter(torch.empty(e, h, i))
        if model.bias:
            self.gate_up_proj_bias = torch.nn.Parameter(torch.empty(e, 2 * i))
            self.down_proj_bias = torch.nn.Parameter(torch.empty(e, h))
        if model.activation == "silu":
            self.act_fn = torch.nn.SiLU()
        else:
            self.alpha, self.limit = SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def dense_experts(model: MoEModel, device, seed: int = SEED) -> torch.nn.Module:
    """transformers' experts module of the model (built on the meta device, so no fp32 copy is ever made; without
    transformers a PlainExperts), its parameters random bf16 on `device`: weights N(0, 1/fan_in), biases
    N(0, 0.02^2)."""
    import importlib

    with torch.device("meta"):
        if has_transformers():
            _, module_name, class_name = TRANSFORMERS_CLASSES[model.family]
            module = getattr(importlib.import_module(module_name), class_name)(experts_config(model))
        else:
            module = PlainExperts(model)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()):
            std = 0.02 if name.endswith("_bias") else 1 / math.sqrt(model.hidden if "gate_up" in name else model.inter)
            t = torch.empty(p.shape, dtype=DTYPE, device=device).normal_(0.0, std, generator=gen)
            setattr(module, name, torch.nn.Parameter(t, requires_grad=False))
    return module.eval()


def with_implementation(module: torch.nn.Module, model: MoEModel, implementation: str) -> torch.nn.Module | None:
    """The same module (its parameters shared) running transformers' experts implementation `implementation`
    (config._experts_implementation), or None where this transformers has none for it (a module class
    without @use_experts_implementation, or an interface without the name)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    if getattr(module, "config", None) is None or implementation not in ALL_EXPERTS_FUNCTIONS:
        return None
    twin = copy.copy(module)  # a shallow copy: the same parameter dict, its own config attribute
    twin.config = experts_config(model, implementation)
    return twin


def quantized_weights(module: torch.nn.Module, model: MoEModel, fmt: str):
    """tilefish's weights of the module in format fmt, quantized where the module's weights are (on the GPU):
    QuantizedExperts.from_dense, as quantize_model converts an experts module. int4: the model's group
    (moe_shapes.int4_group), round to nearest without the clip search (the values do not change the time);
    nf4: blocksize 64; mxfp4: OCP MXFP4."""
    from ..experts import QuantizedExperts

    options = {"int4": dict(group_size=model.int4_group(), clip_search=False),
               "nf4": dict(blocksize=NF4_BLOCKSIZE), "mxfp4": {}}[fmt]
    layer = QuantizedExperts.from_dense(module, fmt, dtype=DTYPE, **options)
    return layer.gate_up, layer.down, layer.gate_up_bias, layer.down_bias, layer.activation


# ---- inputs and the implementations ---------------------------------------------------------------------------

def routing(model: MoEModel, tokens: int, device, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's output for `tokens` tokens: ids int64 [T, K] (K distinct experts a token, uniform) and
    weights bf16 [T, K] (a softmax over random logits), seeded by (seed, tokens), made on the CPU."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + tokens)
    ids = torch.rand(tokens, model.experts, generator=gen).topk(model.topk, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, model.topk, generator=gen), dim=-1)
    return ids.to(device), weights.to(device=device, dtype=DTYPE)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's activation as GptOssExperts computes it."""
    from ..ops.moe import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


def grouped_mm_function():
    """torch._grouped_mm, else torch.nn.functional.grouped_mm, else None."""
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm
    return getattr(torch.nn.functional, "grouped_mm", None)


def torch_grouped_mm_experts(module: torch.nn.Module, model: MoEModel):
    """fn(x, ids, weights) -> y: the experts on torch's grouped GEMM called directly, on the module's own bf16
    tensors (no copy): the slots sorted by expert, the rows gathered, the two grouped GEMMs (the group ends from
    a scatter-add of the ids, so nothing syncs and the call captures in a CUDA graph), the activation, the
    routing weights, the K slots of a token summed in fp32."""
    from ..experts import dense_layout

    mm = grouped_mm_function()
    layout = dense_layout(module)
    w1 = module.gate_up_proj if layout.transposed else module.gate_up_proj.transpose(1, 2)   # [E, H, 2I]
    w2 = module.down_proj if layout.transposed else module.down_proj.transpose(1, 2)         # [E, I, H]
    b1 = getattr(module, "gate_up_proj_bias", None) if layout.has_bias else None
    b2 = getattr(module, "down_proj_bias", None) if layout.has_bias else None
    experts = model.experts

    def run(x, ids, weights):
        tokens, topk = ids.shape
        flat = ids.reshape(-1)
        sorted_ids, perm = torch.sort(flat)
        counts = torch.zeros(experts, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = mm(x[perm // topk], w1, offs=offs)
        if b1 is not None:
            h = h + b1[sorted_ids]
        gate, up = (h[:, 0::2], h[:, 1::2]) if layout.interleaved else h.chunk(2, dim=-1)
        a = swiglu_oai(gate, up) if model.activation == "swiglu_oai" else torch.nn.functional.silu(gate) * up
        out = mm(a, w2, offs=offs)
        if b2 is not None:
            out = out + b2[sorted_ids]
        out = out * weights.reshape(-1)[perm, None]
        y = torch.empty_like(out).index_copy_(0, perm, out)
        return y.view(tokens, topk, -1).sum(1, dtype=torch.float32).to(x.dtype)
    return run


def dense_reference(module: torch.nn.Module, model: MoEModel, x, ids, weights) -> torch.Tensor:
    """The layer on the module's bf16 weights in float64, expert by expert over the selected ones."""
    from ..experts import dense_layout
    from ..reference import moe_activation

    layout = dense_layout(module)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        w1 = module.gate_up_proj[e].double()
        w1 = w1.t() if layout.transposed else w1                       # [2I, H]
        if layout.interleaved:
            w1 = torch.cat([w1[0::2], w1[1::2]])
        w2 = module.down_proj[e].double()
        w2 = w2.t() if layout.transposed else w2                       # [H, I]
        h = x[token].double() @ w1.t()
        if layout.has_bias:
            b = module.gate_up_proj_bias[e].double()
            h = h + (torch.cat([b[0::2], b[1::2]]) if layout.interleaved else b)
        a = moe_activation(h[:, :model.inter], h[:, model.inter:], model.activation)
        y = a @ w2.t()
        if layout.has_bias:
            y = y + module.down_proj_bias[e].double()
        out.index_add_(0, token, y * weights[token, slot].double()[:, None])
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def graphed(fn):
    """fn captured in a CUDA graph (warmed on a side stream first): (replay, graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay, graph


# ---- the run ------------------------------------------------------------------------------------------------------

def kernel_specs(info, models, tokens, impls) -> list:
    """The KernelSpecs the tilefish rows launch on the device `info` (device_info(): SMs, shared memory per block):
    the alignment, activation and combine kernels and the two grouped GEMMs of plan_grouped for each model x token
    count x 4-bit format."""
    from ..ops.moe_kernels import act_spec, align_spec, combine_spec, grouped_gemm_spec, plan_grouped

    specs = []
    for model in models:
        fmts = [f for f in TILEFISH_IMPLS if f in impls]
        if fmts:
            specs += [align_spec(torch.int64), act_spec(DTYPE, model.activation), combine_spec(DTYPE, torch.int64)]
        for fmt in fmts:
            g = model.group(fmt)
            for t in tokens:
                plan = plan_grouped(t, model.topk, model.experts, model.hidden, model.inter, (g, False), (g, False),
                                    info.sm_count, info.smem_per_block_optin)
                specs += [grouped_gemm_spec(DTYPE, plan.gate_up.config, g, False, fmt),
                          grouped_gemm_spec(DTYPE, plan.down.config, g, False, fmt)]
    return list(dict.fromkeys(specs))


def _peer_availability(impls) -> tuple[list[str], list[str]]:
    """(the peers of impls that can run here, notes on those that cannot)."""
    notes, ok, known = [], [], set()
    try:
        import transformers
    except ImportError as e:
        transformers = None
        notes.append(f"transformers not importable ({e.name or e}): no transformers rows (the tilefish and "
                     "torch._grouped_mm rows run on plain bf16 experts; pip install 'tilefish[hf]')")
    if transformers is not None:
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
            known = set(ALL_EXPERTS_FUNCTIONS)
        except ImportError:
            pass
    for impl in (i for i in PEER_IMPLS if i in impls):
        if impl == "torch_grouped_mm":
            if grouped_mm_function() is None:
                notes.append(f"torch {torch.__version__} has neither torch._grouped_mm nor F.grouped_mm: "
                             "no torch._grouped_mm rows")
            else:
                ok.append(impl)
        elif transformers is None:
            continue
        elif impl != "bf16" and impl not in known:
            notes.append(f"transformers {transformers.__version__} offers no '{impl}' experts implementation: "
                         f"no {impl} rows")
        else:
            ok.append(impl)
    return ok, notes


def run(models=None, tokens=None, impls=None, graphs: bool = False, reps: int = 50, title_note: str = "",
        device=None) -> Report:
    """models: MoEModels or a --models string (None: every model); tokens: token counts (None: DEFAULT_TOKENS);
    impls: names of moe_shapes.IMPLS (None: all that run here); graphs: the tilefish op (and the peers that
    capture) replayed from CUDA graphs, as decode runs. A row per implementation and token count, then the case's
    byte floor (the first 4-bit format's bytes at the copy rate; every format's and bf16's in its extra).
    device: the current CUDA device by default (the tests run the whole loop on the CPU with the timing faked)."""
    from .. import moe as tf_moe
    from ..reference import moe_experts as reference_moe
    from ..runtime import device_info

    models = parse_models(models) if models is None or isinstance(models, str) else list(models)
    tokens = list(tokens or DEFAULT_TOKENS)
    impls = [i for i in IMPLS if i in (impls or IMPLS)]
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    warm_note = _warm(device_info(), models, tokens, impls) if dev.type == "cuda" else "no kernels to warm (CPU)"
    copy_gbps = copy_bandwidth_gbps()
    report = Report("MoE layer: tilefish 4-bit experts vs transformers' bf16 experts (ratio = peer time / tilefish "
                    "time)" + title_note, {"copy GB/s": copy_gbps})
    peers, peer_notes = _peer_availability(impls)
    report.notes += [warm_note, *peer_notes]
    report.notes.append(f"every implementation of a case timed in {ROUNDS} alternating rounds (time_alternating_us: "
                        "CUDA events, L2 flushed, median); routing: K distinct experts a token, uniform, seeded; "
                        "softmax weights; bf16 activations; GB/s over the selected experts' bytes, % of the copy "
                        "bandwidth = the byte floor / the time")
    if graphs:
        report.notes.append("--graphs: the tilefish op and the grouped_mm / batched_mm / torch._grouped_mm peers "
                            "replayed from CUDA graphs; transformers' eager loop (it syncs per expert) runs eager")
    if any(m.int4_group() != 128 for m in models) and "int4" in impls:
        odd = [m for m in models if m.int4_group() != 128]
        report.notes.append("int4 group 128 needs hidden and intermediate sizes that are multiples of 128: "
                            + ", ".join(f"{m.name} ({m.hidden} / {m.inter}) uses group {m.int4_group()}" for m in odd))
    for model in models:
        _run_model(report, model, tokens, [i for i in impls if i in TILEFISH_IMPLS or i in peers], graphs, reps,
                   dev, copy_gbps, tf_moe, reference_moe)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _warm(info, models, tokens, impls) -> str:
    from .progress import warm_kernels

    return warm_kernels(kernel_specs(info, models, tokens, impls), info.arch)


def _check(report, model, t, calls, names, weights, peers, module, x, ids, rw, reference_moe) -> dict[str, float]:
    """Run each of `names` once and compare its output with the float64 reference of its own weights (tilefish:
    reference.moe_experts on the 4-bit weights; the bf16 rows: dense_reference); {name: relative error}. A name
    that raises is dropped (from calls, and from weights / peers for the rest of the model) with a note; one
    beyond CHECK_TOLERANCE is noted as CHECK FAILED (its rows are flagged)."""
    errs: dict[str, float] = {}
    if not names:
        return errs
    with torch.no_grad():
        dense_ref = dense_reference(module, model, x, ids, rw) if any(n in peers for n in names) else None
        for name in names:
            try:
                out = calls[name]()
                if name in weights:
                    gu, dn, gub, db, act = weights[name]
                    ref = reference_moe(x, ids, rw, gu, dn, act, gub, db).double()
                else:
                    ref = dense_ref
                errs[name] = rel_err(out, ref)
            except Exception as e:  # noqa: BLE001 - an implementation that cannot run here loses its rows only
                report.notes.append(f"{model.name} t{t}: {name} FAILED to run ({type(e).__name__}: "
                                    f"{(str(e).splitlines() or [''])[0][:160]}); no {name} rows")
                del calls[name]
                if name in peers:
                    peers.remove(name)
                else:
                    del weights[name]
                continue
            if errs[name] > CHECK_TOLERANCE:
                report.notes.append(f"{model.name} t{t}: {name} CHECK FAILED, relative error {errs[name]:.3g} > "
                                    f"{CHECK_TOLERANCE} against the float64 reference of its weights")
    return errs


def _run_model(report, model, tokens, impls, graphs, reps, dev, copy_gbps, tf_moe, reference_moe) -> None:
    fmts = [f for f in TILEFISH_IMPLS if f in impls]
    peers = [p for p in PEER_IMPLS if p in impls]
    _sync(dev)
    t0 = time.perf_counter()
    module = dense_experts(model, dev)
    _sync(dev)
    build_s = time.perf_counter() - t0
    weights, quant_s = {}, {}
    for fmt in fmts:
        t0 = time.perf_counter()
        try:
            weights[fmt] = quantized_weights(module, model, fmt)
        except Exception as e:  # noqa: BLE001 - one format's failure costs neither the others nor the peers
            report.notes.append(f"{model.name}: {fmt} quantization FAILED ({type(e).__name__}: {e}); no {fmt} rows")
            continue
        _sync(dev)
        quant_s[fmt] = time.perf_counter() - t0
    where = "GPU" if dev.type == "cuda" else dev.type.upper()
    report.notes.append(f"{model.name}: bf16 experts ({model.layer_bytes('bf16') / 1e9:.2f} GB) made in "
                        f"{build_s:.1f} s; "
                        f"quantized on the {where} (QuantizedExperts.from_dense, one expert at a time): "
                        + (", ".join(f"{f} {s:.1f} s" for f, s in quant_s.items()) or "none"))
    twins = {p: with_implementation(module, model, p) for p in ("grouped_mm", "batched_mm") if p in peers}
    peer_fns = {} if isinstance(module, PlainExperts) else {"bf16": lambda x, i, w: module(x, i, w)}
    peer_fns.update({p: (lambda m: lambda x, i, w: m(x, i, w))(m) for p, m in twins.items() if m is not None})
    if "torch_grouped_mm" in peers:
        peer_fns["torch_grouped_mm"] = torch_grouped_mm_experts(module, model)
    peers = [p for p in peers if p in peer_fns]
    failed: set[str] = set()
    checked: set[str] = set()
    skipped_batched = []
    for t in tokens:
        ids, rw = routing(model, t, dev)
        x = torch.randn(t, model.hidden, device=dev, dtype=DTYPE)
        calls = {}
        for fmt in weights:
            gu, dn, gub, db, act = weights[fmt]
            calls[fmt] = (lambda gu, dn, gub, db, act: lambda: tf_moe.moe_experts(x, ids, rw, gu, dn, act, gub, db))(
                gu, dn, gub, db, act)
        for p in peers:
            if p == "batched_mm" and not model.batched_mm_fits(t):
                skipped_batched.append(t)
                continue
            calls[p] = (lambda f: lambda: f(x, ids, rw))(peer_fns[p])
        errs = _check(report, model, t, calls, [c for c in calls if c not in checked], weights, peers, module, x, ids,
                      rw, reference_moe)
        checked.update(errs)
        failed.update(name for name, err in errs.items() if err > CHECK_TOLERANCE)
        graph_keep = {}
        if graphs and dev.type == "cuda":
            for name in list(calls):
                if name == "bf16":
                    continue
                try:
                    replay, graph_keep[name] = graphed(calls[name])
                    calls[name] = replay
                except Exception as e:  # noqa: BLE001 - eager instead, said
                    torch.cuda.synchronize()
                    report.notes.append(f"{model.name} t{t}: {name} did not capture in a CUDA graph "
                                        f"({type(e).__name__}); timed eager")
        with torch.no_grad():
            times = time_alternating_us(calls, rounds=ROUNDS, per_round=max(4, -(-reps // ROUNDS)),
                                        warmup=2) if calls else {}
        distinct = distinct_experts(ids)
        case = f"{model.name} t{t}"
        peer_times = {p: times[p] for p in peers if p in times}
        best = min(peer_times.values()) if peer_times else None
        extra_base = {"model": model.name, "tokens": t, "experts": model.experts, "topk": model.topk,
                      "hidden": model.hidden, "inter": model.inter, "selected_experts": distinct, "graphs": graphs}
        for name in [n for n in list(weights) + peers if n in times]:
            fmt = name if name in weights else "bf16"
            nbytes = distinct * model.expert_bytes(fmt)
            us = times[name]
            gbps = nbytes / (us * 1e-6) / 1e9
            ratios = {}
            if name in weights:
                ratios = {RATIO_NAMES[p]: pt / us for p, pt in peer_times.items()}
                if best is not None:
                    ratios[BEST_BF16] = best / us
            label = model.label(name) + (" CHECK FAILED" if name in failed else "")
            extra = dict(extra_base, impl=name, format=fmt, group=model.group(fmt) if fmt != "bf16" else None,
                         bytes=nbytes, floor_us=floor_us(nbytes, copy_gbps), graphed=name in graph_keep)
            if name in errs:
                extra["rel_err"] = errs[name]
            report.add(Row("moe", case, label, us, gbps, "GB/s", 100 * gbps / copy_gbps, ratios, extra))
        # the case's last row: the byte floor of the first 4-bit format's bytes (bf16's without one), both floors
        # in extra (bench/families/moe.py counts a case at this row)
        fmt = next(iter(weights), "bf16")
        floors = {f: floor_us(distinct * model.expert_bytes(f), copy_gbps) for f in [*weights, "bf16"]}
        what = model.label(fmt).removeprefix("tilefish ") if fmt != "bf16" else "bf16"
        report.add(Row("moe", case, f"byte floor ({what} bytes at the copy rate)", floors[fmt], copy_gbps, "GB/s",
                       100.0, {},
                       dict(extra_base, format=fmt, bytes=distinct * model.expert_bytes(fmt),
                            floors_us={f: round(v, 3) for f, v in floors.items()})))
        del calls, graph_keep, x, ids, rw
    if skipped_batched:
        report.notes.append(f"{model.name}: batched_mm skipped at {','.join(map(str, skipped_batched))} tokens (its "
                            f"copy of one expert's bf16 weights per slot would pass {BATCHED_MM_MAX_BYTES / 2**30:g} "
                            "GiB)")
    del module, weights, peer_fns, twins
