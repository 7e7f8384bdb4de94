"""The W4A16 weight in the kernel layout: W4A16Weight, pack / unpack and the shape checks.

Kernel layout (docs/w4a16.md has the fragment maps):
  packed  int32 [n/64, 8k], strip-major: for each 64-column strip S, its k16 rows r in order, each
          32 lanes x 4 words; word j of lane l = 4g + t holds, in nibble p,
          q[n = 64 S + 16 j + 8 h + g, k = 16 r + 8 a + 2 t + b] with p = 4 b + 2 h + a (the order in
          which lop3 peels nibble pairs into mma B fragments).
  scales  [groups, n] in the x dtype; for grouped weights permuted inside each 64-column strip so a
          lane's 8 scales (column 8 s + g, s = 0..7) are 16 contiguous bytes; per-channel scales stay
          in natural order (they multiply the accumulators in the epilogue).
  zeros   [groups, n] zero points as x-dtype values 0..15, permuted like grouped scales; None = 8.
  codebook  what a nibble means: "int4" ((q - zero) x scale), "nf4" (NF4_TABLE[q] x scale, bitsandbytes'
          NormalFloat codes), or "mxfp4" (E2M1_VALUES[q] x scale, OCP MXFP4 codes, group size 32, each scale a
          power of two). The table codebooks have no zero points; their words store the nibbles above in the
          order p = 0 4 1 5 2 6 3 7 (NF4_NIBBLE_ORDER), which the table lookup in kernels/w4a16/dequant.cuh needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...quant.int4 import Int4Weight

K_MULTIPLE = 64  # k must be a multiple of this: the packed layout's k16 rows come in 64-wide stages
BK = 128  # the mma.sync kernel's k tile and the skinny kernel's stage; with k % 128 == 64 their last is half of one
DTYPES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
CODEBOOKS = ("int4", "nf4", "mxfp4")
TABLE_CODEBOOKS = ("nf4", "mxfp4")  # a 16-entry value table, looked up (no zero points)
MXFP4_GROUP = 32  # one E8M0 scale per 32 weights (OCP MX)
NF4_NIBBLE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble i of a table-codebook word holds int4-layout nibble NF4_NIBBLE_ORDER[i]


@dataclass
class W4A16Weight:
    """A 4-bit weight in the kernel's layout, for y = x @ W^T with W [n, k]."""
    packed: torch.Tensor            # int32 [n/64, 8k] (strip-major, see the module docstring)
    scales: torch.Tensor            # fp16/bf16 [groups, n] (see module docstring for the order)
    zeros: torch.Tensor | None      # same dtype [groups, n] or None (symmetric)
    group_size: int                 # -1 (per channel), 32, 64, 128
    n: int
    k: int
    perm: torch.Tensor | None = None  # act-order: the kernel computes x[..., perm] @ W^T
    codebook: str = "int4"            # "int4", "nf4" or "mxfp4" (module docstring)

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def to(self, *args, **kwargs) -> "W4A16Weight":
        """Like Tensor.to: a device moves every tensor; a dtype (float16 / bfloat16, the activation
        dtype the weight serves) converts the scales and zero points only, never the packed words."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype not in DTYPES:
            raise TypeError(f"a W4A16 weight's dtype (its scales') must be float16 or bfloat16, got {dtype}")

        def move(t, values: bool):
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if values else None, non_blocking=non_blocking)
        return W4A16Weight(move(self.packed, False), move(self.scales, True), move(self.zeros, True), self.group_size,
                           self.n, self.k, move(self.perm, False), self.codebook)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [n, k] weight in the kernel's k order (act-order: permuted), each value
        code-value x scale computed in float64 and rounded once to dtype."""
        q = unpack(self)
        if self.codebook == "int4":
            return q.dequantize(dtype)
        # a fresh tensor, not a copy of a cached one: under torch.compile's backward it is traced
        values = torch.tensor(codebook_values(self.codebook), dtype=torch.float64, device=q.q.device)[q.q.long()]
        scales = q.scales.double().repeat_interleave(self.group_size if self.group_size != -1 else self.k, dim=1)
        return (values * scales).to(dtype)


