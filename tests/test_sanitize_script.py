"""scripts/sanitize_all.py on the CPU: the plan enumeration covers every dispatchable kernel (or says why not),
plan ids and the worker's arguments round-trip, and the log parser / summary writer read canned
compute-sanitizer output (a clean run, memcheck errors, racecheck hazards of both classes)."""
from __future__ import annotations

import importlib.util
import os
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "sanitize_all.py"


@pytest.fixture(scope="module")
def san():
    """The script as a module. Its worker turns on -lineinfo builds (TILEFISH_LINEINFO: own cache keys) for
    the process: that is undone after this module's tests, so later tests see the library's cache keys."""
    saved = os.environ.get("TILEFISH_LINEINFO")
    spec = importlib.util.spec_from_file_location("sanitize_all", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sanitize_all"] = mod
    spec.loader.exec_module(mod)
    yield mod
    if saved is None:
        os.environ.pop("TILEFISH_LINEINFO", None)
    else:
        os.environ["TILEFISH_LINEINFO"] = saved
    sys.modules.pop("sanitize_all", None)


@pytest.fixture(scope="module")
def universe(san):
    return san.dispatch_universe()


@pytest.fixture(scope="module")
def plans(san, universe):
    return san.enumerate_plans(132, 90, universe=universe)


def test_every_dispatch_spec_reads_back(universe):
    bad = [(fam, spec.name, fmt.get("error")) for fam, spec, _, cfg, fmt in universe if cfg is None and "error" in fmt]
    assert not bad, f"kernel_specs() entries spec_config cannot read back: {bad[:5]}"


def test_w4a16_specs_are_matched_to_the_dispatchers_builds(san, universe):
    """W4A16 / NF4-matmul specs come with the configuration and format ops.w4a16.dispatch_builds names
    (no template arguments read back), and a spec no build names is an error, not a guess."""
    import torch
    from tilefish.ops import w4a16 as w4

    builds = {b.spec: b for b in w4.dispatch_builds()}
    w4_entries = [(spec, pfam, cfg, fmt) for fam, spec, pfam, cfg, fmt in universe if fam == "w4a16"]
    assert w4_entries and {spec for spec, *_ in w4_entries} == set(builds)
    for spec, pfam, cfg, fmt in w4_entries:
        b = builds[spec]
        assert cfg == b.config and (fmt["g"], bool(fmt["zp"]), fmt["cb"]) == (b.group_size, b.zero_points, b.codebook)
        assert pfam == ("nf4-matmul" if b.codebook == "nf4" else "w4a16")
    stray = w4.kernel_spec(torch.float16, w4.GemmConfig(4, 1, 8, 4), 128, False)  # not a dispatched configuration
    assert stray not in builds
    with pytest.raises(ValueError, match="not one of ops.w4a16.dispatch_builds"):
        san.spec_config("w4a16", stray, builds)


def test_coverage_of_kernel_specs(san, plans, universe):
    from tilefish.ops import kernel_specs

    cov = san.coverage(plans, universe, 90)
    all_specs = {s for _, s in kernel_specs()}
    assert set(cov.covered) | set(cov.excluded) == all_specs
    assert not set(cov.covered) & set(cov.excluded)
    assert all(cov.excluded[s] for s in cov.excluded), "every spec not run has a reason"
    assert not any(r.startswith(("UNREAD", "no plan")) for r in cov.excluded.values())
    # NF4 dequantize, SGEMM and HGEMM: every dispatched spec runs
    by_family = {}
    for fam, s in kernel_specs():
        by_family.setdefault(fam, set()).add(s)
    for fam in ("nf4", "sgemm", "hgemm"):
        assert by_family[fam] <= set(cov.covered), fam
    # W4A16: every configuration (mma.sync, wgmma tile / stream-K, skinny register / staged) under every tool
    assert cov.config_tools and all(tools == set(san.TOOLS) for tools in cov.config_tools.values()), \
        {lb: t for lb, t in cov.config_tools.items() if t != set(san.TOOLS)}
    # ... and every format (22: dtype x group x zero points, nf4 dtype x group) of each kernel under every tool
    sources = {src for src, _ in cov.format_tools}
    assert sources == {"w4a16/gemm.cu", "w4a16/wgmma.cu", "w4a16/skinny.cu"}
    for src in sources:
        for fmt in san.format_cycle():
            assert cov.format_tools.get((src, san._fmt_key(fmt))) == set(san.TOOLS), (src, fmt)


def test_plans_exercise_the_modes(san, plans):
    ids = [p.id for p in plans]
    w4 = [p.args for p in plans if p.family in ("w4a16", "nf4-matmul")]
    assert any(a.get("dsmem") == "1" and int(a.get("sl", 1)) > 1 for a in w4), "DSMEM cluster splits"
    assert any(a.get("dsmem") == "0" and int(a.get("sl", 1)) > 1 for a in w4), "workspace splits"
    assert any("streamk" in a["cfg"] and a.get("ct") == "7" for a in w4), "stream-K grids that cut tiles"
    assert any(a["cfg"].endswith("-st") for a in w4) and any(a["cfg"].startswith("skinny") and
                                                             not a["cfg"].endswith("-st") for a in w4)
    assert any(a["cfg"] == "auto" and a["cb"] == "nf4" for a in w4) and any(a["cfg"] == "auto" and a["cb"] == "int4"
                                                                           for a in w4)
    assert any(a.get("tail") for a in w4), "the separate tail launch"
    assert any(a["perm"] == "1" for a in w4) and any(a["bias"] == "1" for a in w4)
    assert {a["g"] for a in w4} == {"-1", "32", "64", "128"} and {a["zp"] for a in w4} == {"0", "1"}
    assert any(int(a["k"]) % 128 == 64 for a in w4), "the half last k tile / stage"
    assert len(ids) == len(set(ids))
    fams = {p.family for p in plans}
    assert fams == set(san.FAMILIES)
    assert all(p.tools for p in plans) and all(p.why for p in plans)
    # racecheck runs a smaller set than memcheck, and every hgemm configuration once
    race = [p for p in plans if "racecheck" in p.tools]
    assert 0 < len(race) < len([p for p in plans if "memcheck" in p.tools])
    assert len({p.args["cfg"] for p in race if p.family == "hgemm"}) == \
        len({p.args["cfg"] for p in plans if p.family == "hgemm"})


def test_mode_plans_have_their_mode_in_the_launch_geometry(san, plans):
    """The plans that claim a launch mode have it in the launcher's own geometry on the described H100
    (w4_geometry: ops.w4a16.launch_geometry under the plan's LaunchPolicy, tilefish.w4a16.plan for the
    dispatcher's picks): DSMEM splits run as clusters of their slices, dsmem=0 splits never, the tail
    plan has its second launch, the stream-K plans of 7 CTAs launch 7."""
    gpu = san.described_gpu(132, 90)
    w4 = [p for p in plans if p.family in ("w4a16", "nf4-matmul")]
    geos = {p.id: san.w4_geometry(p, gpu) for p in w4}
    dsmem = [p for p in w4 if p.args.get("dsmem") == "1"]
    assert dsmem and any("as clusters of 3" in p.why for p in dsmem)
    for p in dsmem:
        sl = int(p.args.get("sl", 1))
        assert geos[p.id].cluster == (sl if 1 < sl <= 8 else 1), p.id
    workspace = [p for p in w4 if p.args.get("dsmem") == "0"]
    assert workspace and all(geos[p.id].cluster == 1 and geos[p.id].slices > 1 for p in workspace)
    tails = [p for p in w4 if p.args.get("tail")]
    assert tails and all(len(geos[p.id].launches) == 2 and geos[p.id].launches[1].first_tile > 0 for p in tails)
    assert all(geos[p.id].ctas == 7 and geos[p.id].cluster == 1 for p in w4 if p.args.get("ct") == "7")
    autos = [p for p in w4 if p.args["cfg"] == "auto"]
    assert autos and all(geos[p.id].policy == san.plan_policy(p.args) for p in autos)
    assert san.plan_policy({"dsmem": "0", "tail": "never"}) == san.plan_policy({}).__class__(False, "never")


def test_plan_ids_round_trip(san, plans):
    for p in plans:
        fam, kw = san.parse_plan_id(p.id)
        assert fam == p.family and kw == p.args
        assert "," not in p.id
    with pytest.raises(ValueError):
        san.parse_plan_id("nope:cfg=x")
    with pytest.raises(ValueError):
        san.make_plan("sgemm", cfg="a:b")


def test_exhaustive_runs_every_spec(san, universe):
    from tilefish.ops import kernel_specs

    plans = san.enumerate_plans(132, 90, exhaustive=True, universe=universe)
    cov = san.coverage(plans, universe, 90)
    assert not cov.excluded and set(cov.covered) == {s for _, s in kernel_specs()}


def test_non_hopper_gpu_leaves_out_sm90_kernels(san, universe):
    plans = san.enumerate_plans(108, 80, universe=universe)
    cov = san.coverage(plans, universe, 80)
    assert not any("wg-" in p.id or "skinny" in p.id or "07_wgmma" in p.id for p in plans)
    assert any(r.startswith("needs sm_90") for r in cov.excluded.values())
    assert {lb for lb in cov.config_tools} and all(not lb.startswith(("wg-", "skinny")) for lb in cov.config_tools)


def test_worker_arguments(san, tmp_path):
    a = san.parse_args(["--worker", "--plans", "sgemm:cfg=01_naive.32:m=35:n=35:k=37:beta=1,hgemm:cfg=x", "--result",
                        str(tmp_path / "r.jsonl")])
    assert a.worker and san.read_plan_list(a.plans) == ["sgemm:cfg=01_naive.32:m=35:n=35:k=37:beta=1", "hgemm:cfg=x"]
    f = tmp_path / "p.txt"
    f.write_text("# batch\nnf4-dequant:dt=bf16:dq=1:rows=67:cols=1030:bs=64\n\nsgemm:cfg=01_naive.32:m=3:n=3:k=3\n")
    assert san.read_plan_list(f"@{f}") == ["nf4-dequant:dt=bf16:dq=1:rows=67:cols=1030:bs=64",
                                           "sgemm:cfg=01_naive.32:m=3:n=3:k=3"]
    with pytest.raises(SystemExit):
        san.parse_args(["--worker"])
    d = san.parse_args([])
    assert d.budget == 240 and d.tools.split(",") == list(san.TOOLS) and not d.worker


def test_worker_cpu_path_writes_records(san, plans, tmp_path):
    """--worker --cpu runs the plans' CPU path (the plumbing: weights, reference, checks, the JSON records)."""
    pick = []
    for fam in san.FAMILIES:
        pick += [p.id for p in plans if p.family == fam][:2]
    out = tmp_path / "r.jsonl"
    assert san.main(["--worker", "--cpu", "--plans", ",".join(pick), "--result", str(out)]) == 0
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    done = [r for r in recs if r["type"] == "plan"]
    assert [r["id"] for r in done] == pick and all(r["ok"] for r in done), [r["error"] for r in done]
    assert recs[-1]["type"] == "done"


KERNEL = "_Z11w4a16_wgmmaI6__halfLi64ELi4ELi2ELi6ELi128ELb1ELb0EEvPKiPKT_S6_S6_PS4_PfPiiiiiii"
CLEAN = """========= COMPUTE-SANITIZER
========= ERROR SUMMARY: 0 errors
"""
RACE = f"""========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at {KERNEL}+0x7420 in wgmma.cu:301
=========     and Read access at {KERNEL}+0x1300 in wgmma.cu:512 [64 hazards]
=========     and Read access at {KERNEL}+0x1310 in wgmma.cu:513 [32 hazards]
=========
========= Error: Race reported between Write access at
=========     {KERNEL}+0x2000 in wgmma.cu:600
=========     and Read access at
=========     {KERNEL}+0x2100 in wgmma.cu:610
=========     [4 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""
OLD_RACE = """========= WARN: Race reported between Read access at 0x00000170 in ./race.cu:4:test(int*, int*)
=========     and Write access at 0x00000148 in ./race.cu:3:test(int*, int*) [4 hazards]
=========
"""
MEMCHECK = f"""========= COMPUTE-SANITIZER
========= Invalid __global__ read of size 16 bytes
=========     at {KERNEL}+0x1a30 in wgmma.cu:212
=========     by thread (37,0,0) in block (1,0,2)
=========     Address 0x7f3a5c000400 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f3a5c000000 of size 1023 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2dfbef] in libcuda.so.1
=========
========= Warning: Detected overflow of tracked cuda::barrier structures. Results might be incorrect.
=========
========= ERROR SUMMARY: 1 error
"""
SASS = f"""
        Function : {KERNEL}
        /*1300*/                   LDS.128 R4, [R2] ;
        /*1310*/              @!P0 LDS.128 R8, [R2+0x10] ;
        /*2000*/                   STS.128 [R3], R4 ;
        /*2100*/                   LDS R9, [R3] ;
        /*7420*/                   UBLKCP.S.G [UR8], [UR6], UR4 ;
