"""The safetensors files of a checkpoint directory: headers read on opening, tensors one at a time.

Tensors are known by the names the model gives them: a checkpoint written for an older module tree (Mixtral's
``block_sparse_moe``, now ``mlp`` in transformers 5) is renamed once (``rename_to_model``); errors name the
stored name.
"""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .formats import CheckpointError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_EXTRA = "pip install tilefish[hf]"

# safetensors header dtype codes -> torch dtypes (a code missing here is reported as unsupported)
_SAFETENSORS_DTYPES = {
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool,
}
# module path renames transformers applies when loading older checkpoints: (stored part, the model's part)
LEGACY_RENAMES = ((".block_sparse_moe.", ".mlp."),)


@dataclass(frozen=True)
class _TensorInfo:
    file: str                           # the file holding the tensor (named in errors)
    shape: tuple[int, ...]
    dtype: torch.dtype | str            # str: a safetensors dtype code torch has no counterpart for here
    stored: str = ""                    # the name in the file, where the model's name differs


class _Checkpoint:
    """The tensors of a checkpoint directory: every header is read on opening, data one tensor at a time."""

    def __init__(self, directory: Path, stack: ExitStack):
        self._directory, self._stack = directory, stack
        self._handles = {}                                  # file name -> open safe_open handle
        self.tensors: dict[str, _TensorInfo] = {}
        if (directory / SINGLE_FILE).is_file():
            self.source = SINGLE_FILE                       # the file errors about the whole checkpoint name
            self._add_file(SINGLE_FILE, None)
        elif (directory / INDEX_FILE).is_file():
            self.source = INDEX_FILE
            for shard, names in self._read_index().items():
                self._add_file(shard, names)
        else:
            raise CheckpointError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found (tilefish loads "
                                  "safetensors checkpoints)")

    def _read_index(self) -> dict[str, list[str]]:
        """shard file -> the tensor names the index places in it; every shard must exist."""
        try:
            weight_map = json.loads((self._directory / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{INDEX_FILE}: unreadable index, no weight_map ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{INDEX_FILE}: weight_map must map tensor names to shard file names")
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
        for shard, names in shards.items():
            if not (self._directory / shard).is_file():
                raise CheckpointError(f"{INDEX_FILE}: weight_map puts tensor {names[0]!r} in shard {shard!r}, "
                                      f"which does not exist in {self._directory}")
        return shards

    def _add_file(self, file: str, names: list[str] | None) -> None:
        """Open one file and record the headers of ``names`` (all of its tensors when None)."""
        try:
            from safetensors import SafetensorError, safe_open
        except ImportError as e:
            raise ImportError(f"tilefish.load_quantized reads safetensors files; {HF_EXTRA}") from e
        try:
            handle = self._stack.enter_context(safe_open(str(self._directory / file), framework="pt"))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: not a readable safetensors file, corrupt or truncated ({e})") from e
        self._handles[file] = handle
        present = handle.keys()
        for name in present if names is None else names:
            if name not in present:
                raise CheckpointError(f"{INDEX_FILE}: weight_map puts tensor {name!r} in {file}, which has no "
                                      "such tensor")
            piece = handle.get_slice(name)
            code = piece.get_dtype()
            self.tensors[name] = _TensorInfo(file, tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(code, code))

    def where(self, name: str) -> str:
        info = self.tensors[name]
        return f"{info.file}: tensor {info.stored or name!r}"

    def load(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        return self._handles[info.file].get_tensor(info.stored or name)

    def rename_to_model(self, model: nn.Module) -> None:
        """Apply LEGACY_RENAMES where the checkpoint uses a module path the model does not have and the renamed
        one it has (each rename all or nothing)."""
        paths = {name for name, _ in model.named_modules()}
        for old, new in LEGACY_RENAMES:
            if any(old in f".{p}." for p in paths):
                continue
            moved = {n for n in self.tensors if old in f".{n}"}
            if not moved or not any(new in f".{p}." for p in paths):
                continue
            renamed = {}
            for n, info in self.tensors.items():
                target = f".{n}".replace(old, new, 1)[1:] if n in moved else n
                renamed[target] = replace(info, stored=info.stored or n) if n in moved else info
            if len(renamed) < len(self.tensors):
                clash = sorted(n for n in moved if f".{n}".replace(old, new, 1)[1:] in self.tensors)[0]
                raise CheckpointError(f"{self.where(clash)}: renamed {old.strip('.')!r} -> {new.strip('.')!r} for "
                                      "this model, it collides with a tensor stored under the new name")
            self.tensors = renamed

