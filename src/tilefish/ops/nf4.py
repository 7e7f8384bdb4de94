"""NF4 ops: dequantization (validate -> pick the kernel variant -> launch) and the fused matmul
(a bitsandbytes weight repacked once into the W4A16 kernels' layout with codebook "nf4").

CPU tensors go to reference.py (bitsandbytes' exact fp32 arithmetic), so the ops work everywhere.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ..quant.nf4 import NF4Weight
from ..runtime import KernelSpec, device_info, get_kernel, i32, i64, launch

if TYPE_CHECKING:
    from .w4a16 import W4A16Weight

SOURCE = "nf4/dequantize.cu"
THREADS = 256
VECTOR_ELEMS = 32  # one 16-byte vector of codes
OUT_DTYPES = {torch.bfloat16: "__nv_bfloat16", torch.float16: "__half", torch.float32: "float"}


@dataclass(frozen=True)
class DequantConfig:
    """Template parameters of kernels/nf4/dequantize.cu plus the grid size rule."""
    lut: int = 0          # 0 shared-memory 16 floats, 1 warp shuffle, 2 shared 256 x float2
    transpose: int = 1    # 1: re-deal codes through shared memory so warp stores are contiguous
    ilp: int = 1          # 16-byte vectors in flight per lane
    stream: bool = True   # evict-first output stores
    prefetch: bool = False  # L2::256B hint on code loads
    blocks_per_sm: int = 0  # grid = SMs x this (grid-stride loop); 0: one pass, a block per tile

    def label(self) -> str:
        return (f"lut{self.lut}-t{self.transpose}-ilp{self.ilp}-{'cs' if self.stream else 'wb'}"
                f"{'-pf' if self.prefetch else ''}-b{self.blocks_per_sm}")


# Chosen from `tilefish bench nf4 --variants` on the H200 (docs/nf4.md has the sweep).
DEFAULT_CONFIG = DequantConfig()


@functools.lru_cache(maxsize=None)
def kernel_spec(dtype: torch.dtype, double_quant: bool, cfg: DequantConfig = DEFAULT_CONFIG) -> KernelSpec:
    name = (f"nf4_dequantize<{OUT_DTYPES[dtype]}, {'true' if double_quant else 'false'}, {cfg.lut}, "
            f"{cfg.transpose}, {cfg.ilp}, {'true' if cfg.stream else 'false'}, {'true' if cfg.prefetch else 'false'}>")
    return KernelSpec(SOURCE, name, hot=True)


def variant_configs() -> list[DequantConfig]:
    """The design space the benchmark sweeps (each is compilable; only the default is dispatched).

    TRANSPOSE=0 stays in with one representative per LUT: it shows what the store pattern costs.
    """
    out = [DequantConfig(lut, 0, 1, False) for lut in (0, 1, 2)]
    for lut in (0, 1, 2):
        for ilp in (1, 2):
            for stream in (False, True):
                for bps in (8, 32, 0):
                    out.append(DequantConfig(lut, 1, ilp, stream, False, bps))
    out += [DequantConfig(0, 1, 1, True, True, bps) for bps in (8, 32, 0)]
    return out


def dispatch_specs(arch: str | None = None) -> list[KernelSpec]:
    """The dequantize kernels: the same on every arch (sm_80 and newer, no arch-specific code); arch
    ("sm_86", None: any) filters by KernelSpec.supports all the same."""
    specs = [kernel_spec(dt, dq) for dt in OUT_DTYPES for dq in (True, False)]
    return [s for s in specs if arch is None or s.supports(arch)]


def _check_out(out: torch.Tensor, q: NF4Weight, dtype: torch.dtype) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")
    if out.numel() != q.numel:
        raise ValueError(f"out has {out.numel()} elements, the weight has {q.numel} (shape {tuple(q.shape)})")
    if out.device != q.codes.device:
        raise ValueError(f"out is on {out.device}, the weight's codes are on {q.codes.device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")


def launch_dequantize(q: NF4Weight, out: torch.Tensor, cfg: DequantConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Launch the kernel writing into `out` (contiguous, right dtype and size, same device)."""
    if q.codes.data_ptr() % 16 or out.data_ptr() % 16:
        raise ValueError("the CUDA kernel needs 16-byte aligned codes and output "
                         f"(codes at {q.codes.data_ptr() % 16} mod 16, out at {out.data_ptr() % 16} mod 16); "
                         "pass freshly allocated tensors or .clone() them")
    dev = q.codes.device
    k = get_kernel(kernel_spec(out.dtype, q.double_quant, cfg), dev)
    n_vec = q.numel // VECTOR_ELEMS
    per_block = THREADS * cfg.ilp
    tiles = max(1, -(-n_vec // per_block))
    grid = tiles if cfg.blocks_per_sm == 0 else min(tiles, device_info(dev.index).sm_count * cfg.blocks_per_sm)
    null = 0
    args = (
        q.codes.data_ptr(), out.data_ptr(),
        q.absmax.data_ptr() if q.absmax is not None else null,
        q.absmax_q.data_ptr() if q.double_quant else null,
        q.code2.data_ptr() if q.double_quant else null,
        q.absmax2.data_ptr() if q.double_quant else null,
        q.offset.data_ptr() if q.double_quant else null,
        i64(q.numel), i32(q.blocksize.bit_length() - 1),
    )
    launch(k, grid, THREADS, *args)
    return out


def dequantize_impl(q: NF4Weight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    q.validate()
    if dtype not in OUT_DTYPES:
        raise TypeError(f"NF4 dequantize: dtype must be bfloat16, float16 or float32, not {dtype}")
    if out is not None:
        _check_out(out, q, dtype)
    if q.codes.device.type == "cpu":
        from ..reference import nf4_dequantize_fp32_chain

        res = nf4_dequantize_fp32_chain(q, dtype)
        if out is None:
            return res
        out.view(-1).copy_(res.view(-1))
        return out
    if q.codes.device.type != "cuda":
        raise ValueError(f"NF4 dequantize runs on CUDA or CPU tensors, not {q.codes.device}")
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.codes.device)
    return launch_dequantize(q, out)


# ---- the fused NF4 matmul: bitsandbytes weights repacked once into the W4A16 kernels' layout --------------------
#
# An NF4 weight [n, k] is a 4-bit code per element and an fp32 scale (absmax) per block of `blocksize`
# consecutive elements of the flattened weight. With k % 128 == 0 and g = min(blocksize, 128), every
# (row, k-group of g) segment lies inside one block (g divides both k and the blocksize, so block
# boundaries fall on multiples of g), so the weight is exactly the W4A16 form "code value x per-group
# scale" with group size g: the codes go into the W4A16 kernel layout with codebook "nf4" (the kernels
# look NF4 values up instead of subtracting a zero point) and the decoded absmax, rounded once to the
# activation dtype, becomes the group scales. Everything W4A16 has (skinny stream-K, wgmma, mma.sync,
# the dispatcher, launch plans) runs NF4 unchanged. The bitsandbytes scale tensors are kept as given,
# so export (to_nf4, bnb state dicts) is exact.

MATMUL_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(eq=False)
class NF4MatmulWeight:
    """An NF4 weight [n, k] prepared for tilefish.nf4.matmul (tilefish.nf4.prepare builds it).

    kernel: the codes in the W4A16 kernel layout (codebook "nf4") and the per-group scales in the
    activation dtype. blocksize, orig_dtype and the scale tensors (absmax, or absmax_q / code2 /
    absmax2 / offset with double quant) are the bitsandbytes weight's, unchanged."""

    kernel: "W4A16Weight"
    blocksize: int
    orig_dtype: torch.dtype
    absmax: torch.Tensor | None = None
    absmax_q: torch.Tensor | None = None
    code2: torch.Tensor | None = None
    absmax2: torch.Tensor | None = None
    offset: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return self.kernel.n

    @property
    def k(self) -> int:
        return self.kernel.k

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype the kernel scales are in (x must have it)."""
        return self.kernel.dtype

    @property
    def device(self) -> torch.device:
        return self.kernel.device

    @property
    def double_quant(self) -> bool:
        return self.absmax_q is not None

    def scale_state(self, codes: torch.Tensor) -> NF4Weight:
        """An NF4Weight with these block scales and the given codes (an empty tensor where only the
        scales are read, as _kernel_scales does)."""
        return NF4Weight(codes=codes, shape=self.shape, dtype=self.orig_dtype, blocksize=self.blocksize,
                         absmax=self.absmax, absmax_q=self.absmax_q, code2=self.code2, absmax2=self.absmax2,
                         offset=self.offset)

    def to_nf4(self) -> NF4Weight:
        """The bitsandbytes weight, bit for bit (codes repacked back to bitsandbytes' byte order)."""
        from .w4a16 import unpack

        codes = unpack(self.kernel).q.reshape(-1)
        packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8)
        return self.scale_state(packed)

    def to(self, *args, **kwargs) -> "NF4MatmulWeight":
        """A device moves every tensor; a dtype (float16 / bfloat16) rebuilds the kernel scales for
        that activation dtype from the exact block scales."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and dtype not in MATMUL_DTYPES:
            raise TypeError(f"an NF4 matmul weight serves float16 or bfloat16 activations, not {dtype}")

        def move(t):
            return None if t is None else t.to(device=device, non_blocking=non_blocking)
        out = NF4MatmulWeight(self.kernel.to(device=device, non_blocking=non_blocking), self.blocksize,
                              self.orig_dtype, move(self.absmax), move(self.absmax_q), move(self.code2),
                              move(self.absmax2), move(self.offset))
        if dtype is not None and dtype != self.dtype:
            out.kernel = replace(out.kernel, scales=_kernel_scales(out, dtype))
        return out


def scale_group(blocksize: int) -> int:
    """The fused matmul's scale group of an NF4 weight of `blocksize`: blocks above 128 split to 128."""
    return min(blocksize, 128)


def check_matmul_shape(shape, blocksize: int) -> None:
    """What the fused kernels can tile: a 2-D weight [n, k], n % 64 == 0, k % 64 == 0, and k a multiple
    of the matmul's scale group min(blocksize, 128) (so blocksize >= 128 needs k % 128 == 0)."""
    from .w4a16.layout import K_MULTIPLE

    if len(shape) != 2:
        raise ValueError(f"the NF4 matmul needs a 2-D weight [out_features, in_features], got shape {tuple(shape)}")
    n, k = shape
    group = scale_group(blocksize)
    if n % 64 or k % K_MULTIPLE or k % group:
        raise ValueError(f"the NF4 matmul kernels tile n (out_features) by 64 and k (in_features) by {K_MULTIPLE}, "
                         f"and need k % {group} == 0 (the scale group of blocksize {blocksize}); got n={n}, k={k}. "
                         "tilefish.nf4.dequantize + F.linear handles any shape")


def _group_scales(w: NF4Weight, n: int, k: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Each (row, k-group) segment's block absmax, decoded in fp32 as bitsandbytes does and rounded
    once to `dtype`: [n, k / group]. A scale that overflows fp16 is an error."""
    from ..reference import nf4_absmax

    absmax = nf4_absmax(w)
    first = (torch.arange(n, device=absmax.device)[:, None] * k
             + torch.arange(0, k, group, device=absmax.device)[None, :])      # each segment's first element
    scales = absmax[first // w.blocksize]
    out = scales.to(dtype)
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"an NF4 block scale (absmax up to {float(scales.abs().max()):.4g}) does not fit {dtype}; "
                         "prepare the weight for bfloat16 activations")
    return out


def _kernel_scales(w: NF4MatmulWeight, dtype: torch.dtype) -> torch.Tensor:
    from .w4a16 import _strip_permute

    state = w.scale_state(torch.empty(0, dtype=torch.uint8, device=w.device))
    return _strip_permute(_group_scales(state, w.n, w.k, w.kernel.group_size, dtype).t().contiguous()).contiguous()


def prepare(q: NF4Weight, dtype: torch.dtype | None = None) -> NF4MatmulWeight:
    """Repack an NF4 weight [n, k] once for the fused matmul with `dtype` activations (default the
    weight's dtype; float16 for a float32 weight). Lossless: to_nf4() gives the weight back bit for bit.
    Pure torch, on the weight's device; reads the scales once (a device sync)."""
    from ..quant.int4 import Int4Weight
    from .w4a16 import pack

    if not isinstance(q, NF4Weight):
        raise TypeError(f"prepare expects an NF4Weight (tilefish.nf4.quantize / from_bnb / from_state_dict), "
                        f"got {type(q).__name__}")
    q.validate()
    check_matmul_shape(q.shape, q.blocksize)
    dtype = dtype or (q.dtype if q.dtype in MATMUL_DTYPES else torch.float16)
    if dtype not in MATMUL_DTYPES:
        raise TypeError(f"the NF4 matmul runs float16 or bfloat16 activations, not {dtype}")
    n, k = q.shape
    c = q.codes
    codes = torch.stack((c >> 4, c & 0xF), dim=1).reshape(n, k)
    group = scale_group(q.blocksize)
    kernel = pack(Int4Weight(codes, _group_scales(q, n, k, group, dtype), None, group), codebook="nf4")
    return NF4MatmulWeight(kernel, q.blocksize, q.dtype, q.absmax, q.absmax_q, q.code2, q.absmax2, q.offset)


def matmul_impl(x: torch.Tensor, w: NF4MatmulWeight, bias: torch.Tensor | None = None, workspace=None) -> torch.Tensor:
    """CUDA: the W4A16 kernels with NF4 codes; CPU: bitsandbytes' dequantization then a float64 matmul.
    workspace: as in ops.w4a16.matmul_impl."""
    if not isinstance(w, NF4MatmulWeight):
        if isinstance(w, NF4Weight):
            raise TypeError("nf4.matmul takes a prepared weight: w = tilefish.nf4.prepare(nf4_weight) once, then "
                            "matmul(x, w) (or use tilefish.nn.NF4Linear, which does it for you)")
        raise TypeError(f"w must be an NF4MatmulWeight (tilefish.nf4.prepare), got {type(w).__name__}")
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        from ..reference import dense_matmul, nf4_dequantize_fp32_chain
        from .w4a16 import validate

        validate(x, w.kernel, bias)
        dense = nf4_dequantize_fp32_chain(w.to_nf4(), x.dtype)
        return dense_matmul(x.reshape(-1, w.k), dense, bias).reshape(*x.shape[:-1], w.n)
    from .w4a16 import matmul_impl as w4a16_matmul_impl

    return w4a16_matmul_impl(x, w.kernel, bias, workspace=workspace)