"""


def test_parse_clean_log(san):
    r = san.parse_sanitizer_log(CLEAN, "memcheck")
    assert r["findings"] == [] and r["errors"] == 0 and r["header"]


def test_parse_racecheck_hazards_and_classify(san):
    r = san.parse_sanitizer_log(RACE, "racecheck")
    assert r["race"] == (2, 2, 0)
    first, second = r["findings"]
    assert first.kind == "race" and first.severity == "error" and first.count == 96
    assert [(a.access, a.pc, a.file, a.line, a.hazards) for a in first.accesses] == \
        [("Write", 0x7420, "wgmma.cu", 301, 0), ("Read", 0x1300, "wgmma.cu", 512, 64),
         ("Read", 0x1310, "wgmma.cu", 513, 32)]
    assert all(a.func == KERNEL for a in first.accesses)
    assert [(a.pc, a.line) for a in second.accesses] == [(0x2000, 600), (0x2100, 610)]  # wrapped lines
    sass = san.parse_sass(SASS)
    san.classify_race(first, sass)
    san.classify_race(second, sass)
    assert first.cls == "async-proxy" and first.accesses[0].opcode == "UBLKCP.S.G"
    assert first.accesses[2].sass == "@!P0 LDS.128 R8, [R2+0x10]"
    assert second.cls == "generic" and second.is_error
    assert not first.is_error  # listed, not an error (unless --strict-racecheck)
    third = san.parse_sanitizer_log(OLD_RACE, "racecheck")["findings"][0]
    assert third.severity == "warning" and [(a.access, a.pc, a.line, a.func) for a in third.accesses] == \
        [("Read", 0x170, 4, "test(int*, int*)"), ("Write", 0x148, 3, "test(int*, int*)")]
    san.classify_race(third, None)
    assert third.cls == "unclassified" and third.is_error


def test_parse_memcheck_errors(san):
    r = san.parse_sanitizer_log(MEMCHECK, "memcheck")
    assert r["errors"] == 1
    mem, warn = r["findings"]
    assert mem.kind == "memory" and mem.is_error and mem.thread == "thread (37,0,0) block (1,0,2)"
    assert (mem.accesses[0].pc, mem.accesses[0].file, mem.accesses[0].line) == (0x1a30, "wgmma.cu", 212)
    assert warn.kind == "warning" and not warn.is_error


def _fake_run(san, tmp_path, logs_text: dict, results: dict, tools):
    """A finished run as driver_main records it: batches with their sanitizer logs and worker records."""
    logs = tmp_path / "logs"
    logs.mkdir()
    plans = [{"id": "w4a16:cfg=wg-m64n256c2s6:dt=fp16:g=128:zp=1:cb=int4:m=5:n=256:k=640:sl=1", "family": "w4a16",
              "tools": list(tools), "tier": 0},
             {"id": "sgemm:cfg=01_naive.32:m=35:n=35:k=37:beta=1", "family": "sgemm", "tools": list(tools), "tier": 0}]
    kern = {"name": "w4a16_wgmma<__half, 64, 4, 2, 6, 128, true, false>", "source": "w4a16/wgmma.cu",
            "defines": [], "lowered": KERNEL, "arch": "sm_90", "cubin": str(tmp_path / "k.cubin")}
    batches = []
    for i, tool in enumerate(tools):
        tag = f"b{i:03d}-{tool}"
        (logs / f"{tag}.log").write_text(logs_text[tool])
        recs = [{"type": "plan", "id": p["id"], "family": p["family"], "ok": results.get((tool, p["id"]), True),
                 "error": None if results.get((tool, p["id"]), True) else "AssertionError: relative error 0.5",
                 "secs": 1.5, "kernels": [kern] if p["family"] == "w4a16" else [], "compiled": []} for p in plans]
        (logs / f"{tag}.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        batches.append({"tag": tag, "tool": tool, "tier": 0, "plans": [p["id"] for p in plans], "rc": 0,
                        "killed": False, "secs": 20.0, "log": f"{tag}.log", "out": f"{tag}.out",
                        "result": f"{tag}.jsonl",
                        "not_run": []})
    (logs / "dry_run.jsonl").write_text("")
    run = {"gpu": {"name": "NVIDIA H100 80GB HBM3", "cc": 90, "sm_count": 132, "torch": "2.x", "driver": "13.0"},
           "slug": "h100", "commit": "abc1234", "date": "2026-01-01 00:00 UTC", "sanitizer": None,
           "sanitizer_version": "Version 2025.3.0", "tools": list(tools), "lineinfo": True, "budget": 240, "jobs": 8,
           "wall": 300.0, "prep_secs": 60.0, "command": "python3 scripts/sanitize_all.py", "plans": plans,
           "plan_specs": {plans[0]["id"]: [kern["name"]]}, "batches": batches, "warm": {"kernels": 2, "secs": 5.0},
           "warm_errors": [], "estimate": {"per_tool_plan_s": {t: 10.0 for t in tools}},
           "coverage": {"specs": 3, "covered": 2, "excluded": 1, "reasons": {"a reason": 1},
                        "counts": {"w4a16": {t: 1 for t in tools}}},
           "logs": str(logs), "strict_racecheck": False, "require_complete": False}
    return run, logs


def test_summary_of_a_clean_run(san, tmp_path):
    tools = ("memcheck", "racecheck")
    run, logs = _fake_run(san, tmp_path, {"memcheck": CLEAN, "racecheck": CLEAN.replace(
        "ERROR SUMMARY: 0 errors", "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)")}, {}, tools)
    md_path = tmp_path / "bench" / "results" / "h100" / "sanitizer.md"
    assert san.finish(run, logs, [md_path]) == 0
    md = md_path.read_text()
    assert "**PASS**" in md and "abc1234" in md and "Version 2025.3.0" in md
    assert "| memcheck | w4a16 | 1/1 | 0 | 0 | 0 | 0 | 1.5 |" in md
    assert "None: every sanitizer summary reads 0 errors." in md
    assert (logs / "run.json").is_file()


def test_summary_reports_findings_and_fails(san, tmp_path, monkeypatch):
    tools = ("memcheck", "racecheck")
    sgemm_id = "sgemm:cfg=01_naive.32:m=35:n=35:k=37:beta=1"
    run, logs = _fake_run(san, tmp_path, {"memcheck": MEMCHECK, "racecheck": RACE}, {("memcheck", sgemm_id): False},
                          tools)
    (tmp_path / "k.cubin").write_bytes(b"\0")
    monkeypatch.setattr(san, "dump_sass", lambda cubin, a, b: SASS)
    md_path = tmp_path / "sanitizer.md"
    assert san.finish(run, logs, [md_path]) == 1
    md = md_path.read_text()
    assert "**FAIL**" in md
    assert "### memcheck memory: Invalid __global__ read of size 16 bytes [ERROR]" in md
    assert "w4a16_wgmma<__half, 64, 4, 2, 6, 128, true, false>" in md
    assert "class: **async-proxy**" in md and "class: **generic**" in md
    assert "`+0x7420 wgmma.cu:301`" in md and "UBLKCP.S.G [UR8], [UR6], UR4" in md
    assert f"memcheck: `{sgemm_id}`: AssertionError: relative error 0.5" in md
    assert "| racecheck | w4a16 | 1/1 | 0 | 0 | 1 | 100 (96 async-proxy) | 1.5 |" in md
    assert (logs / "sass").is_dir()


def test_gpu_slug(san):
    assert san.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert san.gpu_slug("NVIDIA H200") == "h200"
    assert san.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"


FAKE_SANITIZER = '''#!{python}
"""A stand-in for compute-sanitizer: lists options, prints a version, runs the application, writes a clean log."""
import subprocess, sys
argv = sys.argv[1:]
if "--help" in argv:
    print("--tool --error-exitcode --log-file --port --show-backtrace --demangle --print-limit --report-api-errors "
          "--destroy-on-device-error --racecheck-report --kernel-name")
    sys.exit(0)
if "--version" in argv:
    print("NVIDIA (R) Compute Sanitizer\\nVersion 2099.1.0.0 (fake)")
    sys.exit(0)
log, tool = argv[argv.index("--log-file") + 1], argv[argv.index("--tool") + 1]
app = argv.index({python!r})
rc = subprocess.run(argv[app:]).returncode
with open(log, "w") as f:
    f.write("========= COMPUTE-SANITIZER\\n========= ERROR SUMMARY: 0 errors\\n")
sys.exit(rc)
'''


def test_driver_end_to_end_with_a_stand_in_sanitizer(san, tmp_path, monkeypatch):
    """The driver's whole path without a GPU: warm-up compile (NVRTC), the dry run, a batch under a fake
    compute-sanitizer (the worker runs the CPU path), the summary."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("TILEFISH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(san.FAKE_DEVICE_ENV, json.dumps({"name": "NVIDIA H100 80GB HBM3", "cc": 90, "sm_count": 132}))
    monkeypatch.delenv("OUT", raising=False)
    md = tmp_path / "sanitizer.md"
    rc = san.main(["--sanitizer", str(fake), "--match", r"^sgemm:cfg=01_naive|^nf4-dequant:dt=bf16:dq=1",
                   "--tools", "memcheck", "--budget", "120", "--jobs", "1", "--compile-jobs", "1",
                   "--logs", str(tmp_path / "logs"), "--md", str(md)])
    text = md.read_text()
    assert rc == 0, text
    assert "**PASS**" in text and "Version 2099.1.0.0 (fake)" in text
    assert "| memcheck | sgemm | 1/1 | 0 | 0 | 0 | 0 |" in text and "| memcheck | nf4-dequant | 1/1 |" in text
    run = json.loads((tmp_path / "logs" / "run.json").read_text())
    assert run["warm"]["kernels"] >= 2 and [b["rc"] for b in run["batches"]] == [0]
    cmd = run["batches"][0]["cmd"]
    assert "--report-api-errors no" in cmd and "--kernel-name kns=sgemm_" in cmd and "--tool memcheck" in cmd


