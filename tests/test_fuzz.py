"""Property-based fuzzing (hypothesis) of every op against tilefish.reference, and torch.library.opcheck.

Ops: W4A16 matmul (int4 codes, every group size, zero points, act order, forced k splits / stream-K),
NF4 dequantize (out= poisoned), the fused NF4 matmul, HGEMM and SGEMM (c poisoned where beta == 0).

Legality is never predicted here: each drawn case goes to the op (and the builders in front of it:
quantize / pack / prepare). If they raise, the exception must be a ValueError / TypeError whose
message names the offending value, no tilefish kernel may have launched, and a following valid call
must still give its known result with torch.cuda.synchronize() raising nothing. Otherwise the output
is compared with the reference. So the tests follow the ops when their legal space grows (k % 64).

Tolerances: relative error ||out - ref|| / ||ref|| against a float64 reference rounded once to the
output dtype, conftest.TOLERANCE by output dtype:
  fp32 (SGEMM) 1e-5: fp32 accumulation over k <= ~4k terms, ~sqrt(k) * 2^-24 = 4e-6 rms at k = 4096;
  fp16 2e-3: the output rounding (<= 2^-11 = 4.9e-4 an element) plus, for the 4-bit ops, the weight
       value code x scale formed in fp16 inside the kernel (another <= 2^-11 a weight, random signs);
  bf16 1.6e-2: the same two roundings at bf16's 2^-8 (3.9e-3 each), with room for their sum.
  NF4 dequantize is compared bit for bit (the kernel follows bitsandbytes' fp32 chain exactly).

Examples: hypothesis, no example database, a fixed seed (TILEFISH_FUZZ_SEED, default 0), so a run
is reproducible and a failure prints its falsifying example and a @reproduce_failure blob.
TILEFISH_FUZZ_EXAMPLES=N runs N examples per op (target for long device runs: >= 500). Each test
first replays its own example sequence without launching anything, collects the kernels it will
dispatch and compiles them in parallel processes (bench.progress.warm_kernels), so the run does not
compile one kernel at a time.

  default  (GPU ~40-60 s on an H100 with a cold kernel cache):  pytest -m gpu tests/test_fuzz.py
  long:    TILEFISH_FUZZ_EXAMPLES=500 pytest -m gpu tests/test_fuzz.py -x -rP   (-rP: examples run per op)
  CPU part (CI): pytest tests/test_fuzz.py
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings, strategies as st
from hypothesis import seed as hypothesis_seed

import tilefish
from tilefish import nf4, reference, w4a16
from tilefish.ops import library
from tilefish.ops import w4a16 as w4ops
from tilefish.ops.w4a16 import launch as w4launch
from tilefish.quant.int4 import quantize_rtn
from tilefish.quant.nf4 import SUPPORTED_BLOCKSIZES

from conftest import TOLERANCE, rel_err

hg = importlib.import_module("tilefish.ops.hgemm")
sg = importlib.import_module("tilefish.ops.sgemm")

_EXAMPLES = os.environ.get("TILEFISH_FUZZ_EXAMPLES", "").strip()
FUZZ_SEED = int(os.environ.get("TILEFISH_FUZZ_SEED", "0"), 0)
REJECT = (ValueError, TypeError)
F16 = (torch.float16, torch.bfloat16)


def n_examples(default: int) -> int:
    return int(_EXAMPLES) if _EXAMPLES else default


def fuzz(default: int):
    """hypothesis settings of every fuzz test: `default` examples (TILEFISH_FUZZ_EXAMPLES overrides),
    no database, the fixed seed, no deadline (first launches compile), the falsifying blob printed."""
    def deco(f):
        f = settings(max_examples=n_examples(default), database=None, derandomize=False, deadline=None,
                     print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much, HealthCheck.large_base_example,
                                            HealthCheck.function_scoped_fixture])(f)
        return hypothesis_seed(FUZZ_SEED)(f)
    return deco


# Default example counts per op on the GPU (the distinct kernels they touch are warmed in parallel first).
GPU_EXAMPLES = {"w4a16": 40, "nf4_dequantize": 40, "nf4_matmul": 25, "hgemm": 30, "sgemm": 25}
CPU_EXAMPLES = 25


# ---- helpers ----------------------------------------------------------------------------------------------------

def _gen(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _randn(g, *shape, dtype=torch.float32, device="cuda", scale: float = 1.0):
    return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)


def _poison_allocator(numel: int, dtype, device) -> None:
    """Leave a NaN block of the output's size in the caching allocator: the op's torch.empty output
    reuses it, so an element the kernel fails to write shows up as NaN (rel_err rejects NaN)."""
    if torch.device(device).type == "cuda" and numel > 0:
        torch.full((numel,), float("nan"), device=device, dtype=dtype)


@contextlib.contextmanager
def count_launches(device):
    """Counts tilefish kernel launches (every op launches through runtime.launch's cuda.core launch)."""
    calls = [0]
    if torch.device(device).type != "cuda":
        yield calls
        return
    import importlib

    rl = importlib.import_module("tilefish.runtime.launch")  # the module: tilefish.runtime re-exports a launch() function

    orig = rl._cuda_launch()

    def counting(*args, **kwargs):
        calls[0] += 1
        return orig(*args, **kwargs)

    rl._launch_fn = counting
    try:
        yield calls
    finally:
        rl._launch_fn = orig


def assert_clear_rejection(exc: BaseException, *names) -> None:
    """A rejected input: ValueError / TypeError, a message of some length that names one of `names`
    (the offending values or constraint words); never a CUDA / driver error."""
    assert isinstance(exc, REJECT), f"expected ValueError/TypeError, got {type(exc).__name__}: {exc}"
    msg = str(exc)
    assert len(msg) >= 20, f"unhelpful message: {msg!r}"
    low = msg.lower()
    for bad in ("cuda_error", "cudaerror", "illegal address", "launch failure", "misaligned address"):
        assert bad not in low, f"a CUDA error surfaced as {type(exc).__name__}: {msg}"
    if names:
        assert any(str(v).lower() in low for v in names), f"message names none of {names}: {msg!r}"


def _sentinel(device):
    """A small valid W4A16 + HGEMM call with its first result: run after every rejection."""
    g = _gen(12345, device)
    q = quantize_rtn(_randn(g, 128, 256, device=device), 128, False, clip_search=False, scale_dtype=torch.float16)
    p = w4ops.pack(q)
    x = _randn(g, 3, 256, dtype=torch.float16, device=device)
    a, b = _randn(g, 33, 64, dtype=torch.float16, device=device), _randn(g, 64, 40, dtype=torch.float16, device=device)

    def run():
        return w4a16.matmul(x, p), tilefish.hgemm(a, b)
    return run, run()


_SENTINELS: dict = {}


def after_rejection(device) -> None:
    """The device is fine after a rejected call: a valid call gives its known bits and synchronize() is clean."""
    key = str(device)
    if key not in _SENTINELS:
        _SENTINELS[key] = _sentinel(device)
    run, want = _SENTINELS[key]
    got = run()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    for o, w in zip(got, want):
        assert torch.equal(o, w), "a valid call after a rejected one changed its result"


def rejected(device, fn, *names):
    """Run fn expecting either a result (returned) or a clean rejection (None is returned)."""
    with count_launches(device) as calls:
        try:
            out = fn()
        except REJECT as e:
            assert_clear_rejection(e, *names)
            assert calls[0] == 0, f"{calls[0]} kernel(s) launched before the rejection: {e}"
            note(f"rejected: {type(e).__name__}: {e}")
            after_rejection(device)
            return None
    return out


def _x_view(g, lead, k, dtype, layout, device):
    """x [*lead, k] as a contiguous tensor, a storage-offset view (aligned or not), a row slice of a
    wider matrix (row pitch != k) or a transposed view."""
    m = math.prod(lead)
    if layout.startswith("offset"):
        off = int(layout[6:])
        x = _randn(g, m * k + off, dtype=dtype, device=device)[off:].view(m, k)
    elif layout == "sliced":
        x = _randn(g, m, k + 24, dtype=dtype, device=device)[:, 8:8 + k]
    elif layout == "transposed":
        x = _randn(g, k, m, dtype=dtype, device=device).t()
    else:
        x = _randn(g, m, k, dtype=dtype, device=device)
    return x.unflatten(0, lead) if len(lead) > 1 else x


X_LAYOUTS = ["contiguous", "contiguous", "offset1", "offset3", "offset8", "sliced", "transposed"]


# ---- strategies -------------------------------------------------------------------------------------------------

def _m():
    """Odd and even m from 1 to ~600 (most mass on the small, dispatch-sensitive values), a few large."""
    return st.one_of(st.integers(1, 20), st.integers(21, 600), st.sampled_from([0, 1024, 2048 + 3, 4099]))


def _multiple_of_64(lo, hi, large):
    """Legal-looking k / n (multiples of 64, the smallest legal and large ones), and now and then any int."""
    return st.one_of(st.integers(lo, hi).map(lambda i: 64 * i), st.integers(lo, hi).map(lambda i: 64 * i),
                     st.integers(lo, hi).map(lambda i: 64 * i), st.sampled_from([64] + large),
                     st.integers(1, 64 * hi))


@dataclasses.dataclass(frozen=True)
class W4Case:
    lead: tuple
    n: int
    k: int
    group: int
    dtype: torch.dtype
    sym: bool
    act_order: bool
    bias: str | None
    layout: str
    force: tuple | None      # (cfg, slices, ctas) forced, or None: the dispatcher's plan
    codebook: str
    seed: int

    @property
    def m(self) -> int:
        return math.prod(self.lead)


def _force(m):
    """Now and then force a plan: any configuration of the three kernels, with a k split or grid."""
    cfgs = list(w4ops.CONFIGS) + list(w4ops.HOPPER_CONFIGS) + list(w4ops.SKINNY_CONFIGS)
    return st.one_of(st.none(), st.none(), st.none(),
                     st.tuples(st.sampled_from(cfgs), st.sampled_from([None, 1, 2, 3, 5, 8]),
                               st.sampled_from([None, 1, 7, 31, 100000])).map(
                         lambda t: (t[0], None if t[0].streamk else t[1], t[2] if t[0].streamk else None)))


@st.composite
def w4a16_cases(draw, codebook="int4"):
    m = draw(_m())
    lead = draw(st.sampled_from([(m,), (m,), (1, m), (m, 1)] if m else [(m,)]))
    return W4Case(lead=lead, n=draw(_multiple_of_64(1, 40, [4096, 8192, 14336])),
                  k=draw(_multiple_of_64(1, 48, [4096, 8192, 14336])),
                  group=draw(st.sampled_from([-1, 32, 64, 128])), dtype=draw(st.sampled_from(F16)),
                  sym=draw(st.booleans()), act_order=draw(st.booleans()),
                  bias=draw(st.sampled_from([None, None, "contiguous", "strided"])),
                  layout=draw(st.sampled_from(X_LAYOUTS)), force=draw(_force(m)), codebook=codebook,
                  seed=draw(st.integers(0, 2**31 - 1)))


@dataclasses.dataclass(frozen=True)
class NF4Case:
    shape: tuple
    blocksize: int
    double_quant: bool
    orig_dtype: torch.dtype
    dtype: torch.dtype
    out: str | None          # None: allocated by the op; else how out is given
    codes_offset: int        # codes as a view this many bytes into a buffer
    seed: int


@st.composite
def nf4_dequant_cases(draw):
    shape = draw(st.one_of(
        st.tuples(st.integers(1, 300), st.integers(1, 700)),
        st.tuples(st.integers(1, 5000)),
        st.tuples(st.integers(1, 4), st.integers(1, 30), st.integers(1, 200)),
        st.sampled_from([(4096, 4096 + 64), (1, 1), (3, 65), (11008, 512)])))
    return NF4Case(shape=shape, blocksize=draw(st.sampled_from(SUPPORTED_BLOCKSIZES)),
                   double_quant=draw(st.booleans()),
                   orig_dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])),
                   dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])),
                   out=draw(st.sampled_from([None, "contiguous", "contiguous", "flat", "offset", "strided",
                                             "wrong_dtype", "wrong_size"])),
                   codes_offset=draw(st.sampled_from([0, 0, 0, 16, 1])), seed=draw(st.integers(0, 2**31 - 1)))


