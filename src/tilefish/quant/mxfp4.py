"""MXFP4 weights (OCP Microscaling, FP4 E2M1 elements), pure torch (CPU and GPU).

The format (OCP MX specification v1.0, "MXFP4"):

* each element is a 4-bit E2M1 code: bit 3 the sign, bits 0-2 the magnitude index into
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (E2M1_VALUES lists all 16, code order);
* each block of 32 consecutive elements along the last dim (k) shares one E8M0 scale byte s, whose value
  is 2^(s - 127); s = 255 is NaN in the specification and rejected here;
* element value = E2M1_VALUES[code] x 2^(s - 127).

Stored form of gpt-oss checkpoints (``*_blocks`` / ``*_scales``, read by transformers'
integrations/mxfp4.py): blocks uint8 [..., k/32, 16], two codes a byte, the LOW nibble the even element;
scales uint8 [..., k/32].

Quantization picks each block's scale as the specification does, 2^(floor(log2(amax)) - 2) (2 is E2M1's
largest exponent, so amax / scale lies in [4, 8) and values above 6 saturate to +-6), then rounds every
element to the nearest E2M1 value, ties to the even code. An all-zero block gets scale 1 (s = 127).

On the W4A16 kernels (codebook "mxfp4", ``to_int4_weight``): the codes as they are, group size 32, and
each scale as an activation-dtype value, checked exact (kernel_scales): bf16 holds any block of scale
2^-127 .. 2^125, fp16 any block of scale 2^-23 .. 2^13 (0.5 x 2^-23 and 6 x 2^13 are fp16 numbers), and
outside those ranges the blocks whose every value is a number of the dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E2M1_VALUES", "BLOCK", "SCALE_BIAS", "MXFP4Weight", "quantize", "from_blocks", "to_blocks",
           "to_int4_weight"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32            # elements sharing one scale
SCALE_BIAS = 127      # E8M0: value 2^(s - 127)
SCALE_NAN = 255       # E8M0's NaN encoding
E2M1_MAX_EXPONENT = 2  # 6 = 1.5 x 2^2
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def e2m1_table(device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16 E2M1 values in code order (a fresh tensor; every value is exact in any float dtype)."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


@dataclass
class MXFP4Weight:
    """An MXFP4 tensor [..., k]: one code per element (unpacked, uint8 0..15) and one E8M0 byte per block.

    codes:     uint8 [..., k]
    exponents: uint8 [..., k / 32], the stored scale bytes s (value 2^(s - 127))
    """

    codes: torch.Tensor
    exponents: torch.Tensor

    def __post_init__(self) -> None:
        for name, t in (("codes", self.codes), ("exponents", self.exponents)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
                raise TypeError(f"MXFP4Weight.{name} must be a uint8 tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
        if self.codes.dim() < 1 or self.codes.shape[-1] % BLOCK:
            raise ValueError(f"MXFP4Weight.codes must be [..., k] with k a multiple of {BLOCK}; "
                             f"got shape {tuple(self.codes.shape)}")
        want = (*self.codes.shape[:-1], self.codes.shape[-1] // BLOCK)
        if tuple(self.exponents.shape) != want:
            raise ValueError(f"MXFP4Weight.exponents must be [..., k / {BLOCK}] = {want} for codes "
                             f"{tuple(self.codes.shape)}; got {tuple(self.exponents.shape)}")
        if self.codes.device != self.exponents.device:
            raise ValueError(f"MXFP4Weight tensors must be on one device; codes on {self.codes.device}, "
                             f"exponents on {self.exponents.device}")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def validate(self) -> "MXFP4Weight":
        """Check the values: codes 0..15, no NaN scale byte (255). Reads the tensors (a device sync)."""
        if self.codes.numel() and int(self.codes.max()) > 15:
            raise ValueError(f"MXFP4Weight.codes must be 4-bit codes 0..15; found {int(self.codes.max())}")
        if self.exponents.numel() and bool((self.exponents == SCALE_NAN).any()):
            raise ValueError(f"MXFP4Weight.exponents holds {SCALE_NAN}, E8M0's NaN: no finite scale")
        return self

    def scales(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The block scales 2^(s - 127) [..., k / 32] (float64 and bf16 hold all of them exactly)."""
        exponents = self.exponents.to(torch.int32) - SCALE_BIAS
        return torch.ldexp(torch.ones_like(exponents, dtype=torch.float64), exponents).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Every element's value, computed in float64 (exact) and rounded once to ``dtype``."""
        values = e2m1_table(self.device, torch.float64)[self.codes.long()]
        scales = self.scales(torch.float64).repeat_interleave(BLOCK, dim=-1)
        return (values * scales).to(dtype)