def test_a_bulk_copy_side_is_async_proxy_even_without_the_kernels_sass(san):
    """A race whose write sits in tf::bulk_load (cp.async.bulk: UBLKCP) is the async-proxy class even
    when the reading kernel's SASS cannot be matched (a lambda's frame, as on the H100 run); a race with
    no such side and no SASS stays unclassified."""
    lam = "_ZZ12w4a16_skinnyI6__halfLi8EEvvENKUliE0_clEi"
    f = san.Finding("racecheck", "race", "error", "race between read and write",
                    [san.Access("Read", lam, 0xf20, "skinny.cu", 409),
                     san.Access("Write", "_ZN2tf9bulk_loadEPvPKvjPy", 0x6e20, "hopper.cuh", 86)])
    san.classify_race(f, None)
    assert f.cls == "async-proxy" and not f.is_error
    g = san.Finding("racecheck", "race", "error", "race between read and write",
                    [san.Access("Read", lam, 0xf20, "skinny.cu", 409), san.Access("Write", lam, 0xf80, "skinny.cu", 420)])
    san.classify_race(g, None)
    assert g.cls == "unclassified" and g.is_error


def test_a_report_naming_inlined_functions_is_resolved_to_its_kernel_by_the_sass(san):
    """-lineinfo reports name the innermost inlined function (tf::bulk_load, w4h::Words::load) with the kernel's
    offsets: the kernel is the batch's one whose SASS holds a fitting instruction at every offset (the bulk copy
    a UBLKCP, the read a shared load); then the read's own opcode is known. Two fitting kernels: unresolved."""
    words = "_ZN3w4h5WordsILi2EE4loadEPKhRA2_j"
    bulk = "_ZN2tf9bulk_loadEPvPKvjPy"
    f = san.Finding("racecheck", "race", "error", "race between read and write",
                    [san.Access("Write", bulk, 0x5fb0, "hopper.cuh", 86),
                     san.Access("Read", words, 0x1020, "wgmma.cu", 76)])
    fits = {"/c/b.cubin": {"kB": {0x1020: "LDS.64 R4, [R2]", 0x5fb0: "UBLKCP.S.G [UR8], [UR6], UR4"}}}
    other = {"/c/a.cubin": {"kA": {0x1020: "IADD3 R1, R2, R3", 0x5fb0: "UBLKCP.S.G [UR8], [UR6], UR4"}},
             "/c/c.cubin": {"kC": {0x1020: "LDS.64 R4, [R2]", 0x5fb0: "STS [R1], R2"}},  # not a bulk copy
             "/c/d.cubin": {"kD": {0x1020: "LDS.64 R4, [R2]"}},                       # no instruction there
             "/c/w.cubin": {"kW": {0x1020: "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR15], R8",  # an mbarrier wait,
                                   0x5fb0: "UBLKCP.S.G [UR8], [UR6], UR4"}}}                # not a load
    tables = {**fits, **other}
    kernels = [{"name": n, "lowered": n, "cubin": c, "defines": []}
               for c, t in tables.items() for n in t]
    k = san.resolve_by_sass(f, kernels, tables.__getitem__)
    assert k is not None and k["lowered"] == "kB"
    san.classify_race(f, None, tables["/c/b.cubin"]["kB"])
    assert [a.opcode for a in f.accesses] == ["UBLKCP.S.G", "LDS.64"] and f.cls == "async-proxy"
    twin = {"/c/e.cubin": {"kE": dict(tables["/c/b.cubin"]["kB"])}}
    both = kernels + [{"name": "kE", "lowered": "kE", "cubin": "/c/e.cubin", "defines": []}]
    assert san.resolve_by_sass(f, both, {**tables, **twin}.__getitem__) is None