def codebook_values(codebook: str) -> tuple[float, ...]:
    """The 16 values a table codebook's codes stand for, in code order."""
    if codebook == "nf4":
        from ...quant.nf4 import NF4_TABLE

        return tuple(NF4_TABLE)
    if codebook == "mxfp4":
        from ...quant.mxfp4 import E2M1_VALUES

        return E2M1_VALUES
    raise ValueError(f"codebook {codebook!r} has no value table (the table codebooks are {TABLE_CODEBOOKS})")


def check_codebook(codebook: str, group_size: int, symmetric: bool) -> None:
    """What the kernels read: "int4" codes with any group size and zero points; "nf4" codes with group
    scales and no zero points (NF4 values are signed already); "mxfp4" codes with group size 32 and no
    zero points (E2M1 values are signed; one scale a 32-weight block)."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
    if codebook == "nf4" and (not symmetric or group_size == -1):
        raise ValueError(f"codebook 'nf4' needs group scales (group_size 32, 64 or 128) and no zero points "
                         f"(symmetric=True); got group_size={group_size}, symmetric={symmetric}")
    if codebook == "mxfp4" and (not symmetric or group_size != MXFP4_GROUP):
        raise ValueError(f"codebook 'mxfp4' needs group_size {MXFP4_GROUP} (one scale a block) and no zero points "
                         f"(symmetric=True); got group_size={group_size}, symmetric={symmetric}")


def check_perm(perm: torch.Tensor, k: int) -> None:
    """An act-order permutation must be an integer tensor [k] holding each of 0..k-1 once (the op
    gathers x's columns with it; a bad index would read out of bounds on the GPU). Reads its values:
    call where a weight is built or loaded, not per call."""
    if not isinstance(perm, torch.Tensor) or perm.dtype not in (torch.int32, torch.int64) or perm.shape != (k,):
        raise ValueError(f"perm must be an int32/int64 tensor of shape ({k},) (a permutation of in_features), got "
                         f"{getattr(perm, 'dtype', type(perm).__name__)} {tuple(getattr(perm, 'shape', ()))}")
    if perm.device.type != "meta" and not bool((torch.sort(perm).values == torch.arange(k, device=perm.device)).all()):
        raise ValueError(f"perm must hold each of 0..{k - 1} exactly once")


def _strip_permute(t: torch.Tensor) -> torch.Tensor:
    """[rows, n] -> within each 64-column strip, position 8 g + s holds column 8 s + g."""
    rows, n = t.shape
    return t.reshape(rows, n // 64, 8, 8).transpose(-1, -2).reshape(rows, n)


def _strip_unpermute(t: torch.Tensor) -> torch.Tensor:
    return _strip_permute(t)  # the permutation is a transpose of 8x8 blocks: its own inverse


def check_shape(n: int, k: int, group_size: int) -> None:
    if n % 64:
        raise ValueError(f"W4A16 needs n (out_features) to be a multiple of 64; got n={n}")
    if k % K_MULTIPLE:
        raise ValueError(f"W4A16 needs k (in_features) to be a multiple of {K_MULTIPLE}; got k={k}")
    if group_size not in (-1, 32, 64, 128):
        raise ValueError(f"W4A16 group_size must be -1, 32, 64 or 128; got {group_size}")
    if group_size != -1 and k % group_size:
        raise ValueError(f"W4A16 group_size={group_size} needs k (in_features) to be a multiple of it; got k={k}")


def pack(w: Int4Weight, perm: torch.Tensor | None = None, codebook: str = "int4") -> W4A16Weight:
    """Int4Weight (q [n, k], scales/zeros [n, groups]) -> the kernel layout. Pure torch, any device.
    codebook "nf4": q holds NF4 codes (tilefish.nf4.prepare builds these); "mxfp4": E2M1 codes with
    group size 32 (quant.mxfp4.to_int4_weight); both without zero points."""
    n, k = w.n, w.k
    check_shape(n, k, w.group_size)
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {CODEBOOKS}, got {codebook!r}")
    if codebook in TABLE_CODEBOOKS and w.zeros is not None:
        raise ValueError(f"an {codebook} codebook weight has no zero points")
    check_codebook(codebook, w.group_size, w.zeros is None)
    if perm is not None:
        check_perm(perm, k)
    q = w.q.to(torch.int64)
    # n = 64 S + 16 j + 8 h + g ; k = 16 r + 8 a + 2 t + b
    v = q.view(n // 64, 4, 2, 8, k // 16, 2, 4, 2)          # S j h g r a t b
    v = v.permute(0, 4, 3, 6, 1, 7, 2, 5)                     # S r g t j b h a
    v = v.reshape(n // 64, k // 16, 32, 4, 8)
    if codebook in TABLE_CODEBOOKS:
        v = v[..., list(NF4_NIBBLE_ORDER)]
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    packed = words.reshape(n // 64, 8 * k).contiguous()
    scales = w.scales.t().contiguous()                       # [groups, n]
    if w.group_size != -1:
        scales = _strip_permute(scales).contiguous()
    zeros = None
    if w.zeros is not None:
        zeros = _strip_permute(w.zeros.t().to(w.scales.dtype)).contiguous()
    return W4A16Weight(packed, scales, zeros, w.group_size, n, k, perm, codebook)


def unpack(p: W4A16Weight) -> Int4Weight:
    """The inverse of pack (for tests and export): q holds the codes (int4 values or NF4 indices)."""
    n, k = p.n, p.k
    words = p.packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int64)
    v = (words.view(n // 64, k // 16, 32, 4, 1) >> shifts) & 0xF        # S r (g t) j p
    if p.codebook in TABLE_CODEBOOKS:
        v = v[..., [NF4_NIBBLE_ORDER.index(i) for i in range(8)]]
    v = v.view(n // 64, k // 16, 8, 4, 4, 2, 2, 2)                      # S r g t j b h a
    v = v.permute(0, 4, 6, 2, 1, 7, 3, 5)                               # S j h g r a t b
    q = v.reshape(n, k).to(torch.uint8)
    scales = p.scales if p.group_size == -1 else _strip_unpermute(p.scales)
    zeros = None if p.zeros is None else _strip_unpermute(p.zeros).to(torch.uint8).t().contiguous()
    return Int4Weight(q.contiguous(), scales.t().contiguous(), zeros, p.group_size)


# A gated weight (gate and up projections of a SiLU-gated MLP as one matmul whose epilogue computes
# silu(gate) * up): its columns alternate GATED_BLOCK gate columns and the same GATED_BLOCK up columns, so
# every kernel thread that holds a gate column holds its up column too (kernels/w4a16/epilogue.cuh).
GATED_BLOCK = 8


def gated_order(n: int, device=None) -> torch.Tensor:
    """[n] int64: column p of a gated weight is column gated_order(n)[p] of [gate; up] (each n / 2 wide)."""
    if n % (2 * GATED_BLOCK):
        raise ValueError(f"a gated weight needs n % {2 * GATED_BLOCK} == 0, got n={n}")
    half, block = n // 2, GATED_BLOCK
    base = torch.arange(0, half, block, device=device).view(-1, 1, 1)  # first gate column of each block
    within = torch.arange(block, device=device).view(1, 1, -1)
    side = torch.tensor([0, half], device=device).view(1, 2, 1)        # gate, then up
    return (base + side + within).reshape(n)


def split_gated(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up columns of a gated weight's output y [..., n] (copies, each [..., n / 2])."""
    blocks = y.reshape(*y.shape[:-1], -1, 2, GATED_BLOCK)
    return tuple(blocks[..., i, :].reshape(*y.shape[:-1], -1) for i in (0, 1))


def _take_columns(w: W4A16Weight, index: torch.Tensor) -> W4A16Weight:
    """w with its output columns reordered, exactly: column p of the result is column index[p] of w."""
    q = unpack(w)
    packed = pack(Int4Weight(q.q[index], q.scales[index], None, q.group_size), codebook=w.codebook).packed

    def columns(t: torch.Tensor | None, permuted: bool) -> torch.Tensor | None:  # a [groups, n] kernel tensor
        if t is None:
            return None
        t = (_strip_unpermute(t) if permuted else t)[:, index]
        return (_strip_permute(t) if permuted else t).contiguous()
    return W4A16Weight(packed, columns(w.scales, w.group_size != -1), columns(w.zeros, True), w.group_size, w.n,
                       w.k, w.perm, w.codebook)


def interleave_gated(w: W4A16Weight) -> W4A16Weight:
    """[gate; up] side by side (n = 2 I) -> the gated column order (gated_order)."""
    return _take_columns(w, gated_order(w.n, w.packed.device))


def deinterleave_gated(w: W4A16Weight) -> W4A16Weight:
    """The inverse of interleave_gated: a gated weight -> [gate; up] side by side."""
    return _take_columns(w, torch.argsort(gated_order(w.n, w.packed.device)))
