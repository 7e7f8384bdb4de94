"""ExpertWeights: one projection of E experts, each expert's 4-bit weight [n, k] in the W4A16 kernel layout,
stacked along a leading expert dim. The grouped expert op (ops/moe.py) takes two of these (gate_up, down).

Layout: expert e of an ExpertWeights is exactly the W4A16Weight ``expert(e)`` (ops/w4a16/layout.py has the
packed word order, the strip-permuted scales and the codebooks); the stack adds nothing between experts:

  packed  int32 [E, n/64, 8k]         expert e's words at packed[e]; contiguous, expert e starts at word
                                      e * (n/64) * 8k
  scales  fp16/bf16 [E, groups, n]    expert e's scales at scales[e] (strip-permuted when grouped), starting
                                      at element e * groups * n; groups = 1 (group_size -1) or k / group_size
  zeros   same dtype [E, groups, n] or None (int4 only; None means 8), laid out like scales
  group_size, n, k, codebook          shared by every expert: "int4" (groups -1/32/64/128, zero points or not),
                                      "nf4" (groups 32/64/128) or "mxfp4" (group 32)

No act-order permutation: every expert reads x in its natural k order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.int4 import SUPPORTED_GROUP_SIZES
from .w4a16.layout import CODEBOOKS, DTYPES, MXFP4_GROUP, W4A16Weight, check_codebook, check_shape, pack

__all__ = ["ExpertWeights"]


@dataclass
class ExpertWeights:
    """E experts' 4-bit weights [n, k] of one projection, stacked (module docstring)."""

    packed: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    n: int
    k: int
    codebook: str = "int4"

    def __post_init__(self) -> None:
        self.check()

    # -- properties ---------------------------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @property
    def groups(self) -> int:
        return 1 if self.group_size == -1 else self.k // self.group_size

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the scales')."""
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def check(self) -> None:
        """Shapes, dtypes and devices (no values read): a TypeError / ValueError naming the field."""
        check_shape(self.n, self.k, self.group_size)
        check_codebook(self.codebook, self.group_size, self.zeros is None)
        if not isinstance(self.packed, torch.Tensor) or self.packed.dtype != torch.int32 or self.packed.dim() != 3:
            raise TypeError(f"ExpertWeights.packed must be an int32 tensor [E, n/64, 8k]; got "
                            f"{getattr(self.packed, 'dtype', type(self.packed).__name__)} "
                            f"{tuple(getattr(self.packed, 'shape', ()))}")
        e = self.packed.shape[0]
        if self.packed.shape != (e, self.n // 64, 8 * self.k):
            raise ValueError(f"ExpertWeights.packed must be [E, n/64, 8k] = {(e, self.n // 64, 8 * self.k)}; got "
                             f"{tuple(self.packed.shape)}")
        if not isinstance(self.scales, torch.Tensor) or self.scales.dtype not in DTYPES:
            raise TypeError(f"ExpertWeights.scales must be float16 or bfloat16; got "
                            f"{getattr(self.scales, 'dtype', type(self.scales).__name__)}")
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if t is None:
                continue
            if t.shape != (e, self.groups, self.n):
                raise ValueError(f"ExpertWeights.{name} must be [E, groups, n] = {(e, self.groups, self.n)}; got "
                                 f"{tuple(t.shape)}")
            if t.dtype != self.scales.dtype or t.device != self.packed.device:
                raise ValueError(f"ExpertWeights.{name} must be {self.scales.dtype} on {self.packed.device}; got "
                                 f"{t.dtype} on {t.device}")

    # -- views and conversions ----------------------------------------------------------------------------------
    def expert(self, e: int) -> W4A16Weight:
        """Expert e's weight [n, k] as a W4A16Weight (views of the stacked tensors, nothing copied)."""
        if not 0 <= e < self.num_experts:
            raise IndexError(f"expert {e} out of range: {self.num_experts} experts")
        zeros = None if self.zeros is None else self.zeros[e]
        return W4A16Weight(self.packed[e], self.scales[e], zeros, self.group_size, self.n, self.k, None,
                           self.codebook)

    def dequantize(self, dtype: torch.dtype = torch.float32, experts=None) -> torch.Tensor:
        """The dense weights [E, n, k] (or [len(experts), n, k] of the experts listed), each value computed in
        float64 and rounded once to dtype (W4A16Weight.dequantize)."""
        ids = range(self.num_experts) if experts is None else [int(e) for e in experts]
        return torch.stack([self.expert(e).dequantize(dtype) for e in ids]) if ids else torch.empty(
            0, self.n, self.k, dtype=dtype, device=self.device)

    def to(self, *args, **kwargs) -> "ExpertWeights":
        """Like W4A16Weight.to: a device moves every tensor, a dtype (fp16 / bf16) converts the scales and
        zero points only."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype not in DTYPES:
            raise TypeError(f"an ExpertWeights' dtype (its scales') must be float16 or bfloat16, got {dtype}")

        def move(t, values: bool):
            return None if t is None else t.to(device=device, dtype=dtype if values else None,
                                                non_blocking=non_blocking)
        return ExpertWeights(move(self.packed, False), move(self.scales, True), move(self.zeros, True),
                             self.group_size, self.n, self.k, self.codebook)

    @classmethod
    def stack(cls, weights: list[W4A16Weight]) -> "ExpertWeights":
        """One ExpertWeights from E W4A16Weights of one shape, group size, codebook and dtype, without
        act-order permutations (symmetric experts among asymmetric ones get zero points 8 written out)."""
        if not weights:
            raise ValueError("ExpertWeights.stack needs at least one expert")
        first = weights[0]
        for i, w in enumerate(weights):
            if not isinstance(w, W4A16Weight):
                raise TypeError(f"expert {i}: a W4A16Weight is needed, got {type(w).__name__}")
            if (w.n, w.k, w.group_size, w.codebook, w.dtype) != (first.n, first.k, first.group_size, first.codebook,
                                                                 first.dtype):
                raise ValueError(f"expert {i} is [n={w.n}, k={w.k}] group {w.group_size} {w.codebook} {w.dtype}; "
                                 f"expert 0 is [n={first.n}, k={first.k}] group {first.group_size} {first.codebook} "
                                 f"{first.dtype}: the experts of one projection share all of these")
            if w.perm is not None:
                raise ValueError(f"expert {i} has an act-order permutation; stacked experts read x in its natural "
                                 "order (a grouped kernel gathers no per-expert columns)")
        zeros = None
        if any(w.zeros is not None for w in weights):
            zeros = torch.stack([w.zeros if w.zeros is not None else torch.full_like(w.scales, 8) for w in weights])
        return cls(torch.stack([w.packed for w in weights]), torch.stack([w.scales for w in weights]), zeros,
                   first.group_size, first.n, first.k, first.codebook)

    @classmethod
    def from_weights(cls, w: torch.Tensor, codebook: str = "int4", *, group_size: int | None = None,
                     symmetric: bool = True, clip_search: bool = True, blocksize: int | None = None,
                     double_quant: bool = True, dtype: torch.dtype | None = None) -> "ExpertWeights":
        """Quantize dense expert weights w [E, n, k] (fp16 / bf16 / fp32), one expert at a time, on w's device.

        codebook "int4": round to nearest with groups (group_size -1 / 32 / 64 / 128, default 128; symmetric
            or with zero points; clip_search as tilefish.w4a16.quantize).
        codebook "nf4": bitsandbytes NF4 (blocksize, default 64; double_quant), repacked as tilefish.nf4.prepare
            does: group scales of min(blocksize, 128), each block's absmax rounded once to dtype.
        codebook "mxfp4": OCP MXFP4 (tilefish.quant.mxfp4.quantize): group size 32, power-of-two scales.
        dtype: the activation dtype (fp16 / bf16); default w's if 16-bit, else fp16.
        An option of another codebook (group_size with nf4 or mxfp4, blocksize with int4 ...) is a ValueError."""
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in (torch.float16, torch.bfloat16,
                                                                              torch.float32):
            raise TypeError(f"w must be a float16 / bfloat16 / float32 tensor [E, n, k]; got "
                            f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")
        if codebook not in CODEBOOKS:
            raise ValueError(f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
        dtype = dtype or (w.dtype if w.dtype in DTYPES else torch.float16)
        if dtype not in DTYPES:
            raise TypeError(f"dtype (the activation dtype) must be float16 or bfloat16, got {dtype}")
        if w.shape[0] < 1:
            raise ValueError("w holds no experts (E = 0)")
        quantize_one = _quantizer(codebook, group_size, symmetric, clip_search, blocksize, double_quant, dtype)
        return cls.stack([quantize_one(w[e].detach()) for e in range(w.shape[0])])


def _quantizer(codebook, group_size, symmetric, clip_search, blocksize, double_quant, dtype):
    """The function quantizing one expert [n, k] in ``codebook``, after checking the options apply to it."""
    if codebook != "int4" and (group_size is not None or symmetric is not True or clip_search is not True):
        raise ValueError(f"group_size, symmetric and clip_search are int4 options; codebook {codebook!r} takes "
                         f"{'blocksize and double_quant' if codebook == 'nf4' else 'none'}")
    if codebook != "nf4" and (blocksize is not None or double_quant is not True):
        raise ValueError(f"blocksize and double_quant are nf4 options, not {codebook!r} ones")
    if codebook == "int4":
        from ..quant.int4 import quantize_rtn

        group = 128 if group_size is None else group_size
        if isinstance(group, bool) or group not in SUPPORTED_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}; got {group!r}")

        def one(x):
            check_shape(x.shape[0], x.shape[1], group)
            return pack(quantize_rtn(x, group, symmetric, clip_search, scale_dtype=dtype))
        return one
    if codebook == "nf4":
        from ..quant.nf4 import quantize
        from .nf4 import prepare

        block = 64 if blocksize is None else blocksize
        return lambda x: prepare(quantize(x, block, double_quant), dtype).kernel
    from ..quant import mxfp4

    def one(x):
        check_shape(x.shape[0], x.shape[1], MXFP4_GROUP)
        return pack(mxfp4.to_int4_weight(mxfp4.quantize(x), dtype), codebook="mxfp4")
    return one


def join_rows(parts: list[W4A16Weight]) -> W4A16Weight:
    """One W4A16Weight whose rows (n) are ``parts``' in order, exact: the packed layout and the scales are per
    64-row strip and every part is whole strips (a gate and an up projection -> gate_up). Same k, group size,
    codebook and dtype; no act-order permutations; symmetric parts among asymmetric ones get zero points 8."""
    first = parts[0]
    for i, p in enumerate(parts):
        if (p.k, p.group_size, p.codebook, p.dtype) != (first.k, first.group_size, first.codebook, first.dtype):
            raise ValueError(f"part {i} is k={p.k} group {p.group_size} {p.codebook} {p.dtype}; part 0 is "
                             f"k={first.k} group {first.group_size} {first.codebook} {first.dtype}: rows join only "
                             "between weights that share these")
        if p.perm is not None:
            raise ValueError(f"part {i} has an act-order permutation: joined rows read x in one order")
    zeros = None
    if any(p.zeros is not None for p in parts):
        zeros = torch.cat([p.zeros if p.zeros is not None else torch.full_like(p.scales, 8) for p in parts], 1)
    return W4A16Weight(torch.cat([p.packed for p in parts], 0), torch.cat([p.scales for p in parts], 1), zeros,
                       first.group_size, sum(p.n for p in parts), first.k, None, first.codebook)