def test_moe_specs_read_back_and_plans_name_the_planned_configs(san, universe, plans):
    """ops.moe_kernels.kernel_specs() reads back (template arguments and defines, rebuilt by moe_kernels' /
    moe_decode's spec functions; the dense build of a grouped configuration is not a MoE kernel, nor a decode
    kernel of another batch size), and each grouped moe plan id names the configurations and k splits plan_grouped
    makes for its shapes on the GPU it describes (sms, a forced smem): what the worker checks before it launches.
    plan_specs are the call's five launches."""
    import dataclasses

    import torch
    from tilefish.ops import moe_decode as md
    from tilefish.ops import moe_kernels as mk
    from tilefish.ops.w4a16 import parse_plan

    moe = [(spec, pfam, cfg, fmt) for fam, spec, pfam, cfg, fmt in universe if fam == "moe"]
    assert {spec for spec, *_ in moe} == set(mk.kernel_specs())
    assert all(pfam == "moe" and cfg is not None for _, pfam, cfg, _ in moe)
    assert {cfg for _, _, cfg, _ in moe if isinstance(cfg, str)} == {"align", "act", "combine", *san.DECODE_KINDS}
    dense = mk.kernel_spec(torch.float16, mk.grouped_config(1, 256), 128, False)  # no TF_W4A16_GROUPED
    with pytest.raises(ValueError, match="cannot read back as a MoE kernel"):
        san.spec_config("moe", dense)
    gpu = san.described_gpu(132, 90)
    mp = [p for p in plans if p.family == "moe" and p.args.get("path") != "decode"]
    assert mp and all(p.args["sms"] == "132" for p in mp)
    # the decode kernels read back to their format, activation and id dtype; another batch size (RW), a stray
    # define or two codebooks do not
    spec = md.gate_up_spec(torch.bfloat16, 64, False, "nf4", "swiglu_oai", torch.int64)
    assert san.spec_config("moe", spec)[1:] == ("decode_gate_up", {"kind": "decode_gate_up", "dt": "bf16", "g": 64,
                                                                  "zp": 0, "cb": "nf4", "act": "swiglu_oai",
                                                                  "id": "i64"})
    spec = md.down_spec(torch.float16, -1, True, "int4", torch.int32)
    assert san.spec_config("moe", spec)[1:] == ("decode_down", {"kind": "decode_down", "dt": "fp16", "g": -1,
                                                               "zp": 1, "cb": "int4", "id": "i32", "rt": "f32"})
    act_routing = md.down_spec(torch.bfloat16, 32, False, "mxfp4", torch.int64, torch.bfloat16)
    assert san.spec_config("moe", act_routing)[1:] == ("decode_down", {"kind": "decode_down", "dt": "bf16", "g": 32,
                                                                      "zp": 0, "cb": "mxfp4", "id": "i64",
                                                                      "rt": "act"})
    for bad in (dataclasses.replace(spec, name=spec.name.replace(f", {md.DOWN_ROWS_PER_BATCH}, ", ", 16, ")),
                dataclasses.replace(spec, name=spec.name.replace("float>", "__nv_bfloat16>")),  # neither fp32 nor T
                dataclasses.replace(spec, defines=spec.defines + (("TF_W4A16_GROUPED", "1"),)),
                dataclasses.replace(spec, defines=(("TF_W4A16_NF4", "1"), ("TF_W4A16_MXFP4", "1")))):
        with pytest.raises(ValueError, match="does not read back"):
            san.spec_config("moe", bad)
    for p in mp:
        a = p.args
        g1, zp1, _ = san.moe_fmt_parse(a["gu"])
        g2, zp2, _ = san.moe_fmt_parse(a["dn"])
        gp = mk.plan_grouped(*(int(a[x]) for x in ("t", "topk", "e", "h", "i")), (g1, zp1), (g2, zp2), int(a["sms"]),
                             int(a.get("smem", gpu.smem_per_block)))
        assert (gp.gate_up.config, gp.gate_up.slices, gp.down.config, gp.down.slices) == \
            (parse_plan(a["g1"])[0], int(a["s1"]), parse_plan(a["g2"])[0], int(a["s2"])), p.id
        specs = san.plan_specs(p)
        assert [s.source for s in specs][:1] == [mk.ALIGN_SOURCE] and specs[-1].source == mk.COMBINE_SOURCE
        assert all((mk.GROUPED_DEFINE, "1") in s.defines for s in specs if s.source == "w4a16/gemm.cu")
        names = {}
        for s in specs:  # one process never loads two builds of one kernel name
            assert names.setdefault(s.name, s.defines) == s.defines, p.id
    assert san.moe_fmt_parse("int4.pc.zp") == (-1, True, "int4") and san.moe_fmt_code(64, False, "nf4") == "nf4.g64"
    with pytest.raises(ValueError):
        san.moe_fmt_parse("int4.g128.x")


