"""MoE experts in a checkpoint, loaded into tilefish.experts.QuantizedExperts in place of the model's dense
experts module X (transformers 5: 3-D gate_up_proj / down_proj):

* gpt-oss MXFP4 (quant_method "mxfp4"): X.gate_up_proj_blocks uint8 [E, 2I, H/32, 16] and X.gate_up_proj_scales
  uint8 [E, 2I, H/32] (the [n, k] orientation, rows gate / up interleaved), X.down_proj_blocks [E, H, I/32, 16],
  X.down_proj_scales [E, H, I/32], and the biases X.gate_up_proj_bias [E, 2I], X.down_proj_bias [E, H]
  (byte order in tilefish.quant.mxfp4; transformers' integrations/mxfp4.py reads the same bytes).
* GPTQ / AWQ / compressed-tensors: one quantized Linear per expert and projection, X.<e>.<proj>.<role>, with
  <proj> Mixtral's w1 (gate) / w3 (up) / w2 (down) or gate_proj / up_proj / down_proj (Qwen-MoE, DeepSeek), each
  planned and built as a Linear (linears.py); gate and up rows are joined per expert, gate first.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from .files import _Checkpoint
from .formats import CheckpointError, QuantFormat
from .linears import FLOAT_DTYPES, MARKER, check_tileable, int4_weight, plan_linear

PARTS = ("gate", "up", "down")
# the per-expert projection names of each naming scheme, in PARTS order
EXPERT_SCHEMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))
_EXPERT_LINEAR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<proj>\w+)$")
MXFP4_SUFFIXES = ("_blocks", "_scales")


def expert_linear(name: str) -> tuple[str, int, str] | None:
    """'...experts.3.w1' -> ('...experts', 3, 'w1'); None for another name."""
    m = _EXPERT_LINEAR.match(name)
    return None if m is None else (m["experts"], int(m["index"]), m["proj"])


def _layout(name: str, module: nn.Module, where: str):
    from ..experts import dense_layout

    try:
        return dense_layout(module)
    except ValueError as e:
        raise CheckpointError(f"{where}: the model's experts module {name!r} cannot hold 4-bit experts: {e}") from e


def plan_experts(name: str, module: nn.Module, stored: dict[tuple[int, str], str], ckpt: _Checkpoint,
                 fmt: QuantFormat) -> dict[str, str]:
    """'<e>.<part>.<role>' -> tensor, for the per-expert Linears ``stored`` ((index, projection) -> a marker
    tensor) of the experts module ``name``: every expert and projection present, each checked as a Linear."""
    first = next(iter(stored.values()))
    layout = _layout(name, module, ckpt.where(first))
    hidden, inter = layout.hidden, layout.intermediate
    if layout.has_bias:
        raise CheckpointError(f"{ckpt.where(first)}: the model's experts module {name!r} has biases; per-expert "
                              f"{fmt.method} checkpoints of experts with biases are not supported")
    names = {proj for _, proj in stored}
    schemes = [s for s in EXPERT_SCHEMES if names <= set(s)]
    if not schemes:
        raise CheckpointError(f"{ckpt.where(first)}: experts {name!r} store projections {sorted(names)}; tilefish "
                              "reads w1 / w3 / w2 (Mixtral) or gate_proj / up_proj / down_proj, one set per module")
    plan = {}
    for (index, _), tname in stored.items():
        if index >= layout.num_experts:
            raise CheckpointError(f"{ckpt.where(tname)}: expert {index} of {name!r}, whose model module holds "
                                  f"{layout.num_experts} experts")
    for e in range(layout.num_experts):
        for proj, part in zip(schemes[0], PARTS):
            linear = f"{name}.{e}.{proj}"
            if (e, proj) not in stored:
                missing = f"{linear}.{MARKER[fmt.method]}"
                raise CheckpointError(f"{ckpt.tensors[first].file}: tensor {missing!r} is missing "
                                      f"(the model's experts module {name!r} holds {layout.num_experts} experts, "
                                      "each with gate, up and down projections)")
            k, n = (inter, hidden) if part == "down" else (hidden, inter)
            roles = plan_linear(linear, k, n, False, ckpt, fmt, what=f"expert {e}'s {part} projection")
            plan.update({f"{e}.{part}.{role}": tname for role, tname in roles.items()})
    return plan


def plan_mxfp4_experts(name: str, module: nn.Module, marker: str, ckpt: _Checkpoint) -> dict[str, str]:
    """role -> tensor of the gpt-oss MXFP4 experts of ``name`` (module docstring), headers checked; ``marker``
    is one of its *_blocks / *_scales tensors."""
    layout = _layout(name, module, ckpt.where(marker))
    e, hidden, inter = layout.num_experts, layout.hidden, layout.intermediate
    check_tileable(name, hidden, 2 * inter, ckpt.where(marker), "the gate_up projection of experts")
    check_tileable(name, inter, hidden, ckpt.where(marker), "the down projection of experts")
    if hidden % 32 or inter % 32:
        raise CheckpointError(f"{ckpt.where(marker)}: MXFP4 blocks are 32 wide: hidden {hidden} and intermediate "
                              f"{inter} must be multiples of 32")
    expected = {"gate_up_proj_blocks": (torch.uint8, (e, 2 * inter, hidden // 32, 16)),
                "gate_up_proj_scales": (torch.uint8, (e, 2 * inter, hidden // 32)),
                "down_proj_blocks": (torch.uint8, (e, hidden, inter // 32, 16)),
                "down_proj_scales": (torch.uint8, (e, hidden, inter // 32))}
    if layout.has_bias:
        expected |= {"gate_up_proj_bias": (FLOAT_DTYPES, (e, 2 * inter)), "down_proj_bias": (FLOAT_DTYPES, (e, hidden))}
    plan = {}
    for role, (dtype, shape) in expected.items():
        tname = f"{name}.{role}"
        info = ckpt.tensors.get(tname)
        if info is None:
            raise CheckpointError(f"{ckpt.tensors[marker].file}: tensor {tname!r} is missing (MXFP4 experts store "
                                  f"{', '.join(expected)})")
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if info.dtype not in dtypes:
            raise CheckpointError(f"{ckpt.where(tname)}: dtype {info.dtype} is wrong; MXFP4 {role} is "
                                  f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)}")
        if info.shape != shape:
            raise CheckpointError(f"{ckpt.where(tname)}: shape {info.shape} disagrees with the model's experts module "
                                  f"{name!r} (E = {e}, hidden H = {hidden}, intermediate I = {inter}): {role} is "
                                  f"{shape}")
        plan[role] = tname
    for role in ("gate_up_proj_bias", "down_proj_bias"):
        if not layout.has_bias and f"{name}.{role}" in ckpt.tensors:
            raise CheckpointError(f"{ckpt.where(f'{name}.{role}')}: the model's experts module {name!r} has no bias")
    return plan


def build_experts(name: str, module: nn.Module, tensors: dict[str, torch.Tensor], fmt: QuantFormat,
                  dtype: torch.dtype):
    """The QuantizedExperts replacing the dense experts ``module`` from its loaded tensors (role -> tensor)."""
    from ..experts import QuantizedExperts, dense_layout, dense_template

    layout = dense_layout(module)
    if fmt.method == "mxfp4":
        gate_up, down, biases = _mxfp4_weights(tensors, layout, dtype)
    else:
        (gate_up, down), biases = _int4_weights(tensors, fmt, layout, dtype), (None, None)
    layer = QuantizedExperts(gate_up, down, layout.activation, *biases, template=dense_template(module),
                             storage=layout)
    layer.copy_attributes(module)
    return layer


def _mxfp4_weights(tensors, layout, dtype):
    from ..ops.expert_weights import ExpertWeights
    from ..ops.w4a16 import pack
    from ..quant import mxfp4

    def rows_gate_first(t):  # gpt-oss interleaves gate / up rows; the op wants gate rows, then up rows
        return torch.cat([t[:, 0::2], t[:, 1::2]], 1) if layout.interleaved else t

    weights = []
    for proj in ("gate_up_proj", "down_proj"):
        q = mxfp4.from_blocks(tensors[f"{proj}_blocks"], tensors[f"{proj}_scales"])
        if proj == "gate_up_proj":
            q = mxfp4.MXFP4Weight(rows_gate_first(q.codes), rows_gate_first(q.exponents))
        experts = [pack(mxfp4.to_int4_weight(mxfp4.MXFP4Weight(q.codes[e], q.exponents[e]), dtype), codebook="mxfp4")
                   for e in range(q.codes.shape[0])]
        weights.append(ExpertWeights.stack(experts))
    biases = (None, None)
    if layout.has_bias:
        biases = (rows_gate_first(tensors["gate_up_proj_bias"]).to(dtype), tensors["down_proj_bias"].to(dtype))
    return weights[0], weights[1], biases


def _int4_weights(tensors, fmt, layout, dtype):
    """(gate_up, down) ExpertWeights from the per-expert Linears' tensors ('<e>.<part>.<role>' -> tensor)."""
    from ..ops.expert_weights import ExpertWeights, join_rows

    hidden, inter = layout.hidden, layout.intermediate
    gate_up, down = [], []
    for e in range(layout.num_experts):
        parts = {}
        for part in PARTS:
            roles = {key.split(".", 2)[2]: t for key, t in tensors.items() if key.startswith(f"{e}.{part}.")}
            n, k = (hidden, inter) if part == "down" else (inter, hidden)
            w = int4_weight(roles, fmt, dtype, n, k)
            if w.perm is not None:
                raise ValueError(f"expert {e}'s {part} projection has an act-order g_idx: the grouped expert kernel "
                                 "reads x in one order for every expert (act-order MoE checkpoints are not supported)")
            parts[part] = w
        gate_up.append(join_rows([parts["gate"], parts["up"]]))
        down.append(parts["down"])
    return ExpertWeights.stack(gate_up), ExpertWeights.stack(down)