@dataclasses.dataclass(frozen=True)
class NF4MatmulCase:
    lead: tuple
    n: int
    k: int
    blocksize: int
    double_quant: bool
    dtype: torch.dtype
    bias: str | None
    layout: str
    seed: int

    @property
    def m(self) -> int:
        return math.prod(self.lead)


@st.composite
def nf4_matmul_cases(draw):
    m = draw(_m())
    return NF4MatmulCase(lead=draw(st.sampled_from([(m,), (1, m)] if m else [(m,)])),
                         n=draw(_multiple_of_64(1, 40, [4096, 11008])),
                         k=draw(_multiple_of_64(1, 48, [4096, 8192])),
                         blocksize=draw(st.sampled_from(SUPPORTED_BLOCKSIZES)), double_quant=draw(st.booleans()),
                         dtype=draw(st.sampled_from(F16)), bias=draw(st.sampled_from([None, "contiguous", "strided"])),
                         layout=draw(st.sampled_from(X_LAYOUTS)), seed=draw(st.integers(0, 2**31 - 1)))


@dataclasses.dataclass(frozen=True)
class GemmCase:
    m: int
    n: int
    k: int
    dtype: torch.dtype
    kernel: str
    b_transposed: bool
    a_layout: str
    b_layout: str
    c: str | None             # sgemm: None, or how c is given
    alpha: float
    beta: float
    seed: int


