"""compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over every plan the dispatchers can choose.

One script for every kernel family (issue 30 item 3; it replaces sanitize_w4a16_hopper.py and sanitize_nf4.py):

  w4a16        the W4A16 kernels, int4 codebook: every mma.sync / wgmma / skinny configuration in
               ops.w4a16.dispatch_specs() (choose_mma_config, the wgmma time model and rule, the skinny
               choices, the shipped tuned tables), each on small shapes that still exercise its modes:
               m below and across tiles, whole k, k split through the global workspace and through
               DSMEM clusters, the separate tail launch, stream-K grids that cut tiles (several CTAs
               a tile, the counter peek / slot fixups, launched twice and compared bitwise), the
               skinny kernel's register and staged fixups (mid-stream and final, > 8 slots), k % 128
               == 64 (the half last tile / stage), the skinny kernel's cluster split (8-row tiles), groups
               -1/32/64/128, zero points, bias, act order;
               the tuned tables' (config, k split) pairs; the dispatcher's own picks (cfg=auto)
  nf4-matmul   the same kernels built with codebook "nf4" (-D TF_W4A16_NF4): groups 32/64/128, both
               dtypes, forced configurations and the dispatcher's picks (NF4_TALL_TILE included)
  nf4-dequant  kernels/nf4/dequantize.cu: every dispatched build (bf16/fp16/fp32, single/double quant)
  norm         kernels/norm/rmsnorm.cu: every dispatched build (fp16/bf16 x the chunks a thread holds), the plain
               norm and the residual add + norm, under programmatic dependent launch
  rope_cache   kernels/attention/rope_cache.cu: both builds (fp16/bf16), a decode step over many CTAs meeting at
               the cache length and a prompt whose last positions fall past the cache, under programmatic launch
  rope_attention  kernels/attention/rope_attention.cu: every build (fp16/bf16 x head dims 64/128), decode
               steps split into one-tile chunks with a bool mask (16 sequences and an 18-chunk cache combining
               on counters; a 12-chunk cache as one cluster on sm_90), then one past the cache with none, early
               K/V copies, under programmatic launch
  sgemm        every ladder step's TUNED and TUNED_SMALL configuration (what kernel="auto" / a step
               name can launch), edge tiles, alpha / beta with c
  hgemm        every dispatched configuration (TUNED, TUNED_SMALL, TUNED_LOW_SMEM, step 07's MID /
               NARROW / SHORT tiles and their direct-store twins) x both B layouts x both dtypes;
               step 07 on a persistent grid forced down to 3 CTAs, so every CTA loops over tiles
  moe          the grouped expert GEMMs (ops.moe_kernels.grouped_experts_cuda: moe/align.cu -> w4a16/gemm.cu
               built with -D TF_W4A16_GROUPED -> moe/act.cu -> the grouped GEMM again -> moe/combine.cu), one call
               a plan: every configuration kernel_specs() lists, as plan_grouped picks it from (T, K, E, H, I)
               (swapped operands / 16 / 32-row tiles x 256 / 128 / 64 columns; the variants fitted to less shared
               memory under a forced per-block limit), every weight format x dtype (int4 groups -1/32/64/128 with
               and without zero points, nf4, mxfp4), both id dtypes, both activations, biases, k % 128 == 64, both
               GEMMs splitting k (the caller's tile counters and fresh ones); and the decode path (path="decode",
               ops.moe_decode: moe/decode.cu's moe_decode_gate_up -> moe_decode_down), both kernels in every
               format x dtype, both activations, k split in both (slices > 1 as plan_decode makes them on the
               GPU; owned and fresh counters, launched twice, compared bitwise), slices == 1 (K = 2, and K = 1
               without a workspace), gpt-oss' H = I = 2880 with biases and swiglu_oai; every routing has an idle
               expert, a dropped id and (T >= 3) a token whose every slot is dropped (decode: and an expert
               several slots pick); each call forced to its path, checked against reference.moe_experts

The plans are enumerated from the dispatch code: every spec of kernel_specs() (every dispatchable
KernelSpec) is matched to its configuration and format, for W4A16 / NF4 through the builds the ops
modules name (ops.w4a16.dispatch_builds, ops.nf4.kernel_spec), for SGEMM / HGEMM by reading its
template arguments back, for MoE by reading back the template arguments and defines of
ops.moe_kernels.kernel_specs() and rebuilding them with moe_kernels' / moe_decode's own spec functions;
so a plan the dispatchers gain is picked up (or shows as uncovered in --list and fails
tests/test_sanitize_script.py). A spec no plan runs is listed with the reason. What a W4A16
plan launches (k split, clusters, a separate tail) is the launcher's own geometry on the described
GPU (ops.w4a16.launch_geometry, tilefish.w4a16.plan for the dispatcher's picks; --list -v prints it),
and each plan runs under the ops.w4a16.LaunchPolicy its dsmem / tail keys name.

Modes
  --list              print the plans, counts per family and tool, the time estimate and the coverage
                      of kernel_specs() (CPU only; --sm-count / --cc describe the GPU, default an H100)
  (default: driver)   1. compile every kernel the plans need in parallel processes (NVRTC, no sanitizer;
                         with -lineinfo, so reports carry file:line: line tables only, the optimization
                         is unchanged; under cache keys of their own), so the workers only load cubins,
                      2. a dry run of every plan without a sanitizer (a plain correctness baseline; it
                         also compiles what the dispatcher picks at run time),
                      3. per tool, batches of plans, each one process `compute-sanitizer --tool T
                         --error-exitcode 1 ... python scripts/sanitize_all.py --worker --plans @file`,
                         --jobs of them at once, tier 0 first (one plan per configuration), until
                         --budget seconds are used (what is left is reported as not run),
                      4. parse the logs, dump the SASS of every kernel racecheck flags (cuobjdump /
                         nvdisasm of the cached cubin) and classify each hazard, write the summary.
  --worker --plans P  run plans once each (P: comma-separated plan ids, or @file with one a line),
                      checked against tilefish.reference on the CPU; one JSON line a plan to --result
  --parse DIR         re-read a finished run's logs (DIR/run.json) and rewrite the summary

Sanitizer options and why
  memcheck   --report-api-errors no (cuGetProcAddress probes of the host libraries return
             INVALID_VALUE: host API calls, not kernel accesses), --destroy-on-device-error kernel
             (one bad kernel does not end the batch), PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every tensor
             its own cudaMalloc, so an access past a tensor is out of bounds, not inside a cached block)
  initcheck  PYTORCH_NO_CUDA_MEMORY_CACHING=1 as well: with the caching allocator a tensor reuses
             memory an earlier one wrote, which hides uninitialized reads. Inputs are made on the CPU
             and copied (memcpy counts as initialization); outputs are torch.empty that only the kernel
             writes, and copying them back is checked too (--check-api-memory-access, the default), so
             an output element the kernel never writes is reported. Exception: initcheck does not track
             TMA stores (UTMASTG), so HGEMM step 07's TMA-store outputs start NaN-filled under initcheck
             and the NaN check finds unwritten elements instead. Unused-memory tracking stays off
             (its default: the W4A16 workspace is sized for the largest split and mostly unused by
             small plans, which is by design; in CUDA 13 --track-unused-memory is a switch without a
             value, so no "no" is passed). No kernel-name filter: writes by torch's kernels (the
             workspace counters' zero fill, act order's index_select) must be seen as initializing.
  racecheck  --racecheck-report analysis; known hazard class: racecheck does not model the async
             proxy, so a TMA / bulk-copy write (UBLKCP, UTMALDG) into a pipeline stage that mbarriers
             order after the consumers' reads is reported (docs/w4a16.md, "Sanitizers"). Every hazard
             is recorded with its kernel, instruction offsets and file:line, the SASS instruction at
             each offset is looked up in the cached cubin (a report that names only inlined functions,
             as -lineinfo reports do, is given the one kernel of its batch whose SASS has a fitting
             instruction at every offset: a UBLKCP / UTMALDG for a bulk-copy frame, a shared-memory
             load for a read, a store for a write), and a hazard whose every access pair has an
             async-proxy side is classed "async-proxy" (listed, to check against the SASS; not counted
             as an error unless --strict-racecheck). Any other hazard is an error.
  all        --kernel-name kns=... filters restrict memcheck / racecheck / synccheck to tilefish's
             kernels (torch's own are not ours to check), --demangle no (reports name kernels by their
             mangled names, matched exactly to the cached cubins), --show-backtrace device.

Output: bench/results/<gpu>/sanitizer.md (per tool x family: plans run, errors, hazards, time; the
commit (TILEFISH_COMMIT or git), compute-sanitizer's version, every finding in detail), a copy at
$OUT/sanitizer.md when $OUT is set, and the raw logs with run.json under $OUT/sanitizer_logs (or --logs;
--parse rewrites the summary from them).
Exit status: 1 on any error (a sanitizer error, a non-async-proxy hazard, a wrong result or a crash),
0 otherwise (plans cut by --budget are reported, and fail the run only with --require-complete).

Device command (repository root, about 5 minutes on an H100):
  pip install -q --no-deps --no-build-isolation -e . && TILEFISH_COMMIT=<hash> python scripts/sanitize_all.py
The moe family alone needs a larger budget: about 340 s of sanitizer runs at --jobs 16 on the H100 plus the
warm-up (`--families moe --budget 330 --jobs 16`, about 7 minutes in all); --list prints the estimate.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
try:
    import tilefish  # noqa: F401
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(REPO / "src"))

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
FAMILIES = ("w4a16", "nf4-matmul", "nf4-dequant", "norm", "rope_cache", "rope_attention", "sgemm", "hgemm", "moe")
ALL = frozenset(TOOLS)
NO_RACE = frozenset(("memcheck", "synccheck", "initcheck"))
KERNEL_FILTERS = ("w4a16_", "nf4_dequantize", "rms_norm", "rope_cache", "rope_attention", "sgemm_", "hgemm_",
                  "moe_")  # substrings of our kernels' mangled names
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}  # tests/conftest.py's, by output dtype
LINEINFO_ENV = "TILEFISH_SANITIZE_LINEINFO"
FAKE_DEVICE_ENV = "TILEFISH_SANITIZE_FAKE_DEVICE"  # tests: a device description; workers run the CPU path
TOOL_ENV = "TILEFISH_SANITIZE_TOOL"  # the tool a worker runs under (set by the driver)

# Rough per-plan costs under each tool (seconds, first load of a kernel included) and a process's start
# (torch import + CUDA init under the sanitizer): used to size batches and for --list's estimate; the
# summary reports the measured times next to them.
PLAN_COST = {"memcheck": 0.8, "racecheck": 3.0, "synccheck": 0.8, "initcheck": 0.8}
# A MoE plan quantizes E experts and runs the float64 reference on the CPU, and torch's own CUDA work runs under
# the tool too: measured on the H100 with 16 processes at once (0e60b81), 21 s a plan (27 under racecheck).
FAMILY_PLAN_COST = {"moe": {"memcheck": 21.0, "racecheck": 27.0, "synccheck": 21.0, "initcheck": 21.0}}
PROCESS_COST = 15.0


def plan_cost(tool: str, plan_id: str) -> float:
    """The estimated seconds of one plan (its id names its family) under `tool`."""
    return FAMILY_PLAN_COST.get(plan_id.partition(":")[0], PLAN_COST)[tool]


# ---- plans ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """One launch (or a few) of one kernel plan. The id holds everything the worker needs:
    "<family>:key=value:key=value..." (no commas, so ids can be listed comma-separated)."""
    family: str
    kw: tuple[tuple[str, str], ...]
    tools: frozenset = ALL
    tier: int = 0            # 0: one plan a configuration; 1: its other modes; 2: extras; 3: --exhaustive
    why: str = ""

    @property
    def id(self) -> str:
        return self.family + "".join(f":{k}={v}" for k, v in self.kw)

    @property
    def args(self) -> dict[str, str]:
        return dict(self.kw)


def make_plan(family: str, tools=ALL, tier: int = 0, why: str = "", **kw) -> Plan:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    items = tuple((k, str(v)) for k, v in kw.items() if v is not None)
    for k, v in items:
        if re.search(r"[:,=\s@]", v) or not re.fullmatch(r"[a-z0-9_]+", k):
            raise ValueError(f"plan value {k}={v!r} cannot go into a plan id")
    return Plan(family, items, frozenset(tools), tier, why)


def parse_plan_id(pid: str) -> tuple[str, dict[str, str]]:
    family, *parts = pid.strip().split(":")
    if family not in FAMILIES:
        raise ValueError(f"plan id {pid!r}: unknown family {family!r} (one of {FAMILIES})")
    kw = {}
    for part in parts:
        k, sep, v = part.partition("=")
        if not sep or not k:
            raise ValueError(f"plan id {pid!r}: {part!r} is not key=value")
        kw[k] = v
    return family, kw


def read_plan_list(text: str) -> list[str]:
    """--plans: comma-separated ids, or @file with one id a line (# comments)."""
    if text.startswith("@"):
        lines = Path(text[1:]).read_text().splitlines()
        return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return [p.strip() for p in text.split(",") if p.strip()]


DT_NAMES = ("fp16", "bf16", "fp32")


def _dtype(name: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _dtname(dtype) -> str:
    import torch

    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


# ---- kernel_specs() matched to configurations -------------------------------------------------------------------

def _targs(name: str) -> tuple[str, list[str]]:
    head, _, rest = name.partition("<")
    return head, [a.strip() for a in rest.rstrip(">").split(",")] if rest else []


def w4a16_builds() -> dict:
    """{KernelSpec: ops.w4a16.KernelBuild} of every W4A16 / NF4-matmul kernel the dispatcher launches
    (ops.w4a16.dispatch_builds: the configurations and formats themselves, not read back from specs)."""
    from tilefish.ops import w4a16 as w4

    return {b.spec: b for b in w4.dispatch_builds()}


def nf4_dequant_builds() -> dict:
    """{KernelSpec: (dtype, double quant)} of every NF4 dequantize build ops.nf4.kernel_spec makes."""
    from tilefish.ops import nf4

    return {nf4.kernel_spec(dt, dq): (dt, dq) for dt in nf4.OUT_DTYPES for dq in (False, True)}


def norm_builds() -> dict:
    """{KernelSpec: (dtype, chunks a thread)} of every RMSNorm build ops.norm.dispatch_specs lists."""
    from tilefish.ops import norm

    return {norm.kernel_spec(dt, v): (dt, v) for dt in norm.DTYPES for v in norm.VPTS}


def rope_cache_builds() -> dict:
    """{KernelSpec: dtype} of every rope_cache build (with and without the head norms)."""
    from tilefish.ops import rope_cache

    return {rope_cache.kernel_spec(dt, hn): dt for dt in rope_cache.DTYPES for hn in (False, True)}


def rope_attention_builds() -> dict:
    """{KernelSpec: (dtype, head dim)} of every rope_attention build (with and without the head norms)."""
    from tilefish.ops import rope_attention

    return {rope_attention.kernel_spec(dt, d, hn): (dt, d) for dt in rope_attention.DTYPES
            for d in rope_attention.HEAD_DIMS for hn in (False, True)}


# A row width whose block (ops.norm.block_config) takes each chunk count: 17, 513 and 1025 chunks of 8.
NORM_COLS = {1: 136, 2: 4104, 4: 8200}


def spec_config(family: str, spec, builds: dict | None = None):
    """A dispatch KernelSpec -> (family, config, format) with format a dict. W4A16 / NF4 specs are
    looked up among the builds their ops module names (w4a16_builds, nf4_dequant_builds); SGEMM and
    HGEMM specs are read back from their template arguments and verified by rebuilding the spec. A spec
    neither finds raises ValueError, which --list and the tests report."""
    import torch
    from tilefish.ops import hgemm, sgemm

    if family == "w4a16":
        b = (w4a16_builds() if builds is None else builds).get(spec)
        if b is None:
            raise ValueError(f"{spec.name} {dict(spec.defines)} is not one of ops.w4a16.dispatch_builds()")
        fmt = {"dt": _dtname(b.dtype), "g": b.group_size, "zp": int(b.zero_points), "cb": b.codebook}
        return "nf4-matmul" if b.codebook == "nf4" else "w4a16", b.config, fmt
    if family == "nf4":
        dt_dq = nf4_dequant_builds().get(spec)
        if dt_dq is None:
            raise ValueError(f"{spec} is not a dispatched NF4 dequantize build")
        return "nf4-dequant", None, {"dt": _dtname(dt_dq[0]), "dq": int(dt_dq[1])}
    if family == "norm":
        dt_v = norm_builds().get(spec)
        if dt_v is None:
            raise ValueError(f"{spec} is not a dispatched RMSNorm build")
        return "norm", None, {"dt": _dtname(dt_v[0]), "vpt": dt_v[1]}
    if family == "rope_cache":
        dt = rope_cache_builds().get(spec)
        if dt is None:
            raise ValueError(f"{spec} is not a dispatched rope_cache build")
        return "rope_cache", None, {"dt": _dtname(dt)}
    if family == "rope_attention":
        dt_d = rope_attention_builds().get(spec)
        if dt_d is None:
            raise ValueError(f"{spec} is not a dispatched rope_attention build")
        return "rope_attention", None, {"dt": _dtname(dt_d[0]), "d": dt_d[1]}
    head, a = _targs(spec.name)
    if family == "sgemm":
        step = Path(spec.source).stem
        cfg = sgemm.SgemmConfig(step, tuple(int(v) for v in a))
        if cfg.spec != spec:
            raise ValueError(f"{spec} does not read back as {cfg.label()}")
        return "sgemm", cfg, {}
    if family == "hgemm":
        step = Path(spec.source).stem
        dts = {"__half": torch.float16, "__nv_bfloat16": torch.bfloat16}
        dt, nk = dts[a[0]], a[1] == "true"
        cfg = hgemm.HgemmConfig(step, tuple(int(v) for v in a[2:]))
        if cfg.spec(dt, nk) != spec:
            raise ValueError(f"{spec} does not read back as {cfg.label()}")
        return "hgemm", cfg, {"dt": _dtname(dt), "nk": int(nk)}
    if family == "moe":
        return ("moe", *moe_read_back(spec))
    raise ValueError(f"unknown kernel family {family!r}")


_ID_NAMES = {"int": "i32", "long long": "i64"}


def _id_dtype(name: str):
    import torch

    return {"i32": torch.int32, "i64": torch.int64}[name]


def moe_fmt_code(group: int, zero_points: bool, codebook: str) -> str:
    """A stacked projection's weight format in a plan id: int4.g128, int4.pc.zp (per channel, zero points),
    nf4.g64, mxfp4.g32."""
    return f"{codebook}.{'pc' if group == -1 else f'g{group}'}{'.zp' if zero_points else ''}"


def _routing_dtype(rt: str | None, dt):
    """A decode plan's routing weights: "act" in the activation dtype, else (None, "f32") fp32."""
    import torch

    return dt if rt == "act" else torch.float32


def moe_fmt_parse(code: str) -> tuple[int, bool, str]:
    cb, gp, *rest = code.split(".")
    if rest not in ([], ["zp"]) or not (gp == "pc" or re.fullmatch(r"g\d+", gp)):
        raise ValueError(f"{code!r} is not a MoE weight format code (int4.g128, int4.pc.zp, nf4.g64, mxfp4.g32)")
    return -1 if gp == "pc" else int(gp[1:]), bool(rest), cb


DECODE_KINDS = ("decode_gate_up", "decode_down")  # moe_read_back's names of ops.moe_decode's two kernels


def moe_read_back(spec):
    """A spec of ops.moe_kernels.kernel_specs() -> (config, format), read back from its template arguments and
    defines and verified by rebuilding it with moe_kernels' / moe_decode's own spec functions: the grouped GEMM
    (gemm.cu built with -D TF_W4A16_GROUPED) -> (GemmConfig, {kind: gemm, dt, g, zp, cb}); the alignment,
    activation and combine kernels -> ("align" / "act" / "combine", {kind, dt, id, act} as they apply); the decode
    path's two kernels (moe/decode.cu) -> ("decode_gate_up", {kind, dt, g, zp, cb, act, id}) / ("decode_down",
    {kind, dt, g, zp, cb, id})."""
    from tilefish.ops import moe_decode as md
    from tilefish.ops import moe_kernels as mk
    from tilefish.ops.w4a16.configs import CODEBOOK_DEFINES, GemmConfig
    from tilefish.ops.w4a16.layout import DTYPES

    head, a = _targs(spec.name)
    dts = {v: k for k, v in DTYPES.items()}
    acts = {v: k for k, v in mk.ACTIVATION_CODES.items()}
    dacts = {v: k for k, v in md.ACTIVATION_CODES.items()}
    group = lambda v: -1 if int(v) == 0 else int(v)  # noqa: E731 - a template's GROUP (0: per channel)

    def codebook() -> str:
        cbs = [cb for cb, d in CODEBOOK_DEFINES.items() if (d, "1") in spec.defines]
        return cbs[0] if len(cbs) == 1 else "int4"

    try:
        if head == "moe_align" and spec.source == mk.ALIGN_SOURCE:
            cfg, fmt = "align", {"kind": "align", "id": _ID_NAMES[a[0]]}
            rebuilt = mk.align_spec(_id_dtype(fmt["id"]))
        elif head == "moe_act" and spec.source == mk.ACT_SOURCE:
            cfg, fmt = "act", {"kind": "act", "dt": _dtname(dts[a[0]]), "act": acts[int(a[1])]}
            rebuilt = mk.act_spec(dts[a[0]], fmt["act"])
        elif head == "moe_combine" and spec.source == mk.COMBINE_SOURCE:
            cfg, fmt = "combine", {"kind": "combine", "dt": _dtname(dts[a[0]]), "id": _ID_NAMES[a[1]]}
            rebuilt = mk.combine_spec(dts[a[0]], _id_dtype(fmt["id"]))
        elif head == "w4a16_gemm" and (mk.GROUPED_DEFINE, "1") in spec.defines:
            dt = dts[a[0]]
            mb, wn, wk, stages, group = (int(v) for v in a[1:6])
            zp, swap, breg = (v == "true" for v in a[6:9])
            cb = codebook()
            cfg = GemmConfig(mb, wn, wk, stages, swap, breg)
            fmt = {"kind": "gemm", "dt": _dtname(dt), "g": -1 if group == 0 else group, "zp": int(zp), "cb": cb}
            rebuilt = mk.grouped_gemm_spec(dt, cfg, fmt["g"], zp, cb)
        elif head in ("moe_decode_gate_up", "moe_decode_down") and spec.source == md.DECODE_SOURCE:
            dt, zp = dts[a[0]], a[2] == "true"
            fmt = {"kind": "", "dt": _dtname(dt), "g": group(a[1]), "zp": int(zp), "cb": codebook()}
            if head == "moe_decode_gate_up":  # <T, GROUP, ASYM, ACT, Id, RW>
                cfg = fmt["kind"] = "decode_gate_up"
                fmt.update(act=dacts[int(a[3])], id=_ID_NAMES[a[4]])
                rebuilt = md.gate_up_spec(dt, fmt["g"], zp, fmt["cb"], fmt["act"], _id_dtype(fmt["id"]))
            else:  # <T, GROUP, ASYM, Id, RW, R>: R the routing weights' type, float or T ("act")
                cfg = fmt["kind"] = "decode_down"
                fmt.update(id=_ID_NAMES[a[3]], rt="f32" if a[5] == "float" else "act")
                rebuilt = md.down_spec(dt, fmt["g"], zp, fmt["cb"], _id_dtype(fmt["id"]), _routing_dtype(fmt["rt"], dt))
        else:
            raise ValueError("not a moe_kernels kernel (moe_align / moe_act / moe_combine / a grouped w4a16_gemm / "
                             "moe_decode_gate_up / moe_decode_down)")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"{spec.name} {dict(spec.defines)}: cannot read back as a MoE kernel: {e}") from None
    if rebuilt != spec:
        raise ValueError(f"{spec} does not read back: moe_kernels builds {rebuilt}")
    return cfg, fmt


def dispatch_universe():
    """[(kernel_specs family, spec, plan family, config, format)] for every dispatchable spec; specs no
    build names come back with config None and the error as format["error"]."""
    from tilefish.ops import kernel_specs

    builds = w4a16_builds()
    out = []
    for fam, spec in kernel_specs():
        try:
            pfam, cfg, fmt = spec_config(fam, spec, builds)
        except Exception as e:  # noqa: BLE001 - reported as uncovered, never hidden
            pfam, cfg, fmt = fam, None, {"error": f"{type(e).__name__}: {e}"}
        out.append((fam, spec, pfam, cfg, fmt))
    return out


def _sg_code(cfg) -> str:
    return ".".join([cfg.step, *(str(v) for v in cfg.values)])


def _sg_parse(code: str):
    step, *vals = code.split(".")
    return step, tuple(int(v) for v in vals if v)


# ---- enumeration ----------------------------------------------------------------------------------------------------

INT4_FORMATS = [(dt, g, zp) for g in (128, -1, 32, 64) for zp in (0, 1) for dt in ("fp16", "bf16")]
NF4_FORMATS = [(dt, g) for g in (64, 128, 32) for dt in ("bf16", "fp16")]


def format_cycle() -> list[dict]:
    """The 22 formats a W4A16 kernel is built for (16 int4: dtype x group x zero points; 6 nf4: dtype x
    group), int4 and nf4 interleaved so a few plans of a kernel already see both codebooks."""
    out, nf4s = [], iter(NF4_FORMATS)
    for i, (dt, g, zp) in enumerate(INT4_FORMATS):
        out.append({"cb": "int4", "dt": dt, "g": g, "zp": zp})
        if i % 3 == 2 and (f := next(nf4s, None)):
            out.append({"cb": "nf4", "dt": f[0], "g": f[1], "zp": 0})
    out += [{"cb": "nf4", "dt": dt, "g": g, "zp": 0} for dt, g in nf4s]
    return out


def _fmt_key(fmt: dict) -> tuple:
    return (fmt["cb"], fmt["dt"], int(fmt["g"]), int(fmt["zp"]))


class _Rotor:
    """Hands each plan of a kernel source the next format, so the source's plans sweep all 22."""

    def __init__(self):
        self.cycle = format_cycle()
        self.i = 0
        self.used: set = set()

    def next(self) -> dict:
        f = self.cycle[self.i % len(self.cycle)]
        self.i += 1
        self.used.add(_fmt_key(f))
        return f

    def missing(self) -> list[dict]:
        return [f for f in self.cycle if _fmt_key(f) not in self.used]


def _w4_plan(cfg_label: str, fmt: dict, *, m: int, n: int, k: int, tools=ALL, tier=0, why="", sl=None, ct=None,
             dsmem=None, tail=None, rep=1, bias=0, perm=0) -> Plan:
    g = int(fmt["g"])
    if g > 0 and k % g:
        k += g - k % g  # k % 128 == 64 shapes take a group that divides k
    nf4 = fmt["cb"] == "nf4"
    return make_plan("nf4-matmul" if nf4 else "w4a16", tools, tier, why, cfg=cfg_label, dt=fmt["dt"], g=g,
                     zp=int(fmt["zp"]), cb=fmt["cb"], m=m, n=n, k=k, sl=sl, ct=ct, dsmem=dsmem, tail=tail,
                     rep=rep if rep > 1 else None, bias=int(bias), perm=0 if nf4 else int(perm))


def plan_policy(a: dict):
    """The ops.w4a16.LaunchPolicy a W4A16 / NF4-matmul plan runs under: its dsmem / tail keys, the
    default where absent."""
    from tilefish.ops import w4a16 as w4

    return w4.LaunchPolicy(dsmem_split=bool(int(a.get("dsmem", 1))), separate_tail=a.get("tail", "rule"))


def described_gpu(sm_count: int, cc: int, name: str = "NVIDIA H100 80GB HBM3"):
    """The GPU the plans are enumerated for, as tilefish describes one (its sm_90 cluster capacity:
    the H100 / H200 default)."""
    from tilefish import GpuSpec

    return GpuSpec(name, sm_count, cc)


def w4_geometry(p: Plan, gpu):
    """What a W4A16 / NF4-matmul plan launches on `gpu` (a tilefish.GpuSpec) under its policy: a forced
    configuration's ops.w4a16.launch_geometry (the launcher's own geometry), or for cfg=auto the
    dispatcher's tilefish.w4a16.plan (a MatmulPlan). Both carry slices, ctas, cluster and launches."""
    import tilefish
    from tilefish.ops import w4a16 as w4

    a = p.args
    policy = plan_policy(a)
    m, n, k, g, zp = int(a["m"]), int(a["n"]), int(a["k"]), int(a["g"]), bool(int(a["zp"]))
    if a["cfg"] == "auto":
        return tilefish.w4a16.plan(m, n, k, group_size=g, dtype=_dtype(a["dt"]), codebook=a["cb"], zero_points=zp,
                                   gpu=gpu, policy=policy)
    cfg, _ = w4.parse_plan(a["cfg"])
    return w4.launch_geometry(cfg, int(a["sl"]) if "sl" in a else None, int(a["ct"]) if "ct" in a else None, m, n, k,
                              gpu.sm_count, g, zp, policy.planner_clusters(gpu.clusters), policy.separate_tail)


def describe_geometry(geo) -> str:
    """A plan's geometry in a few words (--list -v)."""
    label = f"{geo.label}: " if hasattr(geo, "label") else ""
    return (label + f"{geo.ctas} CTAs" + (f", k split {geo.slices}" if geo.slices > 1 else "")
            + (f" as clusters of {geo.cluster}" if geo.cluster > 1 else "")
            + (f", {len(geo.launches)} launches" if len(geo.launches) > 1 else ""))


# MoE (ops.moe_kernels.grouped_experts_cuda): the row classes of plan_grouped's tile choice, from (tokens, K, E):
# S = T K slots over the expected active experts give ~1.3 rows an expert (swapped operands, blocks of 8 rows),
# ~12 (16-row tiles) and ~24 (32-row tiles). The column tile follows n: gate_up's n = 2I (256 wide for I % 128
# == 0, else 128: never 64), down's n = H (256 / 128 / 64). H = 192 and I = 192 make k % 128 == 64 for the
# other GEMM (its half last k tile; no group 128 there). The k-split plans take H = I = 1024 (8 k tiles).
MOE_ROWS = {"swap": (3, 2, 8), "m16": (24, 2, 4), "m32": (48, 2, 4)}
MOE_SPLIT_ROWS = {"swap": (2, 2, 4), "m16": (24, 2, 4), "m32": (48, 2, 4)}
MOE_ROWS_PER_EXPERT = {"swap": 1, "m16": 12, "m32": 24}
MOE_INTER = {256: 128, 128: 192}            # gate_up's column tile -> I
MOE_HIDDEN = {256: 256, 128: 384, 64: 192}  # down's column tile -> H
MOE_SPLIT_SHAPE = (1024, 1024)              # (H, I) of the k-split plans


def moe_formats() -> list[str]:
    """The weight formats a stacked projection may have (moe_kernels.FORMATS), as plan-id codes."""
    from tilefish.ops import moe_kernels as mk

    return [moe_fmt_code(g, zp, cb) for g, zp, cb in mk.FORMATS]


def _moe_row_class(cfg) -> str:
    return "swap" if cfg.swap else f"m{cfg.bm}"


def _moe_base_width(cls: str, cfg) -> int | None:
    """The column tile (the n divisibility) whose grouped_config in row class cls, fitted to some shared memory
    limit, can be cfg: the tile itself, or twice it when fit_mma_smem halved the columns."""
    from tilefish.ops import moe_kernels as mk

    for width in (cfg.bn, 2 * cfg.bn):
        if width in (64, 128, 256) and mk.grouped_config(MOE_ROWS_PER_EXPERT[cls], width).bm == cfg.bm \
                and mk.grouped_config(MOE_ROWS_PER_EXPERT[cls], width).swap == cfg.swap:
            return width
    return None


def moe_smem_to_force(cfg, fmt: str, gpu) -> int | None | bool:
    """How plan_grouped comes to pick cfg for a projection of format fmt: None where the described GPU's own
    shared memory per block does (a grouped_config as it is), else the smallest per-block limit that
    fit_mma_smem fits to cfg (a GPU with less shared memory: the reduced-stage / half-column variants kernel_specs
    lists for sm_86 / sm_89 / sm_120); False where no limit does."""
    from tilefish.ops import moe_kernels as mk
    from tilefish.ops.w4a16.dispatch import KERNEL_STATIC_SMEM, fit_mma_smem

    g, zp, _ = moe_fmt_parse(fmt)
    cls = _moe_row_class(cfg)
    width = _moe_base_width(cls, cfg)
    if width is None:
        return False
    base = mk.grouped_config(MOE_ROWS_PER_EXPERT[cls], width)
    if fit_mma_smem(base, g, zp, gpu.smem_per_block) == cfg:
        return None
    limit = cfg.smem_bytes(g, zp) + KERNEL_STATIC_SMEM
    try:
        return limit if fit_mma_smem(base, g, zp, limit) == cfg else False
    except ValueError:
        return False


def moe_plan(gpu, cls: str, gu_bn: int, dn_bn: int, dt: str, gu: str, dn: str, *, idt: str, act: str, bias: int,
             smem: int | None = None, split: bool = False, cnt: int | None = None, rep: int | None = None,
             tools=ALL, tier: int = 0, why: str = ""):
    """One grouped_experts_cuda call (align -> gate_up GEMM -> act -> down GEMM -> combine) -> (Plan,
    moe_kernels.GroupedPlan). Shapes from the row class and the column tiles (or the k-split shape); the id
    names the plan plan_grouped makes on `gpu` (its SM count: sms; a forced shared memory limit: smem): the
    configurations g1 (gate_up) / g2 (down) and k splits s1 / s2, which the worker checks before it launches.
    A ValueError where a format does not fit its GEMM's k, or where the two GEMMs would be one kernel name
    built twice (int4 / nf4 / mxfp4 builds of one instantiation: one process must not load both)."""
    from tilefish.ops import moe_kernels as mk
    from tilefish.ops.w4a16.layout import check_shape

    t, topk, e = (MOE_SPLIT_ROWS if split else MOE_ROWS)[cls]
    h, i = MOE_SPLIT_SHAPE if split else (MOE_HIDDEN[dn_bn], MOE_INTER[gu_bn])
    (g1, zp1, cb1), (g2, zp2, cb2) = moe_fmt_parse(gu), moe_fmt_parse(dn)
    check_shape(2 * i, h, g1)
    check_shape(h, i, g2)
    gp = mk.plan_grouped(t, topk, e, h, i, (g1, zp1), (g2, zp2), gpu.sm_count,
                         gpu.smem_per_block if smem is None else smem)
    s1 = mk.grouped_gemm_spec(_dtype(dt), gp.gate_up.config, g1, zp1, cb1)
    s2 = mk.grouped_gemm_spec(_dtype(dt), gp.down.config, g2, zp2, cb2)
    if s1.name == s2.name and s1.defines != s2.defines:
        raise ValueError(f"gate_up {gu} and down {dn} are two builds of {s1.name}")
    p = make_plan("moe", tools, tier, why, dt=dt, id=idt, act=act, t=t, topk=topk, e=e, h=h, i=i, gu=gu, dn=dn,
                  bias=bias, sms=gpu.sm_count, smem=smem, g1=gp.gate_up.config.label(), s1=gp.gate_up.slices,
                  g2=gp.down.config.label(), s2=gp.down.slices, cnt=cnt, rep=rep)
    return p, gp


def _moe_fits(fmt: str, k: int) -> bool:
    g = moe_fmt_parse(fmt)[0]
    return g == -1 or k % g == 0


def enumerate_moe(universe, gpu, add) -> None:
    """MoE plans (ops.moe_kernels), tier 0: every grouped GEMM configuration kernel_specs lists (each row class
    x column tile as plan_grouped picks it; the variants fitted to less shared memory under a forced limit),
    every weight format x dtype on the grouped GEMM, the alignment / activation / combine kernels of both id
    dtypes, both activations, both dtypes; tier 1: both GEMMs split k in each row class (the fixup through the
    caller's counters and through fresh ones, launched twice and compared bitwise). Every call routes with an
    idle expert, a dropped id and (T >= 3) a token whose every slot is dropped."""
    cfgs = {cfg.label(): cfg for _, _, pfam, cfg, fmt in universe
            if pfam == "moe" and cfg is not None and not isinstance(cfg, str)}
    if not cfgs:
        return
    fmts = moe_formats()
    left = {dt: list(fmts) for dt in ("fp16", "bf16")}  # formats not yet run on the grouped GEMM, per dtype
    nxt = {dt: 0 for dt in left}
    count = 0

    def pick(dt: str, k: int, avoid=()) -> str:
        """The format for a GEMM of reduction k: one not yet run (those of group 128 first: only some GEMMs of
        the layout take them), else the next of the rotation."""
        ok = sorted((f for f in left[dt] if _moe_fits(f, k) and f not in avoid),
                    key=lambda f: moe_fmt_parse(f)[0] != 128)
        if ok:
            return ok[0]
        for _ in range(2 * len(fmts)):
            f = fmts[nxt[dt] % len(fmts)]
            nxt[dt] += 1
            if _moe_fits(f, k) and f not in avoid:
                return f
        raise ValueError(f"no MoE weight format fits k = {k} besides {sorted(avoid)}")

    def one(cls, gu_bn, dn_bn, tier=0, tools=ALL, why="", dt=None, gu=None, dn=None, **kw):
        nonlocal count
        dt = dt or ("fp16", "bf16")[count % 2]
        h, i = MOE_SPLIT_SHAPE if kw.get("split") else (MOE_HIDDEN[dn_bn], MOE_INTER[gu_bn])
        gu = gu or pick(dt, h)
        tried = {gu}
        while True:
            dn_f = dn or pick(dt, i, tried)
            try:
                p, gp = moe_plan(gpu, cls, gu_bn, dn_bn, dt, gu, dn_f, idt=("i64", "i32")[count // 2 % 2],
                                 act=("silu", "swiglu_oai")[count // 4 % 2], bias=int(count % 3 != 1), tier=tier,
                                 tools=tools, why=why, **kw)
                break
            except ValueError:  # two builds of one kernel name in one call: another down format
                if dn:
                    raise
                tried.add(dn_f)
        count += 1
        for f in (p.args["gu"], p.args["dn"]):
            if f in left[dt]:
                left[dt].remove(f)
        add(p)
        return p, gp

    shape_why = ("S = T K slots, ~{rows} rows an expert ({blocks}); gate_up n = 2I = {n1}, k = H = {h}; down n = H, "
                 "k = I = {i}{half}; an idle expert, a dropped id{drop}")

    def why_of(cls, gu_bn, dn_bn, extra=""):
        t = MOE_ROWS[cls][0]
        h, i = MOE_HIDDEN[dn_bn], MOE_INTER[gu_bn]
        return shape_why.format(rows=MOE_ROWS_PER_EXPERT[cls] if cls != "swap" else "1.3",
                                blocks={"swap": "swapped operands, blocks of 8 rows", "m16": "16-row tiles",
                                        "m32": "32-row tiles"}[cls], n1=2 * i, h=h, i=i,
                                half=" (k % 128 == 64: half last k tiles)" if 64 in (h % 128, i % 128) else "",
                                drop=", a token with every slot dropped" if t >= 3 else "") + extra

    # tier 0: each row class with column tiles (gate_up, down) 256 / 64, 128 / 128, 256 / 256, 128 / 64
    covered: set = set()
    for cls in ("swap", "m16", "m32"):
        for gu_bn, dn_bn in ((256, 64), (128, 128), (256, 256), (128, 64)):
            p, gp = one(cls, gu_bn, dn_bn, why=why_of(cls, gu_bn, dn_bn))
            covered |= {gp.gate_up.config.label(), gp.down.config.label()}
    # configurations plan_grouped picks on GPUs with less shared memory: under a forced per-block limit
    for label in sorted(set(cfgs) - covered):
        cfg = cfgs[label]
        cls = _moe_row_class(cfg)
        width = _moe_base_width(cls, cfg)
        for dt in ("fp16", "bf16"):
            cands = [f for f in left[dt] + fmts if moe_smem_to_force(cfg, f, gpu) not in (False, None)]
            if cands:
                break
        if not cands:
            continue  # coverage() reports its specs as not run
        f = cands[0]
        smem = moe_smem_to_force(cfg, f, gpu)
        gu_bn, dn_bn = (width, 256) if width >= 128 else (256, width)
        p, gp = one(cls, gu_bn, dn_bn, dt=dt, gu=f, dn=f if _moe_fits(f, MOE_INTER[gu_bn]) else None, smem=smem,
                    why=why_of(cls, gu_bn, dn_bn, f"; shared memory per block forced to {smem} B (a GPU with less: "
                                                  f"{label} as fit_mma_smem fits it there)"))
        got = {gp.gate_up.config.label(), gp.down.config.label()}
        if label not in got:
            raise AssertionError(f"MoE plan {p.id} was meant to run {label}; plan_grouped picks {sorted(got)}")
        covered |= got
    # formats the layout left out (the rotation prefers formats not yet run): on the cheapest layout
    for dt in ("fp16", "bf16"):
        while left[dt]:
            f = left[dt][0]
            gu_bn, dn_bn = (256, 256)
            one("swap", gu_bn, dn_bn, dt=dt, gu=f, why=why_of("swap", gu_bn, dn_bn, "; a format the layout left out"))
    # tier 1: k split in each row class (both GEMMs: H = I = 1024), the caller's counters or fresh ones
    for j, cls in enumerate(("swap", "m16", "m32")):
        rows = "swapped operands" if cls == "swap" else cls[1:] + "-row tiles"
        p, gp = one(cls, 256, 256, tier=1, split=True, cnt=int(j % 2 == 0), rep=2,
                    why=f"both GEMMs split k (H = I = 1024), {rows}; "
                        + ("the tile counters the caller owns (checked back at zero)" if j % 2 == 0 else
                           "fresh zeroed tile counters") + "; launched twice, compared bitwise")
        if not (gp.gate_up.slices > 1 and gp.down.slices > 1):
            raise AssertionError(f"MoE plan {p.id} was meant to split k in both GEMMs: {gp}")


def moe_exhaustive(universe, gpu, covered: set, add) -> None:
    """--exhaustive: a memcheck plan for every grouped GEMM spec the sampled plans leave out (the spec's
    configuration and format in the GEMM whose column tile takes it, the other GEMM in a format that fits)."""
    for fam, spec, pfam, cfg, fmt in universe:
        if pfam != "moe" or spec in covered or cfg is None or isinstance(cfg, str):
            continue
        f = moe_fmt_code(fmt["g"], bool(fmt["zp"]), fmt["cb"])
        smem = moe_smem_to_force(cfg, f, gpu)
        if smem is False:
            continue
        cls = _moe_row_class(cfg)
        width = _moe_base_width(cls, cfg)
        gu_bn, dn_bn = (width, 256) if width >= 128 else (256, width)
        h, i = MOE_HIDDEN[dn_bn], MOE_INTER[gu_bn]
        mine_gu = width >= 128
        other = next(o for o in ([f] + moe_formats()) if _moe_fits(o, i if mine_gu else h) and (
            o == f or moe_fmt_parse(o)[:2] != moe_fmt_parse(f)[:2]))
        gu, dn = (f, other) if mine_gu else (other, f)
        p, gp = moe_plan(gpu, cls, gu_bn, dn_bn, fmt["dt"], gu, dn, idt="i64", act="silu", bias=1, smem=smem,
                         tools=frozenset(("memcheck",)), tier=3, why="--exhaustive: a spec the sampled plans leave out")
        if spec not in plan_specs(p):
            raise AssertionError(f"--exhaustive MoE plan {p.id} does not run {spec}")
        add(p)


# The MoE decode path (ops.moe_decode: moe/decode.cu's moe_decode_gate_up -> moe_decode_down; plan ids with
# path=decode, the call forced to it). plan_decode cuts each kernel's k into slices from the shapes and the SM
# count (about 4 CTAs an SM; a slice at least one batch a warp: gate_up 32 k16 rows, down 64). Modes (shapes as a
# function of the weight formats: a group-128 projection gets k % 128 == 0, the others k % 128 == 64 where the
# mode allows), each checked against plan_decode on the GPU the plans are made for:
#   split   both kernels split k (gate_up H = 640, 40 k16 rows; down I = 1088 / 1152, 68 / 72 rows, a part batch
#           of 4 rows in down's last slice at 1088); T tried 4, 3, 2 until both split on this GPU
#   small   slices == 1 in both (small k: H 192 / 256, I 320 / 384); down still sums K = 2 parts (workspace, counters)
#   single  slices == 1 and K = 1: one part a strip, so neither kernel touches a workspace or a counter
#   gptoss  gpt-oss' H = I = 2880 (mxfp4, biases, swiglu_oai; 180 k16 rows, down's last batch partial)
# Every routing has an idle expert, a dropped id, (T >= 3) a token whose every slot is dropped and an expert that
# several slots pick (_run_moe makes one where the seeded routing has none).
MOE_DECODE_SHAPES = {  # mode -> (T candidates, K, E, H (gate_up group 128, else), I (down group 128, else))
    "split": ((4, 3, 2), 2, 4, (640, 640), (1152, 1088)),
    "small": ((3,), 2, 4, (256, 192), (384, 320)),
    "single": ((4,), 1, 4, (256, 320), (256, 192)),
    "gptoss": ((3,), 2, 3, (2880, 2880), (2880, 2880)),
}
MOE_DECODE_MODES = ("split", "small", "split", "single")  # the rotation over a dtype's formats
# The decode plans racecheck runs, (mode, dtype, cnt): the first of each. The kernels' shared memory (the warp sum,
# the fixup's arrival flag) does not depend on the weight format; these take both kernels through both dtypes,
# both activations, a k split with owned and with fresh counters, slices == 1 with and without a workspace.
MOE_DECODE_RACE = (("split", "fp16", "1"), ("split", "bf16", "0"), ("small", "fp16", "1"), ("single", "bf16", None))


def moe_decode_plan(gpu, mode: str, dt: str, gu: str, dn: str, *, idt: str, act: str, bias: int,
                    cnt: int | None = None, rep: int | None = None, rt: str | None = None, tools=ALL, tier: int = 0,
                    why: str = ""):
    """One grouped_experts_cuda(..., path="decode") call in `mode` (MOE_DECODE_SHAPES) -> (Plan,
    moe_decode.DecodePlan). The id names the k slices plan_decode makes on `gpu` (sms): s1 (gate_up), s2 (down),
    which the worker checks before it launches; rt="act": the routing weights in the activation dtype (None:
    fp32). The mode's intent (both split; neither; no workspace at K = 1) is
    checked here (AssertionError), and a format that does not fit its kernel's k is a ValueError."""
    from tilefish.ops import moe_decode as md
    from tilefish.ops.w4a16.layout import check_shape

    ts, topk, e, hs, is_ = MOE_DECODE_SHAPES[mode]
    (g1, _, _), (g2, _, _) = moe_fmt_parse(gu), moe_fmt_parse(dn)
    h, i = hs[g1 != 128], is_[g2 != 128]
    check_shape(2 * i, h, g1)
    check_shape(h, i, g2)
    for t in ts:
        dp = md.plan_decode(t, topk, h, i, gpu.sm_count)
        if mode != "split" or (dp.gate_up_slices > 1 and dp.down_slices > 1):
            break
    intent = {"split": dp.gate_up_slices > 1 and dp.down_slices > 1 and dp.counters > 0,
              "small": dp.gate_up_slices == 1 and dp.down_slices == 1 and dp.counters > 0,
              "single": dp.gate_up_slices == 1 and dp.down_slices == 1 and not dp.counters and not dp.workspace_floats,
              "gptoss": True}[mode]
    if not intent:
        raise AssertionError(f"MoE decode plan ({mode}, T {t}, K {topk}, H {h}, I {i}) on {gpu.sm_count} SMs: "
                             f"plan_decode makes {dp}, not what the mode is meant to run")
    if cnt is not None and not dp.counters:
        raise AssertionError(f"MoE decode plan ({mode}): cnt={cnt} but plan_decode needs no counters ({dp})")
    p = make_plan("moe", tools, tier, why, path="decode", dt=dt, id=idt, act=act, t=t, topk=topk, e=e, h=h, i=i,
                  gu=gu, dn=dn, bias=bias, sms=gpu.sm_count, s1=dp.gate_up_slices, s2=dp.down_slices, cnt=cnt,
                  rep=rep, rt=rt)
    return p, dp


def _decode_why(mode: str, a: dict, dp) -> str:
    t, topk, h, i = (int(a[x]) for x in ("t", "topk", "h", "i"))
    what = {"split": f"both kernels split k (gate_up x{dp.gate_up_slices} over H = {h}, down x{dp.down_slices} over "
                     f"I = {i}{': a part batch in its last slice' if (i // 16) % 8 else ''})",
            "small": f"slices == 1 in both (H = {h}, I = {i}); down sums K = {topk} parts through its workspace",
            "single": f"slices == 1 in both (H = {h}, I = {i}) and K = 1: no workspace, no counter",
            "gptoss": f"gpt-oss' H = I = 2880 (mxfp4, biases, swiglu_oai; gate_up x{dp.gate_up_slices}, down "
                      f"x{dp.down_slices} slices)"}[mode]
    sync = ("" if "cnt" not in a else "; the fixup through the tile counters the caller owns (checked back at zero)"
            if a["cnt"] == "1" else "; the fixup through fresh zeroed counters")
    return (f"decode path (forced): T = {t}, K = {topk}; {what}{sync}"
            + ("; launched twice, compared bitwise" if a.get("rep") == "2" else "")
            + ("; routing weights in the activation dtype" if a.get("rt") == "act" else "")
            + "; an idle expert, a dropped id, an expert several slots pick"
            + (", a token with every slot dropped" if t >= 3 else ""))


def enumerate_moe_decode(universe, gpu, add) -> None:
    """MoE decode-path plans (ops.moe_decode, the call forced to path="decode"), tier 0: both kernels in every
    weight format x dtype (fp16: gate_up and down in different formats, codebooks mixed; bf16: one format both, as
    a model has it), both activations and id dtypes, biases or none, in the modes of MOE_DECODE_SHAPES: k split in
    both kernels (the caller's counters and fresh ones), slices == 1 in both (K = 2, and K = 1 without a workspace),
    gpt-oss' shape (the bf16 mxfp4 plan); the plans with counters launched twice and compared bitwise. racecheck
    runs the MOE_DECODE_RACE plans, the other tools every plan."""
    if not any(pfam == "moe" and fmt.get("kind") in DECODE_KINDS for _, _, pfam, _, fmt in universe):
        return
    fmts = moe_formats()
    n = len(fmts)
    count = 0
    per_mode: dict[str, int] = {}
    race = set(MOE_DECODE_RACE)
    for dt in ("fp16", "bf16"):
        for j, gu in enumerate(fmts):
            dn = fmts[(j + 5) % n] if dt == "fp16" else gu
            gptoss = dt == "bf16" and gu == "mxfp4.g32"
            mode = "gptoss" if gptoss else MOE_DECODE_MODES[j % len(MOE_DECODE_MODES)]
            # the mode's own rotation: the counters (owned / fresh), then the activation
            m = per_mode[mode] = per_mode.get(mode, -1) + 1
            act = "swiglu_oai" if gptoss else ("silu", "swiglu_oai")[(m // 2 if mode == "split" else m) % 2]
            cnt = None if mode == "single" else 1 if gptoss else int(m % 2 == 0)
            key = (mode, dt, None if cnt is None else str(cnt))
            tools = ALL if key in race else NO_RACE
            race.discard(key)
            p, dp = moe_decode_plan(gpu, mode, dt, gu, dn, idt=("i32", "i64")[count % 2], act=act,
                                    bias=1 if gptoss else int(count % 3 != 1), cnt=cnt,
                                    rep=None if mode == "single" else 2, rt="act" if j % 2 else None, tools=tools)
            add(dataclasses.replace(p, why=_decode_why(mode, p.args, dp)))
            count += 1
    if race:
        raise AssertionError(f"no MoE decode plan for racecheck's {sorted(race, key=str)}")


def moe_decode_exhaustive(universe, gpu, covered: set, add) -> None:
    """--exhaustive: memcheck plans (mode small) for every decode spec the sampled plans leave out: each left-out
    gate_up spec with a left-out down spec of its dtype and id dtype where one is left (else down in its own
    format), then the down specs left (gate_up in their format)."""
    left = [(spec, fmt) for _, spec, pfam, _, fmt in universe
            if pfam == "moe" and fmt.get("kind") in DECODE_KINDS and spec not in covered]
    downs = [(s, f) for s, f in left if f["kind"] == "decode_down"]
    todo = []  # (specs, dtype, id, act, gate_up format, down format, routing dtype)
    for spec, fmt in [(s, f) for s, f in left if f["kind"] == "decode_gate_up"]:
        code = moe_fmt_code(fmt["g"], bool(fmt["zp"]), fmt["cb"])
        mate = next((x for x in downs if (x[1]["dt"], x[1]["id"]) == (fmt["dt"], fmt["id"])), None)
        if mate is not None:
            downs.remove(mate)
        todo.append(([spec] + ([mate[0]] if mate else []), fmt["dt"], fmt["id"], fmt["act"], code,
                     moe_fmt_code(mate[1]["g"], bool(mate[1]["zp"]), mate[1]["cb"]) if mate else code,
                     mate[1]["rt"] if mate else None))
    for spec, fmt in downs:
        code = moe_fmt_code(fmt["g"], bool(fmt["zp"]), fmt["cb"])
        todo.append(([spec], fmt["dt"], fmt["id"], "silu", code, code, fmt["rt"]))
    for specs, dt, idt, act, gu, dn, rt in todo:
        p, dp = moe_decode_plan(gpu, "small", dt, gu, dn, idt=idt, act=act, bias=1, rt=None if rt == "f32" else rt,
                                tools=frozenset(("memcheck",)), tier=3)
        p = dataclasses.replace(p, why="--exhaustive: decode specs the sampled plans leave out; "
                                + _decode_why("small", p.args, dp))
        if not set(specs) <= set(plan_specs(p)):
            raise AssertionError(f"--exhaustive MoE decode plan {p.id} does not run {specs}")
        add(p)


def enumerate_plans(sm_count: int = 132, cc: int = 90, exhaustive: bool = False, universe=None,
                    gpu_name: str = "NVIDIA H100 80GB HBM3") -> list[Plan]:
    """Every plan, from the dispatchable specs (dispatch_universe) plus the tuned tables' k splits, the
    dispatcher's own picks and the launch modes. sm_count / cc / gpu_name: the GPU's (shapes that need
    many tiles depend on the SM count; sm_90-only kernels are left out elsewhere). A plan meant to
    exercise a launch mode (DSMEM clusters, the workspace split, the separate tail) is checked to have
    it through the launcher's geometry on that GPU (w4_geometry), and says so in its why."""
    from tilefish.ops import w4a16 as w4
    from tilefish.ops.w4a16.tuned import PACKAGE_TABLES, Plan as TPlan, read_table_doc

    universe = dispatch_universe() if universe is None else universe
    hopper = cc == 90
    gpu = described_gpu(sm_count, cc, gpu_name)
    plans: list[Plan] = []
    seen: set = set()

    def add(p: Plan) -> None:
        if p.id not in seen:
            seen.add(p.id)
            plans.append(p)

    w4cfgs: dict[str, object] = {}
    for _, _, pfam, cfg, _ in universe:
        if pfam in ("w4a16", "nf4-matmul") and cfg is not None:
            w4cfgs.setdefault(cfg.label(), cfg)
    rotors: dict[str, _Rotor] = {}
    base_splits: set = set()
    counter = 0
    for label in sorted(w4cfgs):
        cfg = w4cfgs[label]
        src = w4.kernel_spec(next(iter(w4.DTYPES)), cfg, 128, False).source
        if src != w4.SOURCE and not hopper:
            continue
        rot = rotors.setdefault(src, _Rotor())

        def wp(**kw):
            nonlocal counter
            counter += 1
            return _w4_plan(label, rot.next(), bias=counter % 2, perm=counter % 4 == 3, **kw)

        if isinstance(cfg, w4.GemmConfig):
            add(wp(m=3 if cfg.swap else cfg.bm + 5, n=2 * cfg.bn, k=192, sl=1, tier=0,
                   why="whole k (a half last k tile, k % 128 == 64, unless the group is 128), m across two m "
                       "tiles (swapped operands: m <= 8)"))
            add(wp(m=8 if cfg.swap else max(1, cfg.bm - 3), n=cfg.bn, k=832, sl=3, tier=1,
                   why="k split 3 ways through the global workspace, m below the tile"))
            base_splits |= {(label, 1), (label, 3)}
        elif isinstance(cfg, w4.HopperConfig) and not cfg.streamk:
            add(wp(m=cfg.mt + 5, n=cfg.bn, k=640, sl=1, tier=0,
                   why="whole tiles, m across two m tiles, the stage ring wraps (10 k stages)"))
            cl = wp(m=max(1, cfg.mt // 2 - 1), n=2 * cfg.bn, k=768, sl=3, dsmem=1, tier=1)
            fits = w4_geometry(cl, gpu).cluster == 3
            add(dataclasses.replace(cl, why="k split 3 ways " + ("as clusters of 3 (DSMEM fixup)" if fits else
                                    "through the global workspace (its clusters do not fit this GPU)")
                                    + ", m below the tile"))
            add(wp(m=cfg.mt + 1, n=cfg.bn, k=1024, sl=2, dsmem=0, tier=1,
                   why="k split 2 ways through the global workspace (LaunchPolicy dsmem_split off)"))
            base_splits |= {(label, 1), (label, 2), (label, 3)}
        elif isinstance(cfg, w4.HopperConfig):
            add(wp(m=max(1, cfg.mt - 3), n=2 * cfg.bn, k=1024, ct=7, rep=2, tier=0,
                   why="stream-K, 7 CTAs over 2 tiles x 16 stages: tiles cut mid-k, fixups (peek or slot: "
                       "launched twice, compared bitwise)"))
            add(wp(m=cfg.mt + 5, n=cfg.bn, k=832, tier=1,
                   why="stream-K, default grid: one unit a CTA, 13 contributors a tile, m across two tiles"))
        else:  # SkinnyConfig
            add(wp(m=1, n=2 * cfg.bn, k=1088, ct=3, tier=0,
                   why="3 CTAs over 2 tiles x 8.5 stages (9 with group 128): a tile ended mid-stream (finisher "
                       "fixup) and at the end (final fixup); the half last stage"))
            add(wp(m=cfg.mt, n=cfg.bn, k=2048, ct=24, tier=1,
                   why="m = the tile, one tile over 16 CTAs: a final fixup of more than 8 slots (batches)"))
            if cfg.mt == 8:  # ops.w4a16.choose_skinny_cluster_split: 8-row tiles
                add(wp(m=5, n=2 * cfg.bn, k=1088, sl=4, rep=2, tier=1,
                       why="the cluster split: 2 tiles x 4 slices, each tile's partials summed in its cluster "
                           "through DSMEM (launched twice, compared bitwise); the half last stage"))
    # every format of every kernel source at least once: what the rotation left out, on the source's first config
    for src, rot in sorted(rotors.items()):
        first = next(c for lb, c in sorted(w4cfgs.items())
                     if w4.kernel_spec(next(iter(w4.DTYPES)), c, 128, False).source == src)
        for fmt in rot.missing():
            rot.used.add(_fmt_key(fmt))
            if isinstance(first, w4.SkinnyConfig):
                kw = dict(m=min(5, first.mt), n=first.bn, k=576, ct=5)
            elif isinstance(first, w4.HopperConfig):
                kw = dict(m=first.mt + 3, n=first.bn, k=384, ct=5) if first.streamk else \
                    dict(m=first.mt + 3, n=first.bn, k=384, sl=2)
            else:
                kw = dict(m=3 if first.swap else first.bm + 3, n=first.bn, k=320, sl=2)
            add(_w4_plan(first.label(), fmt, tier=1, why="a format the rotation over the configurations left out",
                         bias=1, **kw))
    # an nf4 build of every configuration (the NF4 matmul runs the dispatcher's configurations with codebook nf4);
    # the rotation gave most of them one, racecheck included: the rest under the other tools
    have_nf4 = {p.args["cfg"] for p in plans if p.family == "nf4-matmul"}
    nf4_cycle = [f for f in format_cycle() if f["cb"] == "nf4"]
    for i, label in enumerate(sorted(lb for lb in w4cfgs if lb not in have_nf4 and
                                     (hopper or isinstance(w4cfgs[lb], w4.GemmConfig)))):
        cfg = w4cfgs[label]
        if isinstance(cfg, w4.SkinnyConfig):
            kw = dict(m=min(5, cfg.mt), n=2 * cfg.bn, k=1088, ct=5)
        elif isinstance(cfg, w4.HopperConfig):
            kw = dict(m=cfg.mt + 3, n=cfg.bn, k=832, ct=5) if cfg.streamk else dict(m=cfg.mt + 3, n=cfg.bn, k=832, sl=2)
        else:
            kw = dict(m=3 if cfg.swap else cfg.bm + 3, n=cfg.bn, k=832, sl=2)
        add(_w4_plan(label, nf4_cycle[i % len(nf4_cycle)], tools=NO_RACE, tier=1, bias=i % 2,
                     why="the configuration's nf4 build (codebook nf4: the NF4 matmul)", **kw))
    # the shipped tuned tables' (config, k split / grid) pairs the plans above do not run
    for path in sorted(PACKAGE_TABLES.glob("*.json")):
        for e in read_table_doc(path)["entries"]:
            tp = TPlan.parse(e["plan"])
            label = tp.cfg.label()
            if isinstance(tp.cfg, w4.SkinnyConfig) or (tp.cfg.streamk and tp.ctas is None):
                continue
            if not hopper and not isinstance(tp.cfg, w4.GemmConfig):
                continue
            key = (label, tp.slices or 1) if not tp.cfg.streamk else (label, f"c{tp.ctas}")
            if key in base_splits:
                continue
            base_splits.add(key)
            rot = rotors.setdefault(w4.kernel_spec(next(iter(w4.DTYPES)), tp.cfg, 128, False).source, _Rotor())
            cfg = tp.cfg
            if tp.cfg.streamk:
                kw = dict(m=max(1, cfg.mt - 3), n=cfg.bn, k=1024, ct=tp.ctas)
            elif isinstance(cfg, w4.HopperConfig):
                kw = dict(m=5, n=cfg.bn, k=256 * (tp.slices or 1), sl=tp.slices or 1, dsmem=1)
            else:
                kw = dict(m=min(5, 8), n=cfg.bn, k=256 * (tp.slices or 1), sl=tp.slices or 1)
            counter += 1
            add(_w4_plan(label, rot.next(), tools=NO_RACE, tier=2, bias=counter % 2,
                         why=f"a tuned table's plan {e['plan']} (its k split / grid) on a small shape", **kw))
    # the dispatcher's own choice (tuned table first, then the model / rules), both codebooks
    auto_cases = [(m, 512, 1024) for m in (1, 3, 8, 12, 16, 24, 64, 130, 300)] + [(1, 4096, 4096), (16, 4096, 4096)]
    fmts = format_cycle()
    for i, (m, n, k) in enumerate(auto_cases):
        fmt = {"cb": "int4", "dt": "fp16", "g": 128, "zp": 0} if n == 4096 else \
            {"cb": "int4", "dt": ("fp16", "bf16")[i % 2], "g": (128, -1, 32, 64)[i % 4], "zp": i % 3 == 1}
        add(_w4_plan("auto", fmt, m=m, n=n, k=k, tools=NO_RACE, tier=2, bias=i % 2, perm=i % 5 == 4,
                     why="the dispatcher's plan (shipped tuned table, time model or rules)" +
                         (" at a tuned table's shape" if n == 4096 else "")))
    for i, (m, n, k, g) in enumerate([(m, 512, 1024, 64) for m in (1, 5, 16, 33, 130, 300)]
                                     + [(m, 768, 2048, 128) for m in (2, 20, 200)]):
        add(_w4_plan("auto", {"cb": "nf4", "dt": ("bf16", "fp16")[i % 2], "g": g, "zp": 0}, m=m, n=n, k=k,
                     tools=NO_RACE, tier=2, bias=i % 2, why="the NF4 dispatcher's plan (nf4.matmul's path)"))
    # the separate tail launch (ops.w4a16.separate_tail): a per-channel whole-tile plan of a two-CTA config whose
    # partial last wave fills more than half the SMs; kept only where the launcher's geometry has the second launch
    tail_cfg = w4.HopperConfig(128, 2, 1, 4)
    if hopper and tail_cfg.label() in w4cfgs:
        m_tiles = -(-(2 * sm_count + sm_count * 3 // 4) // 24)
        tail = _w4_plan(tail_cfg.label(), {"cb": "int4", "dt": "fp16", "g": -1, "zp": 1}, m=m_tiles * 128 - 37,
                        n=128 * 24, k=128, sl=1, tail="rule", tools=NO_RACE, tier=2, bias=1,
                        why="the partial last wave as a second launch (tile_base > 0)")
        if len(w4_geometry(tail, gpu).launches) == 2:
            add(tail)

    # NF4 dequantize, SGEMM, HGEMM: every dispatched spec
    hg_seen: dict = {}
    for fam, spec, pfam, cfg, fmt in universe:
        if cfg is None and pfam not in ("nf4-dequant", "norm", "rope_cache", "rope_attention"):
            continue
        if pfam == "nf4-dequant":
            i = DT_NAMES.index(fmt["dt"]) * 2 + fmt["dq"]
            add(make_plan("nf4-dequant", ALL, 0, "67 x 1030 (a partial last block and vector), every dispatched build",
                          dt=fmt["dt"], dq=fmt["dq"], rows=67, cols=1030, bs=(64, 4096, 256)[i % 3]))
        elif pfam == "norm":
            add(make_plan("norm", ALL, 0, "67 rows, the residual add + norm and the plain norm, programmatic launch",
                          dt=fmt["dt"], vpt=fmt["vpt"], rows=67, cols=NORM_COLS[fmt["vpt"]]))
        elif pfam == "rope_cache":
            add(make_plan("rope_cache", ALL, 0, "a 64-sequence decode step (112 CTAs meet at the length), then a "
                          "33-token prompt whose last 5 positions fall past the cache", dt=fmt["dt"]))
        elif pfam == "rope_attention":
            add(make_plan("rope_attention", ALL, 0, "decode steps in one-tile chunks with a bool mask (16 sequences, "
                          "a 12-chunk cluster, an 18-chunk split through L2), then one past the cache without a "
                          "mask, early K/V copies", dt=fmt["dt"], d=fmt["d"]))
        elif pfam == "sgemm":
            bm, bn = cfg.tile
            vec = cfg.info.vectorized
            bk = cfg.params.get("BK", 32)
            add(make_plan("sgemm", ALL, 0, "edge tiles in m, n and k; alpha / beta with c on every other step",
                          cfg=_sg_code(cfg), m=bm + 3, n=bn + 4 if vec else bn + 3, k=2 * bk + 4 if vec else 37,
                          beta=int(cfg.info.index % 2 == 1)))
        elif pfam == "hgemm":
            if cfg.info.hopper and not hopper:
                continue
            i = hg_seen.setdefault(_sg_code(cfg), len(hg_seen))
            first = fmt["dt"] == ("fp16", "bf16")[(i + fmt["nk"]) % 2]  # one dtype per (config, layout) in tier 0/1
            race = first and fmt["nk"] == i % 2                         # one plan a configuration under racecheck
            bm, bn = cfg.tile
            if cfg.info.hopper:
                shape = dict(m=2 * bm + 5, n=2 * bn + 8, k=200, sms=3)
                why = "persistent grid forced to 3 CTAs (several tiles each, the ring wraps across tiles), edges"
            else:
                bk = cfg.params.get("BK", 16)
                shape = dict(m=bm + 5, n=bn + 8, k=2 * bk + 8)
                why = "edge tiles in m and n, k tail"
            add(make_plan("hgemm", ALL if race else NO_RACE, 0 if first else 2, why, cfg=_sg_code(cfg), dt=fmt["dt"],
                          nk=fmt["nk"], **shape))
    enumerate_moe(universe, gpu, add)
    enumerate_moe_decode(universe, gpu, add)
    if exhaustive:
        covered = set()
        for p in plans:
            covered |= set(plan_specs(p))
        moe_exhaustive(universe, gpu, covered, add)
        moe_decode_exhaustive(universe, gpu, covered, add)
        for fam, spec, pfam, cfg, fmt in universe:
            if spec in covered or cfg is None or pfam not in ("w4a16", "nf4-matmul"):
                continue
            if not hopper and spec.source != w4.SOURCE:
                continue
            if isinstance(cfg, w4.SkinnyConfig):
                kw = dict(m=min(5, cfg.mt), n=cfg.bn, k=576, ct=5)
            elif isinstance(cfg, w4.HopperConfig):
                kw = dict(m=cfg.mt + 3, n=cfg.bn, k=384, ct=5) if cfg.streamk else dict(m=cfg.mt + 3, n=cfg.bn, k=384)
            else:
                kw = dict(m=3 if cfg.swap else cfg.bm + 3, n=cfg.bn, k=320, sl=2)
            add(_w4_plan(cfg.label(), fmt, tools=frozenset(("memcheck",)), tier=3, bias=1,
                         why="--exhaustive: a spec the sampled plans leave out", **kw))
    return plans


def plan_specs(p: Plan) -> list:
    """The KernelSpecs a plan launches, where known before it runs (the dispatcher's picks are recorded by the
    dry run instead)."""
    import torch
    from tilefish.ops import hgemm, nf4, sgemm
    from tilefish.ops import w4a16 as w4

    a = p.args
    if p.family in ("w4a16", "nf4-matmul"):
        if a["cfg"] == "auto":
            return []
        cfg, _ = w4.parse_plan(a["cfg"])
        return [w4.kernel_spec(_dtype(a["dt"]), cfg, int(a["g"]), bool(int(a["zp"])), a["cb"])]
    if p.family == "nf4-dequant":
        return [nf4.kernel_spec(_dtype(a["dt"]), bool(int(a["dq"])))]
    if p.family == "norm":
        from tilefish.ops import norm

        return [norm.kernel_spec(_dtype(a["dt"]), int(a["vpt"]))]
    if p.family == "rope_cache":
        from tilefish.ops import rope_cache

        return [rope_cache.kernel_spec(_dtype(a["dt"]), hn) for hn in (False, True)]
    if p.family == "rope_attention":
        from tilefish.ops import rope_attention

        return [rope_attention.kernel_spec(_dtype(a["dt"]), int(a["d"]), hn) for hn in (False, True)]
    if p.family == "sgemm":
        return [sgemm.SgemmConfig(*_sg_parse(a["cfg"])).spec]
    if p.family == "hgemm":
        dt = _dtype(a["dt"])
        return [hgemm.HgemmConfig(*_sg_parse(a["cfg"])).spec(dt if dt != torch.float32 else torch.float16,
                                                             bool(int(a["nk"])))]
    if p.family == "moe":
        from tilefish.ops import moe_decode as md
        from tilefish.ops import moe_kernels as mk

        dt, idt = _dtype(a["dt"]), _id_dtype(a["id"])
        (g1, zp1, cb1), (g2, zp2, cb2) = moe_fmt_parse(a["gu"]), moe_fmt_parse(a["dn"])
        if a.get("path") == "decode":
            return [md.gate_up_spec(dt, g1, zp1, cb1, a["act"], idt),
                    md.down_spec(dt, g2, zp2, cb2, idt, _routing_dtype(a.get("rt"), dt))]
        return list(dict.fromkeys([mk.align_spec(idt),
                                   mk.grouped_gemm_spec(dt, w4.parse_plan(a["g1"])[0], g1, zp1, cb1),
                                   mk.act_spec(dt, a["act"]),
                                   mk.grouped_gemm_spec(dt, w4.parse_plan(a["g2"])[0], g2, zp2, cb2),
                                   mk.combine_spec(dt, idt)]))
    return []


@dataclass
class Coverage:
    covered: dict          # spec -> [plan ids]
    excluded: dict         # spec -> reason
    unreadable: list       # (family, spec, error)
    config_tools: dict     # W4A16 config label -> set of tools whose plans run it
    format_tools: dict     # (kernel source, format key) -> set of tools
    moe_config_tools: dict = field(default_factory=dict)  # MoE grouped GEMM config label -> set of tools
    moe_format_tools: dict = field(default_factory=dict)  # MoE (dtype, weight format code) -> set of tools
    moe_decode_tools: dict = field(default_factory=dict)  # MoE decode (kernel kind, dtype, format code) -> tools


def coverage(plans: list[Plan], universe=None, cc: int = 90) -> Coverage:
    from tilefish.ops import w4a16 as w4

    universe = dispatch_universe() if universe is None else universe
    covered: dict = {}
    cfg_tools: dict = {}
    fmt_tools: dict = {}
    moe_cfg_tools: dict = {}
    moe_fmt_tools: dict = {}
    decode_tools: dict = {}
    listed = {spec for _, spec, *_ in universe}
    for p in plans:
        for s in plan_specs(p):
            if s in listed:  # coverage of kernel_specs(): a build it does not list is not counted
                covered.setdefault(s, []).append(p.id)
        if p.family == "moe" and p.args.get("path") == "decode":
            a = p.args
            for kind, f in zip(DECODE_KINDS, (a["gu"], a["dn"])):
                decode_tools.setdefault((kind, a["dt"], f), set()).update(p.tools)
        elif p.family == "moe":
            a = p.args
            for g, f in ((a["g1"], a["gu"]), (a["g2"], a["dn"])):
                moe_cfg_tools.setdefault(g, set()).update(p.tools)
                moe_fmt_tools.setdefault((a["dt"], f), set()).update(p.tools)
        if p.family in ("w4a16", "nf4-matmul") and p.args["cfg"] != "auto":
            a = p.args
            cfg_tools.setdefault(a["cfg"], set()).update(p.tools)
            src = plan_specs(p)[0].source
            fmt_tools.setdefault((src, (a["cb"], a["dt"], int(a["g"]), int(a["zp"]))), set()).update(p.tools)
    excluded, unreadable = {}, []
    for fam, spec, pfam, cfg, fmt in universe:
        if spec in covered:
            continue
        if cfg is None and "error" in fmt:
            unreadable.append((fam, spec, fmt["error"]))
            excluded[spec] = f"UNREAD: {fmt['error']} (teach spec_config this kernel)"
        elif spec.min_sm > cc:
            excluded[spec] = f"needs sm_{spec.min_sm}; this GPU is sm_{cc}"
        elif pfam == "moe" and fmt.get("kind") in DECODE_KINDS:
            code = moe_fmt_code(fmt["g"], bool(fmt["zp"]), fmt["cb"])
            variant = (f"activation {fmt['act']}, " if "act" in fmt else "") + f"id {fmt['id']}"
            excluded[spec] = (f"decode variant {cfg} {fmt['dt']} {code} ({variant}) not sampled: the kernel runs this "
                              "format and dtype with another activation / id dtype; --exhaustive runs every spec"
                              if (cfg, fmt["dt"], code) in decode_tools else
                              f"no plan runs the decode kernel {cfg} in {fmt['dt']} {code}: a gap")
        elif pfam == "moe" and fmt.get("kind") == "gemm":
            code = moe_fmt_code(fmt["g"], bool(fmt["zp"]), fmt["cb"])
            excluded[spec] = (f"grouped format {fmt['dt']} {code} of {cfg.label()} not sampled: the configuration "
                              "runs under other formats and this format on another configuration; --exhaustive "
                              "runs every spec" if cfg.label() in moe_cfg_tools and (fmt["dt"], code) in moe_fmt_tools
                              else f"no plan runs the grouped GEMM {cfg.label()} or {fmt['dt']} {code}: a gap")
        elif pfam in ("w4a16", "nf4-matmul"):
            key = (fmt["cb"], fmt["dt"], fmt["g"], fmt["zp"])
            others = sum(1 for (src, fk), tl in fmt_tools.items() if src == spec.source and fk == key)
            excluded[spec] = (f"format {fmt['cb']} {fmt['dt']} g{fmt['g']}{' zp' if fmt['zp'] else ''} of "
                              f"{cfg.label()} not sampled: the configuration runs under other formats and this "
                              f"format runs on another {Path(spec.source).name} configuration ({others}); "
                              "--exhaustive runs every spec")
        else:
            excluded[spec] = "no plan (enumerate_plans does not build one for this family): a gap"
    # every dispatched W4A16 configuration must be in the plan set (the test checks each tool)
    for _, spec, pfam, cfg, fmt in universe:
        if pfam in ("w4a16", "nf4-matmul") and cfg is not None and (cc == 90 or spec.source == w4.SOURCE):
            cfg_tools.setdefault(cfg.label(), set())
        if pfam == "moe" and cfg is not None and fmt.get("kind") == "gemm":  # ... and every MoE grouped GEMM one
            moe_cfg_tools.setdefault(cfg.label(), set())
            moe_fmt_tools.setdefault((fmt["dt"], moe_fmt_code(fmt["g"], bool(fmt["zp"]), fmt["cb"])), set())
        if pfam == "moe" and fmt.get("kind") in DECODE_KINDS:  # ... and every decode kernel x dtype x format
            decode_tools.setdefault((cfg, fmt["dt"], moe_fmt_code(fmt["g"], bool(fmt["zp"]), fmt["cb"])), set())
    return Coverage(covered, excluded, unreadable, cfg_tools, fmt_tools, moe_cfg_tools, moe_fmt_tools, decode_tools)


# ---- the worker ----------------------------------------------------------------------------------------------------

def build_with_line_info(lineinfo: bool) -> None:
    """Build kernels with -lineinfo (reports carry file:line; it adds line tables without changing the
    optimization, as compute-sanitizer's manual recommends it): runtime.compiler's TILEFISH_LINEINFO,
    whose builds have cache keys of their own, so the normal cache entries are never replaced."""
    if lineinfo:
        os.environ["TILEFISH_LINEINFO"] = "1"  # runtime.compiler reads it per build; the workers inherit it


def _seed(pid: str) -> int:
    return int(hashlib.sha1(pid.encode()).hexdigest()[:8], 16)


def _rel_err(out, ref) -> float:
    import torch

    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        raise AssertionError("output has NaN (elements the kernel did not write?)")
    den = ref.norm().item()
    return (out - ref).norm().item() / (den if den > 0 else 1.0)


def _poison(rows: int, cols: int, dtype, device) -> None:
    """A NaN block of the output's size left in torch's caching allocator (the dry run): the op's output reuses
    it, so an unwritten element shows as NaN. Without caching (memcheck / initcheck) initcheck does that job."""
    import torch

    torch.full((rows, cols), float("nan"), device=device, dtype=dtype)


def _run_w4a16(pid: str, a: dict, dev) -> dict:
    import torch

    from tilefish import reference
    from tilefish.ops import w4a16 as w4
    from tilefish.quant.int4 import quantize_rtn

    gen = torch.Generator().manual_seed(_seed(pid))
    dt, g, zp, cb = _dtype(a["dt"]), int(a["g"]), bool(int(a["zp"])), a["cb"]
    m, n, k = int(a["m"]), int(a["n"]), int(a["k"])
    if cb == "int4":
        q = quantize_rtn(torch.randn(n, k, generator=gen) * 0.5, g, not zp, False, scale_dtype=dt)
        perm = torch.randperm(k, generator=gen) if int(a.get("perm", 0)) else None
        weight = w4.pack(q, perm)
        ref_fn = lambda x, b: reference.w4a16_matmul(x if perm is None else x[:, perm], q, b)  # noqa: E731
    elif cb == "mxfp4":
        from tilefish.quant import mxfp4

        mx = mxfp4.quantize(torch.randn(n, k, generator=gen) * 0.5)
        weight = w4.pack(mxfp4.to_int4_weight(mx, dt), codebook="mxfp4")
        wf = mx.dequantize(torch.float64)
        ref_fn = lambda x, b: (x.double() @ wf.t() + (0 if b is None else b.double())).to(x.dtype)  # noqa: E731
    else:
        from tilefish import nf4

        prepared = nf4.prepare(nf4.quantize((torch.randn(n, k, generator=gen) * 0.05).to(dt), blocksize=g), dt)
        weight = prepared.kernel
        ref_fn = lambda x, b: nf4.matmul(x, prepared, b)  # noqa: E731 - the CPU path: bitsandbytes' chain, float64
    x = torch.randn(m, k, generator=gen).to(dt)
    bias = torch.randn(n, generator=gen).to(dt) if int(a.get("bias", 0)) else None
    ref = ref_fn(x, bias)
    wg = weight.to(dev)
    xg, bg = x.to(dev), None if bias is None else bias.to(dev)
    cfg = None if a["cfg"] == "auto" else w4.parse_plan(a["cfg"])[0]
    slices = int(a["sl"]) if "sl" in a else None
    ctas = int(a["ct"]) if "ct" in a else None
    ws = w4.Workspace(dev) if dev.type == "cuda" else None  # owned counters: checked back at zero below
    policy = plan_policy(a)
    info: dict = {}
    if dev.type != "cuda":
        pass  # --cpu: the plumbing only (the ops' CPU path is the reference itself)
    else:
        lp = w4.LaunchPlan.build(wg, bg, m, dev, cfg, slices, ctas, policy=policy)
        info["launches"] = len(lp.launches)
        info["clusters"] = lp.geometry.cluster > 1
        if cfg is None:  # the dispatcher's pick: what tilefish.w4a16.plan says this GPU runs, and runs it
            import tilefish

            mp = tilefish.w4a16.plan(m, n, wg.k, group_size=wg.group_size, dtype=dt, codebook=wg.codebook,
                                     zero_points=wg.zeros is not None, policy=policy)
            info["plan"] = mp.label
            if (mp.config, mp.launches) != (lp.config, lp.geometry.launches):
                raise AssertionError(f"tilefish.w4a16.plan says {mp.label} {mp.launches}, the launch is "
                                     f"{lp.config.label()} {lp.geometry.launches}")
    outs = []
    t0 = time.perf_counter()
    for _ in range(int(a.get("rep", 1))):
        _poison(m, n, dt, dev)
        outs.append(w4.matmul_impl(xg, wg, bg, cfg=cfg, slices=slices, ctas=ctas, workspace=ws, policy=policy).cpu())
    info["gpu_s"] = time.perf_counter() - t0
    err = _rel_err(outs[0], ref)
    info["rel_err"] = err
    if not err < TOLERANCE[a["dt"]]:
        raise AssertionError(f"relative error {err:.3g} > {TOLERANCE[a['dt']]}")
    if any(not torch.equal(o, outs[0]) for o in outs[1:]):
        raise AssertionError("repeated launches differ bitwise")
    if ws is not None and int(ws.counters.abs().sum()):
        raise AssertionError("workspace tile counters not back at zero after the launch")
    return info


def _run_nf4_dequant(pid: str, a: dict, dev) -> dict:
    import torch

    from tilefish import nf4
    from tilefish.reference import nf4_dequantize_fp32_chain

    gen = torch.Generator().manual_seed(_seed(pid))
    dt = _dtype(a["dt"])
    w = torch.randn(int(a["rows"]), int(a["cols"]), generator=gen).to(torch.bfloat16)
    q = nf4.quantize(w, blocksize=int(a["bs"]), double_quant=bool(int(a["dq"])))
    ref = nf4_dequantize_fp32_chain(q, dt)
    qg = q.to(dev)
    t0 = time.perf_counter()
    out = torch.empty(q.shape, dtype=dt, device=dev)
    nf4.dequantize(qg, dt, out=out)
    out = out.cpu()
    info = {"gpu_s": time.perf_counter() - t0}
    if not torch.equal(out.view(-1), ref.view(-1)):
        raise AssertionError("differs from the fp32-chain reference (bitsandbytes' arithmetic)")
    return info


def _run_norm(pid: str, a: dict, dev) -> dict:
    import torch

    from tilefish import norm
    from tilefish.reference import rms_norm

    gen = torch.Generator().manual_seed(_seed(pid))
    dt, rows, cols = _dtype(a["dt"]), int(a["rows"]), int(a["cols"])
    x, r = (torch.randn(rows, cols, generator=gen).to(dt) for _ in range(2))
    w = (torch.rand(cols, generator=gen) + 0.5).to(dt)
    t0 = time.perf_counter()
    xg, rg, wg = x.to(dev), r.to(dev), w.to(dev)
    h, out = norm.rms_norm(xg, wg, 1e-6, rg)       # the add + norm, then the norm of its sum: a launch reading
    again = norm.rms_norm(h, wg, 1e-6)             # what the one ahead wrote (programmatic launch)
    h, out, again = h.cpu(), out.cpu(), again.cpu()
    info = {"gpu_s": time.perf_counter() - t0}
    if not torch.equal(h, x + r):
        raise AssertionError("h differs from x + residual")
    ref = rms_norm(h.float(), w.float(), 1e-6)  # both normalise h
    for got in (out, again):
        err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        if not err < TOLERANCE[a["dt"]]:
            raise AssertionError(f"relative error {err:.2e} against the fp32 reference")
    return info


def _run_rope_cache(pid: str, a: dict, dev) -> dict:
    import torch

    from tilefish.ops import rope_cache
    from tilefish.reference import rope_cache as reference

    gen = torch.Generator().manual_seed(_seed(pid))
    dt = _dtype(a["dt"])
    info = {"gpu_s": 0.0}
    # heads 32 on 8 kv heads, head dim 128; the last case with Qwen3's per-head q / k norms
    for b, t, slots, start, normed in ((64, 1, 40, 17, False), (2, 33, 60, 32, False), (5, 3, 40, 30, True)):
        qkv = torch.randn(b, t, 48 * 128, generator=gen).to(dt)
        cos, sin = (torch.rand(b, t, 128, generator=gen).to(dt) for _ in range(2))
        keys, values = (torch.randn(b, 8, slots, 128, generator=gen).to(dt) for _ in range(2))
        length = torch.tensor(start)
        norms = [(1 + 0.5 * torch.randn(128, generator=gen)).to(dt) for _ in range(2)] if normed else [None, None]
        t0 = time.perf_counter()
        got = [x.to(dev) for x in (keys, values, length)]
        q = rope_cache.rope_cache_impl(qkv.to(dev), cos.to(dev), sin.to(dev), *got, 32, 8, None,
                                       *[None if w is None else w.to(dev) for w in norms]).cpu()
        got = [x.cpu() for x in got]
        info["gpu_s"] += time.perf_counter() - t0
        want_q = reference(qkv, cos, sin, keys, values, length, 32, 8, *norms)
        if normed:  # the norm's fp32 sum runs in another order than torch's: within its rounding
            close = all(((x.double() - y.double()).norm() / y.double().norm()).item() < TOLERANCE[a["dt"]]
                        for x, y in ((q, want_q), (got[0], keys)))
            if not (close and torch.equal(got[1], values) and torch.equal(got[2], length)):
                raise AssertionError(f"b {b}, t {t}, head norms: differs from the reference")
        elif not (torch.equal(q, want_q) and all(torch.equal(x, y) for x, y in zip(got, (keys, values, length)))):
            raise AssertionError(f"b {b}, t {t}: differs from the reference bitwise")
    return info


def _run_rope_attention(pid: str, a: dict, dev) -> dict:
    import math

    import torch

    from tilefish.ops import rope_attention

    gen = torch.Generator().manual_seed(_seed(pid))
    dt, d = _dtype(a["dt"]), int(a["d"])
    info = {"gpu_s": 0.0}
    # 32 heads on 8 kv heads; chunks of 64: a split of 4 over 16 sequences (512 CTAs: through L2), of 12 (one
    # cluster of a non-portable size on sm_90, through L2 elsewhere), of 18 (through L2), none; Qwen3's per-head
    # q / k norms in two of them
    for b, slots, start, masked, normed in ((16, 200, 130, True, False), (1, 760, 700, True, True),
                                            (2, 1100, 300, True, False), (3, 64, 70, False, True)):
        qkv = torch.randn(b, 1, 48 * d, generator=gen).to(dt)
        cos, sin = (torch.rand(b, 1, d, generator=gen).to(dt) for _ in range(2))
        keys, values = (torch.randn(b, 8, slots, d, generator=gen).to(dt) for _ in range(2))
        length = torch.tensor(start)
        mask = (torch.rand(b, 1, 1, slots, generator=gen) > 0.3) if masked else None
        norms = [(1 + 0.5 * torch.randn(d, generator=gen)).to(dt) for _ in range(2)] if normed else [None, None]
        t0 = time.perf_counter()
        got = [x.clone().to(dev) for x in (keys, values, length)]  # a copy on the CPU path too
        out = rope_attention.rope_attention_impl(qkv.to(dev), cos.to(dev), sin.to(dev), *got,
                                                 None if mask is None else mask.to(dev), 1 / math.sqrt(d), 32, 8,
                                                 None, *[None if w is None else w.to(dev) for w in norms],
                                                 chunk=64, early_kv=True).cpu()
        got = [x.cpu() for x in got]
        info["gpu_s"] += time.perf_counter() - t0
        want = rope_attention.reference(qkv, cos, sin, keys, values, length, mask, 1 / math.sqrt(d), 32, 8, *norms)
        if normed:  # the new keys' norm sums in another order than torch's: within its rounding
            keys_err = ((got[0].double() - keys.double()).norm() / keys.double().norm()).item()
            if not (keys_err < TOLERANCE[a["dt"]] and torch.equal(got[1], values) and torch.equal(got[2], length)):
                raise AssertionError(f"b {b}, head norms: the cache or length differs from the reference")
        elif not all(torch.equal(x, y) for x, y in zip(got, (keys, values, length))):
            raise AssertionError(f"b {b}: the cache or length differs from the reference")
        err = ((out.double() - want.double()).norm() / want.double().norm()).item()
        if not err < TOLERANCE[a["dt"]]:
            raise AssertionError(f"b {b}: relative error {err:.2e} against the reference")
    return info


def _run_sgemm(pid: str, a: dict, dev) -> dict:
    import torch

    from tilefish.ops import sgemm

    gen = torch.Generator().manual_seed(_seed(pid))
    cfg = sgemm.SgemmConfig(*_sg_parse(a["cfg"]))
    m, n, k = int(a["m"]), int(a["n"]), int(a["k"])
    x, y = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    beta = 0.5 if int(a.get("beta", 0)) else 0.0
    c = torch.randn(m, n, generator=gen) if beta else None
    ref = sgemm.sgemm_reference(x, y, c, 1.5, beta)
    t0 = time.perf_counter()
    if c is None:
        _poison(m, n, torch.float32, dev)
    out = sgemm.sgemm(x.to(dev), y.to(dev), None if c is None else c.to(dev), 1.5, beta, kernel=cfg).cpu()
    info = {"gpu_s": time.perf_counter() - t0, "rel_err": _rel_err(out, ref)}
    if not info["rel_err"] < TOLERANCE["fp32"]:
        raise AssertionError(f"relative error {info['rel_err']:.3g}")
    return info


def _run_hgemm(pid: str, a: dict, dev) -> dict:
    import dataclasses

    import torch

    from tilefish.ops import hgemm

    gen = torch.Generator().manual_seed(_seed(pid))
    cfg = hgemm.HgemmConfig(*_sg_parse(a["cfg"]))
    dt, nk = _dtype(a["dt"]), bool(int(a["nk"]))
    m, n, k = int(a["m"]), int(a["n"]), int(a["k"])
    x = torch.randn(m, k, generator=gen).to(dt)
    y = (torch.randn(n, k, generator=gen) if nk else torch.randn(k, n, generator=gen)).to(dt)
    ref = hgemm.hgemm_reference(x, y, nk)
    orig = hgemm.device_info
    if "sms" in a and dev.type == "cuda":  # step 07's persistent grid over fewer CTAs than tiles: every CTA loops
        fake = dataclasses.replace(orig(dev.index), sm_count=int(a["sms"]))
        hgemm.device_info = lambda index=None: fake
    # initcheck does not see the TMA store's writes (cp.async.bulk.tensor, SASS UTMASTG), so the copy back of an
    # output only a TMA store wrote is reported uninitialized. Such an output starts NaN-filled instead: the
    # tool then sees initialized memory, and _rel_err's NaN check finds any element the kernel did not write.
    prefill = (os.environ.get(TOOL_ENV) == "initcheck" and dev.type == "cuda" and cfg.info.hopper
               and cfg.params.get("TMA_STORE") == 1)  # (where the launcher falls back to direct stores: harmless)
    try:
        t0 = time.perf_counter()
        if prefill:
            out = torch.full((m, n), float("nan"), dtype=dt, device=dev)
            hgemm.launch_config(cfg, x.to(dev), y.to(dev), out, nk)
            out = out.cpu()
        else:
            _poison(m, n, dt, dev)
            out = hgemm.hgemm(x.to(dev), y.to(dev), kernel=cfg, b_transposed=nk).cpu()
    finally:
        hgemm.device_info = orig
    info = {"gpu_s": time.perf_counter() - t0, "rel_err": _rel_err(out, ref), "output_prefilled": prefill}
    if not info["rel_err"] < TOLERANCE[a["dt"]]:
        raise AssertionError(f"relative error {info['rel_err']:.3g}")
    return info


def _moe_weights(e: int, n: int, k: int, code: str, dt, gen, scale: float = 1.0):
    """E random experts [n, k] quantized on the CPU in format `code` (ExpertWeights.from_weights)."""
    import torch

    from tilefish.ops.expert_weights import ExpertWeights

    g, zp, cb = moe_fmt_parse(code)
    w = torch.randn(e, n, k, generator=gen) * (scale / math.sqrt(k))
    if cb == "int4":
        ew = ExpertWeights.from_weights(w, "int4", group_size=g, symmetric=not zp, clip_search=False, dtype=dt)
    elif cb == "nf4":
        ew = ExpertWeights.from_weights(w, "nf4", blocksize=g, dtype=dt)
    else:
        ew = ExpertWeights.from_weights(w, cb, dtype=dt)
    if (ew.group_size, ew.zeros is not None, ew.codebook) != (g, zp, cb):
        raise AssertionError(f"{code}: quantized as group {ew.group_size}, zero points {ew.zeros is not None}, "
                             f"{ew.codebook}")
    return ew


def _moe_device_limits(a: dict, dev) -> tuple[int, int]:
    """(SM count, shared memory per block) the plan is made for: the id's sms and smem (the GPU's own where
    absent; on the CPU path the described GPU's)."""
    if dev.type == "cuda":
        from tilefish.runtime import device_info

        smem = device_info(dev.index).smem_per_block_optin
    else:
        from tilefish.runtime.device import SMEM_PER_BLOCK_BY_CC

        fake = json.loads(os.environ.get(FAKE_DEVICE_ENV) or "{}")
        smem = SMEM_PER_BLOCK_BY_CC[int(fake.get("cc", 90))]
    return int(a["sms"]), int(a["smem"]) if "smem" in a else smem


def _share_an_expert(ids, experts: int) -> bool:
    """Make some expert the pick of several slots (of two tokens; each token's ids stay distinct) where the
    routing has none: the first valid slot of the second token with a valid slot takes the first token's first
    valid id. False where fewer than two tokens have a valid slot."""
    valid = (ids >= 0) & (ids < experts)
    picked = ids[valid]
    if picked.numel() > picked.unique().numel():
        return True
    rows = [r for r in range(ids.shape[0]) if bool(valid[r].any())]
    if len(rows) < 2:
        return False
    ta, tb = rows[:2]
    ids[tb, int(valid[tb].nonzero()[0])] = ids[ta][valid[ta]][0]
    return True


def _run_moe(pid: str, a: dict, dev) -> dict:
    """One grouped_experts_cuda call on the path the id names (path=decode: ops.moe_decode's two launches; else the
    grouped path; either forced): E experts in the id's formats, seeded routing with an idle expert (no slot
    names it), a dropped id (negative, E, or past int32 for int64 ids), for T >= 3 a token whose every slot
    is dropped (its row must be exactly 0) and, on the decode path, an expert several slots pick. The plan the
    launcher makes (grouped: configurations and k splits by plan_grouped; decode: plan_decode's k slices)
    is checked against the id first, under the id's SM count / shared memory limit (moe_kernels.device_info
    stands in for the GPU where they differ from its own). The caller's counters (cnt=1) must be back at zero
    after the call. Checked against tilefish.reference.moe_experts (float64 from the dequantized weights, CPU)
    with the dropped slots given weight 0."""
    import dataclasses

    import torch

    from tilefish import reference
    from tilefish.ops import moe_decode as md
    from tilefish.ops import moe_kernels as mk
    from tilefish.ops.w4a16 import parse_plan
    from tilefish.ops.w4a16.workspace import new_counters

    gen = torch.Generator().manual_seed(_seed(pid))
    dt, idt = _dtype(a["dt"]), _id_dtype(a["id"])
    t, topk, e, h, i = (int(a[x]) for x in ("t", "topk", "e", "h", "i"))
    act = a["act"]
    path = a.get("path", "grouped")
    (g1, zp1, _), (g2, zp2, _) = moe_fmt_parse(a["gu"]), moe_fmt_parse(a["dn"])
    sms, smem = _moe_device_limits(a, dev)
    if path == "decode":
        dplan = md.plan_decode(t, topk, h, i, sms)
        if (dplan.gate_up_slices, dplan.down_slices) != (int(a["s1"]), int(a["s2"])):
            raise AssertionError(f"plan_decode splits gate_up x{dplan.gate_up_slices}, down x{dplan.down_slices}; "
                                 f"the plan id names x{a['s1']}, x{a['s2']}")
        info: dict = {"decode_plan": dplan._asdict()}
        needs_counters = dplan.counters
    else:
        plan = mk.plan_grouped(t, topk, e, h, i, (g1, zp1), (g2, zp2), sms, smem)
        got = (plan.gate_up.config, plan.gate_up.slices, plan.down.config, plan.down.slices)
        want = (parse_plan(a["g1"])[0], int(a["s1"]), parse_plan(a["g2"])[0], int(a["s2"]))
        if got != want:
            raise AssertionError(f"plan_grouped picks gate_up {got[0].label()} x{got[1]}, down {got[2].label()} "
                                 f"x{got[3]}; the plan id names {a['g1']} x{a['s1']}, {a['g2']} x{a['s2']}")
        info = {"block_m": plan.block_m, "max_blocks": plan.max_blocks}
        needs_counters = max(plan.gate_up.tile_counters, plan.down.tile_counters)
    gate_up = _moe_weights(e, 2 * i, h, a["gu"], dt, gen, 4.0 if act == "swiglu_oai" else 1.0)
    down = _moe_weights(e, h, i, a["dn"], dt, gen)
    x = torch.randn(t, h, generator=gen).to(dt)
    idle = int(torch.randint(e, (1,), generator=gen))
    pool = torch.tensor([x for x in range(e) if x != idle])
    ids = torch.stack([pool[torch.randperm(e - 1, generator=gen)[:topk]] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, topk, generator=gen), -1)
    if a.get("rt") == "act":  # the kernel reads them in the activation dtype; the reference gets the same values
        weights = weights.to(dt)
    drops = (-1, e, 2**40, -(2**40)) if idt == torch.int64 else (-1, e, 2**31 - 1)
    t0 = int(torch.randint(t, (1,), generator=gen))
    ids[t0, int(torch.randint(topk, (1,), generator=gen))] = drops[_seed(pid) % len(drops)]
    t_none = (t0 + 1) % t if t >= 3 else None
    if t_none is not None:
        ids[t_none] = torch.tensor([drops[(_seed(pid) + 1 + j) % len(drops)] for j in range(topk)])
    if path == "decode" and not _share_an_expert(ids, e):
        raise AssertionError(f"T = {t}, K = {topk}: fewer than two tokens keep a slot, no expert can take several")
    ids = ids.to(idt)
    valid = (ids >= 0) & (ids < e)
    gb = torch.randn(e, 2 * i, generator=gen).to(dt) if int(a["bias"]) else None
    db = (torch.randn(e, h, generator=gen) * 0.1).to(dt) if int(a["bias"]) else None
    ref = reference.moe_experts(x, torch.where(valid, ids, 0).long(), torch.where(valid, weights, 0.0), gate_up,
                                down, act, gb, db)
    if dev.type != "cuda":  # --cpu: the plumbing only (the op's CPU path is the reference itself)
        outs = [ref]
    else:
        xg, idg, wg = x.to(dev), ids.to(dev), weights.to(dev)
        gug, dng = gate_up.to(dev), down.to(dev)
        gbg, dbg = (None if b is None else b.to(dev) for b in (gb, db))
        counters = new_counters(dev) if int(a.get("cnt", 0)) else None
        if counters is not None:  # the launcher uses them only where they have room
            info["owned_counters"] = 0 < needs_counters <= counters.numel()
            if not info["owned_counters"]:
                raise AssertionError(f"the plan needs {needs_counters} tile counters / sync words; the caller's hold "
                                     f"{counters.numel()} (cnt=1 is meant to run the call through them)")
        orig = mk.device_info
        real = orig(dev.index)
        if (real.sm_count, real.smem_per_block_optin) != (sms, smem):  # the plan's GPU description
            fake = dataclasses.replace(real, sm_count=sms, smem_per_block_optin=smem)
            mk.device_info = lambda index=None: fake
        outs = []
        t1 = time.perf_counter()
        try:
            for _ in range(int(a.get("rep", 1))):
                s_ = t * topk
                if path == "decode":  # the workspace, a [S, I], y [T, H]
                    if dplan.workspace_floats:
                        _poison(1, dplan.workspace_floats, torch.float32, dev)
                else:
                    _poison(s_, max(2 * i, h), dt, dev)
                _poison(s_, i, dt, dev)
                _poison(t, h, dt, dev)
                outs.append(mk.grouped_experts_cuda(xg, idg, wg, gug, dng, act, gbg, dbg, counters, path=path).cpu())
        finally:
            mk.device_info = orig
        info["gpu_s"] = time.perf_counter() - t1
        if counters is not None and int(counters.abs().sum()):
            raise AssertionError("the caller's tile counters are not back at zero after the call")
    err = _rel_err(outs[0], ref)
    info["rel_err"] = err
    if not err < TOLERANCE[a["dt"]]:
        raise AssertionError(f"relative error {err:.3g} > {TOLERANCE[a['dt']]}")
    if t_none is not None and not bool((outs[0][t_none] == 0).all()):
        raise AssertionError(f"token {t_none}: every slot dropped, but its row is not 0")
    if any(not torch.equal(o, outs[0]) for o in outs[1:]):
        raise AssertionError("repeated calls differ bitwise")
    return info


RUNNERS = {"w4a16": _run_w4a16, "nf4-matmul": _run_w4a16, "nf4-dequant": _run_nf4_dequant, "norm": _run_norm,
           "rope_cache": _run_rope_cache, "rope_attention": _run_rope_attention,
           "sgemm": _run_sgemm,
           "hgemm": _run_hgemm, "moe": _run_moe}


def _kernel_record(loaded) -> dict:
    from tilefish import __version__
    from tilefish.runtime import compiler

    spec = loaded.spec
    arch = loaded.compiled.arch
    key = compiler.cache_key(spec, arch)
    return {"name": spec.name, "source": spec.source, "defines": [list(d) for d in spec.defines],
            "lowered": loaded.compiled.lowered_name, "arch": arch,
            "cubin": str(compiler.cache_dir() / f"v{__version__}" / f"{key}.cubin")}


def worker_main(args) -> int:
    import torch

    build_with_line_info(os.environ.get(LINEINFO_ENV, "0") == "1")
    import importlib

    rt_launch = importlib.import_module("tilefish.runtime.launch")  # the module (the package exports a launch function)

    ids = read_plan_list(args.plans)
    res = open(args.result, "a", buffering=1) if args.result else sys.stdout

    def emit(rec):
        res.write(json.dumps(rec) + "\n")
        res.flush()

    if args.cpu or os.environ.get(FAKE_DEVICE_ENV):
        dev = torch.device("cpu")
    elif not torch.cuda.is_available():
        emit({"type": "abort", "error": "no CUDA device"})
        return 3
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
    compiled_here = []
    orig_compile = rt_launch.compile_kernel

    def compile_kernel(spec, arch, *a, **kw):  # NVRTC under the sanitizer: the warm-up missed this kernel
        ck = orig_compile(spec, arch, *a, **kw)
        if not ck.from_cache:
            compiled_here.append(spec.name)
        return ck
    rt_launch.compile_kernel = compile_kernel
    status = 0
    for pid in ids:
        family, a = parse_plan_id(pid)
        before = set(rt_launch._loaded)
        del compiled_here[:]
        t0 = time.perf_counter()
        rec = {"type": "plan", "id": pid, "family": family}
        try:
            rec["info"] = RUNNERS[family](pid, a, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            rec["ok"], rec["error"] = True, None
        except Exception as e:  # noqa: BLE001 - a failing plan is a result
            rec["ok"], rec["error"] = False, f"{type(e).__name__}: {e}"[:2000]
        rec["secs"] = round(time.perf_counter() - t0, 4)
        rec["kernels"] = [_kernel_record(rt_launch._loaded[key]) for key in set(rt_launch._loaded) - before]
        rec["compiled"] = list(compiled_here)
        emit(rec)
        if not rec["ok"] and dev.type == "cuda":
            try:  # a sticky CUDA error (a crashed kernel) ends the process: the driver reruns the rest
                torch.cuda.synchronize()
                torch.zeros(1, device=dev).cpu()
            except Exception as e:  # noqa: BLE001
                emit({"type": "abort", "id": pid, "error": f"CUDA context unusable: {type(e).__name__}: {e}"[:500]})
                status = 3
                break
    emit({"type": "done", "kernels": [_kernel_record(v) for v in rt_launch._loaded.values()]})
    return status


# ---- parsing compute-sanitizer output -------------------------------------------------------------------------------

_PREFIX = re.compile(r"^=+ ?")
_LOC_NEW = re.compile(r"(?P<func>\S(?:.*?\S)?)\+0x(?P<pc>[0-9a-fA-F]+)(?:\s+in\s+(?P<file>[^\s:]+):(?P<line>\d+))?")
_LOC_OLD = re.compile(r"0x(?P<pc>[0-9a-fA-F]+)\s+in\s+(?:(?P<file>[^\s:]+):(?P<line>\d+):)?(?P<func>\S.*?)$")
_ACCESS = re.compile(r"(?P<acc>Read|Write) access at\s+(?P<loc>.*?)(?:\s*\[(?P<n>\d+) hazards?\])?"
                     r"(?=\s+and\s+(?:Read|Write) access at|$)")
_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)")


@dataclass
class Access:
    access: str          # Read / Write (racecheck), or the kind of access for memcheck
    func: str
    pc: int | None
    file: str | None = None
    line: int | None = None
    hazards: int = 0
    opcode: str | None = None
    sass: str | None = None

    def where(self) -> str:
        s = f"{'+0x%x' % self.pc if self.pc is not None else ''}"
        if self.file:
            s += f" {self.file}:{self.line}"
        return s.strip()


@dataclass
class Finding:
    tool: str
    kind: str            # race | memory | init | sync | api | app-exit | warning | other
    severity: str        # error | warning | info
    title: str
    accesses: list
    thread: str | None = None
    raw: str = ""
    count: int = 1       # racecheck: hazards; else occurrences
    cls: str | None = None       # racecheck: "async-proxy" / "generic" / "unclassified"
    kernel: str | None = None    # the spec name it maps to
    plans: list = field(default_factory=list)
    families: list = field(default_factory=list)
    batches: list = field(default_factory=list)

    def key(self) -> tuple:
        return (self.tool, self.kind, self.title if self.kind != "race" else "", self.kernel,
                tuple((a.access, a.func, a.pc) for a in self.accesses))

    @property
    def is_error(self) -> bool:
        if self.kind == "warning":
            return False
        if self.kind == "race":
            return self.cls != "async-proxy" or STRICT_RACECHECK
        return True


STRICT_RACECHECK = False


def _parse_loc(text: str) -> tuple[str, int | None, str | None, int | None]:
    text = text.strip()
    if text.startswith("0x"):
        mo = _LOC_OLD.match(text)
        if mo:
            return mo["func"].strip(), int(mo["pc"], 16), mo["file"], int(mo["line"]) if mo["line"] else None
    mo = _LOC_NEW.match(text)
    if mo:
        return mo["func"].strip(), int(mo["pc"], 16), mo["file"], int(mo["line"]) if mo["line"] else None
    return text, None, None, None


def _blocks(text: str) -> list[list[str]]:
    """Sanitizer output -> report blocks: a line at the prefix's indentation starts a block, indented
    lines continue it, a bare prefix line ends it. Lines without the prefix (the application's) are skipped."""
    blocks, cur = [], None
    for raw in text.splitlines():
        if not raw.startswith("="):
            continue
        body = _PREFIX.sub("", raw, count=1)
        if not body.strip():
            cur = None
            continue
        if body[0].isspace() and cur is not None:
            cur.append(body.strip())
        else:
            cur = [body.strip()]
            blocks.append(cur)
    return blocks


def parse_sanitizer_log(text: str, tool: str) -> dict:
    """-> {"findings": [Finding], "errors": ERROR SUMMARY count or None, "race": (hazards, errors, warnings) or
    None, "header": bool}. Unknown report blocks are kept as kind "other" (counted as errors)."""
    findings: list[Finding] = []
    summary_errors, race_summary, header = None, None, False
    for block in _blocks(text):
        first = block[0]
        joined = " ".join(block)
        if first.startswith("COMPUTE-SANITIZER"):
            header = True
            continue
        if mo := _SUMMARY.search(first):
            summary_errors = (summary_errors or 0) + int(mo.group(1))
            continue
        if mo := _RACE_SUMMARY.search(first):
            race_summary = tuple(int(v) for v in mo.groups())
            continue
        if first.startswith(("LEAK SUMMARY", "Saved host backtrace", "Host Frame", "Device Frame")):
            continue
        thread = None
        if mo := re.search(r"by thread (\(\d+,\d+,\d+\)) in block (\(\d+,\d+,\d+\))", joined):
            thread = f"thread {mo.group(1)} block {mo.group(2)}"
        if "Race reported between" in joined:
            sev = "warning" if re.match(r"(?i)warn", first) else "info" if re.match(r"(?i)info", first) else "error"
            body = joined.split("Race reported between", 1)[1]
            accs = []
            for mo in _ACCESS.finditer(body.strip()):
                func, pc, f, ln = _parse_loc(mo["loc"])
                accs.append(Access(mo["acc"], func, pc, f, ln, int(mo["n"] or 0)))
            findings.append(Finding(tool, "race", sev, "race between " + " and ".join(
                sorted({x.access.lower() for x in accs})), accs, None, "\n".join(block),
                count=sum(x.hazards for x in accs) or 1))
            continue
        if mo := re.search(r"Potential (RAW|WAR|WAW) hazard", first):
            accs = []
            for ln in block[1:]:
                if m2 := re.match(r"(Read|Write) Thread (\(\d+,\s*\d+,\s*\d+\)) at (.*)", ln):
                    func, pc, f, line = _parse_loc(m2.group(3))
                    accs.append(Access(m2.group(1), func, pc, f, line, 1))
            sev = "warning" if re.match(r"(?i)warn", first) else "error"
            findings.append(Finding(tool, "race", sev, f"{mo.group(1)} hazard", accs, None, "\n".join(block)))
            continue
        at = next((ln for ln in block[1:] if ln.startswith("at ")), None)
        accs = []
        if at is not None:
            func, pc, f, line = _parse_loc(at[3:])
            accs.append(Access("at", func, pc, f, line))
        if re.search(r"Uninitialized __\w+__ memory read", first) or "uninitialized" in first.lower():
            kind = "init"
        elif first.startswith(("Barrier error", "Warpgroup MMA sequence error")) or "barrier" in first.lower() \
                and "Detected overflow" not in first:
            kind = "sync"
        elif re.search(r"(Invalid|Misaligned|Out-of-range|out of bounds|Illegal|Malloc|Free|Hardware exception|"
                       r"Potential invalid __shared__|Cuda barrier|misaligned)", first):
            kind = "memory"
        elif first.startswith("Program hit") or "on CUDA API call" in joined:
            kind = "api"
        elif "Target application returned an error" in first:
            kind = "app-exit"
        elif first.lower().startswith("warning") or "Detected overflow" in first or first.startswith("Unused"):
            kind = "warning"
        else:
            kind = "other"
        findings.append(Finding(tool, kind, "warning" if kind == "warning" else "error", first, accs, thread,
                                "\n".join(block)))
    return {"findings": findings, "errors": summary_errors, "race": race_summary, "header": header}


# ---- SASS --------------------------------------------------------------------------------------------------------

# Instructions that access shared memory through the async proxy (TMA, bulk copies, wgmma operand reads):
# racecheck does not order them by the mbarriers / proxy fences the kernels use.
ASYNC_PROXY_FUNCS = re.compile(r"_ZN2tf\d+(bulk_load|tma_load\w*)E")
ASYNC_PROXY_OPS = ("UBLKCP", "UTMALDG", "UTMASTG", "UBLKRED", "UTMAREDG", "UBLKPF", "UTMAPF", "HGMMA", "IGMMA",
                   "QGMMA", "BGMMA")  # (mbarrier operations, SYNCS, are not: a race on one is a generic report)
_SASS_LINE = re.compile(r"/\*([0-9a-fA-F]{4,})\*/\s+(.*?)\s*;")


def find_tool(name: str, near: str | None = None) -> str | None:
    cands = []
    if near:
        base = Path(near).resolve().parent
        cands += [base / name, base.parent / "bin" / name]
    cands += [Path("/usr/local/cuda/bin") / name]
    try:
        import nvidia

        for base in map(Path, nvidia.__path__):
            cands += list(base.glob(f"cu*/bin/{name}"))
    except Exception:  # noqa: BLE001
        pass
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which(name)


def parse_sass(text: str) -> dict[str, dict[int, str]]:
    """cuobjdump -sass / nvdisasm text -> {function: {offset: instruction}} ("" when no function header)."""
    out: dict[str, dict[int, str]] = {}
    cur = out.setdefault("", {})
    for ln in text.splitlines():
        if mo := re.match(r"\s*Function\s*:\s*(\S+)", ln):
            cur = out.setdefault(mo.group(1), {})
            continue
        if mo := re.match(r"\s*\.text\.(\S+?):", ln):  # nvdisasm section labels
            cur = out.setdefault(mo.group(1), {})
            continue
        for mo in _SASS_LINE.finditer(ln):
            cur[int(mo.group(1), 16)] = mo.group(2).strip()
    return {k: v for k, v in out.items() if v}


def opcode(instr: str) -> str:
    toks = [t for t in instr.split() if not t.startswith("@")]
    return toks[0] if toks else ""


def dump_sass(cubin: str, cuobjdump: str | None, nvdisasm: str | None) -> str:
    for tool, argv in ((cuobjdump, ["-sass"]), (nvdisasm, ["-c", "-g"])):
        if tool and Path(cubin).is_file():
            try:
                r = subprocess.run([tool, *argv, cubin], capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if r.returncode == 0 and "/*" in r.stdout:
                return r.stdout
    return ""


# Opcodes that can read / write shared memory as a racecheck access (mbarrier ops, SYNCS, are left out: no
# report of ours names an mbarrier wrapper, and an mbarrier wait at an offset must not make a kernel fit)
SHARED_READ_OPS = ("LDS", "LDSM", "LD", "ATOMS", "ATOM")
SHARED_WRITE_OPS = ("STS", "STSM", "ST", "ATOMS", "ATOM", "RED")


def _access_fits(acc: Access, instr: str | None) -> bool:
    """Could this instruction be the access racecheck reports? An async-proxy op where the report's function is
    an async-proxy wrapper (bulk_load, tma_load_*), else a shared-memory load for a read, a store for a write."""
    if instr is None:
        return False
    op = opcode(instr).split(".")[0]
    if ASYNC_PROXY_FUNCS.match(acc.func or ""):
        return op in ASYNC_PROXY_OPS
    return op in (SHARED_READ_OPS if acc.access == "Read" else SHARED_WRITE_OPS) or op in ASYNC_PROXY_OPS


def resolve_by_sass(f: Finding, kernels: list[dict], sass_of) -> dict | None:
    """A report that names an inlined function (-lineinfo builds report the innermost inlined frame) carries
    kernel-relative offsets: the kernel is the one of the batch whose SASS has, at every reported offset, an
    instruction that can be that access. None when no kernel, or more than one distinct kernel, fits."""
    if not f.accesses or any(a.pc is None for a in f.accesses):
        return None
    fits = {}
    for k in kernels:
        if not k.get("cubin"):
            continue
        table = sass_of(k["cubin"]).get(k["lowered"], {})
        if table and all(_access_fits(a, table.get(a.pc)) for a in f.accesses):
            fits[k["lowered"]] = k
    return next(iter(fits.values())) if len(fits) == 1 else None


def classify_race(f: Finding, sass: dict[str, dict[int, str]] | None, kernel_table: dict[int, str] | None = None
                  ) -> None:
    """Look up every access's instruction (in kernel_table, the SASS of the kernel the report was resolved to, for
    accesses named by an inlined function); the report is "async-proxy" when each (first access, other access)
    pair has an async-proxy instruction on one side, "generic" when some pair has none, "unclassified" without
    SASS."""
    for acc in f.accesses:
        table = (sass or {}).get(acc.func) or kernel_table or \
            (next(iter(sass.values())) if sass and len(sass) == 1 else None)
        if table is not None and acc.pc is not None and acc.pc in table:
            acc.sass = table[acc.pc]
            acc.opcode = opcode(acc.sass)
        elif acc.opcode is None and ASYNC_PROXY_FUNCS.match(acc.func or ""):
            # the access sits in a wrapper that is one async-proxy instruction (kernels/common/hopper.cuh:
            # bulk_load is cp.async.bulk, UBLKCP; tma_load_* are cp.async.bulk.tensor, UTMALDG): its
            # symbol names the instruction where the kernel's SASS could not be matched (a lambda's frame)
            acc.opcode = "UBLKCP" if "bulk" in acc.func else "UTMALDG"
            acc.sass = f"{acc.opcode} (by its function, {acc.func})"
    is_async = [acc.opcode is not None and acc.opcode.split(".")[0] in ASYNC_PROXY_OPS for acc in f.accesses]
    first, rest = is_async[0], is_async[1:] or [False]
    if all(first or r for r in rest):
        f.cls = "async-proxy"
        return
    if any(acc.opcode is None for acc in f.accesses):
        f.cls = "unclassified"
        return
    first, rest = is_async[0], is_async[1:] or [False]
    f.cls = "async-proxy" if all(first or r for r in rest) else "generic"


# ---- the driver ----------------------------------------------------------------------------------------------------

def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200' (bench/results/<slug>/), else bench's slug."""
    mo = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name.lower().replace("nvidia", ""))
    if mo:
        return mo.group(1)
    from tilefish.bench.quick import gpu_slug as bench_slug

    return bench_slug(name)


def device_query() -> dict:
    if fake := os.environ.get(FAKE_DEVICE_ENV):  # the driver's own test (tests/test_sanitize_script.py)
        return json.loads(fake)
    code = ("import json, torch; p = torch.cuda.get_device_properties(0); "
            "print(json.dumps({'name': p.name, 'cc': p.major * 10 + p.minor, 'sm_count': p.multi_processor_count, "
            "'driver': torch.version.cuda, 'torch': torch.__version__}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise SystemExit(f"no CUDA device visible to torch:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def commit_id() -> str:
    if c := os.environ.get("TILEFISH_COMMIT"):
        return c
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return (head + ("+dirty" if dirty else "")) if head else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def sanitizer_version(san: str) -> str:
    try:
        r = subprocess.run([san, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = [ln.strip() for ln in r.stdout.splitlines() if "version" in ln.lower()]
    return lines[-1] if lines else (r.stdout.strip().splitlines() or ["unknown"])[-1]


def find_sanitizer(explicit: str | None) -> str | None:
    for c in (explicit, os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer"),
              "/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    for c in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer"), reverse=True):
        return str(c)
    return None


def sanitizer_options(san: str) -> set[str]:
    """The long options this compute-sanitizer's --help lists (empty when it cannot be read: then nothing is
    filtered)."""
    try:
        r = subprocess.run([san, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return set(re.findall(r"--([a-z][a-z0-9-]+)", r.stdout + r.stderr))


def tool_flags(tool: str, kernel_filter: bool, supported: set | None = None, dropped: set | None = None) -> list[str]:
    """The options a tool runs with (the module docstring says why); an option this compute-sanitizer's --help
    does not list is left out (and noted in `dropped`)."""
    pairs = [("show-backtrace", "device"), ("demangle", "no"), ("print-limit", "200")]
    if tool == "memcheck":
        pairs += [("report-api-errors", "no"), ("destroy-on-device-error", "kernel")]
    if tool == "racecheck":
        pairs += [("racecheck-report", "analysis")]
    if kernel_filter and tool != "initcheck":
        pairs += [("kernel-name", f"kns={s}") for s in KERNEL_FILTERS]
    flags = []
    for opt, val in pairs:
        if supported and opt not in supported:
            if dropped is not None:
                dropped.add(opt)
            continue
        flags += [f"--{opt}", val]
    return flags


def tool_env(tool: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{TOOL_ENV: tool})
    if tool in ("memcheck", "initcheck"):
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    return env


@dataclass
class Batch:
    tool: str
    tier: int
    plans: list           # plan ids
    est: float
    index: int = 0
    attempt: int = 0


def make_batches(plans: list[Plan], tools, jobs: int, spec_of: dict) -> list[Batch]:
    """Per (tool, tier): plans split into batches of similar estimated cost, about 3 batches a job slot in
    all; two plans whose kernels share a mangled name (the int4 and nf4 builds of one instantiation) never
    share a batch, so every report maps to one cubin."""
    per = {t: [p for p in plans if t in p.tools] for t in tools}
    total = sum(sum(plan_cost(t, p.id) for p in ps) + PROCESS_COST for t, ps in per.items() if ps)
    target = max(25.0, total / max(1, 3 * jobs))
    out: list[Batch] = []
    for tool in tools:
        for tier in sorted({p.tier for p in per[tool]}):
            group = [p for p in per[tool] if p.tier == tier]
            n = max(1, math.ceil(sum(plan_cost(tool, p.id) for p in group) / target))
            buckets: list[list[Plan]] = [[] for _ in range(n)]
            names: list[dict] = [{} for _ in range(n)]
            for i, p in enumerate(sorted(group, key=lambda p: (p.family, p.id))):
                for j in [(i + d) % n for d in range(n)] + [None]:
                    if j is None:
                        buckets.append([])
                        names.append({})
                        j = len(buckets) - 1
                    specs = spec_of.get(p.id, [])
                    if all(names[j].get(s.name, s.defines) == s.defines for s in specs):
                        buckets[j].append(p)
                        for s in specs:
                            names[j][s.name] = s.defines
                        break
            for b in buckets:
                if b:
                    out.append(Batch(tool, tier, [p.id for p in b],
                                     PROCESS_COST + sum(plan_cost(tool, p.id) for p in b)))
    order = {t: i for i, t in enumerate(("racecheck", "memcheck", "initcheck", "synccheck"))}
    out.sort(key=lambda b: (b.tier, order.get(b.tool, 9), -b.est))
    for i, b in enumerate(out):
        b.index = i
    return out


def estimate(plans: list[Plan], tools, jobs: int) -> dict:
    per_tool = {}
    for t in tools:
        per_tool[t] = sum(plan_cost(t, p.id) for p in plans if t in p.tools)
    batches = make_batches(plans, tools, jobs, {})
    cpu = sum(b.est for b in batches)
    return {"per_tool_plan_s": per_tool, "batches": len(batches), "process_s": cpu, "wall_s": cpu / max(1, jobs)}


def warm_cache(specs, arch: str, lineinfo: bool, jobs: int) -> dict:
    from tilefish.runtime import compile_many, is_cached

    build_with_line_info(lineinfo)
    todo = [s for s in specs if s.supports(arch)]
    uncached = sum(not is_cached(s, arch) for s in todo)
    t0 = time.perf_counter()
    results = compile_many([(s, arch) for s in todo], max(1, jobs), initializer=build_with_line_info,
                           initargs=(lineinfo,))
    errors = [(s.name, f"CompileError: {log}"[:2000]) for s, (_, log) in zip(todo, results) if log is not None]
    return {"kernels": len(todo), "compiled": uncached - len(errors), "errors": errors,
            "secs": time.perf_counter() - t0}


def read_results(path: Path) -> list[dict]:
    out = []
    if path.is_file():
        for ln in path.read_text().splitlines():
            try:
                out.append(json.loads(ln))
            except ValueError:
                pass
    return out


def run_batches(batches: list[Batch], args, san: str, logs: Path, env_extra: dict, t_end: float) -> list[dict]:
    """Run the batches, at most args.jobs at once, until t_end (monotonic): a batch still running then is
    killed (its finished plans count); batches not started are returned as not run. A batch whose worker
    aborted on a sticky CUDA error is rerun from the next plan (once per plan)."""
    queue = list(batches)
    running: dict = {}
    done: list[dict] = []
    slots = list(range(args.jobs))
    n_started = 0
    while queue or running:
        now = time.monotonic()
        while queue and slots and now < t_end:
            b = queue.pop(0)
            slot = slots.pop(0)
            n_started += 1
            tag = f"b{b.index:03d}{'r%d' % b.attempt if b.attempt else ''}-{b.tool}"
            plan_file, result, log = logs / f"{tag}.plans", logs / f"{tag}.jsonl", logs / f"{tag}.log"
            plan_file.write_text("\n".join(b.plans) + "\n")
            cmd = [san, "--tool", b.tool, "--error-exitcode", "1", "--log-file", str(log)]
            if not args.no_port and (not SUPPORTED or "port" in SUPPORTED):
                cmd += ["--port", str(49152 + 32 * slot)]  # concurrent sanitizers never share ports
            cmd += tool_flags(b.tool, not args.no_kernel_filter, SUPPORTED, DROPPED) + list(args.sanitizer_arg or [])
            cmd += [sys.executable, str(Path(__file__).resolve()), "--worker", "--plans", f"@{plan_file}",
                    "--result", str(result)]
            stdout = open(logs / f"{tag}.out", "w")
            env = {**tool_env(b.tool), **env_extra}
            proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, env=env, cwd=str(REPO),
                                    start_new_session=True)
            running[proc.pid] = (proc, b, slot, time.monotonic(), tag, stdout, cmd)
            print(f"[{time.monotonic() - T0:6.1f}s] start {tag}: {len(b.plans)} plans (est {b.est:.0f}s)", flush=True)
        time.sleep(0.5)
        now = time.monotonic()
        for pid, (proc, b, slot, t_start, tag, stdout, cmd) in list(running.items()):
            rc = proc.poll()
            killed = False
            if rc is None and now > t_end + args.grace:
                try:
                    os.killpg(proc.pid, 9)  # the batch's own process group (start_new_session)
                except OSError:
                    pass
                rc, killed = proc.wait(), True
            if rc is None:
                continue
            stdout.close()
            del running[pid]
            slots.append(slot)
            recs = read_results(logs / f"{tag}.jsonl")
            ran = [r["id"] for r in recs if r.get("type") == "plan"]
            abort = next((r for r in recs if r.get("type") == "abort"), None)
            rest = [p for p in b.plans if p not in ran]
            rec = {"tag": tag, "tool": b.tool, "tier": b.tier, "plans": b.plans, "rc": rc, "killed": killed,
                   "secs": round(now - t_start, 1), "log": f"{tag}.log", "out": f"{tag}.out",
                   "result": f"{tag}.jsonl", "cmd": " ".join(cmd), "abort": abort, "not_run": []}
            if abort and rest and not killed:
                nb = Batch(b.tool, b.tier, rest, PROCESS_COST + sum(plan_cost(b.tool, r) for r in rest), b.index,
                           b.attempt + 1)
                queue.insert(0, nb)
            else:
                rec["not_run"] = rest
            done.append(rec)
            print(f"[{now - T0:6.1f}s] done  {tag}: rc {rc}{' (killed at the budget)' if killed else ''}, "
                  f"{len(ran)}/{len(b.plans)} plans, {rec['secs']}s", flush=True)
        if not running and queue and time.monotonic() >= t_end:
            break
    for b in queue:
        done.append({"tag": f"b{b.index:03d}-{b.tool}", "tool": b.tool, "tier": b.tier, "plans": b.plans,
                     "rc": None, "killed": False, "secs": 0.0, "not_run": list(b.plans), "skipped": True})
    return done


T0 = time.monotonic()
SUPPORTED: set = set()   # compute-sanitizer's options (its --help), read by driver_main
DROPPED: set = set()     # options of ours it does not list


def analyse(run: dict, logs: Path) -> dict:
    """Parse every batch's log, map findings to kernels and plans, classify racecheck hazards against the SASS."""
    global STRICT_RACECHECK
    STRICT_RACECHECK = bool(run.get("strict_racecheck"))
    plan_family = {p["id"]: p["family"] for p in run["plans"]}
    lowered: dict[str, dict] = {}
    results: dict[tuple, dict] = {}   # (tool, plan id) -> record
    findings: dict[tuple, Finding] = {}
    tool_totals = {t: {"errors": 0, "race": [0, 0, 0], "procs": 0, "secs": 0.0, "bad_exit": []} for t in TOOLS}
    sass_tools = (find_tool("cuobjdump", run.get("sanitizer")), find_tool("nvdisasm", run.get("sanitizer")))
    sass_cache: dict[str, dict] = {}  # cubin -> {function: {offset: instruction}}
    sass_text: dict[str, str] = {}

    def sass_of(cubin: str) -> dict:
        if cubin not in sass_cache:
            sass_text[cubin] = dump_sass(cubin, *sass_tools)
            sass_cache[cubin] = parse_sass(sass_text[cubin])
        return sass_cache[cubin]
    dry = read_results(logs / "dry_run.jsonl")
    for rec in dry:
        for k in rec.get("kernels", []):
            lowered.setdefault(k["lowered"], k)
    for b in run["batches"]:
        tool = b["tool"]
        tt = tool_totals[tool]
        recs = read_results(logs / b["result"]) if b.get("result") else []
        batch_kernels: dict[str, dict] = {}
        plan_kernels: dict[str, list] = {}
        for r in recs:
            if r.get("type") == "plan":
                results[(tool, r["id"])] = r
                plan_kernels[r["id"]] = [k["lowered"] for k in r.get("kernels", [])]
            for k in r.get("kernels", []):
                batch_kernels[k["lowered"]] = k
                lowered.setdefault(k["lowered"], k)
        if b.get("skipped"):
            continue
        tt["procs"] += 1
        tt["secs"] += b.get("secs", 0.0)
        text = (logs / b["log"]).read_text(errors="replace") if (logs / b["log"]).is_file() else ""
        parsed = parse_sanitizer_log(text, tool)
        if parsed["errors"]:
            tt["errors"] += parsed["errors"]
        if parsed["race"]:
            tt["race"] = [x + y for x, y in zip(tt["race"], parsed["race"])]
        if b["rc"] not in (0, 1) and not b.get("killed"):
            tt["bad_exit"].append((b["tag"], b["rc"]))
        for f in parsed["findings"]:
            f.batches = [b["tag"]]
            k = next((batch_kernels.get(a.func) or lowered.get(a.func) for a in f.accesses
                      if (batch_kernels.get(a.func) or lowered.get(a.func))), None)
            resolved = k is None and f.kind == "race"
            if resolved:  # the report names inlined functions only: find its kernel by the SASS at its offsets
                k = resolve_by_sass(f, list(batch_kernels.values()), sass_of)
            if k is not None:
                f.kernel = k["name"] + "".join(f" -D{d[0]}" for d in k["defines"])
                f.plans = [pid for pid, ks in plan_kernels.items() if k["lowered"] in ks]
                if not f.plans:  # loaded by an earlier plan of the batch: every plan of the batch on that kernel
                    f.plans = [pid for pid in b["plans"] if any(
                        k["name"] == s for s in run["plan_specs"].get(pid, []))]
                f.families = sorted({plan_family.get(p, "?") for p in f.plans}) or ["?"]
                f._cubin = k.get("cubin")  # type: ignore[attr-defined]
                if resolved:
                    f._table = sass_cache[k["cubin"]][k["lowered"]]  # type: ignore[attr-defined]
            else:
                f.families = ["?"]
            key = f.key()
            if key in findings:
                old = findings[key]
                old.count += f.count
                old.plans = sorted(set(old.plans) | set(f.plans))
                old.batches += f.batches
                old.families = sorted(set(old.families) | set(f.families))
            else:
                findings[key] = f
    # SASS for every kernel a race report names, and the classification
    sass_dir = logs / "sass"
    excerpts = []
    for f in findings.values():
        if f.kind != "race":
            continue
        cubin = getattr(f, "_cubin", None)
        if cubin:
            sass_of(cubin)
        classify_race(f, sass_cache.get(cubin) if cubin else None, getattr(f, "_table", None))
        if cubin and sass_text.get(cubin):
            sass_dir.mkdir(exist_ok=True)
            if f.cls != "async-proxy":  # the whole listing where a report needs a reading
                (sass_dir / (Path(cubin).stem + ".sass")).write_text(sass_text[cubin])
            table = getattr(f, "_table", None) or (sass_cache[cubin].get(f.accesses[0].func) if f.accesses else None)
            table = table or (next(iter(sass_cache[cubin].values())) if len(sass_cache[cubin]) == 1 else {})
            offs = sorted(table)
            lines = [f"== {f.kernel} ({Path(cubin).name}) {f.cls}"]
            for acc in f.accesses:
                if acc.pc in table:
                    i = offs.index(acc.pc)
                    lines.append(f"-- {acc.access} at +0x{acc.pc:x} {acc.file or ''}:{acc.line or ''}")
                    lines += [f"{'>>' if o == acc.pc else '  '} /*{o:04x}*/ {table[o]}"
                              for o in offs[max(0, i - 4):i + 3]]
            excerpts.append("\n".join(lines))
    if excerpts:
        sass_dir.mkdir(exist_ok=True)
        (sass_dir / "excerpts.txt").write_text("\n\n".join(excerpts) + "\n")
    return {"results": results, "findings": list(findings.values()), "tool_totals": tool_totals,
            "dry": [r for r in dry if r.get("type") == "plan"], "sass_tools": list(sass_tools)}


def summarize(run: dict, an: dict) -> dict:
    """Per tool x family counts, and the verdict."""
    plans = run["plans"]
    rows = []
    for tool in run["tools"]:
        for fam in FAMILIES:
            sel = [p for p in plans if p["family"] == fam and tool in p["tools"]]
            if not sel:
                continue
            recs = [an["results"].get((tool, p["id"])) for p in sel]
            ran = [r for r in recs if r]
            fs = [f for f in an["findings"] if f.tool == tool and fam in f.families]
            rows.append({"tool": tool, "family": fam, "plans": len(sel), "ran": len(ran),
                         "ok": sum(1 for r in ran if r["ok"]), "failed": sum(1 for r in ran if not r["ok"]),
                         "not_run": len(sel) - len(ran),
                         "errors": sum(f.count if f.kind != "race" else 1 for f in fs if f.is_error),
                         "hazards": sum(f.count for f in fs if f.kind == "race"),
                         "async_proxy": sum(f.count for f in fs if f.kind == "race" and f.cls == "async-proxy"),
                         "secs": round(sum(r["secs"] for r in ran), 1)})
        una = [f for f in an["findings"] if f.tool == tool and "?" in f.families]
        if una:  # reports naming no kernel of a plan (torch's, or a function the mapping missed)
            rows.append({"tool": tool, "family": "(no plan's kernel)", "plans": 0, "ran": 0, "ok": 0, "failed": 0,
                         "not_run": 0, "errors": sum(f.count if f.kind != "race" else 1 for f in una if f.is_error),
                         "hazards": sum(f.count for f in una if f.kind == "race"),
                         "async_proxy": sum(f.count for f in una if f.kind == "race" and f.cls == "async-proxy"),
                         "secs": 0.0})
    unattributed = [f for f in an["findings"] if "?" in f.families]
    failures = [(tool, pid, r["error"]) for (tool, pid), r in an["results"].items() if not r["ok"]]
    dry_fail = [(r["id"], r["error"]) for r in an["dry"] if not r["ok"]]
    errors = [f for f in an["findings"] if f.is_error]
    bad_exit = [(t, tag, rc) for t, tt in an["tool_totals"].items() for tag, rc in tt["bad_exit"]]
    parsed_errs = {t: sum(f.count for f in an["findings"] if f.tool == t and f.kind != "race" and f.is_error)
                   for t in TOOLS}
    unexplained = [(t, tt["errors"]) for t, tt in an["tool_totals"].items()
                   if tt["errors"] and tt["errors"] > parsed_errs[t] and t != "racecheck"]
    not_run = sum(r["not_run"] for r in rows)
    status = "FAIL" if (errors or failures or dry_fail or bad_exit or unexplained or run.get("warm_errors")) else \
        ("INCOMPLETE" if not_run else "PASS")
    return {"rows": rows, "unattributed": unattributed, "failures": failures, "dry_fail": dry_fail,
            "errors": errors, "bad_exit": bad_exit, "unexplained": unexplained, "not_run": not_run,
            "status": status}


def _md_table(rows: list[list], head: list[str]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def write_markdown(run: dict, an: dict, sm: dict) -> str:
    L = [f"# compute-sanitizer over every dispatch plan ({run['gpu']['name']})", "",
         f"Written by `scripts/sanitize_all.py`. **{sm['status']}**.", ""]
    env = [("commit", run["commit"]), ("date", run["date"]), ("GPU", f"{run['gpu']['name']}, sm_{run['gpu']['cc']}, "
           f"{run['gpu']['sm_count']} SMs"), ("compute-sanitizer", run["sanitizer_version"]),
           ("torch / CUDA", f"{run['gpu'].get('torch')} / {run['gpu'].get('driver')}"),
           ("kernels", f"{run['warm'].get('kernels', 0)} warmed in {run['warm'].get('secs', 0):.0f} s "
                       f"({'-lineinfo builds' if run['lineinfo'] else 'the normal builds'})"),
           ("budget", f"{run['budget']} s for the sanitizer runs, {run['jobs']} at once; wall {run['wall']:.0f} s "
                      f"(warm-up and dry run {run['prep_secs']:.0f} s)"),
           ("command", f"`{run['command']}`")]
    L += [f"- {k}: {v}" for k, v in env] + [""]
    L += ["## Per tool and family", ""]
    L += _md_table([[r["tool"], r["family"], f"{r['ran']}/{r['plans']}", r["failed"], r["not_run"], r["errors"],
                     f"{r['hazards']}" + (f" ({r['async_proxy']} async-proxy)" if r["async_proxy"] else ""),
                     r["secs"]] for r in sm["rows"]],
                   ["tool", "family", "plans run", "wrong / failed", "not run", "errors", "hazards", "plan time (s)"])
    L += [""]
    tt = an["tool_totals"]
    L += _md_table([[t, tt[t]["procs"], f"{tt[t]['secs']:.0f}", tt[t]["errors"] if t != "racecheck" else
                     "%d hazards displayed (%d errors, %d warnings)" % tuple(tt[t]["race"]),
                     f"{run['estimate']['per_tool_plan_s'].get(t, 0) + PROCESS_COST * tt[t]['procs']:.0f}"]
                    for t in run["tools"]],
                   ["tool", "processes", "process time (s)", "sanitizer summaries", "estimated (s)"])
    L += ["", "Plan time is the worker's time a plan (CPU set-up, launches under the tool, copies back); process "
          "time includes the start (torch import, CUDA init, module patching). Estimates come from "
          "PLAN_COST / PROCESS_COST in the script.", ""]
    L += ["## Findings", ""]
    if not an["findings"]:
        L += ["None: every sanitizer summary reads 0 errors.", ""]
    ordered = sorted(an["findings"], key=lambda f: (not f.is_error, f.tool, f.kind, f.kernel or ""))
    listed_races = [f for f in ordered if f.kind == "race" and not f.is_error]
    compact = listed_races[5:]  # past five detailed examples, one table row a report
    for f in ordered:
        if f in compact:
            continue
        tag = "ERROR" if f.is_error else "listed"
        L += [f"### {f.tool} {f.kind}: {f.title} [{tag}]", ""]
        L += [f"- kernel: `{f.kernel or (f.accesses[0].func if f.accesses else '?')}`",
              f"- families: {', '.join(f.families)}; batches: {', '.join(sorted(set(f.batches)))}",
              f"- severity: {f.severity}; {'hazards' if f.kind == 'race' else 'occurrences'}: {f.count}"]
        if f.cls:
            L += [f"- class: **{f.cls}**" + {
                "async-proxy": " (every access pair has a TMA / bulk-copy / wgmma side: the racecheck limitation "
                               "of docs/w4a16.md; check the ordering mbarrier in the SASS below)",
                "generic": " (a pair of ordinary shared-memory accesses: a real race candidate)",
                "unclassified": " (no SASS for an access: cuobjdump / nvdisasm missing or the cubin not found)"}[f.cls]]
        if f.thread:
            L += [f"- {f.thread}"]
        for acc in f.accesses:
            L += [f"  - {acc.access} at `{acc.where()}`" + (f" [{acc.hazards} hazards]" if acc.hazards else "")
                  + (f": `{acc.sass}`" if acc.sass else "")]
        if f.plans:
            L += [f"- plans ({len(f.plans)}): " + ", ".join(f"`{p}`" for p in f.plans[:8])
                  + (" ..." if len(f.plans) > 8 else "")]
        L += ["", "```", *f.raw.splitlines()[:12], "```", ""]
    if compact:
        L += [f"### {len(compact)} more racecheck reports of the async-proxy class", ""]
        L += _md_table([[f"`{f.kernel or f.accesses[0].func}`", ", ".join(f.families), f.count,
                         "; ".join(f"{a.access[0]} {a.where()} `{a.opcode}`" for a in f.accesses[:4])
                         + (" ..." if len(f.accesses) > 4 else ""), len(f.plans)] for f in compact],
                       ["kernel", "families", "hazards", "accesses (R/W, offset, line, opcode)", "plans"])
        L += [""]
    if sm["failures"] or sm["dry_fail"]:
        L += ["## Wrong results and failed plans", ""]
        L += [f"- dry run (no sanitizer): `{pid}`: {err}" for pid, err in sm["dry_fail"]]
        L += [f"- {tool}: `{pid}`: {err}" for tool, pid, err in sm["failures"]]
        L += [""]
    if sm["bad_exit"] or sm["unexplained"] or run.get("warm_errors"):
        L += ["## Tool and run problems", ""]
        L += [f"- {t} batch {tag} exited {rc} (neither clean nor --error-exitcode): see its .out / .log"
              for t, tag, rc in sm["bad_exit"]]
        L += [f"- {t}: the ERROR SUMMARY lines count {n} errors, more than the reports parsed (print limit?)"
              for t, n in sm["unexplained"]]
        L += [f"- compile error: {n}: {e[:300]}" for n, e in run.get("warm_errors", [])]
        L += [""]
    notrun = [(b["tool"], len(b["not_run"]), b.get("skipped", False)) for b in run["batches"] if b.get("not_run")]
    if notrun:
        L += ["## Not run", ""]
        L += [f"- {t}: {n} plans ({'never started: budget' if sk else 'cut at the budget or after an abort'})"
              for t, n, sk in notrun] + [""]
    cov = run["coverage"]
    L += ["## Coverage", "",
          f"{len(run['plans'])} plans run" + (f" (a selection of the {cov['all_plans']} the enumeration makes)"
                                               if cov.get("all_plans", len(run["plans"])) != len(run["plans"]) else "")
          + f"; kernel_specs(): {cov['specs']} dispatchable specs, {cov['covered']} run by a "
          f"plan of the enumeration, {cov['excluded']} not (reasons in `--list -v`; by reason: "
          + "; ".join(f"{n} x {r}" for r, n in cov["reasons"].items()) + ").", ""]
    L += _md_table([[fam, *[cov["counts"].get(fam, {}).get(t, 0) for t in TOOLS]] for fam in FAMILIES],
                   ["family", *TOOLS])
    L += ["", "## How to read this", "",
          "- A plan is one forced configuration (or the dispatcher's pick) on a small shape, run once under each "
          "tool by `--worker` and checked against `tilefish.reference` on the CPU; a wrong result fails the plan.",
          "- racecheck's async-proxy class: racecheck does not model TMA / bulk copies (UBLKCP, UTMALDG) or wgmma "
          "operand reads, so a stage refill ordered after the consumers' reads by an mbarrier is reported. Such "
          "reports are listed with the SASS of each access and are not errors; any other hazard is. "
          "`--strict-racecheck` counts them all.",
          "- initcheck runs without the caching allocator; unused-memory tracking is off (by design the workspace "
          "is larger than a small plan uses). initcheck does not track TMA stores (UTMASTG): the copy back of an "
          "output only a TMA store wrote would be reported uninitialized, so HGEMM step 07's TMA-store outputs "
          "start NaN-filled under initcheck and the plan's NaN check finds any element the kernel did not write.",
          "- A 'Detected overflow of tracked cuda::barrier structures' warning means racecheck / synccheck tracked "
          "fewer mbarriers than a kernel uses: rerun with `--sanitizer-arg=--num-cuda-barriers --sanitizer-arg=N`.",
          f"- Raw logs: {run['logs']} (per batch: .plans, .log from the sanitizer, .out, .jsonl from the worker; "
          "sass/excerpts.txt: the SASS around every flagged offset; sass/*.sass: whole listings of kernels with "
          "reports that are not of the async-proxy class).", ""]
    if run.get("dropped_options"):
        L += [f"Options this compute-sanitizer does not list, left out: {', '.join(run['dropped_options'])}.", ""]
    return "\n".join(L)


def coverage_summary(plans: list[Plan], cov: Coverage) -> dict:
    reasons: dict[str, int] = {}
    for r in cov.excluded.values():
        if r.startswith("format"):
            short = ("W4A16 / NF4-matmul format variant not sampled (its configuration runs under other formats, "
                     "the format on other configurations of the kernel; --exhaustive runs it)")
        elif r.startswith("grouped format"):
            short = ("MoE grouped GEMM format variant not sampled (its configuration runs under other formats, "
                     "the format on other grouped configurations; --exhaustive runs it)")
        elif r.startswith("decode variant"):
            short = ("MoE decode kernel variant not sampled (the kernel runs its format and dtype with another "
                     "activation / id dtype; --exhaustive runs it)")
        else:
            short = r.split(":")[0]
        reasons[short] = reasons.get(short, 0) + 1
    counts: dict = {}
    for p in plans:
        for t in p.tools:
            counts.setdefault(p.family, {}).setdefault(t, 0)
            counts[p.family][t] += 1
    return {"specs": len(cov.covered) + len(cov.excluded), "covered": len(cov.covered),
            "excluded": len(cov.excluded), "reasons": reasons, "counts": counts}


def finish(run: dict, logs: Path, md_paths: list[Path]) -> int:
    an = analyse(run, logs)
    sm = summarize(run, an)
    md = write_markdown(run, an, sm)
    for p in md_paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(md)
        print(f"wrote {p}")
    (logs / "run.json").write_text(json.dumps(run, indent=1, default=str))
    print(f"{sm['status']}: {len(sm['errors'])} error finding(s), {len(sm['failures']) + len(sm['dry_fail'])} "
          f"failed plan(s), {sm['not_run']} not run")
    if sm["status"] == "FAIL":
        return 1
    if sm["status"] == "INCOMPLETE" and run.get("require_complete"):
        return 2
    return 0


def select_plans(plans: list[Plan], args) -> list[Plan]:
    fams = set(args.families.split(",")) if args.families else set(FAMILIES)
    bad = fams - set(FAMILIES)
    if bad:
        raise SystemExit(f"unknown families {sorted(bad)}; one of {FAMILIES}")
    rx = re.compile(args.match) if args.match else None
    return [p for p in plans if p.family in fams and p.tier <= args.max_tier and (rx is None or rx.search(p.id))]


def list_main(args) -> int:
    plans = select_plans(enumerate_plans(args.sm_count, args.cc, args.exhaustive), args)
    tools = [t for t in args.tools.split(",")]
    cov = coverage(plans, cc=args.cc)
    gpu = described_gpu(args.sm_count, args.cc)
    for p in plans:
        geo = (f" [{describe_geometry(w4_geometry(p, gpu))}]" if args.verbose and p.family in ("w4a16", "nf4-matmul")
               else "")
        print(f"{p.tier}  {','.join(t[:4] for t in TOOLS if t in p.tools):19s}  {p.id}" +
              (f"    # {p.why}{geo}" if args.verbose else ""))
    print()
    print(f"{'family':12s} " + " ".join(f"{t:>9s}" for t in TOOLS) + "   plans")
    for fam in FAMILIES:
        sel = [p for p in plans if p.family == fam]
        print(f"{fam:12s} " + " ".join(f"{sum(1 for p in sel if t in p.tools):9d}" for t in TOOLS) + f"   {len(sel)}")
    print(f"{'total':12s} " + " ".join(f"{sum(1 for p in plans if t in p.tools):9d}" for t in TOOLS)
          + f"   {len(plans)}")
    est = estimate(plans, tools, args.jobs)
    print("\nestimated sanitizer time (PLAN_COST / PROCESS_COST guesses): " + ", ".join(
        f"{t} {s:.0f}s of plans" for t, s in est["per_tool_plan_s"].items())
        + f"; {est['batches']} processes, {est['process_s']:.0f}s in all, ~{est['wall_s']:.0f}s wall at --jobs "
          f"{args.jobs}; plus the warm-up compile and the dry run")
    cs = coverage_summary(plans, cov)
    print(f"\ncoverage of kernel_specs(): {cs['specs']} specs, {cs['covered']} run by a plan, {cs['excluded']} not:")
    for r, n in cs["reasons"].items():
        print(f"  {n:5d} x {r}")
    if args.verbose:
        for s, r in cov.excluded.items():
            print(f"  not run: {s.name} {dict(s.defines) or ''}: {r}")
    missing = {lb: sorted(set(tools) - tl) for lb, tl in cov.config_tools.items() if set(tools) - tl}
    for lb, ts in sorted(missing.items()):
        print(f"  W4A16 configuration {lb} not run under {ts}")
    for what, table in (("configuration", cov.moe_config_tools), ("dtype / format", cov.moe_format_tools)):
        for key, tl in sorted(table.items()):
            if set(tools) - tl:
                print(f"  MoE grouped GEMM {what} {key} not run under {sorted(set(tools) - tl)}")
    for key, tl in sorted(cov.moe_decode_tools.items()):  # racecheck runs a few decode plans (enumerate_moe_decode)
        if (set(tools) & NO_RACE) - tl:
            print(f"  MoE decode kernel x dtype x format {key} not run under {sorted((set(tools) & NO_RACE) - tl)}")
    if cov.unreadable:
        for fam, s, e in cov.unreadable:
            print(f"  UNREADABLE spec ({fam}) {s.name}: {e}")
        return 1
    return 0


def driver_main(args) -> int:
    global T0
    T0 = time.monotonic()
    tools = [t for t in args.tools.split(",")]
    for t in tools:
        if t not in TOOLS:
            raise SystemExit(f"unknown tool {t!r}; one of {TOOLS}")
    san = find_sanitizer(args.sanitizer)
    if san is None:
        raise SystemExit("compute-sanitizer not found (PATH, $COMPUTE_SANITIZER, /usr/local/cuda/bin): "
                         "--sanitizer PATH")
    SUPPORTED.update(sanitizer_options(san))
    gpu = device_query()
    slug = args.gpu_slug or gpu_slug(gpu["name"])
    out_env = os.environ.get("OUT")
    logs = Path(args.logs) if args.logs else (Path(out_env) / "sanitizer_logs" if out_env else
                                              Path(tempfile.mkdtemp(prefix="tf-sanitize-")))
    logs.mkdir(parents=True, exist_ok=True)
    md_paths = [Path(args.md) if args.md else REPO / "bench" / "results" / slug / "sanitizer.md"]
    if out_env:
        md_paths.append(Path(out_env) / "sanitizer.md")
    lineinfo = not args.no_lineinfo
    env_extra = {LINEINFO_ENV: "1" if lineinfo else "0"}
    os.environ.update(env_extra)
    universe = dispatch_universe()
    every = enumerate_plans(gpu["sm_count"], gpu["cc"], args.exhaustive, universe, gpu["name"])
    plans = [p for p in select_plans(every, args) if set(tools) & p.tools]
    cov = coverage(every, universe, gpu["cc"])  # of the whole plan set; the run may select part of it
    arch = f"sm_{gpu['cc']}"
    spec_of = {p.id: plan_specs(p) for p in plans}
    specs = sorted({s for ss in spec_of.values() for s in ss}, key=lambda s: (s.source, s.name, s.defines))
    from tilefish.ops.w4a16 import ONE_CTA_PER_SM_SMEM  # noqa: F401 - the cluster probe kernel is warmed below
    from tilefish.runtime import KernelSpec

    specs.append(KernelSpec("probes/cluster_capacity.cu", "tf_cluster_capacity", min_sm=90))
    print(f"{len(plans)} plans, {len(specs)} kernels; compute-sanitizer {san}; logs {logs}", flush=True)
    warm = warm_cache(specs, arch, lineinfo, args.compile_jobs or os.cpu_count() or 4)
    print(f"[{time.monotonic() - T0:6.1f}s] warm-up: {warm['kernels']} kernels, {warm['compiled']} compiled, "
          f"{len(warm['errors'])} errors", flush=True)
    all_ids = logs / "all.plans"
    all_ids.write_text("\n".join(p.id for p in plans) + "\n")
    dry = logs / "dry_run.jsonl"
    n_dry = max(1, min(4, args.jobs))
    procs = []
    for i in range(n_dry):  # a few processes at once; their results end up in one file
        part = logs / f"dry_run{i}.plans"
        part.write_text("\n".join(p.id for p in plans[i::n_dry]) + "\n")
        for f in (logs / f"dry_run{i}.jsonl",):
            if f.exists():
                f.unlink()
        fo = open(logs / f"dry_run{i}.out", "w")
        procs.append((subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker", "--plans",
                                        f"@{part}", "--result", str(logs / f"dry_run{i}.jsonl")], stdout=fo,
                                       stderr=subprocess.STDOUT, env=dict(os.environ), cwd=str(REPO)), fo))
    rcs = []
    for proc, fo in procs:
        try:
            rcs.append(proc.wait(timeout=900))
        except subprocess.TimeoutExpired:
            proc.kill()
            rcs.append(proc.wait())
        fo.close()
    dry.write_text("".join((logs / f"dry_run{i}.jsonl").read_text() for i in range(n_dry)
                           if (logs / f"dry_run{i}.jsonl").is_file()))
    dry_recs = [x for x in read_results(dry) if x.get("type") == "plan"]
    print(f"[{time.monotonic() - T0:6.1f}s] dry run: rc {rcs}, {sum(x['ok'] for x in dry_recs)}/"
          f"{len(dry_recs)} plans correct without a sanitizer", flush=True)
    for x in dry_recs:  # the kernels each plan loaded (the dispatcher's picks among them)
        known = {(s.name, s.defines) for s in spec_of.get(x["id"], [])}
        for k in x.get("kernels", []):
            ks = KernelSpec(k["source"], k["name"], tuple(tuple(d) for d in k["defines"]))
            if (ks.name, ks.defines) not in known:
                spec_of.setdefault(x["id"], []).append(ks)
    prep = time.monotonic() - T0
    batches = make_batches(plans, tools, args.jobs, spec_of)
    t_end = time.monotonic() + args.budget
    done = run_batches(batches, args, san, logs, env_extra, t_end)
    run = {"gpu": gpu, "slug": slug, "commit": commit_id(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "sanitizer": san, "sanitizer_version": sanitizer_version(san), "tools": tools, "lineinfo": lineinfo,
           "budget": args.budget, "jobs": args.jobs, "wall": time.monotonic() - T0, "prep_secs": prep,
           "command": " ".join([Path(sys.executable).name, "scripts/sanitize_all.py", *sys.argv[1:]]),
           "plans": [{"id": p.id, "family": p.family, "tools": sorted(p.tools), "tier": p.tier} for p in plans],
           "plan_specs": {pid: [s.name for s in ss] for pid, ss in spec_of.items()},
           "batches": done, "warm": {k: v for k, v in warm.items() if k != "errors"},
           "warm_errors": warm["errors"], "estimate": estimate(plans, tools, args.jobs),
           "coverage": {**coverage_summary(plans, cov), "all_plans": len(every)}, "logs": str(logs),
           "strict_racecheck": args.strict_racecheck,
           "dropped_options": sorted(DROPPED),
           "require_complete": args.require_complete}
    return finish(run, logs, md_paths)


def parse_main(args) -> int:
    logs = Path(args.parse)
    run = json.loads((logs / "run.json").read_text())
    run["strict_racecheck"] = args.strict_racecheck or run.get("strict_racecheck")
    md = [Path(args.md) if args.md else REPO / "bench" / "results" / run["slug"] / "sanitizer.md"]
    return finish(run, logs, md)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="scripts/sanitize_all.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--worker", action="store_true", help="run --plans once each (under a sanitizer)")
    mode.add_argument("--list", action="store_true", help="print the plans, counts and coverage; no GPU")
    mode.add_argument("--parse", metavar="LOGDIR", help="rewrite the summary from a finished run's logs")
    p.add_argument("--plans", help="worker: plan ids, comma-separated, or @file (one a line)")
    p.add_argument("--result", help="worker: append one JSON line a plan here (default stdout)")
    p.add_argument("--cpu", action="store_true", help="worker: run the plans' CPU path (a plumbing check, no kernels)")
    p.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS))
    p.add_argument("--families", help="comma-separated subset of " + ",".join(FAMILIES))
    p.add_argument("--match", help="only plans whose id matches this regex")
    p.add_argument("--max-tier", type=int, default=3, help="0: one plan a configuration; 1: + modes; 2: + extras")
    p.add_argument("--exhaustive", action="store_true", help="also one memcheck plan for every W4A16 spec not sampled")
    p.add_argument("--budget", type=float, default=240, help="seconds for the sanitizer runs (default 240)")
    p.add_argument("--grace", type=float, default=20, help="seconds a running batch may overrun the budget")
    p.add_argument("--jobs", type=int, default=8, help="sanitizer processes at once (default 8)")
    p.add_argument("--compile-jobs", type=int, default=0, help="warm-up compile processes (default: CPUs)")
    p.add_argument("--sanitizer", help="compute-sanitizer binary (default: PATH, $COMPUTE_SANITIZER, CUDA dirs)")
    p.add_argument("--sanitizer-arg", action="append", help="an extra compute-sanitizer argument (repeatable)")
    p.add_argument("--no-kernel-filter", action="store_true", help="check torch's kernels too")
    p.add_argument("--no-port", action="store_true", help="let compute-sanitizer pick its ports")
    p.add_argument("--no-lineinfo", action="store_true", help="sanitize the normal builds (no file:line)")
    p.add_argument("--strict-racecheck", action="store_true", help="async-proxy class hazards are errors too")
    p.add_argument("--require-complete", action="store_true", help="exit 2 when the budget cut plans")
    p.add_argument("--logs", help="raw log directory (default $OUT/sanitizer_logs, else a temp dir)")
    p.add_argument("--md", help="summary path (default bench/results/<gpu>/sanitizer.md)")
    p.add_argument("--gpu-slug", help="results directory name (default from the GPU name: h100, h200)")
    p.add_argument("--sm-count", type=int, default=132, help="--list: the GPU's SM count")
    p.add_argument("--cc", type=int, default=90, help="--list: the GPU's compute capability")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.worker and not args.plans:
        p.error("--worker needs --plans")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.list:
        return list_main(args)
    if args.parse:
        return parse_main(args)
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
