"""bitsandbytes-compatible NF4 weights (4-bit NormalFloat, optional double quantization), pure torch.

Layout, identical to ``bitsandbytes.functional.quantize_4bit(quant_type="nf4")``:

* the weight is flattened row-major and cut into blocks of ``blocksize`` elements (the last may be partial);
* each element stores the index (0..15) of the NF4 value nearest to ``w / absmax[block]``;
* two indices per byte, the EARLIER element in the HIGH nibble: ``ceil(numel / 2)`` bytes; with an odd numel
  the last low nibble is padding, never read (quantize writes 7, the code of 0.0, as bitsandbytes does);
* single level: ``absmax`` fp32 ``[nblocks]``;
* double quant: ``offset = mean(absmax)`` and ``absmax - offset`` is quantized to uint8 ``absmax_q`` with the
  8-bit signed dynamic map ``code2`` in groups of 256 blocks, with fp32 group scales ``absmax2``:
  ``absmax[b] = code2[absmax_q[b]] * absmax2[b // 256] + offset`` (fp32, multiply then add).

The value of element i of block b is ``NF4[code_i] * absmax[b]`` in fp32, cast once to the output dtype
(``tilefish.reference.nf4_dequantize_fp32_chain``).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # only for the annotation; bitsandbytes is optional
    from bitsandbytes.functional import QuantState

__all__ = [
    "NF4_TABLE", "SUPPORTED_BLOCKSIZES", "NESTED_BLOCKSIZE", "FLOAT_DTYPES", "NF4Weight", "nf4_table",
    "dynamic_map_signed", "quantize", "from_bnb", "to_bnb", "from_state_dict", "to_state_dict",
]

# bitsandbytes' get_4bit_type("nf4"); every entry is exactly a float32 value.
NF4_TABLE: list[float] = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
]
SUPPORTED_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
NESTED_BLOCKSIZE = 256
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_QS_SUFFIX = "quant_state.bitsandbytes__"
# Elements quantized per step: bounds quantize()'s fp32/int32 temporaries on multi-GB weights.
_CHUNK = 1 << 24


@functools.cache
def _nf4_table_cpu() -> torch.Tensor:
    return torch.tensor(NF4_TABLE, dtype=torch.float32)


def nf4_table(device=None) -> torch.Tensor:
    """The 16 NF4 values as fp32 ``[16]`` (a fresh tensor, safe to modify)."""
    return _nf4_table_cpu().to("cpu" if device is None else device, copy=True)


@functools.cache
def _dynamic_map_cpu() -> torch.Tensor:
    # Same ops, same order as bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8),
    # always on CPU (a CUDA linspace may round differently), so the float32 values are bit-identical.
    # Exponent e = 0..6 contributes the 2**e midpoints of linspace(0.1, 1, 2**e + 1) scaled by 10**(e - 6), and
    # their negatives; with 0 and 1.0 that is 2 * 127 + 2 = 256 entries, sorted: [0] = -0.99297, [127] = 0, [255] = 1.
    data: list[float] = []
    for e in range(7):
        bounds = torch.linspace(0.1, 1, 2**e + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (10 ** (e - 6) * means).tolist()
        data += (-(10 ** (e - 6)) * means).tolist()
    data += [0.0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def dynamic_map_signed(device=None) -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed=True)``, bit for bit, as fp32 ``[256]`` (a fresh tensor)."""
    return _dynamic_map_cpu().to("cpu" if device is None else device, copy=True)