def _dim(small_hi, large):
    return st.one_of(st.integers(1, 40), st.integers(1, small_hi), st.sampled_from([0] + large))


def _gemm_k(multiple):
    return st.one_of(st.integers(0, 128).map(lambda i: multiple * i), st.integers(0, 128).map(lambda i: multiple * i),
                     st.integers(0, 1100), st.sampled_from([multiple, 4096]))


@st.composite
def hgemm_cases(draw):
    kernels = ["auto"] * 6 + [s for s in hg.KERNELS if not hg.STEPS[s].hopper]
    return GemmCase(m=draw(_dim(600, [1024, 2100])), n=draw(_dim(700, [1000, 4096])), k=draw(_gemm_k(8)),
                    dtype=draw(st.sampled_from(F16)), kernel=draw(st.sampled_from(kernels)),
                    b_transposed=draw(st.booleans()),
                    a_layout=draw(st.sampled_from(["contiguous", "contiguous", "transposed", "offset1", "offset8"])),
                    b_layout=draw(st.sampled_from(["contiguous", "contiguous", "transposed", "offset1", "offset8"])),
                    c=None, alpha=1.0, beta=0.0, seed=draw(st.integers(0, 2**31 - 1)))


@st.composite
def sgemm_cases(draw):
    kernels = ["auto"] * 4 + list(sg.KERNELS)
    c = draw(st.sampled_from([None, None, "contiguous", "contiguous", "transposed", "offset1"]))
    beta = 0.0 if c is None else draw(st.sampled_from([0.0, 0.0, 1.0, -0.75]))
    return GemmCase(m=draw(_dim(600, [1024, 2049])), n=draw(_dim(700, [1000, 2052])), k=draw(_gemm_k(4)),
                    dtype=torch.float32, kernel=draw(st.sampled_from(kernels)), b_transposed=False,
                    a_layout=draw(st.sampled_from(["contiguous", "contiguous", "transposed", "offset1", "offset4"])),
                    b_layout=draw(st.sampled_from(["contiguous", "contiguous", "transposed", "offset1", "offset4"])),
                    c=c, alpha=draw(st.sampled_from([1.0, 1.0, 0.0, -2.5, 0.3])), beta=beta,
                    seed=draw(st.integers(0, 2**31 - 1)))


def _matrix(g, rows, cols, dtype, layout, device):
    if layout == "transposed":
        return _randn(g, cols, rows, dtype=dtype, device=device).t()
    if layout.startswith("offset"):
        off = int(layout[6:])
        return _randn(g, rows * cols + off, dtype=dtype, device=device)[off:].view(rows, cols)
    return _randn(g, rows, cols, dtype=dtype, device=device)


# ---- the case runners (device: "cuda" in the GPU tests; "cpu" runs the same bodies on the reference path) ------

def _bias(g, kind, n, dtype, device):
    if kind is None:
        return None
    if kind == "strided":
        return _randn(g, 2 * n, dtype=dtype, device=device)[::2]
    return _randn(g, n, dtype=dtype, device=device)


def _call_w4a16(x, p, bias, force):
    if force is None:
        return w4a16.matmul(x, p, bias)
    cfg, slices, ctas = force
    return w4ops.matmul_impl(x, p, bias, cfg=cfg, slices=slices, ctas=ctas)


