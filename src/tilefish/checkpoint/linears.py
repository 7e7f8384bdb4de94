"""Quantized Linears in a checkpoint (GPTQ, AWQ, compressed-tensors pack-quantized): the tensors each X stores,
checked from the headers against the Linear's shape; the W4A16 weight built from them. The per-expert Linears of
MoE checkpoints (experts.py) are planned and built by the same functions. Layouts: tilefish.quant.int4 (GPTQ,
AWQ) and tilefish.quant.compressed."""
from __future__ import annotations

import torch

from .files import _Checkpoint
from .formats import CheckpointError, QuantFormat

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_INDEX_DTYPES = (torch.int32, torch.int64)
# the tensors one quantized Linear X stores as X.<role>, and the dtypes each may have
ROLE_DTYPES = {
    "qweight": (torch.int32,), "qzeros": (torch.int32,), "scales": FLOAT_DTYPES, "g_idx": INT_INDEX_DTYPES,
    "bias": FLOAT_DTYPES, "weight_packed": (torch.int32,), "weight_scale": FLOAT_DTYPES,
    "weight_zero_point": (torch.int32,), "weight_g_idx": INT_INDEX_DTYPES, "weight_shape": INT_INDEX_DTYPES,
}
ROLES = {"gptq": ("qweight", "qzeros", "scales", "g_idx", "bias"), "awq": ("qweight", "qzeros", "scales", "bias"),
         "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape",
                                "bias")}
MARKER = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}   # X.<marker>: X is quantized
SCALES = {"gptq": "scales", "awq": "scales", "compressed-tensors": "weight_scale"}
WHY_REQUIRED = {"g_idx": "desc_act (act-order) is set in config.json", "bias": "the model's nn.Linear has a bias",
                "weight_zero_point": "the scheme is asymmetric (symmetric: false in config.json)"}


def check_tileable(name: str, k: int, n: int, where: str, what: str = "nn.Linear") -> None:
    """The W4A16 kernels tile n by 64 and k by 64 (ops/w4a16/layout.py check_shape; the group size is
    checked against k where the scales are read)."""
    from ..ops.w4a16.layout import K_MULTIPLE

    if n % 64 or k % K_MULTIPLE:
        raise CheckpointError(f"{where}: the W4A16 kernel cannot tile {what} {name!r} (in_features k = {k}, "
                              f"out_features n = {n}): it needs n % 64 == 0 and k % {K_MULTIPLE} == 0")


