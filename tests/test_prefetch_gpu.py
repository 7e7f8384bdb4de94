"""The L2 prefetch of the next GEMM's weights (ops/w4a16/prefetch.py, tilefish.link_weight_prefetch) on the
GPU: a hint that never changes a result, in every kernel family, through every loop a user runs."""
from __future__ import annotations

import copy

import pytest
import torch

import tilefish
from tilefish.ops import w4a16 as ops
from tilefish.prefetch_chain import forward_order

from conftest import poison, rel_err

pytestmark = pytest.mark.gpu


def _weight(n, k, dtype, seed, group=128, sym=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tilefish.w4a16.quantize(torch.randn(n, k, device="cuda", generator=g), group, sym, dtype=dtype,
                                   clip_search=False)


def _forced_configs(cc: int):
    """One configuration of each kernel the GPU runs, with the rows it handles."""
    cases = [(ops.GemmConfig(1, 2, 4, 4), None, (1, 5, 16)), (ops.GemmConfig(2, 1, 8, 4), 3, (17, 40))]
    if cc == 90:
        cases += [(ops.SkinnyConfig(8, 2, 2, 4, 2), None, (1, 7)), (ops.SkinnyConfig(16, 2, 2, 6, 2), None, (13,)),
                  (ops.HopperConfig(64, 2, 1, 8), 3, (40, 64)), (ops.HopperConfig(64, 2, 2, 6, True), None, (64,))]
    return cases


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefetch_never_changes_the_result(dtype, seed):
    """Every kernel family (mma.sync with and without a k split; on sm_90 skinny, wgmma split and stream-K),
    the dispatcher's own plans from m = 1 to 65 (past PREFETCH_MAX_M: no prefetch), with the next weight
    larger than the prefetch cap or smaller: bitwise the launch without the prefetch."""
    w = _weight(512, 1024, dtype, seed)
    small = _weight(256, 512, dtype, seed + 1, group=64, sym=False)
    big = _weight(8192, 4096, dtype, seed + 2)  # 16.8 MB packed: above the cap on a GPU with < 34 MB of L2
    cc = torch.cuda.get_device_capability()[0] * 10 + torch.cuda.get_device_capability()[1]
    counters = ops.Workspace(torch.device("cuda")).counters
    for cfg, slices, ms in [(None, None, (1, 2, 9, 16, 33, 64, 65))] + _forced_configs(cc):
        for m in ms:
            x = torch.randn(m, 1024, device="cuda", dtype=dtype)
            kw = dict(cfg=cfg, slices=slices, workspace=counters)
            poison(torch.empty(m, 512, device="cuda", dtype=dtype))
            want = ops.matmul_impl(x, w, **kw)
            for nxt in (small, big, w):
                poison(torch.empty(m, 512, device="cuda", dtype=dtype))
                got = ops.matmul_impl(x, w, prefetch=nxt, **kw)
                assert torch.equal(got, want), (cfg, m, seed)
            ref = x.double() @ w.dequantize(torch.float64).T
            assert rel_err(want, ref) < (2e-3 if dtype == torch.float16 else 1.5e-2), (cfg, m, seed)


def test_prefetch_targets_it_cannot_use_are_left_out(seed):
    """A next weight on the CPU, strided or misaligned scales: the call runs as without a prefetch."""
    w = _weight(256, 512, torch.float16, seed)
    x = torch.randn(3, 512, device="cuda", dtype=torch.float16)
    want = ops.matmul_impl(x, w)
    cpu = ops.PrefetchTarget(w.packed.cpu(), w.scales.cpu())
    strided = ops.PrefetchTarget(w.packed, w.scales.t())
    offset = ops.PrefetchTarget(w.packed.view(-1)[1:], w.scales.view(-1)[3:])
    for target in (cpu, strided, offset):
        assert torch.equal(ops.matmul_impl(x, w, prefetch=target), want)
    assert ops.prefetch_args(cpu, x.device, 3) == ops.prefetch_args(None, x.device, 3)
    pp, pb, sp, sb = ops.prefetch_args(w, x.device, 3)
    assert (pp, int(pb), sp, int(sb)) == (w.packed.data_ptr(), w.packed.numel() * 4, w.scales.data_ptr(),
                                          w.scales.numel() * 2)
    with pytest.raises(TypeError, match="prefetch_next"):
        tilefish.w4a16.matmul(x, w, prefetch_next=w.packed)


def _llama(layers=2, seed=0):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).half().cuda().eval()
    report = tilefish.quantize_model(model, skip=())
    assert report.prefetch_links == 4 * layers  # qkv, o, gate_up, down a layer, then lm_head
    return model


def test_linked_model_matches_unlinked_in_every_loop(seed):
    """A linked model against the same model unlinked: eager, a manual CUDA graph, torch.compile
    (reduce-overhead: CUDA graph trees) and generate with the static cache, bitwise."""
    linked = _llama(seed=seed)
    plain = copy.deepcopy(linked)  # copies come unlinked
    assert all(layer.prefetch_next is None for layer in forward_order(plain))
    ids = torch.randint(0, 512, (1, 1), device="cuda")
    with torch.no_grad():
        assert torch.equal(linked(ids).logits, plain(ids).logits)
        x = torch.randn(1, 1, 512, device="cuda", dtype=torch.float16)
        outs = []
        for model in (linked, plain):
            body = model.model.layers[0]
            pos = torch.zeros(1, 1, dtype=torch.long, device="cuda")
            emb = model.model.rotary_emb(x, pos)
            body(x, position_embeddings=emb)  # warm-up: plans and kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = body(x, position_embeddings=emb)
            graph.replay()
            outs.append((out[0] if isinstance(out, tuple) else out).clone())
        assert torch.equal(outs[0], outs[1])
        compiled = [torch.compile(m, mode="reduce-overhead", fullgraph=True) for m in (linked, plain)]
        for _ in range(3):  # each output copied out before the other model's replay reuses the pool
            a, b = (c(ids).logits.clone() for c in compiled)
            assert torch.equal(a, b)
    prompt = torch.randint(0, 512, (1, 6), device="cuda")
    gen = [m.generate(prompt, max_new_tokens=8, do_sample=False, cache_implementation="static")
           for m in (linked, plain)]
    assert torch.equal(gen[0], gen[1])


def test_plans_follow_the_next_layers_weights(seed):
    """A layer's kept launch plans point at its next layer's weights: replacing them (a new tensor, .to)
    or relinking drops the plans that held the old ones; unlinking leaves none."""
    model = _llama(layers=1, seed=seed)
    qkv, o = forward_order(model)[:2]
    x = torch.randn(1, 512, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        want = qkv(x)
        (plan,) = qkv._plans.values()
        assert plan.prefetch[0] == o.packed.data_ptr()
        o.packed = o.packed.clone()
        assert not qkv._plans
        assert torch.equal(qkv(x), want)
        (plan,) = qkv._plans.values()
        assert plan.prefetch[0] == o.packed.data_ptr()
        tilefish.link_weight_prefetch(model, enabled=False)
        assert not qkv._plans and qkv.prefetch_next is None and o._prefetch_prev is None
        assert torch.equal(qkv(x), want)
        (plan,) = qkv._plans.values()
        assert plan.prefetch == ops.NO_PREFETCH
