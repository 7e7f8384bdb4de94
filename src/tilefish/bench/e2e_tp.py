"""`tilefish bench e2e --tp 1,2,...`: the e2e decoder (bench/e2e.py) tensor-parallel over several GPUs.

Run under torchrun, one process per GPU: `torchrun --nproc_per_node 2 -m tilefish.cli bench e2e --tp 1,2`.
For each TP size N in the list, ranks 0..N-1 form a group, and each of them builds the whole model from the
same seed, converts it (fp16, tilefish W4A16 g128, tilefish NF4), checks the unsharded logits, shards it
with tilefish.distributed.shard_model (fp16 sharded the same way, dense column / row-parallel), checks the
sharded logits against the unsharded ones, and times decode steps; the other ranks wait. Rank 0 reports.
Ratios: against fp16 at the same TP size, and against the same variant at TP 1 (latency ratio and
tokens/s scaling are the same number: one step's time at TP 1 over its time at TP N).
"""
from __future__ import annotations

import dataclasses
import gc
import os

import torch
import torch.distributed as dist

from .. import distributed as tp_layers
from . import e2e
from .report import Report, Row

TP_IMPLS = ("fp16", "w4a16", "tilefish-nf4")  # bitsandbytes' Linear4bit layers cannot be sharded here
TP_BATCHES = (1, 16)
# The targets: decode latency at batch 1 with TP 2 <= 0.6x TP 1; tokens/s at batch 16 >= 1.6x.
TARGETS = {1: ("latency", 0.6), 16: ("tokens/s", 1.6)}


def _init() -> tuple[int, int, torch.device]:
    """(rank, world, this rank's device); starts the default process group from torchrun's environment
    when none exists (NCCL with CUDA, gloo without)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device


def check_tp_sizes(tps, world: int) -> list[int]:
    tps = sorted(set(tps))
    too_big = [t for t in tps if t > world]
    if too_big:
        raise ValueError(f"--tp {','.join(map(str, too_big))} needs that many processes, one per GPU (torchrun "
                         f"--nproc_per_node {max(too_big)} -m tilefish.cli bench e2e --tp ...); this run has {world}")
    return tps


def run(tps, impls=TP_IMPLS, layers: int = 32, batches=TP_BATCHES, context: int = 512, modes=("compiled",),
        model: str = "auto", reps: int = 50, *, config=None, backend: str = "inductor", seed: int = 0) -> Report:
    """The TP report (rank 0's; other ranks return an empty report). config / backend: as e2e.run (tests)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (device README)
    rank, world, device = _init()
    tps = check_tp_sizes(tps, world)
    if model == "auto":
        model = "hf" if e2e.has_transformers() else "builtin"
    unknown = set(impls) - set(e2e.IMPLS)
    if unknown:
        raise ValueError(f"unknown impls {sorted(unknown)}; --tp runs {', '.join(TP_IMPLS)}")
    notes = [f"{i} skipped: " + ("bitsandbytes' Linear4bit layers cannot be sharded by tilefish.distributed"
                                 if i == "nf4" else f"--tp runs {', '.join(TP_IMPLS)}")
             for i in impls if i not in TP_IMPLS]
    impls = [i for i in impls if i in TP_IMPLS]
    cfg = config or e2e.LlamaConfig.llama3_8b(layers)
    if device.type == "cuda":
        kv_tokens = max(b * e2e._round_up(context + 1, e2e.CACHE_ALIGN) for b in batches)
        fit = e2e._fit_layers(cfg, max(kv_tokens, e2e.CHECK_TOKENS), torch.cuda.mem_get_info(device)[0])
        fit = _min_over_ranks(fit, device)
        if fit < cfg.num_hidden_layers:
            notes.append(f"reduced to {fit} of {cfg.num_hidden_layers} layers: each rank builds the whole fp16 "
                         f"model before sharding it")
            cfg = dataclasses.replace(cfg, num_hidden_layers=fit)
    plan = e2e._Plan(e2e._HF if model == "hf" else e2e._Builtin, cfg, device, [m for m in e2e.MODES if m in modes],
                     [("decode", b) for b in batches], context, reps, backend, seed, "dense")
    report = Report(f"End-to-end decoder, tensor-parallel, Llama-3-8B shapes, {cfg.num_hidden_layers} layers, "
                    f"{model} model, fp16 activations (tok/s; ratios = other time / this time)")
    report.notes += notes + [
        f"{world} processes (torchrun), one GPU each; TP sizes {', '.join(map(str, tps))}: ranks 0..N-1 hold the "
        "shards, rank 0's times reported; q/k/v and gate/up column-parallel, o and down row-parallel (one "
        "all-reduce each), lm_head vocab-parallel (its logits all-gathered), embeddings and norms whole on every rank "
        "(tilefish.distributed.shard_model)",
        f"decode: one token per sequence over a KV cache filled with {context} random K/V positions; compiled: each "
        "decoder layer torch.compile(fullgraph=True), the whole step captured in one CUDA graph and replayed"]
    times: dict[tuple, dict[tuple[str, int], float]] = {}
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=max(8, len(plan.cases) + 2)):
        for size in tps:
            group = dist.new_group(list(range(size)))  # every rank takes part in creating every group
            if rank < size:
                for impl in (i for i in TP_IMPLS if i in impls):
                    _variant(plan, impl, size, group, rank, times, report.notes)
                    torch._dynamo.reset()
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            dist.barrier()
    if rank != 0:
        return Report(report.title)
    _add_rows(report, plan, times)
    report.notes.append(target_summary(report.rows))
    return report