def expected_shapes(fmt: QuantFormat, k: int, n: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """role -> (shape, its formula) for a Linear(k, n)."""
    groups = 1 if fmt.group_size == -1 else k // fmt.group_size
    if fmt.method == "compressed-tensors":
        return {"weight_packed": ((n, k // 8), "[n, k/8]"), "weight_scale": ((n, groups), "[n, k/G]"),
                "weight_zero_point": ((-(-n // 8), groups), "[ceil(n/8), k/G]"), "weight_g_idx": ((k,), "[k]"),
                "weight_shape": ((2,), "[2]"), "bias": ((n,), "[n]")}
    qweight = ((k // 8, n), "[k/8, n]") if fmt.method == "gptq" else ((k, n // 8), "[k, n/8]")
    return {"qweight": qweight, "qzeros": ((groups, n // 8), "[k/G, n/8]"), "scales": ((groups, n), "[k/G, n]"),
            "g_idx": ((k,), "[k]"), "bias": ((n,), "[n]")}


def plan_linear(name: str, k: int, n: int, has_bias: bool, ckpt: _Checkpoint, fmt: QuantFormat,
                what: str = "nn.Linear") -> dict[str, str]:
    """role -> checkpoint tensor name for the quantized Linear ``name`` (in_features k, out_features n), after
    checking every header. what: how errors call the layer (an expert's projection says which)."""
    marker = f"{name}.{MARKER[fmt.method]}"
    check_tileable(name, k, n, ckpt.where(marker), what)
    required = {MARKER[fmt.method], SCALES[fmt.method]}
    if fmt.method == "compressed-tensors":
        required |= set() if fmt.symmetric else {"weight_zero_point"}
    else:
        required |= {"qzeros"} | ({"g_idx"} if fmt.desc_act else set())
    if has_bias:
        required.add("bias")
    expected = expected_shapes(fmt, k, n)
    tensors = {}
    for role in ROLES[fmt.method]:
        tname = f"{name}.{role}"
        info = ckpt.tensors.get(tname)
        if info is None:
            if role in required:
                raise CheckpointError(f"{ckpt.tensors[marker].file}: tensor {tname!r} is missing "
                                      f"({WHY_REQUIRED.get(role, 'every quantized layer stores it')})")
            continue
        where = ckpt.where(tname)
        if role == "bias" and not has_bias:
            raise CheckpointError(f"{where}: the model's {what} {name!r} has no bias")
        if role == "weight_zero_point" and fmt.symmetric:
            raise CheckpointError(f"{where}: unexpected: the scheme is symmetric (config.json), which stores no zero "
                                  "points")
        if info.dtype not in ROLE_DTYPES[role]:
            want = " or ".join(str(d).removeprefix("torch.") for d in ROLE_DTYPES[role])
            raise CheckpointError(f"{where}: dtype {info.dtype} is wrong; {fmt.method} {role} is {want}")
        shape, formula = expected[role]
        if info.shape != shape:
            context = (f"group_size {fmt.group_size} (config.json)" if role in ("qzeros", "scales", "weight_scale",
                                                                               "weight_zero_point")
                       else f"the model's {what} {name!r}")
            raise CheckpointError(
                f"{where}: shape {info.shape} disagrees with in_features k = {k}, out_features n = {n} of {what} "
                f"{name!r}: {fmt.method} {role} is {formula} = {shape} for {context}")
        tensors[role] = tname
    return tensors


def int4_weight(tensors: dict[str, torch.Tensor], fmt: QuantFormat, dtype: torch.dtype, n: int, k: int):
    """The W4A16Weight [n, k] of one Linear's loaded GPTQ / AWQ / compressed-tensors tensors (scales in dtype).
    A value the headers cannot show (zero points, g_idx groups, weight_shape) raises ValueError."""
    from .. import w4a16

    if fmt.method == "gptq":
        return w4a16.from_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"].to(dtype), tensors.get("g_idx"),
                               zero_convention=fmt.zero_convention, group_size=fmt.group_size)
    if fmt.method == "awq":
        return w4a16.from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"].to(dtype),
                              group_size=fmt.group_size)
    from ..quant.compressed import from_pack_quantized

    shape = tensors.get("weight_shape")
    if shape is not None and shape.tolist() != [n, k]:
        raise ValueError(f"weight_shape holds {shape.tolist()}, not the layer's [out_features, in_features] = {[n, k]}")
    q, perm = from_pack_quantized(tensors["weight_packed"], tensors["weight_scale"].to(dtype),
                                  tensors.get("weight_zero_point"), tensors.get("weight_g_idx"),
                                  group_size=fmt.group_size)
    return w4a16.pack(q, perm)


def build_linear(name: str, tensors: dict[str, torch.Tensor], fmt: QuantFormat, dtype: torch.dtype, linear):
    """The tilefish layer replacing the nn.Linear ``linear`` (a W4A16Linear, or an NF4Linear for bitsandbytes)."""
    from ..nn import NF4Linear, W4A16Linear

    if fmt.method == "bitsandbytes":  # the entries under their checkpoint names: nf4.from_state_dict checks values
        from .bnb import BNB_ENTRIES

        entries = {f"{name}.{BNB_ENTRIES[role]}": t for role, t in tensors.items()}
        return NF4Linear.from_state_dict(entries, prefix=f"{name}.", dtype=dtype)
    bias = tensors.get("bias")
    weight = int4_weight(tensors, fmt, dtype, linear.out_features, linear.in_features)
    return W4A16Linear.from_weight(weight, None if bias is None else bias.to(dtype))