def run_w4a16_case(c: W4Case, device="cuda") -> None:
    note(repr(c))
    g = _gen(c.seed, device)
    w = _randn(g, c.n, c.k, device=device, scale=0.02 + (c.seed % 100) / 50)
    perm = torch.randperm(c.k, generator=g, device=device) if c.act_order and c.k else None
    built = rejected(device, lambda: (q := quantize_rtn(w, c.group, c.sym, clip_search=False, scale_dtype=c.dtype),
                                      w4ops.pack(q, perm))[::-1] + (q,), c.n, c.k, c.group)
    x = _x_view(g, c.lead, c.k, c.dtype, c.layout, device)
    bias = _bias(g, c.bias, c.n, c.dtype, device)
    if built is None:  # the builders refused the weight: so must the op, given one built by hand
        fake = w4ops.W4A16Weight(torch.zeros(max(c.n // 64, 1), 8 * c.k, dtype=torch.int32, device=device),
                                 torch.ones(max(1, c.k // c.group if c.group > 0 else 1), c.n, dtype=c.dtype,
                                            device=device), None, c.group, c.n, c.k)
        rejected(device, lambda: w4a16.matmul(x, fake, bias), c.n, c.k, c.group)
        return
    p, _, q = built
    if p.k != x.shape[-1]:
        raise AssertionError("pack changed k")
    _poison_allocator(c.m * c.n, c.dtype, device)
    out = rejected(device, lambda: _call_w4a16(x, p, bias, c.force), c.n, c.k, c.m, "config", "m <=", "n %")
    if out is None:
        assert c.force is not None, "the dispatcher's own plan was rejected"
        return
    xr = x.reshape(-1, c.k)
    if perm is not None:
        xr = xr[:, perm]
    ref = reference.w4a16_matmul(xr, q, bias).reshape(*c.lead, c.n)
    assert out.shape == ref.shape and out.dtype == c.dtype
    if out.numel():
        err = rel_err(out, ref)
        assert err < TOLERANCE[c.dtype], f"rel err {err:.3g} >= {TOLERANCE[c.dtype]}"


def _nf4_weight(g, c, device):
    w = _randn(g, *c.shape, dtype=c.orig_dtype, device=device, scale=0.1 + (c.seed % 50) / 10)
    return nf4.quantize(w, blocksize=c.blocksize, double_quant=c.double_quant)


def run_nf4_dequant_case(c: NF4Case, device="cuda") -> None:
    note(repr(c))
    g = _gen(c.seed, device)
    q = _nf4_weight(g, c, device)
    if c.codes_offset:
        buf = torch.zeros(q.codes.numel() + c.codes_offset, dtype=torch.uint8, device=device)
        buf[c.codes_offset:].copy_(q.codes)
        q = dataclasses.replace(q, codes=buf[c.codes_offset:])
    numel = q.numel
    out = None
    if c.out is not None:
        dt = c.dtype if c.out != "wrong_dtype" else torch.float32 if c.dtype != torch.float32 else torch.float16
        if c.out == "contiguous":
            out = torch.empty(q.shape, dtype=dt, device=device)
        elif c.out == "flat":
            out = torch.empty(numel, dtype=dt, device=device)
        elif c.out == "offset":
            out = torch.empty(numel + 1, dtype=dt, device=device)[1:]
        elif c.out == "strided":
            out = torch.empty(numel * 2, dtype=dt, device=device)[::2]
        elif c.out == "wrong_size":
            out = torch.empty(numel + 1, dtype=dt, device=device)
        else:
            out = torch.empty(q.shape, dtype=dt, device=device)
        out.fill_(float("nan"))
    res = rejected(device, lambda: nf4.dequantize(q, c.dtype, out=out), "out", "aligned", "contiguous", "dtype",
                   "elements", numel)
    if res is None:
        return
    if out is not None:
        assert res is out
    ref = reference.nf4_dequantize_fp32_chain(q, c.dtype)
    assert res.dtype == c.dtype and res.numel() == numel
    assert not torch.isnan(res).any(), "unwritten output elements (NaN poison survived)"
    assert torch.equal(res.reshape(-1), ref.reshape(-1)), "differs from bitsandbytes' fp32 chain"


def run_nf4_matmul_case(c: NF4MatmulCase, device="cuda") -> None:
    note(repr(c))
    g = _gen(c.seed, device)
    w = _randn(g, c.n, c.k, device=device, scale=0.05 + (c.seed % 30) / 10)
    q = nf4.quantize(w, blocksize=c.blocksize, double_quant=c.double_quant)
    p = rejected(device, lambda: nf4.prepare(q, c.dtype), c.n, c.k, c.blocksize)
    x = _x_view(g, c.lead, c.k, c.dtype, c.layout, device)
    bias = _bias(g, c.bias, c.n, c.dtype, device)
    if p is None:
        return
    _poison_allocator(c.m * c.n, c.dtype, device)
    out = nf4.matmul(x, p, bias)
    dense = p.kernel.dequantize(torch.float64)  # the kernel's format exactly: NF4 value x group scale
    ref = reference.dense_matmul(x.reshape(-1, c.k), dense, bias).reshape(*c.lead, c.n)
    assert out.shape == ref.shape and out.dtype == c.dtype
    if out.numel():
        err = rel_err(out, ref)
        assert err < TOLERANCE[c.dtype], f"rel err {err:.3g} >= {TOLERANCE[c.dtype]}"


def _gemm_ref(a, b, c=None, alpha=1.0, beta=0.0):
    out = a.double() @ b.double()
    out = out * alpha
    if c is not None and beta != 0:
        out = out + beta * c.double()
    return out


def run_hgemm_case(c: GemmCase, device="cuda") -> None:
    note(repr(c))
    g = _gen(c.seed, device)
    a = _matrix(g, c.m, c.k, c.dtype, c.a_layout, device)
    b = _matrix(g, *((c.n, c.k) if c.b_transposed else (c.k, c.n)), c.dtype, c.b_layout, device)
    _poison_allocator(c.m * c.n, c.dtype, device)
    out = rejected(device, lambda: tilefish.hgemm(a, b, kernel=c.kernel, b_transposed=c.b_transposed),
                   c.k, c.n, "aligned", "sm_90")
    if out is None:
        return
    ref = _gemm_ref(a, b.t() if c.b_transposed else b)
    assert out.shape == (c.m, c.n) and out.dtype == c.dtype
    if out.numel():
        assert not torch.isnan(out).any(), "unwritten output elements (NaN poison survived)"
        err = rel_err(out, ref)
        assert err < TOLERANCE[c.dtype], f"rel err {err:.3g} >= {TOLERANCE[c.dtype]}"


def run_sgemm_case(c: GemmCase, device="cuda") -> None:
    note(repr(c))
    g = _gen(c.seed, device)
    a = _matrix(g, c.m, c.k, torch.float32, c.a_layout, device)
    b = _matrix(g, c.k, c.n, torch.float32, c.b_layout, device)
    cc = None
    if c.c is not None:
        cc = _matrix(g, c.m, c.n, torch.float32, c.c, device)
        if c.beta == 0:
            cc.fill_(float("nan"))  # beta == 0 never reads c (BLAS): NaN must not leak into the result
    c_before = None if cc is None else cc.clone()
    if cc is None:
        _poison_allocator(c.m * c.n, torch.float32, device)
    out = rejected(device, lambda: tilefish.sgemm(a, b, cc, alpha=c.alpha, beta=c.beta, kernel=c.kernel),
                   c.k, c.n, "aligned")
    assert out is not None, "sgemm takes any shape and alignment"
    if cc is not None:
        assert out is cc, "sgemm must update c in place and return it"
    ref = _gemm_ref(a, b, c_before, c.alpha, c.beta)
    assert out.shape == (c.m, c.n)
    if out.numel():
        err = rel_err(out, ref)
        assert err < TOLERANCE[torch.float32], f"rel err {err:.3g} >= {TOLERANCE[torch.float32]}"


# ---- kernel warm-up: replay each test's examples without launching, compile their kernels in parallel ---------

def _w4a16_spec(c, info, clusters, table):
    from tilefish.ops.w4a16 import dispatch, kernel_spec

    try:
        w4ops.check_shape(c.n, c.k, c.group)
    except ValueError:
        return None
    if c.m == 0:
        return None
    group, asym = c.group, not c.sym
    cfg = c.force[0] if c.force is not None else dispatch.choose_plan(
        c.m, c.n, c.k, info.sm_count, info.cc, group, clusters, c.dtype, c.codebook, table).cfg
    return kernel_spec(c.dtype, cfg, group, asym, c.codebook)


def _nf4_matmul_spec(c, info, clusters, table):
    from tilefish.ops.w4a16 import dispatch, kernel_spec

    group = min(c.blocksize, 128)
    if c.n % 64 or c.k % 64 or c.k % group or not c.m:
        return None
    cfg = dispatch.choose_plan(c.m, c.n, c.k, info.sm_count, info.cc, group, clusters, c.dtype, "nf4", table).cfg
    return kernel_spec(c.dtype, cfg, group, False, "nf4")


def _hgemm_spec(c, info):
    if c.k % 8 or not c.m or not c.n or not c.k:
        return None
    try:
        cfg = hg.select(c.m, c.n, c.kernel, info.sm_count, info.cc, info.smem_per_block_optin)
        if cfg.info.hopper and cfg.TMA_STORE and c.n % 8:
            cfg = hg._direct_store(cfg)
        return [cfg.spec(c.dtype, b_nk) for b_nk in (False, True)]
    except Exception:
        return None


def _sgemm_spec(c, info):
    if not (c.m and c.n and c.k):
        return None
    return [sg.select(c.m, c.n, v, c.kernel, info.sm_count).spec for v in (True, False)]


def warm(strategy, default, spec_of) -> None:
    """Replay the test's example sequence (same strategy, settings and seed) collecting the kernels its
    cases dispatch, then compile the missing ones in parallel processes. Only a head start: a kernel
    missed here compiles on first use."""
    from tilefish.bench.progress import warm_kernels
    from tilefish.runtime import device_info

    info = device_info()
    clusters, table = w4launch.device_clusters(info), w4launch._device_table(info)
    specs = []

    @fuzz(default)
    @given(case=strategy)
    def collect(case):
        s = spec_of(case, info, clusters, table)
        specs.extend(s if isinstance(s, list) else [s] if s is not None else [])

    collect()
    print(warm_kernels([s for s in specs if s.supports(info.arch)], info.arch))


_warmed: set = set()
EXAMPLES_RUN: collections.Counter = collections.Counter()


def _report(name: str) -> None:
    """The examples hypothesis actually ran (it may stop short of max_examples): shown with pytest -rP."""
    print(f"fuzz {name}: {EXAMPLES_RUN[name]} examples run (max_examples {n_examples(GPU_EXAMPLES[name])}, "
          f"TILEFISH_FUZZ_SEED={FUZZ_SEED})")


def _warm_once(name, strategy, spec_of):
    if name not in _warmed:
        _warmed.add(name)
        warm(strategy, GPU_EXAMPLES[name], spec_of)


# ---- GPU fuzz tests ---------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
def test_fuzz_w4a16_matmul():
    _warm_once("w4a16", w4a16_cases(), _w4a16_spec)

    @fuzz(GPU_EXAMPLES["w4a16"])
    @given(case=w4a16_cases())
    def prop(case):
        EXAMPLES_RUN["w4a16"] += 1
        run_w4a16_case(case, "cuda")
    prop()
    _report("w4a16")


@gpu
def test_fuzz_nf4_dequantize():
    _warm_once("nf4_dequantize", nf4_dequant_cases(),
               lambda c, info, *_: [tilefish.ops.nf4.kernel_spec(c.dtype, c.double_quant)])

    @fuzz(GPU_EXAMPLES["nf4_dequantize"])
    @given(case=nf4_dequant_cases())
    def prop(case):
        EXAMPLES_RUN["nf4_dequantize"] += 1
        run_nf4_dequant_case(case, "cuda")
    prop()
    _report("nf4_dequantize")


@gpu
def test_fuzz_nf4_matmul():
    _warm_once("nf4_matmul", nf4_matmul_cases(), _nf4_matmul_spec)

    @fuzz(GPU_EXAMPLES["nf4_matmul"])
    @given(case=nf4_matmul_cases())
    def prop(case):
        EXAMPLES_RUN["nf4_matmul"] += 1
        run_nf4_matmul_case(case, "cuda")
    prop()
    _report("nf4_matmul")


@gpu
def test_fuzz_hgemm():
    _warm_once("hgemm", hgemm_cases(), lambda c, info, *_: _hgemm_spec(c, info))

    @fuzz(GPU_EXAMPLES["hgemm"])
    @given(case=hgemm_cases())
    def prop(case):
        EXAMPLES_RUN["hgemm"] += 1
        run_hgemm_case(case, "cuda")
    prop()
    _report("hgemm")


@gpu
def test_fuzz_sgemm():
    _warm_once("sgemm", sgemm_cases(), lambda c, info, *_: _sgemm_spec(c, info))

    @fuzz(GPU_EXAMPLES["sgemm"])
    @given(case=sgemm_cases())
    def prop(case):
        EXAMPLES_RUN["sgemm"] += 1
        run_sgemm_case(case, "cuda")
    prop()
    _report("sgemm")


@gpu
def test_fuzz_rejections_leave_the_device_usable():
    """Inputs every op must refuse on CUDA (wrong dtypes, device mixes, shapes, alignment, broken weight
    tensors): each a clear ValueError / TypeError before any launch, the device usable after each."""
    for case in _bad_inputs("cuda"):
        name, fn, words = case
        with count_launches("cuda") as calls:
            with pytest.raises(REJECT) as ei:
                fn()
        assert_clear_rejection(ei.value, *words)
        assert calls[0] == 0, f"{name}: {calls[0]} launch(es) before the rejection"
        after_rejection("cuda")


# ---- torch.library.opcheck ----------------------------------------------------------------------------------------

def _w4a16_opcheck_cases(device):
    """(x, weight, bias) for the custom op; on CUDA shapes that dispatch to each kernel family and plan kind:
    the skinny stream-K kernel (m <= 16, large weight), the wgmma kernel with a k split and stream-K (Hopper),
    the mma.sync kernel (tiny weights, other GPUs), act order, 3-D x."""
    g = _gen(7, device)
    out = []
    for m, n, k, group, sym, perm, lead in ((1, 4096, 4096, 128, True, False, None), (7, 8192, 4096, -1, False, False, None),
                                            (33, 512, 2048, 64, False, True, None), (200, 6144, 4096, 128, True, False, None),
                                            (5, 128, 192, 64, True, False, (5, 1)), (3, 256, 512, 32, False, False, (1, 3))):
        if device == "cpu" and n * k > 512 * 2048:
            n, k = 256, 512
        q = quantize_rtn(_randn(g, n, k, device=device), group, sym, clip_search=False, scale_dtype=torch.float16)
        pm = torch.randperm(k, generator=g, device=device) if perm else None
        p = w4ops.pack(q, pm)
        x = _randn(g, *(lead or (m,)), k, dtype=torch.float16, device=device)
        bias = _randn(g, n, dtype=torch.float16, device=device) if m % 2 else None
        out.append((x, p, bias))
    return out


def _opcheck_w4a16(device, requires_grad=False, which=None):
    cases = _w4a16_opcheck_cases(device)
    for x, p, bias in (cases if which is None else [cases[i] for i in which]):
        if requires_grad:
            x = x.detach().requires_grad_(True)
        args = (x, p.packed, p.scales, p.zeros, p.perm, bias, p.group_size, p.n, p.k, p.codebook)
        torch.library.opcheck(library.w4a16_matmul_op, args)


def _opcheck_nf4(device, limit=None):
    g = _gen(8, device)
    for shape, bs, dq, dtype in (((64, 128), 64, True, torch.bfloat16), ((333, 1000), 256, False, torch.float16),
                                 ((7,), 32, True, torch.float32), ((4096, 1088), 4096, True, torch.bfloat16))[:limit]:
        if device == "cpu" and math.prod(shape) > 200_000:
            shape = (100, 130)
        q = nf4.quantize(_randn(g, *shape, device=device), blocksize=bs, double_quant=dq)
        fields = (q.codes, q.absmax, q.absmax_q, q.code2, q.absmax2, q.offset, list(q.shape), q.blocksize)
        torch.library.opcheck(library.nf4_dequantize_op, fields + (dtype,))
        out = torch.empty(q.shape, dtype=dtype, device=device)
        torch.library.opcheck(library.nf4_dequantize_out_op, fields + (out,))


@gpu
def test_opcheck_w4a16_cuda():
    from tilefish.runtime import device_info

    info = device_info()
    plans = set()
    for x, p, _ in _w4a16_opcheck_cases("cuda"):
        m = x.numel() // p.k
        plan = w4ops.choose_plan(m, p.n, p.k, info.sm_count, info.cc, p.group_size, w4launch.device_clusters(info),
                                 p.dtype, p.codebook, w4launch._device_table(info))
        plans.add(type(plan.cfg).__name__ + ("-streamk" if plan.cfg.streamk else "")
                  + (f"-split{plan.slices}" if (plan.slices or 1) > 1 else ""))
    print("w4a16 opcheck plans:", sorted(plans))
    _opcheck_w4a16("cuda")
    _opcheck_w4a16("cuda", requires_grad=True, which=(0, 4))


@gpu
def test_opcheck_w4a16_forced_split_and_stream_k_cuda():
    """The op's k-split and stream-K paths, forced through its plan arguments (the custom op takes the
    dispatcher's plan; the forced plans are checked against the op's own result)."""
    if torch.cuda.get_device_capability() != (9, 0):
        cfgs = [(w4ops.GemmConfig(1, 2, 4, 4), 3, None)]
    else:
        cfgs = [(w4ops.HopperConfig(64, 2, 1, 8), 3, None), (w4ops.HopperConfig(64, 2, 2, 6, True), None, 13),
                (w4ops.SkinnyConfig(8, 4, 1, 3, 2), None, 31), (w4ops.GemmConfig(1, 2, 4, 4), 3, None)]
    g = _gen(9, "cuda")
    q = quantize_rtn(_randn(g, 512, 2048, device="cuda"), 128, False, clip_search=False, scale_dtype=torch.bfloat16)
    p = w4ops.pack(q)
    x = _randn(g, 8, 2048, dtype=torch.bfloat16, device="cuda")
    ref = reference.w4a16_matmul(x, q)
    for cfg, slices, ctas in cfgs:
        out = w4ops.matmul_impl(x, p, cfg=cfg, slices=slices, ctas=ctas)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16], cfg.label()
    torch.library.opcheck(library.w4a16_matmul_op,
                          (x, p.packed, p.scales, p.zeros, p.perm, None, p.group_size, p.n, p.k, p.codebook))


@gpu
def test_opcheck_nf4_cuda():
    _opcheck_nf4("cuda")


def test_opcheck_cpu():
    """The custom ops are well-formed on CPU tensors too (the reference path): schema, fake, autograd."""
    _opcheck_w4a16("cpu", which=(0, 4))
    _opcheck_w4a16("cpu", requires_grad=True, which=(4,))
    _opcheck_nf4("cpu", limit=2)


# ---- CPU fuzz (CI) ------------------------------------------------------------------------------------------------

def _bad_inputs(device):
    """(name, call, words the message must name one of) for inputs every op must reject on `device`."""
    g = _gen(3, device)
    other = "cpu" if device != "cpu" else "meta"
    q = quantize_rtn(_randn(g, 128, 256, device=device), 64, False, clip_search=False, scale_dtype=torch.float16)
    p = w4ops.pack(q)
    x = _randn(g, 4, 256, dtype=torch.float16, device=device)
    nq = nf4.quantize(_randn(g, 128, 256, device=device), blocksize=64)
    npr = nf4.prepare(nq, torch.float16)
    a16, b16 = _randn(g, 16, 64, dtype=torch.float16, device=device), _randn(g, 64, 32, dtype=torch.float16, device=device)
    a32, b32 = a16.float(), b16.float()
    cases = [
        ("w4a16 fp32 x", lambda: w4a16.matmul(x.float(), p), ["float16"]),
        ("w4a16 int x", lambda: w4a16.matmul(x.to(torch.int16), p), ["float16"]),
        ("w4a16 bf16 x, fp16 scales", lambda: w4a16.matmul(x.bfloat16(), p), ["scales"]),
        ("w4a16 wrong k", lambda: w4a16.matmul(x[:, :192], p), ["192"]),
        ("w4a16 0-d x", lambda: w4a16.matmul(x[0, 0], p), ["0-D"]),
        ("w4a16 x elsewhere", lambda: w4a16.matmul(x.to(other), p), ["device"]),
        ("w4a16 bias elsewhere", lambda: w4a16.matmul(x, p, torch.zeros(128, dtype=torch.float16, device=other)),
         ["device"]),
        ("w4a16 bias shape", lambda: w4a16.matmul(x, p, torch.zeros(127, dtype=torch.float16, device=device)), ["bias"]),
        ("w4a16 bias dtype", lambda: w4a16.matmul(x, p, torch.zeros(128, dtype=torch.float32, device=device)), ["bias"]),
        ("w4a16 not a weight", lambda: w4a16.matmul(x, q), ["W4A16Weight"]),
        ("w4a16 n % 64", lambda: w4a16.matmul(x, dataclasses.replace(p, n=100)), ["100"]),
        ("w4a16 k % 64", lambda: w4a16.matmul(x[:, :200], dataclasses.replace(p, k=200)), ["200"]),
        ("w4a16 group", lambda: w4a16.matmul(x, dataclasses.replace(p, group_size=96)), ["96"]),
        ("w4a16 group > k", lambda: w4a16.matmul(x[:, :192], dataclasses.replace(p, k=192, group_size=128)), ["192"]),
        ("w4a16 packed shape", lambda: w4a16.matmul(x, dataclasses.replace(p, packed=p.packed[:, :-4])), ["packed"]),
        ("w4a16 packed dtype", lambda: w4a16.matmul(x, dataclasses.replace(p, packed=p.packed.float())), ["packed"]),
        ("w4a16 scales shape", lambda: w4a16.matmul(x, dataclasses.replace(p, scales=p.scales[:-1])), ["scales"]),
        ("w4a16 zeros dtype", lambda: w4a16.matmul(x, dataclasses.replace(p, zeros=p.zeros.float())), ["zeros"]),
        ("w4a16 scales elsewhere", lambda: w4a16.matmul(x, dataclasses.replace(p, scales=p.scales.to(other))),
         ["device"]),
        ("w4a16 perm dtype", lambda: w4a16.matmul(x, dataclasses.replace(p, perm=torch.arange(256.0, device=device))),
         ["perm"]),
        ("w4a16 perm length", lambda: w4a16.matmul(x, dataclasses.replace(p, perm=torch.arange(255, device=device))),
         ["perm"]),
        ("w4a16 codebook", lambda: w4a16.matmul(x, dataclasses.replace(p, codebook="fp4")), ["codebook"]),
        ("w4a16 nf4 with zeros", lambda: w4a16.matmul(x, dataclasses.replace(p, codebook="nf4")), ["codebook"]),
        ("w4a16 slices", lambda: w4ops.matmul_impl(x, p, slices=0), ["slices"]),
        ("w4a16 ctas", lambda: w4ops.matmul_impl(x, p, ctas=-3), ["ctas"]),
        ("pack perm not a permutation",
         lambda: w4ops.pack(q, torch.zeros(256, dtype=torch.int64, device=device)), ["perm"]),
        ("quantize k % group", lambda: w4a16.quantize(_randn(g, 128, 96, device=device), 64), ["96"]),
        ("nf4 dequantize dtype", lambda: nf4.dequantize(nq, torch.int8), ["dtype"]),
        ("nf4 dequantize out dtype",
         lambda: nf4.dequantize(nq, torch.float16, out=torch.empty(128, 256, dtype=torch.bfloat16, device=device)),
         ["dtype"]),
        ("nf4 dequantize out size",
         lambda: nf4.dequantize(nq, torch.float16, out=torch.empty(128, 255, dtype=torch.float16, device=device)),
         ["elements"]),
        ("nf4 dequantize out elsewhere",
         lambda: nf4.dequantize(nq, torch.float16, out=torch.empty(128, 256, dtype=torch.float16, device=other)),
         ["device", other]),
        ("nf4 dequantize out strided",
         lambda: nf4.dequantize(nq, torch.float16, out=torch.empty(128, 512, dtype=torch.float16, device=device)[:, ::2]),
         ["contiguous"]),
        ("nf4 codes truncated", lambda: nf4.dequantize(dataclasses.replace(nq, codes=nq.codes[:-1])), ["codes"]),
        ("nf4 absmax_q elsewhere",
         lambda: nf4.dequantize(dataclasses.replace(nq, absmax_q=nq.absmax_q.to(other))), ["device"]),
        ("nf4 blocksize", lambda: nf4.dequantize(dataclasses.replace(nq, blocksize=48)), ["48"]),
        ("nf4 not a weight", lambda: nf4.dequantize(torch.zeros(4, device=device)), ["NF4Weight"]),
        ("nf4 prepare shape", lambda: nf4.prepare(nf4.quantize(_randn(g, 100, 256, device=device))), ["100"]),
        ("nf4 prepare k vs blocksize",
         lambda: nf4.prepare(nf4.quantize(_randn(g, 64, 192, device=device), blocksize=256)), ["192"]),
        ("nf4 prepare dtype", lambda: nf4.prepare(nq, torch.float32), ["float32"]),
        ("nf4 matmul unprepared", lambda: nf4.matmul(x, nq), ["prepare"]),
        ("nf4 matmul x dtype", lambda: nf4.matmul(x.bfloat16(), npr), ["scales", "bfloat16"]),
        ("nf4 matmul wrong k", lambda: nf4.matmul(x[:, :128], npr), ["128"]),
        ("hgemm fp32", lambda: tilefish.hgemm(a32, b32), ["float16"]),
        ("hgemm dtype mix", lambda: tilefish.hgemm(a16, b16.bfloat16()), ["same dtype"]),
        ("hgemm inner", lambda: tilefish.hgemm(a16, b16, b_transposed=True), ["inner"]),
        ("hgemm 3-D", lambda: tilefish.hgemm(a16[None], b16), ["2-D"]),
        ("hgemm device mix", lambda: tilefish.hgemm(a16, b16.to(other)), ["device"]),
        ("hgemm kernel", lambda: tilefish.hgemm(a16, b16, kernel="99_magic"), ["kernel"]),
        ("hgemm b_transposed type", lambda: tilefish.hgemm(a16, b16, b_transposed=1), ["b_transposed"]),
        ("sgemm fp16", lambda: tilefish.sgemm(a16, b16), ["fp32"]),
        ("sgemm inner", lambda: tilefish.sgemm(a32, b32.t()), ["inner"]),
        ("sgemm c shape", lambda: tilefish.sgemm(a32, b32, torch.zeros(16, 31, device=device)), ["c has shape"]),
        ("sgemm beta without c", lambda: tilefish.sgemm(a32, b32, beta=1.0), ["beta"]),
        ("sgemm alpha type", lambda: tilefish.sgemm(a32, b32, alpha="2"), ["alpha"]),
        ("sgemm device mix", lambda: tilefish.sgemm(a32, b32.to(other)), ["device"]),
        ("sgemm kernel", lambda: tilefish.sgemm(a32, b32, kernel="00_nope"), ["kernel"]),
    ]
    if device != "cpu":
        cases += [
            ("hgemm K % 8", lambda: tilefish.hgemm(a16[:, :60], b16[:60]), ["K % 8", "60"]),
            ("hgemm N % 8 for [K, N]", lambda: tilefish.hgemm(a16, b16[:, :30].contiguous()), ["N % 8", "30"]),
            ("hgemm misaligned a",
             lambda: tilefish.hgemm(torch.empty(16 * 64 + 1, dtype=torch.float16, device=device)[1:].view(16, 64), b16),
             ["aligned"]),
            ("sgemm c overlaps a", lambda: _overlap_sgemm(device), ["share memory"]),
            ("nf4 dequantize out misaligned",
             lambda: nf4.dequantize(nq, torch.float16, out=torch.empty(128 * 256 + 1, dtype=torch.float16,
                                                                        device=device)[1:]), ["aligned"]),
        ]
    return cases


def _overlap_sgemm(device):
    buf = torch.randn(32 * 32, device=device)
    a = buf.view(32, 32)
    return tilefish.sgemm(a, torch.randn(32, 32, device=device), a, beta=1.0)


def test_cpu_rejections_are_clear():
    """Every op refuses bad inputs on CPU tensors with a ValueError / TypeError naming the problem."""
    for name, fn, words in _bad_inputs("cpu"):
        with pytest.raises(REJECT) as ei:
            fn()
        try:
            assert_clear_rejection(ei.value, *words)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@fuzz(CPU_EXAMPLES)
@given(case=w4a16_cases())
def test_cpu_fuzz_w4a16_reference_path_agrees_with_itself(case):
    """The CPU op (the reference through unpack) on small drawn shapes: rejections are clear; accepted
    inputs give the reference's bits for any x layout, leading dims, act order and bias."""
    case = dataclasses.replace(case, lead=tuple(min(d, 9) for d in case.lead), n=min(case.n, 256),
                               k=min(case.k, 512), force=None)
    note(repr(case))
    g = _gen(case.seed, "cpu")
    w = _randn(g, case.n, case.k, device="cpu")
    perm = torch.randperm(case.k, generator=g) if case.act_order and case.k else None
    try:
        q = quantize_rtn(w, case.group, case.sym, clip_search=False, scale_dtype=case.dtype)
        p = w4ops.pack(q, perm)
    except REJECT as e:
        assert_clear_rejection(e, case.n, case.k, case.group)
        return
    x = _x_view(g, case.lead, case.k, case.dtype, case.layout, "cpu")
    bias = _bias(g, case.bias, case.n, case.dtype, "cpu")
    out = w4a16.matmul(x, p, bias)
    xr = x.reshape(-1, case.k)
    if perm is not None:
        xr = xr[:, perm]
    assert torch.equal(out, reference.w4a16_matmul(xr, q, bias).reshape(*case.lead, case.n))
    assert torch.equal(out, w4a16.matmul(x.contiguous(), p, None if bias is None else bias.contiguous()))
    # unpack inverts pack, and the kernel-layout dequantization is the logical one
    u = w4ops.unpack(p)
    assert torch.equal(u.q, q.q) and torch.equal(p.dequantize(torch.float64), q.dequantize(torch.float64))


@fuzz(CPU_EXAMPLES)
@given(case=nf4_dequant_cases())
def test_cpu_fuzz_nf4_dequantize(case):
    """CPU NF4 dequantize: out= / allocated / rejected, bit for bit the fp32 chain, within an ulp of float64."""
    case = dataclasses.replace(case, shape=tuple(min(d, 300) for d in case.shape))
    run_nf4_dequant_case(case, "cpu")
    if case.out is None and not case.codes_offset:
        q = _nf4_weight(_gen(case.seed, "cpu"), case, "cpu")
        if case.dtype != torch.float32:
            from conftest import ulp_distance
            a = nf4.dequantize(q, case.dtype).reshape(-1)
            assert ulp_distance(a, reference.nf4_dequantize_f64(q, case.dtype).reshape(-1)).max().item() <= 1


@fuzz(CPU_EXAMPLES)
@given(case=nf4_matmul_cases())
def test_cpu_fuzz_nf4_matmul(case):
    """CPU NF4 matmul (bitsandbytes' dequantization + float64 matmul) against the kernel format's exact
    value (group scales rounded to the activation dtype): within the dtype's tolerance."""
    case = dataclasses.replace(case, lead=tuple(min(d, 9) for d in case.lead), n=min(case.n, 256),
                               k=min(case.k, 512))
    run_nf4_matmul_case(case, "cpu")


@fuzz(CPU_EXAMPLES)
@given(case=hgemm_cases())
def test_cpu_fuzz_hgemm(case):
    case = dataclasses.replace(case, m=min(case.m, 200), n=min(case.n, 200), k=min(case.k, 300))
    run_hgemm_case(case, "cpu")


@fuzz(CPU_EXAMPLES)
@given(case=sgemm_cases())
def test_cpu_fuzz_sgemm(case):
    case = dataclasses.replace(case, m=min(case.m, 200), n=min(case.n, 200), k=min(case.k, 300))
    run_sgemm_case(case, "cpu")


def test_warm_pass_replays_the_same_examples():
    """The kernel warm-up relies on a test and its collecting twin drawing the same example sequence."""
    seqs = []
    for _ in range(2):
        seen = []

        @fuzz(15)
        @given(case=w4a16_cases())
        def collect(case):
            seen.append(case)
        collect()
        seqs.append(seen)
    assert seqs[0] == seqs[1] and len(seqs[0]) >= 10
