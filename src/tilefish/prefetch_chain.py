"""A model's W4A16 layers linked in forward order (W4A16Linear.prefetch_next), so each decode GEMM asks L2
for the next one's weights as its own loads finish (ops/w4a16/prefetch.py): DRAM then streams them while the
latency-bound kernels between the two run (norms, rotary, attention, the activation).

The order is the modules' registration order, which is their forward order in the decoder architectures
transformers ships (q, k, v, o, gate, up, down per layer; lm_head last). A fused layer stands where its first
part (W4A16Slice) stands. MoE experts modules and dense layers are not links: the chain steps over them. A
wrong order costs bandwidth only; results never depend on it.
"""
from __future__ import annotations

from torch import nn

from .nn import FusedW4A16Linear, W4A16Linear, W4A16Slice


def forward_order(model: nn.Module) -> list[W4A16Linear]:
    """The W4A16 layers of `model` (NF4Linear and fused ones included) in the order their GEMMs run."""
    sliced = {id(m.fused) for m in model.modules() if isinstance(m, W4A16Slice)}
    order, seen = [], set()
    for m in model.modules():
        layer = m.fused if isinstance(m, W4A16Slice) else m
        if not isinstance(layer, W4A16Linear) or id(layer) in seen:
            continue
        if isinstance(m, FusedW4A16Linear) and id(m) in sliced:
            continue  # placed where its first slice is
        seen.add(id(layer))
        order.append(layer)
    return order


def link_weight_prefetch(model: nn.Module, enabled: bool = True) -> int:
    """Link each W4A16 layer of `model` to the one after it in forward_order (enabled=False: unlink them
    all). Returns the number of links. quantize_model and load_quantized call it (prefetch=False there
    leaves a model unlinked); call it again after replacing layers. Copies of a model (deepcopy, pickle)
    come unlinked."""
    order = forward_order(model)
    for layer in order:
        layer.set_prefetch_next(None)
    if not enabled:
        return 0
    for a, b in zip(order, order[1:]):
        a.set_prefetch_next(b)
    return max(0, len(order) - 1)