@dataclass(eq=False)
class NF4Weight:
    """An NF4-quantized weight: plain tensors, see the module docstring for the layout.

    Exactly one scale representation is set: ``absmax`` (single level) or all of ``absmax_q``, ``code2``,
    ``absmax2`` and ``offset`` (double quant). ``offset`` stays a device tensor: kernels read it by pointer,
    so using a weight never forces a host sync.
    """

    codes: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    blocksize: int
    absmax: torch.Tensor | None = None
    absmax_q: torch.Tensor | None = None
    code2: torch.Tensor | None = None
    absmax2: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.shape = torch.Size(self.shape)

    @property
    def double_quant(self) -> bool:
        return self.absmax_q is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nblocks(self) -> int:
        return -(-self.numel // self.blocksize)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device) -> NF4Weight:
        """A copy with every tensor on ``device`` (tensors already there are shared, not copied)."""
        def mv(t):
            return None if t is None else t.to(device)

        return dataclasses.replace(self, codes=mv(self.codes), absmax=mv(self.absmax), absmax_q=mv(self.absmax_q),
                                   code2=mv(self.code2), absmax2=mv(self.absmax2), offset=mv(self.offset))

    def _tensors(self) -> dict[str, torch.Tensor]:
        names = ("codes", "absmax", "absmax_q", "code2", "absmax2", "offset")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def validate(self) -> None:
        """Raise TypeError/ValueError naming the first constraint of the layout that this weight breaks.

        Checks only metadata (dtype, shape, strides, device): no host sync, cheap enough before every launch.
        """
        _check_tensor("codes", self.codes, torch.uint8, None)
        if not isinstance(self.shape, torch.Size) or any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise TypeError(f"shape must be a torch.Size of non-negative ints, got {self.shape!r}")
        numel = self.numel
        if numel < 1:
            raise ValueError(f"shape {tuple(self.shape)} has no elements")
        if self.dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of float16, bfloat16, float32, got {self.dtype}")
        if isinstance(self.blocksize, bool) or self.blocksize not in SUPPORTED_BLOCKSIZES:
            raise ValueError(f"blocksize must be one of {SUPPORTED_BLOCKSIZES}, got {self.blocksize!r}")
        _check_tensor("codes", self.codes, torch.uint8, ((numel + 1) // 2,),
                      f"ceil(numel / 2) bytes for shape {tuple(self.shape)}")

        nested = {"absmax_q": self.absmax_q, "code2": self.code2, "absmax2": self.absmax2, "offset": self.offset}
        have = [k for k, v in nested.items() if v is not None]
        if have and len(have) < len(nested):
            missing = [k for k in nested if k not in have]
            raise ValueError(f"double-quant fields partially present: {', '.join(have)} set but "
                             f"{', '.join(missing)} missing (double quant needs absmax_q, code2, absmax2, offset)")
        if have and self.absmax is not None:
            raise ValueError("both absmax (single level) and the double-quant fields (absmax_q, code2, absmax2, "
                             "offset) are set; set one of them")
        if not have and self.absmax is None:
            raise ValueError("no block scales: set absmax (single level) or absmax_q, code2, absmax2 and offset "
                             "(double quant)")

        nb = self.nblocks
        what = f"nblocks = ceil({numel} / {self.blocksize})"
        if have:
            _check_tensor("absmax_q", self.absmax_q, torch.uint8, (nb,), what)
            _check_tensor("code2", self.code2, torch.float32, (256,), "the 256-entry dynamic map")
            ng = -(-nb // NESTED_BLOCKSIZE)
            _check_tensor("absmax2", self.absmax2, torch.float32, (ng,), f"ceil(nblocks / 256), nblocks = {nb}")
            _check_tensor("offset", self.offset, torch.float32, None)
            if self.offset.numel() != 1:
                raise ValueError(f"offset must be a 1-element float32 tensor, got shape {tuple(self.offset.shape)}")
        else:
            _check_tensor("absmax", self.absmax, torch.float32, (nb,), what)

        devices = {n: t.device for n, t in self._tensors().items()}
        if len(set(devices.values())) > 1:
            where = ", ".join(f"{n} on {d}" for n, d in devices.items())
            raise ValueError(f"NF4Weight fields must all be on one device, got {where}")


def _check_tensor(name: str, t: Any, dtype: torch.dtype, shape: tuple[int, ...] | None, what: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {_dtype_name(dtype)}, got {_dtype_name(t.dtype)}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must be 1-D of length {shape[0]} ({what}), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (kernels read it by pointer), got strides {t.stride()}")


def _midpoints(table: torch.Tensor) -> torch.Tensor:
    # fp32 midpoints of a sorted table. For NF4 these equal, as float32, the thresholds of bitsandbytes' CUDA
    # decision tree (dQuantizeNF4), and bitsandbytes' pure-torch backend uses them too.
    return (table[:-1] + table[1:]) / 2


def _nearest(x: torch.Tensor, amax: torch.Tensor, midpoints: torch.Tensor) -> torch.Tensor:
    """Index of the table entry nearest to x / amax, row by row (x fp32 [rows, cols], amax fp32 [rows]).

    Like bitsandbytes' CUDA kernels, x is multiplied by the fp32 reciprocal of amax rather than divided, and a
    value exactly on a midpoint takes the lower entry (``x > threshold`` goes up). amax == 0 rows (all zeros) map
    to the entry 0.0; a subnormal amax whose reciprocal overflows falls back to division.
    """
    recip = torch.where(amax > 0, 1.0 / amax, 0.0)[:, None]
    scaled = torch.where(torch.isinf(recip), x / amax[:, None], x * recip).clamp_(-1.0, 1.0)
    return torch.bucketize(scaled, midpoints, out_int32=True)


def quantize(w: torch.Tensor, blocksize: int = 64, double_quant: bool = True) -> NF4Weight:
    """Quantize ``w`` (float16/bfloat16/float32, any shape) to NF4, on ``w.device``.

    Same bytes as bitsandbytes' ``quantize_4bit(w, blocksize, compress_statistics=double_quant,
    quant_type="nf4")`` (same absmax, offset, absmax2 and code2) except where bitsandbytes does not pick the
    nearest entry: values within an ulp of a threshold (its CPU backend divides instead of multiplying by the
    reciprocal for the last partial block), and its CPU 8-bit search for the nested absmax, which misses the
    nearest map entry for a fraction of a percent of blocks. Here every code is the nearest one.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in FLOAT_DTYPES:
        raise TypeError(f"w must be float16, bfloat16 or float32, got {w.dtype}")
    if isinstance(blocksize, bool) or blocksize not in SUPPORTED_BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {SUPPORTED_BLOCKSIZES}, got {blocksize!r}")
    n = w.numel()
    if n < 1:
        raise ValueError(f"cannot quantize an empty tensor (shape {tuple(w.shape)})")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w contains NaN or Inf, which NF4 cannot represent")

    dev = w.device
    flat = w.detach().reshape(-1)
    nblocks = -(-n // blocksize)
    codes = torch.empty((n + 1) // 2, dtype=torch.uint8, device=dev)
    absmax = torch.empty(nblocks, dtype=torch.float32, device=dev)
    mid = _midpoints(nf4_table(dev))
    step = max(1, _CHUNK // blocksize) * blocksize  # whole blocks, an even count: chunks pack independently
    for s in range(0, n, step):
        e = min(n, s + step)
        x = flat[s:e].float()
        if (e - s) % blocksize:  # zero padding leaves the partial block's absmax unchanged
            x = F.pad(x, (0, blocksize - (e - s) % blocksize))
        x = x.view(-1, blocksize)
        am = x.abs().amax(dim=1)
        absmax[s // blocksize: s // blocksize + am.numel()] = am
        # odd numel: keep one padding element, whose code (7, the NF4 zero) fills the last low nibble as in
        # bitsandbytes, so packed bytes compare equal
        idx = _nearest(x, am, mid).reshape(-1)[: e - s + (e - s) % 2]
        codes[s // 2: s // 2 + idx.numel() // 2] = ((idx[0::2] << 4) | idx[1::2]).to(torch.uint8)

    if not double_quant:
        return NF4Weight(codes=codes, shape=w.shape, dtype=w.dtype, blocksize=blocksize, absmax=absmax)

    offset = absmax.mean()
    ng = -(-nblocks // NESTED_BLOCKSIZE)
    centered = F.pad(absmax - offset, (0, ng * NESTED_BLOCKSIZE - nblocks)).view(ng, NESTED_BLOCKSIZE)
    absmax2 = centered.abs().amax(dim=1)
    code2 = dynamic_map_signed(dev)
    absmax_q = _nearest(centered, absmax2, _midpoints(code2)).reshape(-1)[:nblocks].to(torch.uint8)
    return NF4Weight(codes=codes, shape=w.shape, dtype=w.dtype, blocksize=blocksize, absmax_q=absmax_q,
                     code2=code2, absmax2=absmax2, offset=offset)


# ---------------------------------------------------------------------------------------------------------------------
# Interop: bitsandbytes QuantState and Linear4bit state dicts
# ---------------------------------------------------------------------------------------------------------------------

def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{_dtype_name(t.dtype)} tensor of shape {tuple(t.shape)}"
    return type(t).__name__


def _check_quant_type(qt: Any) -> None:
    if qt != "nf4":
        if qt == "fp4":
            raise ValueError("quant_type is 'fp4': only bitsandbytes' nf4 format is supported, not fp4")
        raise ValueError(f"quant_type must be 'nf4', got {qt!r}")


def _check_quant_map(t: Any, name: str) -> None:
    ok = (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == 16
          and torch.equal(t.detach().cpu().reshape(-1), _nf4_table_cpu()))
    if not ok:
        raise ValueError(f"{name}: quant_map is not the NF4 table (expected float32[16] equal to NF4_TABLE, "
                         f"got {_describe(t)}); only bitsandbytes' nf4 format is supported")


def _check_code2(t: Any, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 256:
        raise ValueError(f"{name}: nested_quant_map must be a float32 tensor of length 256, got {_describe(t)}")


def _raw_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    # bitsandbytes may store the packed bytes in another dtype (quant_storage, e.g. bfloat16 for FSDP) and as
    # an [n, 1] Params4bit: reinterpret the flattened storage as bytes (a view, no copy when contiguous).
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t.detach().as_subclass(torch.Tensor).contiguous().reshape(-1).view(torch.uint8)


def _vector(t: Any) -> Any:
    return t.detach().as_subclass(torch.Tensor).contiguous().reshape(-1) if isinstance(t, torch.Tensor) else t


def _fp32_scale(t: Any) -> Any:
    # bitsandbytes' CPU path tolerates a 16-bit absmax (it calls .float()); widening to fp32 is exact.
    if isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16):
        return t.float()
    return t


def _offset_tensor(offset: Any, device: torch.device) -> torch.Tensor:
    if isinstance(offset, torch.Tensor):  # a 1-element tensor becomes 0-dim; anything else is left to validate()
        t = offset.detach().as_subclass(torch.Tensor)
        return t.reshape(()) if t.numel() == 1 else t
    return torch.tensor(float(offset), dtype=torch.float32, device=device)


def from_bnb(packed: torch.Tensor, quant_state: QuantState) -> NF4Weight:
    """Wrap bitsandbytes' ``quantize_4bit`` output (or a Params4bit and its ``quant_state``) as an NF4Weight.

    ``quant_state`` is duck-typed (bitsandbytes need not be importable). Tensors are shared, not copied.
    """
    qs = quant_state
    _check_quant_type(getattr(qs, "quant_type", None))
    if getattr(qs, "packing_format_for_cpu", False):
        raise ValueError("this weight was repacked for bitsandbytes' CPU gemm kernels (packing_format_for_cpu); "
                         "save it through Linear4bit's state_dict (which undoes the repacking) and import that")
    _check_quant_map(getattr(qs, "code", None), "quant_state.code")
    if qs.shape is None:
        raise ValueError("quant_state.shape is None: the logical shape of the weight is needed")
    codes = _raw_bytes(packed, "packed")
    state2 = getattr(qs, "state2", None)
    if state2 is not None:
        if state2.blocksize != NESTED_BLOCKSIZE:
            raise ValueError(f"quant_state.state2.blocksize must be {NESTED_BLOCKSIZE}, got {state2.blocksize}")
        if getattr(state2, "dtype", torch.float32) != torch.float32:
            raise ValueError(f"quant_state.state2.dtype must be float32, got {state2.dtype}")
        _check_code2(state2.code, "quant_state.state2.code")
        if qs.offset is None:
            raise ValueError("quant_state.offset is None but quant_state.state2 is set (double quant needs both)")
        q = NF4Weight(codes=codes, shape=torch.Size(qs.shape), dtype=qs.dtype, blocksize=qs.blocksize,
                      absmax_q=_vector(qs.absmax), code2=_vector(state2.code),
                      absmax2=_vector(_fp32_scale(state2.absmax)), offset=_offset_tensor(qs.offset, codes.device))
    else:
        q = NF4Weight(codes=codes, shape=torch.Size(qs.shape), dtype=qs.dtype, blocksize=qs.blocksize,
                      absmax=_vector(_fp32_scale(qs.absmax)))
    q.validate()
    return q


def to_bnb(q: NF4Weight) -> tuple[torch.Tensor, QuantState]:
    """``(packed uint8 [n, 1], QuantState)`` as bitsandbytes' ``quantize_4bit`` returns them (tensors shared)."""
    try:
        from bitsandbytes.functional import QuantState
    except ImportError as e:
        raise ImportError("tilefish.nf4.to_bnb needs bitsandbytes (pip install bitsandbytes); "
                          "to_state_dict writes the same format without it") from e
    q.validate()
    code = nf4_table(q.device)
    if q.double_quant:
        state2 = QuantState(absmax=q.absmax2, code=q.code2, blocksize=NESTED_BLOCKSIZE, dtype=torch.float32)
        qs = QuantState(absmax=q.absmax_q, shape=q.shape, code=code, blocksize=q.blocksize, quant_type="nf4",
                        dtype=q.dtype, offset=q.offset.reshape(()), state2=state2)
    else:
        qs = QuantState(absmax=q.absmax, shape=q.shape, code=code, blocksize=q.blocksize, quant_type="nf4",
                        dtype=q.dtype)
    return q.codes.view(-1, 1), qs


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # what bitsandbytes writes: "bfloat16", "float16", "float32"


def _dtype_from_name(name: Any, key: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{key} must name float16, bfloat16 or float32, got {name!r}")
    return dtype


def _unpack_json(t: Any, key: str) -> dict[str, Any]:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise TypeError(f"{key} must be a uint8 tensor holding UTF-8 JSON, got {type(t).__name__}"
                        + (f" of dtype {t.dtype}" if isinstance(t, torch.Tensor) else ""))
    try:
        meta = json.loads(bytes(t.detach().cpu().reshape(-1).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{key} does not hold valid UTF-8 JSON: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{key} must hold a JSON object, got {type(meta).__name__}")
    return meta


def from_state_dict(sd: dict[str, torch.Tensor], prefix: str = "weight") -> NF4Weight:
    """Import the NF4 weight stored under ``prefix`` in a bitsandbytes ``Linear4bit`` state dict.

    Keys: ``{prefix}`` (packed bytes, any storage dtype), ``{prefix}.absmax``, ``{prefix}.quant_map``,
    ``{prefix}.quant_state.bitsandbytes__nf4`` (JSON) and, with double quant, ``{prefix}.nested_absmax`` and
    ``{prefix}.nested_quant_map``. Does not need bitsandbytes; tensors are shared, not copied.
    """
    def key(name: str) -> str:
        return f"{prefix}.{name}"

    other = [k for k in sd if k.startswith(key(_QS_SUFFIX)) and k != key(_QS_SUFFIX + "nf4")]
    if key(_QS_SUFFIX + "nf4") not in sd:
        if other:
            qt = other[0].removeprefix(key(_QS_SUFFIX))
            _check_quant_type(qt)
        raise ValueError(f"state dict has no {key(_QS_SUFFIX + 'nf4')!r}: not a bitsandbytes nf4 weight")
    meta = _unpack_json(sd[key(_QS_SUFFIX + "nf4")], key(_QS_SUFFIX + "nf4"))
    missing = [k for k in ("quant_type", "blocksize", "dtype", "shape") if k not in meta]
    if missing:
        raise ValueError(f"{key(_QS_SUFFIX + 'nf4')} JSON lacks {', '.join(missing)}")
    _check_quant_type(meta["quant_type"])
    for name in ("", "absmax", "quant_map"):
        k = key(name) if name else prefix
        if k not in sd:
            raise ValueError(f"state dict has no {k!r}")
    _check_quant_map(sd[key("quant_map")], key("quant_map"))
    if not isinstance(meta["shape"], list):
        raise ValueError(f"{key(_QS_SUFFIX + 'nf4')} JSON shape must be a list of ints, got {meta['shape']!r}")
    codes = _raw_bytes(sd[prefix], prefix)
    common = dict(codes=codes, shape=torch.Size(meta["shape"]), dtype=_dtype_from_name(meta["dtype"], "dtype"),
                  blocksize=meta["blocksize"])

    nested_json = [k for k in ("nested_blocksize", "nested_dtype", "nested_offset") if k in meta]
    if key("nested_absmax") in sd:  # bitsandbytes' own test for double quant
        if key("nested_quant_map") not in sd:
            raise ValueError(f"state dict has {key('nested_absmax')!r} but no {key('nested_quant_map')!r}")
        if len(nested_json) < 3:
            raise ValueError(f"{key(_QS_SUFFIX + 'nf4')} JSON lacks nested_blocksize/nested_dtype/nested_offset "
                             "but the state dict has nested_absmax")
        if meta["nested_blocksize"] != NESTED_BLOCKSIZE:
            raise ValueError(f"nested_blocksize must be {NESTED_BLOCKSIZE}, got {meta['nested_blocksize']!r}")
        if meta["nested_dtype"] != "float32":
            raise ValueError(f"nested_dtype must be 'float32', got {meta['nested_dtype']!r}")
        _check_code2(sd[key("nested_quant_map")], key("nested_quant_map"))
        q = NF4Weight(**common, absmax_q=_vector(sd[key("absmax")]), code2=_vector(sd[key("nested_quant_map")]),
                      absmax2=_vector(_fp32_scale(sd[key("nested_absmax")])),
                      offset=torch.tensor(float(meta["nested_offset"]), dtype=torch.float32, device=codes.device))
    else:
        if nested_json or key("nested_quant_map") in sd:
            raise ValueError(f"state dict has nested (double-quant) entries but no {key('nested_absmax')!r}")
        q = NF4Weight(**common, absmax=_vector(_fp32_scale(sd[key("absmax")])))
    q.validate()
    return q


def to_state_dict(q: NF4Weight, prefix: str = "weight") -> dict[str, torch.Tensor]:
    """The entries bitsandbytes' ``Linear4bit`` writes for this weight (same keys, order, dtypes and JSON bytes).

    The packed weight is a uint8 ``[n, 1]`` view of ``q.codes``; ``nested_quant_map`` is a copy, as in bitsandbytes,
    so safetensors does not see shared tensors. Reading ``offset`` into the JSON syncs with the device.
    """
    q.validate()
    sd = {prefix: q.codes.view(-1, 1)}
    meta: dict[str, Any] = {"quant_type": "nf4", "blocksize": q.blocksize, "dtype": _dtype_name(q.dtype),
                            "shape": list(q.shape)}
    if q.double_quant:
        sd[f"{prefix}.absmax"] = q.absmax_q
        sd[f"{prefix}.quant_map"] = nf4_table(q.device)
        sd[f"{prefix}.nested_absmax"] = q.absmax2
        sd[f"{prefix}.nested_quant_map"] = q.code2.clone()
        meta.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=q.offset.item())
    else:
        sd[f"{prefix}.absmax"] = q.absmax
        sd[f"{prefix}.quant_map"] = nf4_table(q.device)
    # bitsandbytes' pack_dict_to_tensor: json.dumps with default separators, UTF-8 bytes, a CPU uint8 tensor.
    sd[f"{prefix}.{_QS_SUFFIX}nf4"] = torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)
    return sd
