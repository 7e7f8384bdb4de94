"""INT4 weight formats for the W4A16 GEMM, in pure torch (CPU and GPU).

What the W4A16 op computes: ``y = x @ dequant(W).T (+ bias)`` with ``x [..., k]`` fp16/bf16 and a logical
weight ``W [n, k]`` (the weight of an ``nn.Linear(k, n)``).

The logical form, :class:`Int4Weight`, is plain and unpacked (one ``uint8`` per 4-bit value) so that it is
easy to test and to feed the pure-torch reference; the kernel side repacks it into its own tile layout.

* Symmetric:  ``W[i, j] = (q[i, j] - 8)         * scales[i, j // G]``
* Asymmetric: ``W[i, j] = (q[i, j] - zeros[i, g]) * scales[i, g]``,  ``g = j // G``

``q`` and ``zeros`` are in 0..15; ``G`` is the group size along k (``G = k`` when ``group_size == -1``).

Checkpoint conventions (confirmed against the packers/unpackers of AutoGPTQ
``auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py`` (``QuantLinear.pack`` / ``forward``) and AutoAWQ
``awq/modules/linear/gemm.py`` (``WQLinear_GEMM.from_linear``) + ``awq/utils/packing_utils.py``):

GPTQ
    ``qweight`` int32 ``[k / 8, n]``: word ``qweight[r, c]`` holds ``q`` of input rows ``8r .. 8r+7`` of output
    column ``c``; row ``8r + j`` sits in bits ``4j .. 4j+3`` (first element in the low bits).
    ``qzeros`` int32 ``[k / G, n / 8]``: word ``qzeros[g, c]`` holds the zeros of output columns ``8c .. 8c+7``;
    column ``8c + j`` in bits ``4j .. 4j+3``.
    ``scales`` ``[k / G, n]``; ``g_idx`` int32 ``[k]`` = the group of each input row (act-order / desc_act
    checkpoints permute it).
    Zero convention ``"v1"`` (AutoGPTQ's classic format): the stored nibble is ``true_zero - 1`` and readers add
    1 back, so true zero 0 cannot be stored (it would become -1) and a stored 15 would mean 16.
    ``"v2"`` (GPTQModel's internal format): stored nibble = true zero.
    Symmetric GPTQ checkpoints still carry ``qzeros`` (all 7 under v1, all 8 under v2).

AWQ (GEMM layout)
    ``qweight`` int32 ``[k, n / 8]``: word ``qweight[i, c]`` holds output columns ``8c .. 8c+7`` of input row
    ``i``, in the interleaved order ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``: nibble ``j`` (bits ``4j..4j+3``)
    holds column ``8c + AWQ_ORDER[j]``; equivalently column ``8c + t`` is in nibble ``AWQ_REVERSE_ORDER[t]``
    with ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``.
    ``qzeros`` int32 ``[k / G, n / 8]`` packed the same way; the stored zero is the true zero (no offset).
    ``scales`` ``[k / G, n]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "AWQ_ORDER",
    "AWQ_REVERSE_ORDER",
    "SUPPORTED_GROUP_SIZES",
    "Int4Weight",
    "quantize_rtn",
    "from_gptq",
    "to_gptq",
    "from_awq",
    "to_awq",
]

SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)
SCALE_DTYPES = (torch.float16, torch.bfloat16)
SYMMETRIC_ZERO = 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)          # nibble j of a word holds column AWQ_ORDER[j] of its 8-block
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column t of an 8-block lives in nibble AWQ_REVERSE_ORDER[t]
_ZERO_CONVENTIONS = ("v1", "v2")


# ----------------------------------------------------------------------------------------------------------------
# validation helpers


def _check_tensor(name: str, t, dtypes, ndim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}; got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D; got shape {tuple(t.shape)}")


def _check_group_size(group_size) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int in {SUPPORTED_GROUP_SIZES}; got {group_size!r}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}; got {group_size}")


def _group_len(group_size: int, k: int) -> int:
    return k if group_size == -1 else group_size


def _check_k_divisible(k: int, group_size: int) -> None:
    if k <= 0:
        raise ValueError(f"k (in_features) must be positive; got {k}")
    if group_size != -1 and k % group_size != 0:
        raise ValueError(f"k (in_features) = {k} must be a multiple of group_size = {group_size}")


def _check_nibbles(name: str, t: torch.Tensor) -> None:
    if t.device.type == "meta" or t.numel() == 0:
        return
    hi = int(t.max())
    if hi > 15:
        raise ValueError(f"{name} values must be in 0..15 (4 bits); found {hi}")


def _check_same_device(**tensors) -> None:
    devs = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise ValueError(f"tensors must be on one device; got {', '.join(f'{k}={v}' for k, v in devs.items())}")


def _check_zero_convention(zero_convention) -> None:
    if zero_convention not in _ZERO_CONVENTIONS:
        raise ValueError(f"zero_convention must be one of {_ZERO_CONVENTIONS}; got {zero_convention!r}")


# ----------------------------------------------------------------------------------------------------------------
# the logical form


@dataclass
class Int4Weight:
    """Unpacked 4-bit weight of an ``nn.Linear(k, n)``: ``W[i, j] = (q[i, j] - z[i, j // G]) * scales[i, j // G]``.

    q:          uint8 ``[n, k]``, values 0..15
    scales:     fp16 / bf16 ``[n, k // G]`` (``G = k`` when ``group_size == -1``)
    zeros:      uint8 ``[n, k // G]``, values 0..15; ``None`` = symmetric (zero point 8)
    group_size: -1, 32, 64 or 128

    Construction checks types and shapes (cheap, no device sync); :meth:`validate` also checks value ranges.
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int

    def __post_init__(self) -> None:
        self._check_structure()

    # -- properties -------------------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    @property
    def group_len(self) -> int:
        """The number of consecutive k elements sharing one scale (k when group_size == -1)."""
        return _group_len(self.group_size, self.k)

    @property
    def groups(self) -> int:
        return self.k // self.group_len

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def dtype(self) -> torch.dtype:
        """The scale dtype (the natural activation/output dtype for this weight)."""
        return self.scales.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    # -- checks -----------------------------------------------------------------------------------------------
    def _check_structure(self) -> None:
        _check_group_size(self.group_size)
        _check_tensor("Int4Weight.q", self.q, (torch.uint8,), ndim=2)
        _check_tensor("Int4Weight.scales", self.scales, SCALE_DTYPES, ndim=2)
        n, k = self.q.shape
        if n <= 0:
            raise ValueError(f"n (out_features) must be positive; got {n}")
        _check_k_divisible(k, self.group_size)
        groups = k // _group_len(self.group_size, k)
        if tuple(self.scales.shape) != (n, groups):
            raise ValueError(
                f"Int4Weight.scales must have shape [n, k // G] = {(n, groups)} for q {tuple(self.q.shape)} and "
                f"group_size {self.group_size}; got {tuple(self.scales.shape)}"
            )
        if self.zeros is not None:
            _check_tensor("Int4Weight.zeros", self.zeros, (torch.uint8,), ndim=2)
            if tuple(self.zeros.shape) != (n, groups):
                raise ValueError(
                    f"Int4Weight.zeros must have shape [n, k // G] = {(n, groups)}; got {tuple(self.zeros.shape)}"
                )
        _check_same_device(q=self.q, scales=self.scales, zeros=self.zeros)

    def validate(self) -> "Int4Weight":
        """Check dtypes, shapes, devices and value ranges (q, zeros in 0..15, finite scales); returns self."""
        self._check_structure()
        _check_nibbles("Int4Weight.q", self.q)
        if self.zeros is not None:
            _check_nibbles("Int4Weight.zeros", self.zeros)
        if self.scales.device.type != "meta" and not bool(torch.isfinite(self.scales).all()):
            raise ValueError("Int4Weight.scales must be finite (found inf or NaN)")
        return self

    # -- conversions ------------------------------------------------------------------------------------------
    def zero_points(self) -> torch.Tensor:
        """uint8 ``[n, groups]`` zero points; all 8 for a symmetric weight."""
        if self.zeros is not None:
            return self.zeros
        return torch.full_like(self.scales, SYMMETRIC_ZERO, dtype=torch.uint8)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical weight ``W [n, k]``. Computed in fp32, where it is exact, then cast to ``dtype``."""
        n, k, gl = self.n, self.k, self.group_len
        q = self.q.to(torch.float32).view(n, self.groups, gl)
        z = self.zero_points().to(torch.float32).unsqueeze(-1)
        w = (q - z) * self.scales.to(torch.float32).unsqueeze(-1)
        return w.view(n, k).to(dtype)

    def to(self, device=None, *, scale_dtype: torch.dtype | None = None) -> "Int4Weight":
        """A copy on ``device`` (and with scales cast to ``scale_dtype`` if given)."""
        scales = self.scales.to(device=device, dtype=scale_dtype or self.scales.dtype)
        zeros = None if self.zeros is None else self.zeros.to(device)
        return Int4Weight(self.q.to(device), scales, zeros, self.group_size)

    def __repr__(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return (
            f"Int4Weight(n={self.n}, k={self.k}, group_size={self.group_size}, {kind}, "
            f"scales={self.scales.dtype}, device={self.device})"
        )


# ----------------------------------------------------------------------------------------------------------------
# round-to-nearest quantization


def _default_shrink_factors() -> tuple[float, ...]:
    # 1.0 first, so that the search can only improve on the no-search result (ties keep the earlier candidate).
    return tuple(round(1.0 - 0.05 * i, 2) for i in range(11))  # 1.0, 0.95, ..., 0.5


def _rtn_candidate(wg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, factor: float, symmetric: bool,
                   scale_dtype: torch.dtype):
    """Scales (cast to scale_dtype and back), zeros and q for one shrink factor. wg [n, groups, G] fp32."""
    finfo = torch.finfo(scale_dtype)
    if symmetric:
        # levels (q - 8) in -8..7: the tightest scale that clips nothing is max(hi / 7, -lo / 8)
        s = torch.maximum(hi.clamp(min=0) / 7.0, (-lo).clamp(min=0) / 8.0) * factor
        s = s.clamp(min=finfo.tiny, max=finfo.max).to(scale_dtype).to(torch.float32)
        z = torch.full_like(s, float(SYMMETRIC_ZERO))
    else:
        lo_f, hi_f = lo * factor, hi * factor
        s = ((hi_f - lo_f) / 15.0).clamp(min=finfo.tiny, max=finfo.max).to(scale_dtype).to(torch.float32)
        z = torch.round(-lo_f / s).clamp(0, 15)
    q = torch.round(wg / s.unsqueeze(-1) + z.unsqueeze(-1)).clamp(0, 15)
    return s, z, q


def quantize_rtn(
    w: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    clip_search: bool = True,
    *,
    scale_dtype: torch.dtype | None = None,
    shrink_factors: tuple[float, ...] | None = None,
) -> Int4Weight:
    """Round-to-nearest 4-bit quantization of ``w [n, k]`` (fp16, bf16 or fp32) with groups along k.

    Each group's scale (and, for ``symmetric=False``, zero point) comes from its range, shrunk by each factor of
    ``shrink_factors`` (default 1.0, 0.95, ..., 0.5) when ``clip_search`` is on; the candidate with the smallest
    squared error of the group (measured with the scale as stored, in ``scale_dtype``) is kept. Factor 1.0 alone
    (``clip_search=False``) clips nothing; the search is never worse than it, group by group.

    ``scale_dtype`` defaults to ``w.dtype`` for fp16/bf16 and to fp16 for fp32 input.
    """
    _check_tensor("w", w, (torch.float16, torch.bfloat16, torch.float32), ndim=2)
    _check_group_size(group_size)
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool; got {symmetric!r}")
    n, k = w.shape
    if n <= 0:
        raise ValueError(f"n (out_features) must be positive; got {n}")
    _check_k_divisible(k, group_size)
    if scale_dtype is None:
        scale_dtype = w.dtype if w.dtype in SCALE_DTYPES else torch.float16
    if scale_dtype not in SCALE_DTYPES:
        raise TypeError(f"scale_dtype must be torch.float16 or torch.bfloat16; got {scale_dtype}")
    if w.device.type != "meta" and not bool(torch.isfinite(w).all()):
        raise ValueError("w must be finite (found inf or NaN)")
    if shrink_factors is None:
        shrink_factors = _default_shrink_factors()
    factors = tuple(float(f) for f in shrink_factors)
    if not factors or any(not (0.0 < f <= 1.0) for f in factors):
        raise ValueError(f"shrink_factors must be a non-empty sequence of values in (0, 1]; got {shrink_factors}")
    if not clip_search:
        factors = (1.0,)

    gl = _group_len(group_size, k)
    groups = k // gl
    wg = w.to(torch.float32).reshape(n, groups, gl)
    lo = wg.amin(dim=-1)
    hi = wg.amax(dim=-1)
    if not symmetric:
        # a constant group has no range: widen it to include 0 so that the constant is representable exactly
        flat = hi == lo
        lo = torch.where(flat, lo.clamp(max=0), lo)
        hi = torch.where(flat, hi.clamp(min=0), hi)

    best = None
    for f in factors:
        s, z, q = _rtn_candidate(wg, lo, hi, f, symmetric, scale_dtype)
        err = ((q - z.unsqueeze(-1)) * s.unsqueeze(-1) - wg).square().sum(dim=-1)
        q = q.to(torch.uint8)
        if best is None:
            best = [err, s, z, q]
            continue
        better = err < best[0]
        best[0] = torch.where(better, err, best[0])
        best[1] = torch.where(better, s, best[1])
        best[2] = torch.where(better, z, best[2])
        best[3] = torch.where(better.unsqueeze(-1), q, best[3])
    _, s, z, q = best
    return Int4Weight(
        q=q.reshape(n, k),
        scales=s.to(scale_dtype),
        zeros=None if symmetric else z.to(torch.uint8),
        group_size=group_size,
    )


# ----------------------------------------------------------------------------------------------------------------
# nibble packing (int32 words, nibble j in bits 4j .. 4j+3)

_SHIFTS = tuple(range(0, 32, 4))


def _unpack_last(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., m] -> uint8 [..., m * 8]; nibble j of word c becomes element 8c + j."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=words.device)
    nib = torch.bitwise_right_shift(words.unsqueeze(-1), shifts) & 0xF
    return nib.reshape(*words.shape[:-1], words.shape[-1] * 8).to(torch.uint8)


def _pack_last(vals: torch.Tensor) -> torch.Tensor:
    """uint8 [..., m * 8] (0..15) -> int32 [..., m]; element 8c + j goes to nibble j of word c."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=vals.device)
    v = vals.to(torch.int64).reshape(*vals.shape[:-1], vals.shape[-1] // 8, 8)
    words = torch.bitwise_left_shift(v, shifts).sum(dim=-1)          # 0 .. 2**32 - 1
    words = torch.where(words >= 2**31, words - 2**32, words)        # reinterpret as signed int32
    return words.to(torch.int32)


def _awq_columns_to_nibbles(vals: torch.Tensor) -> torch.Tensor:
    """Logical column order -> AWQ nibble order within each 8-block of the last dim (nibble j <- column ORDER[j])."""
    idx = torch.tensor(AWQ_ORDER, device=vals.device)
    m = vals.shape[-1] // 8
    return vals.reshape(*vals.shape[:-1], m, 8).index_select(-1, idx).reshape(vals.shape)


def _awq_nibbles_to_columns(vals: torch.Tensor) -> torch.Tensor:
    """AWQ nibble order -> logical column order (column t <- nibble REVERSE_ORDER[t])."""
    idx = torch.tensor(AWQ_REVERSE_ORDER, device=vals.device)
    m = vals.shape[-1] // 8
    return vals.reshape(*vals.shape[:-1], m, 8).index_select(-1, idx).reshape(vals.shape)


def _resolve_group_size(group_size, k: int, num_groups: int, what: str) -> int:
    if group_size is None:
        if num_groups <= 0 or k % num_groups != 0:
            raise ValueError(f"{what}: k = {k} is not a multiple of the number of scale rows ({num_groups})")
        if num_groups == 1:
            return -1
        group_size = k // num_groups
        if group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"{what}: inferred group_size {group_size} (k = {k}, {num_groups} groups) is not supported; "
                f"supported: {SUPPORTED_GROUP_SIZES}"
            )
        return group_size
    _check_group_size(group_size)
    _check_k_divisible(k, group_size)
    if k // _group_len(group_size, k) != num_groups:
        raise ValueError(
            f"{what}: scales have {num_groups} rows but k = {k} with group_size {group_size} needs "
            f"{k // _group_len(group_size, k)}"
        )
    return group_size


def _maybe_symmetric(zeros: torch.Tensor) -> torch.Tensor | None:
    return None if bool((zeros == SYMMETRIC_ZERO).all()) else zeros


# ----------------------------------------------------------------------------------------------------------------
# GPTQ


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None = None,
    *,
    bits: int = 4,
    zero_convention: str = "v1",
    group_size: int | None = None,
) -> tuple[Int4Weight, torch.Tensor | None]:
    """Import a GPTQ ``QuantLinear`` (qweight, qzeros, scales, g_idx) as ``(Int4Weight, perm)``.

    ``group_size`` is inferred from ``scales`` when not given (one scale row -> -1). With act-order (``g_idx``
    not equal to ``arange(k) // G``) the weight is returned in permuted k order, ``perm = argsort(g_idx)``
    (stable), so that its groups are contiguous: ``W_checkpoint[:, perm] == weight.dequantize()`` and
    ``x @ W_checkpoint.T == x[..., perm] @ weight.dequantize().T``. ``perm`` (int64 ``[k]``) is ``None`` when
    trivial. Zero points that are all 8 (after undoing the v1 offset) give a symmetric weight (``zeros=None``);
    ``qzeros=None`` also means symmetric.
    """
    if bits != 4:
        raise ValueError(f"only bits=4 is supported; got bits={bits}")
    _check_zero_convention(zero_convention)
    _check_tensor("qweight", qweight, (torch.int32,), ndim=2)
    _check_tensor("scales", scales, SCALE_DTYPES, ndim=2)
    if qzeros is not None:
        _check_tensor("qzeros", qzeros, (torch.int32,), ndim=2)
    if g_idx is not None:
        _check_tensor("g_idx", g_idx, (torch.int32, torch.int64), ndim=1)
    _check_same_device(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)

    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if scales.shape[1] != n:
        raise ValueError(f"scales must have shape [k / G, n] with n = {n} (from qweight [k / 8, n]); "
                         f"got {tuple(scales.shape)}")
    num_groups = scales.shape[0]
    G_arg = _resolve_group_size(group_size, k, num_groups, "from_gptq")
    gl = _group_len(G_arg, k)
    if qzeros is not None:
        if n % 8 != 0:
            raise ValueError(f"n = {n} must be a multiple of 8 (qzeros packs 8 output columns per int32)")
        if tuple(qzeros.shape) != (num_groups, n // 8):
            raise ValueError(f"qzeros must have shape [k / G, n / 8] = {(num_groups, n // 8)}; "
                             f"got {tuple(qzeros.shape)}")

    # q in checkpoint k order: [k/8, n] words -> [k/8, n, 8] nibbles -> [k, n] -> [n, k]
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device)
    nib = torch.bitwise_right_shift(qweight.unsqueeze(1), shifts.view(1, 8, 1)) & 0xF      # [k/8, 8, n]
    q = nib.reshape(k, n).t().contiguous().to(torch.uint8)

    if qzeros is None:
        zeros = None
    else:
        stored = _unpack_last(qzeros)                                                        # [groups, n]
        if zero_convention == "v1":
            if bool((stored == 15).any()):
                raise ValueError(
                    "qzeros holds the nibble 15, which under zero_convention='v1' means a zero point of 16 "
                    "(out of range 0..15): v1 cannot store a zero point of 0; the checkpoint is probably "
                    "corrupt, or it uses zero_convention='v2'"
                )
            stored = stored + 1
        zeros = _maybe_symmetric(stored.t().contiguous())

    perm = None
    if g_idx is not None:
        if g_idx.shape[0] != k:
            raise ValueError(f"g_idx must have shape [k] = [{k}]; got {tuple(g_idx.shape)}")
        gi = g_idx.to(torch.int64)
        trivial = torch.arange(k, device=gi.device) // gl
        if not bool((gi == trivial).all()):
            if bool((gi < 0).any()) or bool((gi >= num_groups).any()):
                raise ValueError(f"g_idx values must be in 0..{num_groups - 1}")
            counts = torch.bincount(gi, minlength=num_groups)
            if not bool((counts == gl).all()):
                raise ValueError(
                    f"g_idx must assign exactly G = {gl} input rows to each of the {num_groups} groups; "
                    f"group sizes found range {int(counts.min())}..{int(counts.max())}"
                )
            perm = torch.sort(gi, stable=True).indices
            q = q.index_select(1, perm).contiguous()

    weight = Int4Weight(q=q, scales=scales.t().contiguous(), zeros=zeros, group_size=G_arg)
    return weight, perm


def to_gptq(w: Int4Weight, zero_convention: str = "v1", *, perm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Export as GPTQ tensors ``{"qweight", "qzeros", "scales", "g_idx"}`` (the inverse of :func:`from_gptq`).

    ``perm`` (optional, a permutation of k) says that ``w`` is in permuted k order, column ``i`` of ``w`` being
    checkpoint input row ``perm[i]`` (as returned by :func:`from_gptq`); the export is then an act-order
    checkpoint with ``g_idx[perm[i]] = i // G``. Symmetric weights get stored zeros 7 (v1) / 8 (v2).
    """
    if not isinstance(w, Int4Weight):
        raise TypeError(f"w must be an Int4Weight; got {type(w).__name__}")
    _check_zero_convention(zero_convention)
    w.validate()
    n, k, gl = w.n, w.k, w.group_len
    if k % 8 != 0:
        raise ValueError(f"k = {k} must be a multiple of 8 (qweight packs 8 input rows per int32)")
    if n % 8 != 0:
        raise ValueError(f"n = {n} must be a multiple of 8 (qzeros packs 8 output columns per int32)")

    q = w.q
    g_idx = torch.arange(k, device=q.device, dtype=torch.int32) // gl
    if perm is not None:
        _check_tensor("perm", perm, (torch.int32, torch.int64), ndim=1)
        p = perm.to(device=q.device, dtype=torch.int64)
        if p.shape[0] != k or not bool((torch.sort(p).values == torch.arange(k, device=p.device)).all()):
            raise ValueError(f"perm must be a permutation of range(k = {k})")
        q_ck = torch.empty_like(q)
        q_ck[:, p] = q
        g_ck = torch.empty_like(g_idx)
        g_ck[p] = g_idx
        q, g_idx = q_ck, g_ck

    qweight = _pack_last(q.t().reshape(k // 8, 8, n).transpose(1, 2).reshape(k // 8, n * 8))  # [k/8, n]
    zeros = w.zero_points().t().contiguous()                                              # [groups, n]
    if zero_convention == "v1":
        if bool((zeros == 0).any()):
            raise ValueError("zero_convention='v1' cannot store a zero point of 0 (stored value would be -1); "
                             "use zero_convention='v2'")
        zeros = zeros - 1
    qzeros = _pack_last(zeros)
    return {"qweight": qweight, "qzeros": qzeros, "scales": w.scales.t().contiguous(), "g_idx": g_idx}


# ----------------------------------------------------------------------------------------------------------------
# AWQ


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int) -> Int4Weight:
    """Import an AWQ ``WQLinear_GEMM`` (qweight [k, n/8], qzeros [k/G, n/8], scales [k/G, n]).

    Zero points that are all 8 give a symmetric weight (``zeros=None``); the dequantized weight is the same.
    """
    _check_tensor("qweight", qweight, (torch.int32,), ndim=2)
    _check_tensor("qzeros", qzeros, (torch.int32,), ndim=2)
    _check_tensor("scales", scales, SCALE_DTYPES, ndim=2)
    _check_same_device(qweight=qweight, qzeros=qzeros, scales=scales)
    _check_group_size(group_size)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_k_divisible(k, group_size)
    groups = k // _group_len(group_size, k)
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"scales must have shape [k / G, n] = {(groups, n)} for qweight {tuple(qweight.shape)} "
                         f"and group_size {group_size}; got {tuple(scales.shape)}")
    if tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"qzeros must have shape [k / G, n / 8] = {(groups, n // 8)}; got {tuple(qzeros.shape)}")
    q = _awq_nibbles_to_columns(_unpack_last(qweight)).t().contiguous()                  # [n, k]
    zeros = _awq_nibbles_to_columns(_unpack_last(qzeros)).t().contiguous()               # [n, groups]
    return Int4Weight(q=q, scales=scales.t().contiguous(), zeros=_maybe_symmetric(zeros), group_size=group_size)


def to_awq(w: Int4Weight) -> dict[str, torch.Tensor]:
    """Export as AWQ GEMM tensors ``{"qweight", "qzeros", "scales"}`` (the inverse of :func:`from_awq`)."""
    if not isinstance(w, Int4Weight):
        raise TypeError(f"w must be an Int4Weight; got {type(w).__name__}")
    w.validate()
    if w.n % 8 != 0:
        raise ValueError(f"n = {w.n} must be a multiple of 8 (AWQ packs 8 output columns per int32)")
    qweight = _pack_last(_awq_columns_to_nibbles(w.q.t().contiguous()))                  # [k, n/8]
    qzeros = _pack_last(_awq_columns_to_nibbles(w.zero_points().t().contiguous()))       # [groups, n/8]
    return {"qweight": qweight, "qzeros": qzeros, "scales": w.scales.t().contiguous()}