def quantize(w: torch.Tensor) -> MXFP4Weight:
    """MXFP4 of ``w`` [..., k] (fp16, bf16 or fp32; k a multiple of 32), blocks along the last dim."""
    if not isinstance(w, torch.Tensor) or w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"w must be a float16, bfloat16 or float32 tensor, got {getattr(w, 'dtype', type(w).__name__)}")
    if w.dim() < 1 or w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 blocks are {BLOCK} elements along the last dim: it must be a multiple of {BLOCK}; "
                         f"got shape {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError("w contains NaN or Inf, which MXFP4 cannot represent")
    blocks = w.detach().float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # floor(log2(amax)) exactly: frexp gives amax = m 2^e with m in [0.5, 1)
    floor_log2 = torch.frexp(amax).exponent - 1
    shared = (floor_log2 - E2M1_MAX_EXPONENT).clamp(-SCALE_BIAS, SCALE_BIAS)
    shared = torch.where(amax > 0, shared, torch.zeros_like(shared))          # an all-zero block: scale 1
    scaled = torch.ldexp(blocks, -shared.unsqueeze(-1))                       # a power of two: exact
    return MXFP4Weight(_nearest_codes(scaled).reshape(w.shape), (shared + SCALE_BIAS).to(torch.uint8))


def _nearest_codes(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 code nearest to each value of x, ties to the even code (round-half-to-even on the E2M1
    grid), magnitudes above 6 saturating to 6; zero is +0 whatever the sign of x."""
    grid = e2m1_table(x.device)[:8]
    midpoints = (grid[:-1] + grid[1:]) / 2                                    # exact in fp32
    a = x.abs().contiguous()
    lower = torch.searchsorted(midpoints, a, side="left")                    # midpoints strictly below a
    on_midpoint = (lower < 7) & (midpoints[lower.clamp(max=6)] == a)
    magnitude = torch.where(on_midpoint & (lower % 2 == 1), lower + 1, lower)  # a tie goes to the even code
    sign = ((x < 0) & (magnitude > 0)).to(magnitude.dtype) << 3
    return (magnitude | sign).to(torch.uint8)


def from_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> MXFP4Weight:
    """The gpt-oss / transformers storage: blocks uint8 [..., k/32, 16] (the low nibble of byte j holds
    element 2j of its block, the high nibble element 2j + 1), scales uint8 [..., k/32]."""
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks must be uint8 [..., k/32, 16]; got {getattr(blocks, 'dtype', None)} "
                         f"{tuple(getattr(blocks, 'shape', ()))}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"MXFP4 scales must be uint8 {tuple(blocks.shape[:-1])} (the blocks' shape less the last "
                         f"dim); got {getattr(scales, 'dtype', None)} {tuple(getattr(scales, 'shape', ()))}")
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1)                 # [..., k/32, 16, 2]
    return MXFP4Weight(codes.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK), scales.contiguous())


def to_blocks(q: MXFP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of from_blocks: (blocks uint8 [..., k/32, 16], scales uint8 [..., k/32])."""
    pairs = q.codes.reshape(*q.codes.shape[:-1], q.codes.shape[-1] // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return packed.reshape(*q.exponents.shape, BLOCK // 2), q.exponents.clone()


def kernel_scales(q: MXFP4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The block scales as ``dtype`` values for the W4A16 kernels [..., k/32], checked exact.

    The kernels multiply each E2M1 value (a ``dtype`` number) by its block's scale in ``dtype``, so a
    block is exact when its scale and every value x scale are ``dtype`` numbers. A block whose codes are
    all zero gets scale 1 (its values are zero whatever the scale). Anything else raises ValueError."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the kernel scales are float16 or bfloat16 (the activation dtype), not {dtype}")
    q.validate()
    scales = q.scales(torch.float64)
    zero_block = (q.codes & 0x7).reshape(*q.exponents.shape, BLOCK).amax(dim=-1) == 0
    scales = torch.where(zero_block, torch.ones_like(scales), scales)
    exact = scales.to(dtype).double() == scales
    values = e2m1_table(q.device, torch.float64)[q.codes.long()]
    products = (values * scales.repeat_interleave(BLOCK, dim=-1))
    exact &= (products.to(dtype).double() == products).reshape(*q.exponents.shape, BLOCK).all(dim=-1)
    if not bool(exact.all()):
        bad = (~exact).nonzero()[0].tolist()
        s = int(q.exponents[tuple(bad)])
        held = ("2^-23 .. 2^13 (every E2M1 value times it an fp16 number)" if dtype == torch.float16
                else "2^-127 .. 2^125 (every E2M1 value times it a bf16 number)")
        raise ValueError(f"MXFP4 block {bad} has scale 2^{s - SCALE_BIAS} (byte {s}), which {dtype} activations cannot "
                         f"hold exactly: {dtype} scales cover {held}; use bfloat16")
    return scales.to(dtype)


def to_int4_weight(q: MXFP4Weight, dtype: torch.dtype):
    """A 2-D MXFP4 weight [n, k] as an Int4Weight holding E2M1 codes (for ops.w4a16.pack with codebook
    "mxfp4"): q = the codes, group size 32, scales in ``dtype`` (kernel_scales: checked exact)."""
    from .int4 import Int4Weight

    if q.codes.dim() != 2:
        raise ValueError(f"to_int4_weight takes a 2-D weight [n, k]; got shape {tuple(q.codes.shape)}")
    return Int4Weight(q.codes.contiguous(), kernel_scales(q, dtype).contiguous(), None, BLOCK)
