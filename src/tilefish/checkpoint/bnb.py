"""bitsandbytes 4-bit nf4 Linears in a checkpoint: the Linear4bit entries each X stores, checked from the headers
and the quant-state JSON (layout in tilefish.quant.nf4)."""
from __future__ import annotations

import json
import math

import torch
from torch import nn

from .files import _Checkpoint
from .formats import CheckpointError, QuantFormat
from .linears import FLOAT_DTYPES, WHY_REQUIRED, check_tileable

# role -> the name under the Linear X of the tensor bitsandbytes' Linear4bit stores
BNB_QUANT_STATE = "weight.quant_state.bitsandbytes__"
BNB_ENTRIES = {"weight": "weight", "absmax": "weight.absmax", "quant_map": "weight.quant_map",
               "nested_absmax": "weight.nested_absmax", "nested_quant_map": "weight.nested_quant_map",
               "quant_state": BNB_QUANT_STATE + "nf4", "bias": "bias"}
BNB_MARKERS = ("weight.absmax", "weight.quant_map", "weight.nested_absmax", "weight.nested_quant_map",
               BNB_QUANT_STATE)  # an X.<marker...> tensor makes X a bitsandbytes 4-bit layer


def read_quant_state(ckpt: _Checkpoint, tname: str) -> dict:
    """A bitsandbytes quant-state tensor: UTF-8 JSON bytes (a few hundred; read while planning)."""
    info = ckpt.tensors[tname]
    if info.dtype != torch.uint8 or len(info.shape) != 1:
        raise CheckpointError(f"{ckpt.where(tname)}: dtype {info.dtype}, shape {info.shape}; bitsandbytes stores "
                              "its quant state as 1-D uint8 JSON bytes")
    try:
        meta = json.loads(bytes(ckpt.load(tname).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{ckpt.where(tname)}: not valid UTF-8 JSON ({e})") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{ckpt.where(tname)}: holds JSON {type(meta).__name__}, not an object")
    return meta


def plan_bnb_layer(name: str, linear: nn.Linear, ckpt: _Checkpoint, fmt: QuantFormat) -> dict[str, str]:
    """role -> checkpoint tensor name for the bitsandbytes 4-bit Linear ``name``, after checking the headers and
    its quant-state JSON against the model (the values are checked when the layer is built)."""
    from ..quant.nf4 import NESTED_BLOCKSIZE, SUPPORTED_BLOCKSIZES

    tensors = {role: f"{name}.{entry}" for role, entry in BNB_ENTRIES.items()}
    qs = tensors["quant_state"]
    if qs not in ckpt.tensors:
        other = sorted(t for t in ckpt.tensors if t.startswith(f"{name}.{BNB_QUANT_STATE}"))
        if other:
            raise CheckpointError(f"{ckpt.where(other[0])}: quant type {other[0].rpartition('__')[2]!r} is not "
                                  "supported; tilefish loads bitsandbytes' nf4 (not fp4)")
        marker = next(t for t in ckpt.tensors if t.startswith(f"{name}.weight"))
        raise CheckpointError(f"{ckpt.tensors[marker].file}: tensor {qs!r} is missing (every bitsandbytes 4-bit "
                              f"layer stores it; {marker!r} is there)")
    where = ckpt.where(qs)
    check_tileable(name, linear.in_features, linear.out_features, where)
    k, n = linear.in_features, linear.out_features
    meta = read_quant_state(ckpt, qs)

    def bad(field: str, rule: str) -> CheckpointError:
        return CheckpointError(f"{where}: JSON {field} = {meta.get(field)!r}: {rule}")

    if meta.get("quant_type") != "nf4":
        raise bad("quant_type", "tilefish loads bitsandbytes' nf4")
    if meta.get("shape") != [n, k]:
        raise bad("shape", f"the model's nn.Linear {name!r} is [out_features, in_features] = [{n}, {k}]")
    blocksize = meta.get("blocksize")
    if isinstance(blocksize, bool) or blocksize not in SUPPORTED_BLOCKSIZES:
        raise bad("blocksize", f"bitsandbytes block sizes are {SUPPORTED_BLOCKSIZES}")
    if meta.get("dtype") not in ("float16", "bfloat16", "float32"):
        raise bad("dtype", "must name float16, bfloat16 or float32")
    nested = "nested_offset" in meta
    nblocks = n * k // blocksize  # exact: the tileable n and k make n k a multiple of 8192
    expected = {"weight": None, "absmax": ((torch.uint8,) if nested else FLOAT_DTYPES, (nblocks,)),
                "quant_map": ((torch.float32,), (16,))}
    if nested:
        expected |= {"nested_absmax": ((torch.float32,), (-(-nblocks // NESTED_BLOCKSIZE),)),
                     "nested_quant_map": ((torch.float32,), (256,))}
    if linear.bias is not None:
        expected["bias"] = (FLOAT_DTYPES, (n,))
    for role in ("nested_absmax", "nested_quant_map", "bias"):  # stored but not expected
        if role not in expected and tensors[role] in ckpt.tensors:
            why = (f"the model's nn.Linear {name!r} has no bias" if role == "bias" else
                   f"the quant state {qs!r} has no nested_offset (not double-quantized)")
            raise CheckpointError(f"{ckpt.where(tensors[role])}: unexpected: {why}")
    planned = {"quant_state": qs}
    for role, rule in expected.items():
        tname = tensors[role]
        info = ckpt.tensors.get(tname)
        if info is None:
            why = {"bias": WHY_REQUIRED["bias"], "nested_absmax": f"{qs!r} has nested_offset (double quant)",
                   "nested_quant_map": f"{qs!r} has nested_offset (double quant)"}.get(
                role, "every bitsandbytes 4-bit layer stores it")
            raise CheckpointError(f"{ckpt.tensors[qs].file}: tensor {tname!r} is missing ({why})")
        if role == "weight":  # packed codes, two a byte, in any storage dtype (bitsandbytes' quant_storage)
            size = getattr(info.dtype, "itemsize", None)
            if size is None or math.prod(info.shape) * size != n * k // 2:
                raise CheckpointError(f"{ckpt.where(tname)}: dtype {info.dtype}, shape {info.shape} does not hold "
                                      f"n * k / 2 = {n * k // 2} bytes (two NF4 codes a byte) for nn.Linear {name!r} "
                                      f"(in_features k = {k}, out_features n = {n})")
        else:
            dtypes, shape = rule
            if info.dtype not in dtypes:
                want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise CheckpointError(f"{ckpt.where(tname)}: dtype {info.dtype} is wrong; bitsandbytes {role} is {want}")
            if info.shape != shape:
                raise CheckpointError(f"{ckpt.where(tname)}: shape {info.shape} is wrong; bitsandbytes {role} is "
                                      f"{shape} for nn.Linear {name!r} (n = {n}, k = {k}, blocksize {blocksize}"
                                      f"{', double quant' if nested else ''})")
        planned[role] = tname
    return planned

