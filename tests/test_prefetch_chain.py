"""tilefish.link_weight_prefetch: a model's W4A16 layers linked in the order their GEMMs run, what
quantize_model / load_quantized link, copies, and what torch.compile traces (CPU; the kernels' side is
tests/test_prefetch_gpu.py)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

import tilefish
from tilefish.nn import W4A16Linear
from tilefish.prefetch_chain import forward_order

transformers = pytest.importorskip("transformers")


def _llama(layers=2, seed=0):
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=320)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).half().eval()


def _names(model, layers):
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(layer)] for layer in layers]


def _links(model):
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(a)]: names[id(a.prefetch_next)] for a in forward_order(model) if a.prefetch_next is not None}


def test_quantize_model_links_the_gemms_in_forward_order():
    model = _llama()
    report = tilefish.quantize_model(model, skip=())
    per_layer = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    order = [f"model.layers.{i}.{p}" for i in range(2) for p in per_layer] + ["lm_head"]
    assert _names(model, forward_order(model)) == order
    assert _links(model) == dict(zip(order, order[1:]))
    assert report.prefetch_links == 8 and "L2 prefetch: 8" in str(report)


def test_unfused_parts_link_in_their_own_order():
    model = _llama(layers=1)
    tilefish.quantize_model(model, fuse=False)  # lm_head stays dense: the chain ends at down_proj
    parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    assert _names(model, forward_order(model)) == [f"model.layers.0.{p}" for p in parts]


def test_prefetch_false_and_unlinking_leave_no_link():
    model = _llama()
    report = tilefish.quantize_model(model, prefetch=False)
    assert report.prefetch_links == 0 and "L2 prefetch" not in str(report) and not _links(model)
    assert tilefish.link_weight_prefetch(model) == 7
    assert tilefish.link_weight_prefetch(model, enabled=False) == 0
    assert not _links(model) and all(layer._prefetch_prev is None for layer in forward_order(model))


def test_a_layer_has_one_predecessor_and_links_are_not_submodules():
    model = _llama(layers=1)
    tilefish.quantize_model(model)
    qkv, o, gate_up, down = forward_order(model)
    keys = set(model.state_dict())
    qkv.set_prefetch_next(gate_up)  # gate_up's old predecessor (o) loses its link
    assert o.prefetch_next is None and gate_up._prefetch_prev is qkv
    assert set(model.state_dict()) == keys
    assert all(name.count(".") <= 4 for name, _ in model.named_modules())  # no module reached twice
    assert len(list(model.modules())) == len({id(m) for m in model.modules()})
    with pytest.raises(TypeError, match="W4A16Linear"):
        qkv.set_prefetch_next(torch.nn.Linear(4, 4))


def test_copies_come_unlinked_and_still_compute_the_same():
    model = _llama(layers=1)
    tilefish.quantize_model(model)
    ids = torch.randint(0, 320, (1, 5))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert not _links(twin)
        with torch.no_grad():
            assert torch.equal(twin(ids).logits, model(ids).logits)
    assert len(_links(model)) == 3  # the original keeps its links


def test_compiled_graph_passes_each_layers_next_weight():
    """Under torch.compile each W4A16 op gets its next layer's packed weight and scales as inputs (so a
    CUDA graph captures their addresses), the last one none; one graph, results unchanged."""
    model = _llama()
    tilefish.quantize_model(model, skip=())
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids = torch.randint(0, 320, (1, 4))
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, backend=backend, fullgraph=True)(ids).logits
    assert torch.equal(got, want) and len(graphs) == 1
    calls = [n for n in graphs[0].graph.nodes if n.target is torch.ops.tilefish.w4a16_matmul.default]
    with_next = [n for n in calls if len(n.args) > 11 and n.args[11] is not None]
    assert len(calls) == 9 and len(with_next) == 8