def _min_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _variant(plan, impl: str, size: int, group, rank: int, times: dict, notes: list[str]) -> None:
    torch.manual_seed(plan.seed)
    runner = plan.Runner(plan.cfg, plan.device)
    summary = e2e._convert(runner, impl, "dense")  # shard_model splits a dense lm_head over the vocabulary
    whole = e2e._logits(runner, plan.cfg.vocab_size, plan.device)
    if size > 1:
        report = tp_layers.shard_model(runner.model, group, device=plan.device)
        runner.tp = size
        sharded = e2e._logits(runner, plan.cfg.vocab_size, plan.device)
        err = e2e._rel(sharded, whole)
        if rank == 0:
            notes.append(f"{impl} TP {size} ({summary}; {report}): logits vs the unsharded model "
                         f"{err:.2e}" + ("  LARGE: check the sharding" if err > 1e-2 else ""))
    for mode in plan.modes:
        if mode == "compiled":
            for layer in runner.model.model.layers:
                layer.compile(fullgraph=True, dynamic=False, backend=plan.backend)
        for phase, batch in plan.cases:
            if rank == 0:
                print(f"TP {size} {impl} {mode} {phase} b{batch}", flush=True)
            label = mode
            try:
                ms, _ = e2e._measure(runner, phase, batch, plan.context, mode, plan.cfg.vocab_size, plan.device,
                                     plan.reps)
            except Exception as e:  # noqa: BLE001 - a failed capture is reported; the compiled layers still time
                if mode != "compiled" or plan.device.type != "cuda":
                    raise
                if rank == 0:
                    notes.append(f"{impl} TP {size} b{batch}: CUDA graph capture failed ({type(e).__name__}: "
                                 f"{(str(e).splitlines() or [''])[0]}); timed the compiled layers without a graph")
                label = "compiled, no graph"
                ms, _ = e2e._measure(runner, phase, batch, plan.context, "eager", plan.cfg.vocab_size, plan.device,
                                     plan.reps)
            times.setdefault((label, batch), {})[(impl, size)] = ms


def _add_rows(report: Report, plan, times: dict) -> None:
    for (mode, batch), by in sorted(times.items()):
        for (impl, size), ms in sorted(by.items(), key=lambda kv: (kv[0][1], TP_IMPLS.index(kv[0][0]))):
            ratios = {}
            if impl != "fp16" and ("fp16", size) in by:
                ratios["fp16 same TP"] = by[("fp16", size)] / ms
            if size > 1 and (impl, 1) in by:
                ratios["TP 1"] = by[(impl, 1)] / ms
            report.add(Row("e2e-tp", f"{mode} decode b{batch} ctx{plan.context} TP {size}",
                           f"{e2e.LABELS[impl]}", ms * 1e3, batch / (ms * 1e-3), "tok/s", None, ratios,
                           {"mode": mode, "batch": batch, "tp": size, "impl": impl, "ms_per_step": ms,
                            "layers": plan.cfg.num_hidden_layers, "context": plan.context}))


def target_summary(rows) -> str:
    """Per variant and TP size > 1: TP 1 time / TP N time at batch 1 and 16, against the issue's targets."""
    lines = []
    for r in rows:
        size, batch = r.extra.get("tp"), r.extra.get("batch")
        if size in (None, 1) or "TP 1" not in r.ratios or batch not in TARGETS:
            continue
        speedup = r.ratios["TP 1"]
        what, target = TARGETS[batch]
        if what == "latency":
            value, ok = 1 / speedup, 1 / speedup <= target
            text = f"latency TP {size} / TP 1 = {value:.2f}x (target <= {target})"
        else:
            value, ok = speedup, speedup >= target
            text = f"tokens/s TP {size} / TP 1 = {value:.2f}x (target >= {target})"
        lines.append(f"{r.extra['mode']} {r.impl} b{batch}: {text} {'met' if ok else 'MISSED'}")
    return "Against the targets: " + ("; ".join(lines) if lines else "no TP > 1 row with a TP 1 row beside it")
