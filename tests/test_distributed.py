"""Tensor parallelism (tilefish.distributed): exact weight slicing, and sharded models against the unsharded
one in real multi-process groups: gloo on the CPU (reference path, 2 and 4 ranks), NCCL on two GPUs."""
from __future__ import annotations

import faulthandler
import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tilefish import distributed as tp
from tilefish import w4a16
from tilefish.models.llama import LlamaConfig
from tilefish.nn import FusedW4A16Linear, NF4Linear, W4A16Linear

from conftest import rel_err

TINY = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=512, rope_theta=10000.0, max_position_embeddings=256)
PROMPT = 12
# Sharded against unsharded logits, the same weights and inputs, by activation dtype. Each rank's partial
# product is rounded to the activation dtype before the all-reduce sums it (the unsharded kernel rounds
# once), and two decoder layers carry that to the logits: measured on gloo, fp32 5e-7, fp16 1.0e-3,
# bf16 7.8e-3 (8x fp16's unit roundoff); a wrong shard is O(1).
TP_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _weight(n: int, k: int, group: int, seed: int, act_order: bool = False, symmetric: bool = True):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=g)
    w = w4a16.quantize(dense, group_size=group, symmetric=symmetric, dtype=torch.float16, clip_search=False)
    if act_order:
        w.perm = torch.randperm(k, generator=g)
    return w


# -- exact slicing (single process) -----------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("group,symmetric", [(128, True), (64, False), (-1, True)])
def test_column_shards_are_the_dense_rows(world, group, symmetric):
    w = _weight(512, 256, group, seed=world, symmetric=symmetric)
    full = w.dequantize(torch.float32)
    got = [tp.shard_weight_columns(w, r, world).dequantize(torch.float32) for r in range(world)]
    assert torch.equal(torch.cat(got), full)


def test_fused_column_shards_split_every_part():
    w = _weight(128 * 4 + 128 * 2, 256, 128, seed=1)  # q 512 columns, k 128, v 128 (the parts of a fused qkv)
    parts = [512, 128, 128]
    full = w.dequantize(torch.float32)
    q, k, v = full.split(parts)
    for r in range(2):
        got = tp.shard_weight_columns(w, r, 2, parts).dequantize(torch.float32)
        want = torch.cat([q.chunk(2)[r], k.chunk(2)[r], v.chunk(2)[r]])
        assert torch.equal(got, want)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("group,symmetric,act_order", [(128, True, False), (64, False, False), (-1, True, False),
                                                       (128, True, True)])
def test_row_shards_are_the_dense_columns(world, group, symmetric, act_order):
    w = _weight(128, 1024, group, seed=7, act_order=act_order, symmetric=symmetric)
    full = w.dequantize(torch.float32)  # in the kernel's k order
    for r in range(world):
        shard, index, (k0, k1) = tp.shard_weight_rows(w, r, world)
        assert shard.perm is None and (k1 - k0) * world == w.k
        assert torch.equal(shard.dequantize(torch.float32), full[:, k0:k1])
        if act_order:
            assert torch.equal(index, w.perm[k0:k1])  # the input columns this kernel slice reads
        else:
            assert index is None


def test_untileable_column_shard_is_rejected():
    w = _weight(192, 384, 128, seed=3)
    with pytest.raises(tp.ShardError, match="multiple of 64"):
        tp.shard_weight_columns(w, 0, 2)        # 96 columns a rank: not whole 64-column strips
    assert tp.shard_weight_columns(w, 2, 3).n == 64


def test_untileable_row_shard_is_rejected_and_a_legal_one_is_not():
    w = _weight(128, 384, 128, seed=3)
    shard, _, _ = tp.shard_weight_rows(w, 2, 3)   # 128 inputs a rank: one whole group, one k step
    assert shard.k == 128
    with pytest.raises(tp.ShardError, match="not divisible"):
        tp.shard_weight_rows(w, 0, 5)
    with pytest.raises(tp.ShardError, match="not tileable"):
        tp.shard_weight_rows(_weight(128, 512, 128, seed=4), 0, 8)  # 64 inputs a rank: half a group