def test_moe_coverage(san, plans, universe):
    """Tier 0 alone runs every MoE grouped GEMM configuration kernel_specs() lists (the reduced-smem variants
    under a forced limit) and every dtype x weight format on the grouped GEMM, under every tool, and every
    alignment / activation / combine kernel; tier 1 splits k in both GEMMs, through the caller's counters and
    fresh ones; the rest of the grouped specs are format variants --exhaustive runs."""
    from tilefish.ops import moe_kernels as mk

    tier0 = [p for p in plans if p.tier == 0]
    cov = san.coverage(tier0, universe, 90)
    assert cov.moe_config_tools and all(t == set(san.TOOLS) for t in cov.moe_config_tools.values()), \
        {k: t for k, t in cov.moe_config_tools.items() if t != set(san.TOOLS)}
    assert len(cov.moe_format_tools) == 2 * len(mk.FORMATS)
    assert all(t == set(san.TOOLS) for t in cov.moe_format_tools.values())
    small = [s for s in mk.kernel_specs() if s.source not in ("w4a16/gemm.cu", "moe/decode.cu")]
    assert len(small) == 10 and set(small) <= set(cov.covered)
    moe_excluded = {s: r for s, r in cov.excluded.items() if s in set(mk.kernel_specs())}
    assert all(r.startswith(("grouped format", "decode variant")) for r in moe_excluded.values())
    forced = [p for p in tier0 if p.family == "moe" and "smem" in p.args]
    assert forced and all(int(p.args["smem"]) < san.described_gpu(132, 90).smem_per_block for p in forced)
    split = [p.args for p in plans if p.family == "moe" and p.tier == 1 and p.args.get("path") != "decode"]
    assert split and all(int(a["s1"]) > 1 and int(a["s2"]) > 1 and a["rep"] == "2" for a in split)
    assert {a["cnt"] for a in split} == {"0", "1"} and {a["g2"][:3] for a in split} == {"m16", "m32"}
    assert any(a["g1"].endswith("-swap-reg") for a in split)
    mp = [p.args for p in plans if p.family == "moe"]
    assert {a["act"] for a in mp} == set(mk.ACTIVATION_CODES) and {a["id"] for a in mp} == {"i32", "i64"}
    assert any(int(a["h"]) % 128 == 64 for a in mp) and any(int(a["i"]) % 128 == 64 for a in mp)
    assert {a["bias"] for a in mp} == {"0", "1"}


