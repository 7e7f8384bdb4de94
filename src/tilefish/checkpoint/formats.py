"""The checkpoint's format, read from config.json's ``quantization_config``: QuantFormat, CheckpointError."""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

import torch

GROUP_SIZES = (-1, 32, 64, 128)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
# checkpoint_format -> zero convention: v1 stores true zero - 1 (AutoGPTQ), v2 stores the true zero (GPTQModel)
_GPTQ_FORMATS = {"gptq": "v1", "gptq_v2": "v2"}
METHODS = ("gptq", "awq", "bitsandbytes", "mxfp4", "compressed-tensors")
COMPRESSED_FORMAT = "pack-quantized"    # compressed-tensors' int4 weights, eight to an int32
COMPRESSED_STRATEGIES = ("group", "channel")


class CheckpointError(ValueError):
    """A checkpoint tilefish cannot load; the message names the file, the tensor or config field, and the rule."""


@dataclass(frozen=True)
class QuantFormat:
    """What ``quantization_config`` says about the stored 4-bit layers."""

    method: str                                 # one of METHODS ("bitsandbytes": 4-bit nf4)
    group_size: int | None                      # -1 (one group over k), 32, 64, 128; mxfp4: 32; bitsandbytes: None
                                                # (each layer's quant-state JSON holds its blocksize)
    zero_convention: str | None = None          # GPTQ: "v1" or "v2"; AWQ stores true zeros (None)
    desc_act: bool = False                      # GPTQ act-order: every layer must carry g_idx
    modules_to_not_convert: tuple[str, ...] = ()
    skip_field: str = "modules_to_not_convert"  # the config field modules_to_not_convert came from
    compute_dtype: torch.dtype | None = None    # bitsandbytes' bnb_4bit_compute_dtype, when fp16 / bf16
    symmetric: bool = True                      # compressed-tensors: no zero points stored

    @classmethod
    def from_config(cls, config: dict, source: str) -> "QuantFormat":
        """Parse the ``quantization_config`` of ``config`` (the dict of ``source``, named in errors)."""
        qc = config.get("quantization_config")
        if not isinstance(qc, dict):
            raise CheckpointError(f"{source}: no quantization_config; not a quantized checkpoint")

        def fail(field: str, message: str) -> CheckpointError:
            return CheckpointError(f"{source}: quantization_config.{field} = {qc.get(field)!r}: {message}")

        method = qc.get("quant_method")
        if method is None and ("load_in_4bit" in qc or "load_in_8bit" in qc):
            method = "bitsandbytes"  # transformers' early BitsAndBytesConfig wrote no quant_method
        if method not in METHODS:
            raise fail("quant_method", f"not supported (tilefish loads {', '.join(map(repr, METHODS))}; "
                                       "bitsandbytes 4-bit nf4)")
        if method == "bitsandbytes":
            return cls._from_bitsandbytes(qc, source, fail)
        if method == "mxfp4":
            return cls("mxfp4", 32, modules_to_not_convert=_names(qc, "modules_to_not_convert", fail))
        if method == "compressed-tensors":
            return cls._from_compressed_tensors(qc, source, fail)
        if qc.get("bits") != 4:
            raise fail("bits", "only 4-bit checkpoints are supported")
        group_size = qc.get("group_size")
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise fail("group_size", f"the W4A16 kernel supports group sizes {GROUP_SIZES}")
        skip = _names(qc, "modules_to_not_convert", fail)
        if method == "gptq":
            checkpoint_format = qc.get("checkpoint_format", "gptq")
            if checkpoint_format not in _GPTQ_FORMATS:
                raise fail("checkpoint_format", "not supported (tilefish loads 'gptq' and 'gptq_v2'; marlin and "
                                                "exllama formats are repacked for other kernels)")
            return cls("gptq", group_size, _GPTQ_FORMATS[checkpoint_format], bool(qc.get("desc_act", False)), skip)
        version = qc.get("version", "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise fail("version", "not supported (tilefish loads the AWQ 'gemm' layout; gemv, exllama, marlin "
                                  "and ipex are packed differently)")
        if qc.get("zero_point", True) is not True:
            raise fail("zero_point", "AWQ GEMM checkpoints without zero points are not supported")
        return cls("awq", group_size, None, False, skip)

    @classmethod
    def _from_bitsandbytes(cls, qc: dict, source: str, fail) -> "QuantFormat":
        if qc.get("load_in_8bit") is True:
            raise fail("load_in_8bit", "8-bit (LLM.int8) checkpoints are not supported (tilefish loads bitsandbytes "
                                       "4-bit nf4)")
        if qc.get("load_in_4bit", qc.get("_load_in_4bit")) is not True:
            raise CheckpointError(f"{source}: quantization_config.quant_method = 'bitsandbytes' without load_in_4bit: "
                                  f"true (load_in_4bit = {qc.get('load_in_4bit')!r}); tilefish loads bitsandbytes "
                                  "4-bit nf4 checkpoints")
        quant_type = qc.get("bnb_4bit_quant_type")
        if quant_type != "nf4":
            absent = " (absent: transformers' default, fp4)" if quant_type is None else ""
            raise fail("bnb_4bit_quant_type", f"not supported{absent}; tilefish loads bitsandbytes' 'nf4', not 'fp4'")
        if not isinstance(qc.get("bnb_4bit_use_double_quant", False), bool):
            raise fail("bnb_4bit_use_double_quant", "must be true or false")
        skip = _names(qc, "llm_int8_skip_modules", fail)
        compute = getattr(torch, str(qc.get("bnb_4bit_compute_dtype")), None)
        # Whether a layer is double-quantized is read from its own tensors, as bitsandbytes does.
        return cls("bitsandbytes", None, modules_to_not_convert=skip, skip_field="llm_int8_skip_modules",
                   compute_dtype=compute if compute in ACTIVATION_DTYPES else None)

    @classmethod
    def _from_compressed_tensors(cls, qc: dict, source: str, fail) -> "QuantFormat":
        """compressed-tensors' "pack-quantized" W4A16: every config group quantizes weights only, 4-bit int,
        strategy "group" (group_size 32 / 64 / 128) or "channel", one scheme for all groups."""
        if qc.get("format") != COMPRESSED_FORMAT:
            raise fail("format", f"tilefish loads compressed-tensors' {COMPRESSED_FORMAT!r} (int4 weights, eight to "
                                 "an int32); other compressors store other formats")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise fail("config_groups", "must be a non-empty object of quantization schemes")
        scheme_args = None
        for group, scheme in groups.items():
            args = _compressed_scheme(scheme, f"quantization_config.config_groups.{group}", source)
            if scheme_args is not None and args != scheme_args:
                raise CheckpointError(f"{source}: quantization_config.config_groups.{group} quantizes weights as "
                                      f"(group_size, symmetric) = {args}, another group as {scheme_args}: tilefish "
                                      "loads one weight scheme per checkpoint")
            scheme_args = args
        group_size, symmetric = scheme_args
        return cls("compressed-tensors", group_size, modules_to_not_convert=_names(qc, "ignore", fail),
                   skip_field="ignore", symmetric=symmetric)

    def excludes(self, module_name: str) -> bool:
        """Whether ``modules_to_not_convert`` (``ignore``) covers the module: an entry matches whole dotted name
        parts (as in transformers, where "lm_head" or "mlp.down_proj" name every module containing them); an
        entry with ``*`` is a glob over the name or one of its dotted prefixes (gpt-oss's
        "model.layers.*.self_attn"); "re:<regex>" matches from the start of the name (compressed-tensors)."""
        parts = module_name.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        for entry in self.modules_to_not_convert:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
            elif "*" in entry:
                if any(fnmatch.fnmatchcase(p, entry) for p in prefixes):
                    return True
            elif f".{entry}." in f".{module_name}.":
                return True
        return False

    def describe(self) -> str:
        if self.method == "bitsandbytes":
            return "bitsandbytes nf4"
        if self.method == "awq":
            return "AWQ gemm"
        if self.method == "mxfp4":
            return "MXFP4"
        if self.method == "compressed-tensors":
            return f"compressed-tensors {COMPRESSED_FORMAT} {'sym' if self.symmetric else 'asym'}"
        return f"GPTQ {self.zero_convention}" + (", act-order" if self.desc_act else "")


def _names(qc: dict, field: str, fail) -> tuple[str, ...]:
    names = qc.get(field) or []
    if not isinstance(names, list) or not all(isinstance(s, str) for s in names):
        raise fail(field, "must be a list of module names")
    return tuple(names)


def _compressed_scheme(scheme, where: str, source: str) -> tuple[int, bool]:
    """(group_size, symmetric) of one compressed-tensors scheme, or a CheckpointError naming its field."""
    def fail(field: str, value, message: str) -> CheckpointError:
        return CheckpointError(f"{source}: {where}.{field} = {value!r}: {message}")

    if not isinstance(scheme, dict):
        raise fail("", scheme, "must be a quantization scheme object")
    if scheme.get("format") not in (None, COMPRESSED_FORMAT):
        raise fail("format", scheme.get("format"), f"tilefish loads {COMPRESSED_FORMAT!r} schemes only")
    for field in ("input_activations", "output_activations"):
        if scheme.get(field):
            raise fail(field, scheme[field], "quantized activations are not W4A16 (tilefish's kernels take fp16 / "
                                             "bf16 activations)")
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise fail("weights", weights, "must describe the weight quantization")
    rules = (("num_bits", lambda v: v == 4, "only 4-bit weights are supported"),
             ("type", lambda v: v in (None, "int"), "only integer weights are supported (not float)"),
             ("strategy", lambda v: v in COMPRESSED_STRATEGIES, f"tilefish loads strategies {COMPRESSED_STRATEGIES}"),
             ("symmetric", lambda v: isinstance(v, bool) or v is None, "must be true or false"),
             ("dynamic", lambda v: v in (None, False), "dynamic weight quantization has no stored scales"))
    for field, ok, message in rules:
        if not ok(weights.get(field)):
            raise fail(f"weights.{field}", weights.get(field), message)
    group_size = -1
    if weights["strategy"] == "group":
        group_size = weights.get("group_size")
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES[1:]:
            raise fail("weights.group_size", group_size, f"the W4A16 kernel supports group sizes {GROUP_SIZES[1:]} "
                                                         "(and strategy 'channel')")
    return group_size, weights.get("symmetric", True) is not False