def test_shard_model_checks_everything_before_changing_anything(monkeypatch):
    from tilefish.convert import quantize_model
    from tilefish.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY, "cpu", torch.float16)
    quantize_model(model, clip_search=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(tp, "group_rank_world", lambda group=None: (0, 3))  # 8 heads on 3 ranks
    with pytest.raises(tp.ShardError, match="num_attention_heads 8 is not divisible by the tensor-parallel size 3"):
        tp.shard_model(model)
    monkeypatch.setattr(tp, "group_rank_world", lambda group=None: (0, 8))  # heads fit, k of 1024 / 8 = 128 fits,
    with pytest.raises(tp.ShardError, match="num_key_value_heads 4"):       # but 4 kv heads do not
        tp.shard_model(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(isinstance(m, (tp.ColumnParallelLinear, tp.RowParallelLinear)) for m in model.modules())


def test_shard_model_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        tp.shard_model(nn.Sequential(nn.Linear(4, 4)))


def test_layers_that_cannot_be_sharded_are_named():
    with pytest.raises(tp.ShardError, match="cannot shard a Conv1d"):
        tp.shard_columns(nn.Conv1d(4, 4, 1), 0, 2, "model.conv")
    fused = FusedW4A16Linear(256, [128, 128], bias=False)
    with pytest.raises(tp.ShardError, match="column-parallel"):
        tp.shard_rows(fused, 0, 2, "mlp.gate_up_proj")


# -- real process groups ----------------------------------------------------------------------------------------

def _enter(backend: str, init: str, rank: int, world: int) -> None:
    """Join the group; a rank that aborts in C++ prints its Python stack (pytest's faulthandler covers only the
    parent process)."""
    faulthandler.enable()
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)


def _leave() -> None:
    """A rank whose checks passed ends here, without interpreter teardown: gloo's worker threads can still be
    torn down then and abort the process (SIGABRT, "terminate called without an active exception"); that is
    torch's exit path, not what these tests check."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _build(kind: str, method: str, device: torch.device, dtype: torch.dtype):
    """A tiny Llama (same seed on every rank) as an e2e runner, converted by `method`."""
    from tilefish.bench import e2e
    from tilefish.convert import quantize_model

    torch.manual_seed(0)
    runner = (e2e._HF if kind == "hf" else e2e._Builtin)(TINY, device)
    runner.model.to(dtype)
    if method == "w4a16":
        quantize_model(runner.model, clip_search=False)
    elif method == "w4a16-act-order":  # unfused, every quantized layer with its own input permutation
        quantize_model(runner.model, clip_search=False, fuse=False)
        g = torch.Generator().manual_seed(5)
        for m in runner.model.modules():
            if type(m) is W4A16Linear:
                m.perm = torch.randperm(m.in_features, generator=g).to(m.packed.device)
    elif method == "nf4":
        quantize_model(runner.model, method="nf4")
    return runner


def _logits(runner, device):
    ids = torch.randint(TINY.vocab_size, (2, PROMPT), generator=torch.Generator().manual_seed(11)).to(device)
    runner.setup(2, 64)
    out = runner.step(ids, torch.arange(PROMPT, device=device), logits_to_keep=0).float()
    step = runner.step(ids[:, :1], torch.tensor([PROMPT], device=device), logits_to_keep=0).float()  # one decode step
    return torch.cat([out, step], 1)


def _worker(rank: int, world: int, init: str, backend: str, cases: list):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _enter(backend, init, rank, world)
    try:
        with torch.no_grad():
            for kind, method, dtype in cases:
                runner = _build(kind, method, device, dtype)
                want = _logits(runner, device)
                report = tp.shard_model(runner.model, device=device)
                runner.tp = world
                got = _logits(runner, device)
                err = rel_err(got, want)
                assert err < TP_TOL[dtype], f"rank {rank}/{world} {kind} {method} {dtype}: TP logits rel err {err:.3g}"
                assert len(report.row) == 2 * TINY.num_hidden_layers, report
                others = [torch.empty_like(got) for _ in range(world)]
                dist.all_gather(others, got)  # every rank computes the same logits
                assert all(torch.equal(o, got) for o in others), f"{kind} {method}: ranks disagree"
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _leave()


def _spawn(world: int, backend: str, cases: list) -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, f"file://{d}/store", backend, cases), nprocs=world, join=True,
                           start_method="spawn")


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_sharded_models_match_unsharded(world):
    cases = [("builtin", "dense", torch.float32), ("builtin", "w4a16", torch.float16),
             ("builtin", "nf4", torch.bfloat16), ("builtin", "w4a16-act-order", torch.float16)]
    if world == 2:
        pytest.importorskip("transformers")
        cases.append(("hf", "w4a16", torch.float16))
    _spawn(world, "gloo", cases)


@pytest.mark.gpu
def test_nccl_sharded_models_match_unsharded():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the device tool's nvidia-h100-x2 kind)")
    cases = [("builtin", "dense", torch.float16), ("builtin", "w4a16", torch.float16),
             ("builtin", "nf4", torch.bfloat16), ("builtin", "w4a16-act-order", torch.float16)]
    try:
        import transformers  # noqa: F401
        cases.append(("hf", "w4a16", torch.float16))
    except ImportError:
        pass
    _spawn(2, "nccl", cases)


def test_layer_level_gather_and_full_input(tmp_path):
    """ColumnParallelLinear(gather_output=True) and RowParallelLinear(input_is_parallel=False) on gloo."""
    mp.start_processes(_layer_worker, args=(2, f"file://{tmp_path}/store"), nprocs=2, join=True, start_method="spawn")


def _layer_worker(rank: int, world: int, init: str):
    _enter("gloo", init, rank, world)
    try:
        g = torch.Generator().manual_seed(2)
        dense = nn.Linear(256, 512, bias=True)
        with torch.no_grad():
            dense.weight.copy_(torch.randn(512, 256, generator=g) * 0.05)
            dense.bias.copy_(torch.randn(512, generator=g))
        layer = W4A16Linear.from_linear(dense, group_size=128, clip_search=False)
        nf4 = NF4Linear.from_linear(dense.to(torch.bfloat16), blocksize=64)
        x = torch.randn(3, 5, 256, generator=g, dtype=torch.float16)
        for full, xin in ((layer, x), (nf4, x.to(torch.bfloat16))):
            want = full(xin).float()
            col = tp.ColumnParallelLinear.from_layer(full, gather_output=True)
            assert rel_err(col(xin), want) < 2e-3
            row = tp.RowParallelLinear.from_layer(_transpose_like(full), input_is_parallel=False)
            y = row(want.to(xin.dtype))  # a 512 -> 256 layer on the full input
            ref = _transpose_like(full)(want.to(xin.dtype)).float()
            assert rel_err(y, ref) < 1e-2
    finally:
        dist.destroy_process_group()
    _leave()


def _transpose_like(layer):
    """A W4A16 layer of the transposed shape (k 512, n 256), from the layer's own dequantized weight."""
    dense = nn.Linear(layer.out_features, layer.in_features, bias=False, dtype=torch.float32)
    with torch.no_grad():
        dense.weight.copy_(layer.weight.dequantize().float().t())
    return W4A16Linear.from_linear(dense, group_size=128, dtype=layer.scales.dtype, clip_search=False)


def test_bench_e2e_tp_on_gloo(tmp_path):
    """`tilefish bench e2e --tp 1,2`'s harness on a tiny model: both TP sizes of every variant timed, the
    sharded logits checked against the unsharded model, ratios against TP 1 and against fp16."""
    out = tmp_path / "report.json"
    mp.start_processes(_bench_worker, args=(2, f"file://{tmp_path}/store", str(out)), nprocs=2, join=True,
                       start_method="spawn")
    from tilefish.bench.report import Report

    rep = Report.from_json(out)
    got = {(r.extra["tp"], r.extra["impl"], r.extra["batch"]) for r in rep.rows}
    assert got == {(t, i, b) for t in (1, 2) for i in ("fp16", "w4a16", "tilefish-nf4") for b in (1, 2)}
    assert all("TP 1" in r.ratios for r in rep.rows if r.extra["tp"] == 2)
    assert all("fp16 same TP" in r.ratios for r in rep.rows if r.extra["impl"] != "fp16")
    checks = [n for n in rep.notes if "logits vs the unsharded model" in n]
    assert len(checks) == 3 and not any("LARGE" in n for n in checks), checks
    assert any(n.startswith("Against the targets") for n in rep.notes)


def _bench_worker(rank: int, world: int, init: str, out: str):
    from tilefish.bench import e2e_tp

    _enter("gloo", init, rank, world)
    try:
        rep = e2e_tp.run([1, 2], batches=(1, 2), context=8, reps=2, config=TINY, backend="eager", model="builtin")
        if rank == 0:
            rep.to_json(out)
        else:
            assert not rep.rows  # rank 0 reports
    finally:
        dist.destroy_process_group()
    _leave()


def test_cli_tp_flags_reach_the_tp_bench(monkeypatch):
    import argparse

    from tilefish.bench import e2e_tp
    from tilefish.bench.families import FAMILIES
    from tilefish.bench.report import Report

    calls = []
    monkeypatch.setattr(e2e_tp, "run", lambda tps, **kw: calls.append((tps, kw)) or Report("tp"))
    args = argparse.Namespace(family="e2e", tp="1,2", impls="fp16,w4a16,nf4", layers=8, batches=None, context=256,
                              modes=None, model="builtin", reps=9, prefill="512", lm_head="dense")
    FAMILIES["e2e"].run(args)
    tps, kw = calls[-1]
    assert tps == [1, 2] and kw["batches"] == [1, 16] and kw["modes"] == ["compiled"]
    assert kw["impls"] == ["fp16", "w4a16", "nf4"]  # e2e_tp.run notes that it skips bitsandbytes' nf4
    with pytest.raises(ValueError, match="needs that many processes"):
        e2e_tp.check_tp_sizes([1, 4], world=2)


@pytest.mark.parametrize("case", ["gptq-g128", "gptq-act-order-g32"])
def test_gloo_load_sharded_checkpoint(tmp_path, case):
    """load_sharded: each rank loads a GPTQ checkpoint (act-order too) and keeps its shards; the sharded
    model's logits match the unsharded load."""
    transformers = pytest.importorskip("transformers")
    from test_checkpoint import Fmt, llama_reference, write_checkpoint

    fmt = {"gptq-g128": Fmt(group_size=128), "gptq-act-order-g32": Fmt(group_size=32, sym=False, desc_act=True)}[case]
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    directory = write_checkpoint(tmp_path / "ckpt", llama_reference(config), fmt, config=config.to_dict())
    mp.start_processes(_load_worker, args=(2, f"file://{tmp_path}/store", str(directory), fmt.desc_act), nprocs=2,
                       join=True, start_method="spawn")


def _load_worker(rank: int, world: int, init: str, directory: str, act_order: bool):
    from tilefish.checkpoint import load_quantized

    _enter("gloo", init, rank, world)
    try:
        ids = torch.randint(256, (2, 9), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            whole, _ = load_quantized(directory)
            want = whole(ids).logits.float()
            model, report = tp.load_sharded(directory)
            got = model(ids).logits.float()
        row = model.model.layers[0].mlp.down_proj
        assert isinstance(row, tp.RowParallelLinear) and (row.input_index is not None) == act_order
        assert len(report.row) == 4, report
        err = rel_err(got, want)
        assert err < TP_TOL[torch.float16], f"rank {rank}: sharded checkpoint logits rel err {err:.3g}"
    finally:
        dist.destroy_process_group()
    _leave()