def test_moe_worker_checks_the_plan_before_it_runs(san, plans):
    """A plan id whose configuration plan_grouped would not pick fails in the worker (CPU path)."""
    import torch

    p = next(p for p in plans if p.family == "moe" and "g1" in p.args and p.args["g1"] != p.args["g2"])
    fam, a = san.parse_plan_id(p.id)
    a = {**a, "g1": a["g2"]}
    with pytest.raises(AssertionError, match="plan_grouped picks"):
        san._run_moe(p.id, a, torch.device("cpu"))


def test_moe_decode_plans(san, plans, universe):
    """The decode path (ops.moe_decode, forced path=decode), tier 0 alone: both kernels in every weight format x
    dtype under memcheck / synccheck / initcheck, both activations; racecheck on both kernels in both dtypes, both
    activations, a k split with owned and fresh counters and slices == 1. A k split in both kernels (plan_decode's
    slices > 1, launched twice), slices == 1 in both (K = 2 and K = 1), gpt-oss' shape; every plan id names the
    slices plan_decode makes on the described GPU, and plan_specs are the two decode kernels."""
    from tilefish.ops import moe_decode as md
    from tilefish.ops import moe_kernels as mk

    tier0 = [p for p in plans if p.tier == 0]
    cov = san.coverage(tier0, universe, 90)
    want = {(k, dt, f) for k in san.DECODE_KINDS for dt in ("fp16", "bf16") for f in san.moe_formats()}
    assert set(cov.moe_decode_tools) == want and len(want) == 2 * 2 * len(mk.FORMATS)
    assert all(tools >= san.NO_RACE for tools in cov.moe_decode_tools.values()), \
        {k: t for k, t in cov.moe_decode_tools.items() if not t >= san.NO_RACE}
    listed = {s for s in mk.kernel_specs() if s.source == md.DECODE_SOURCE}
    assert {r.split(" ")[0] for s, r in cov.excluded.items() if s in listed} <= {"decode"}
    dec = [p for p in tier0 if p.family == "moe" and p.args.get("path") == "decode"]
    assert dec and all(p.args.get("path") == "decode" for p in plans if p.family == "moe" and "g1" not in p.args)
    race = [p.args for p in dec if "racecheck" in p.tools]
    assert {a["dt"] for a in race} == {"fp16", "bf16"} and {a["act"] for a in race} == set(md.ACTIVATION_CODES)
    assert {a.get("cnt") for a in race if int(a["s1"]) > 1 and int(a["s2"]) > 1} == {"0", "1"}
    assert {a["topk"] for a in race if a["s1"] == a["s2"] == "1"} == {"1", "2"} and len(race) < len(dec) / 2
    args = [p.args for p in dec]
    assert {a["act"] for a in args} == set(md.ACTIVATION_CODES) and {a["id"] for a in args} == {"i32", "i64"}
    assert {a["bias"] for a in args} == {"0", "1"} and all(int(a["t"]) >= 2 for a in args)
    assert any(a["gu"].split(".")[0] != a["dn"].split(".")[0] for a in args), "two codebooks in one call"
    split = [a for a in args if int(a["s1"]) > 1 and int(a["s2"]) > 1]
    assert {a["cnt"] for a in split} == {"0", "1"} and all(a["rep"] == "2" for a in split)
    assert {a["act"] for a in split} == set(md.ACTIVATION_CODES) and any(int(a["t"]) >= 3 for a in split)
    assert any(int(a["i"]) // 16 % md.DOWN_ROWS_PER_BATCH for a in split), "a part batch in down's last slice"
    whole = [a for a in args if a["s1"] == a["s2"] == "1"]
    assert {a["topk"] for a in whole} == {"1", "2"}  # K = 1: no workspace, no counter
    assert {a.get("cnt") for a in whole if a["topk"] == "2"} == {"0", "1"}
    gptoss = [a for a in args if a["h"] == a["i"] == "2880"]
    assert len(gptoss) == 1 and gptoss[0]["bias"] == "1" and gptoss[0]["act"] == "swiglu_oai"
    assert (gptoss[0]["gu"], gptoss[0]["dn"], gptoss[0]["dt"]) == ("mxfp4.g32", "mxfp4.g32", "bf16")
    for p in dec:
        a = p.args
        dp = md.plan_decode(*(int(a[x]) for x in ("t", "topk", "h", "i", "sms")))
        assert (dp.gate_up_slices, dp.down_slices) == (int(a["s1"]), int(a["s2"])), p.id
        assert ("cnt" in a) == (dp.counters > 0), p.id
        assert [s.source for s in san.plan_specs(p)] == [md.DECODE_SOURCE] * 2, p.id
        assert set(san.plan_specs(p)) <= listed, p.id
    # on another GPU the split plans still split (T is cut down until both kernels do)
    other = san.enumerate_plans(40, 80, universe=universe)
    assert any(p.args.get("path") == "decode" and int(p.args["s1"]) > 1 and int(p.args["s2"]) > 1 for p in other)


def test_moe_decode_worker_cpu_path(san, plans):
    """A decode plan's worker path on the CPU: the slices the id names are checked against plan_decode, the
    routing gets an expert several slots pick, and the reference runs; a wrong split fails before any launch."""
    import torch

    p = next(p for p in plans if p.family == "moe" and p.args.get("path") == "decode" and p.args["topk"] == "1")
    fam, a = san.parse_plan_id(p.id)
    info = san._run_moe(p.id, a, torch.device("cpu"))
    assert info["decode_plan"]["gate_up_slices"] == int(a["s1"]) and info["rel_err"] == 0
    with pytest.raises(AssertionError, match="plan_decode splits"):
        san._run_moe(p.id, {**a, "s1": "3"}, torch.device("cpu"))
    ids = torch.tensor([[0, 1], [2, 3], [-1, 9]])
    assert san._share_an_expert(ids, 4) and ids.tolist() == [[0, 1], [0, 3], [-1, 9]]
    assert san._share_an_expert(ids, 4) and ids.tolist() == [[0, 1], [0, 3], [-1, 9]]  # already shared: kept
    assert not san._share_an_expert(torch.tensor([[1], [-1]]), 4)
