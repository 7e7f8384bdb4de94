"""The command line on a machine without a GPU; `tilefish bench nf4`'s pieces that need none (flags, the
suite's mapping, the matmul rows and loop with the timing replaced, the summary against the targets)."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tilefish import cli
from tilefish.bench import nf4 as bench_nf4
from tilefish.bench.families import FAMILIES
from tilefish.bench.report import Report, Row


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tilefish.cli", *args], capture_output=True, text=True, timeout=600,
                          env=env)


def no_gpu_env() -> dict:
    """The environment of a machine without a GPU, on any machine: no device is visible to torch."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def test_info_runs_without_gpu():
    r = run("info", env=no_gpu_env())
    assert r.returncode == 0, r.stderr
    assert "NVRTC" in r.stdout and "kernel cache" in r.stdout
    assert "GPU             none visible to torch" in r.stdout


def test_compile_prints_resources(compile_all):
    """`tilefish compile --arch sm_90` from an empty cache (conftest's compile_all: run once per session, in
    parallel processes, the machine's cores): exit 0, one table row with registers for every dispatchable
    sm_90 kernel, 0 failures."""
    from tilefish.ops import kernel_specs

    r = compile_all("sm_90")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    specs = kernel_specs(arch="sm_90")
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.startswith(("sm_90 ", "sm_90a "))]
    assert len(rows) == len(specs) and f"{len(specs)} kernel(s), 0 failure(s)" in r.stdout
    assert [row[1] for row in rows] == [fam for fam, _ in specs]  # the table follows kernel_specs()' order
    for row in rows:
        regs, smem, stack, spill = row[-4:]
        assert int(regs) > 0 and int(smem) >= 0 and int(stack) >= 0 and "/" in spill, row
    assert {s.target("sm_90") for _, s in specs} == {row[0] for row in rows} == {"sm_90", "sm_90a"}
    assert "nf4_dequantize" in r.stdout and "COMPILE ERROR" not in r.stderr


def test_bench_without_gpu_says_so():
    r = run("bench", "nf4", env=no_gpu_env())
    assert r.returncode == 2 and "needs an NVIDIA GPU" in r.stderr and "none is visible" in r.stderr


def test_compile_fails_a_hot_kernel_without_ptxas_report(monkeypatch, capsys):
    """A compile whose log has no ptxas -v report (the driver's JIT cache answered) cannot prove
    "no spills": compile-all counts it as a failure instead of passing it."""
    import argparse

    import tilefish.ops
    import tilefish.runtime
    from tilefish import cli
    from tilefish.runtime.compiler import CompiledKernel, KernelSpec, Resources

    hot = KernelSpec("nf4/dequantize.cu", "hot_kernel", hot=True)
    cold = KernelSpec("nf4/dequantize.cu", "cold_kernel", hot=False)
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "1")  # cmd_compile sets it for its process: undone after the test
    monkeypatch.setattr(tilefish.ops, "kernel_specs",
                        lambda include_variants=False, arch=None: [("nf4", hot), ("nf4", cold)])
    monkeypatch.setattr(tilefish.runtime.compiler, "compile_kernel",
                        lambda spec, arch, use_cache=None: CompiledKernel(spec, arch, b"", spec.name, "", Resources()))
    rc = cli.cmd_compile(argparse.Namespace(arch=["sm_90"], all=False, jobs=1))
    out = capsys.readouterr().out
    assert rc == 1 and "1 failure(s)" in out and "NO PTXAS REPORT" in out


# ---- the command line itself: usage errors, the top-level help, and what the README says about it ---------------

ROOT = Path(__file__).resolve().parents[1]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """name -> parser of every subcommand registered on the top-level parser."""
    action, = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("kind, content, why", [
    ("missing", None, "No such file or directory"),
    ("directory", None, "Is a directory"),
    ("not JSON", "name,value\n1,2\n", "not JSON"),
    ("binary", b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "not a text file"),
    ("JSON, not a report", '{"gpu": "H100", "rows": []}', "not a tilefish benchmark report (no 'title' field"),
    ("a JSON list", "[1, 2]", "not a tilefish benchmark report"),
    ("rows of another format", '{"title": "t", "rows": [{"shape": "4096"}]}', "not a tilefish benchmark report"),
])
def test_table_names_the_file_and_the_problem(tmp_path, capsys, kind, content, why):
    """`tilefish table PATH` on something that is not a benchmark report: one line on stderr naming the file
    and the problem, exit 2 (the usage-error status), nothing on stdout, no traceback."""
    path = tmp_path / "run.json"
    if kind == "directory":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert cli.main(["table", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"tilefish table: {path}: ") and why in err, err


def test_table_checks_every_file_before_printing(tmp_path, capsys):
    good = tmp_path / "good.json"
    rep = Report("a title")
    rep.add(Row("nf4", "4096x4096", "tilefish", 10.0, 2000.0, "GB/s"))
    rep.to_json(good, env={"gpu": "GPU0", "commit": "abc", "date": "2026-01-01"})
    assert cli.main(["table", str(good)]) == 0
    assert "**a title** — GPU0" in capsys.readouterr().out
    assert cli.main(["table", str(good), str(tmp_path / "missing.json")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"tilefish table: {tmp_path / 'missing.json'}: No such file or directory\n"


def test_table_error_through_the_entry_point(tmp_path):
    r = run("table", str(tmp_path / "nowhere.json"), env=no_gpu_env())
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"tilefish table: {tmp_path / 'nowhere.json'}: No such file or directory"


def test_help_lists_every_subcommand_on_one_line(monkeypatch, capsys):
    """`tilefish --help` names every registered subcommand with its one-line help (at 80 columns), and every
    cmd_* function of the CLI is registered as one."""
    monkeypatch.setenv("COLUMNS", "80")
    action, = (a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in action._choices_actions}
    assert set(helps) == set(action.choices) and all(helps.values()), helps
    assert {name[len("cmd_"):] for name in dir(cli) if name.startswith("cmd_")} == set(action.choices)
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    for name, text in helps.items():
        assert re.search(rf"^ +{name} +{re.escape(text)}$", out, re.M), (name, out)


@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_jobs_must_be_a_positive_integer(monkeypatch, capsys, value):
    """Every subcommand with --jobs / -j rejects 0, negatives and non-integers at parsing (exit 2), naming the
    rule; a positive count parses to an int."""
    with_jobs = [name for name, sp in subcommands(cli.build_parser()).items()
                 if any("--jobs" in a.option_strings for a in sp._actions)]
    assert with_jobs  # compile has it
    for name in dir(cli):  # no command runs, whatever parses
        if name.startswith("cmd_"):
            monkeypatch.setattr(cli, name, lambda args: 0)
    for cmd in with_jobs:
        for argv in ([cmd, "--jobs", value], [cmd, f"--jobs={value}"], [cmd, "-j", value]):
            with pytest.raises(SystemExit) as e:
                cli.main(argv)
            err = capsys.readouterr().err
            assert e.value.code == 2 and "--jobs" in err and "positive integer" in err and repr(value) in err, err
        assert cli.build_parser().parse_args([cmd, "-j", "3"]).jobs == 3


def _words(text: str) -> str:
    return " ".join(text.split())


def test_quick_run_time_is_said_the_same_everywhere(monkeypatch, capsys):
    """`tilefish bench --help` and the README give the quick run's time in the same words (cli.QUICK_RUN_TIME)."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    bench_help = _words(capsys.readouterr().out)
    assert cli.QUICK_RUN_TIME in bench_help and "2 minutes" not in bench_help
    assert cli.QUICK_RUN_TIME in _words((ROOT / "README.md").read_text())


def test_readme_set_up_matches_ci():
    """The README's first part stays short, shows both set-up commands, and its test command is what .ci/run
    installs and runs."""
    readme = (ROOT / "README.md").read_text()
    first, sep, _ = readme.partition("\n## Set up\n")
    assert sep and len(first.split()) < 200, len(first.split())
    assert '```bash\npip install -e ".[bench,peers]" && tilefish bench\n```' in readme
    extras, = re.findall(r'^pip install -e "\.\[([a-z,]+)\]" && pytest$', readme, re.M)
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip()
          and not ln.lstrip().startswith("#")]
    assert any(f'-e ".[{extras}]"' in ln for ln in ci) and ci[-1] == "pytest"


# ---- `tilefish bench nf4`: flags, the suite's mapping, the matmul rows, the summary against the targets ----------


def parse(monkeypatch, *argv) -> argparse.Namespace:
    """The namespace `tilefish <argv>` hands to its command (which does not run)."""
    seen = []
    monkeypatch.setattr(cli, "cmd_bench", lambda args: seen.append(args) or 0)
    assert cli.main(list(argv)) == 0
    return seen[0]


def test_bench_nf4_flags(monkeypatch):
    a = parse(monkeypatch, "bench", "nf4")
    assert (a.only, a.quick, a.m, a.dtypes, a.blocksize, a.single_quant) == (None, False, None, None, 64, False)
    e = parse(monkeypatch, "bench", "e2e")
    assert e.impls is None and e.loops == "harness,generate"  # every variant of each loop
    a = parse(monkeypatch, "bench", "nf4", "--only", "matmul", "--quick", "--m", "1,16", "--dtypes", "bf16,fp16",
              "--blocksize", "128", "--single-quant", "--shapes", "4096x4096,8192x28672")
    assert (a.only, a.quick, a.m, a.dtypes, a.blocksize, a.single_quant) == ("matmul", True, "1,16", "bf16,fp16",
                                                                            128, True)
    assert a.shapes == [(4096, 4096), (8192, 28672)]
    assert parse(monkeypatch, "bench", "e2e", "--impls", "fp16,tilefish-nf4").impls == "fp16,tilefish-nf4"


@pytest.mark.parametrize("family,argv", [("nf4", ["--only", "both"]), ("nf4", ["--m", "0,16"]), ("nf4", ["--m", "1,x"]),
                                         ("nf4", ["--dtypes", "fp32"]), ("nf4", ["--impls", "fp16,bogus"]),
                                         ("e2e", ["--loops", "harness,bogus"]), ("e2e", ["--new-tokens", "0"]),
                                         ("e2e", ["--generate-batches", "0"]), ("e2e", ["--impls", "int3"])])
def test_bench_rejects_bad_flags(monkeypatch, capsys, family, argv):
    monkeypatch.setattr(cli, "cmd_bench", lambda args: 0)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", family, *argv])
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err


def test_cli_e2e_impls_match_the_bench():
    from tilefish.bench import e2e, e2e_generate
    from tilefish.bench.families import e2e as e2e_family

    assert e2e_family.HARNESS_IMPLS == e2e.IMPLS and set(e2e.LABELS) == set(e2e.IMPLS)
    assert e2e_family.GENERATE_IMPLS == e2e_generate.IMPLS and set(e2e_generate.LABELS) == set(e2e_generate.IMPLS)


def test_bench_e2e_loop_flags(monkeypatch):
    a = parse(monkeypatch, "bench", "e2e", "--loops", "generate", "--new-tokens", "64", "--generate-batches", "1,8",
              "--impls", "bf16,tinygemm")
    assert (a.loops, a.new_tokens, a.generate_batches, a.impls) == ("generate", 64, "1,8", "bf16,tinygemm")


@pytest.fixture
def nf4_calls(monkeypatch):
    """bench nf4's two parts replaced by recorders (no GPU): [(part, kwargs)]."""
    calls = []

    def dequant(**kw):
        calls.append(("dequantize", kw))
        rep = Report("dequantize")
        rep.add(Row("nf4", "8192x8192", "tilefish", 1.0, 1.0, "GB/s"))
        return rep

    def matmul(**kw):
        calls.append(("matmul", kw))
        rep = bench_nf4.NF4Report("matmul" + kw.get("title_note", ""))
        rep.rows = synthetic_rows(shapes=[(4096, 4096)], ms=[1])
        return rep

    monkeypatch.setattr(bench_nf4, "run", dequant)
    monkeypatch.setattr(bench_nf4, "run_matmul", matmul)
    return calls


def test_nf4_suite_maps_flags(monkeypatch, nf4_calls):
    run = lambda *argv: (nf4_calls.clear(), FAMILIES["nf4"].run(parse(monkeypatch, "bench", "nf4", *argv)))[1]
    rep = run()
    (_, d), (_, m) = nf4_calls
    assert [c[0] for c in nf4_calls] == ["dequantize", "matmul"]
    assert d == dict(shapes=None, dtype="bf16", blocksize=64, double_quant=True, variants=False, reps=50)
    assert m == dict(shapes=None, ms=None, dtypes=["bf16"], blocksize=64, double_quant=True, reps=50, title_note="")
    assert {r.family for r in rep.rows} == {"nf4", bench_nf4.MATMUL_FAMILY}
    assert "== dequantize ==" in rep.table() and "== matmul ==" in rep.table()

    run("--quick", "--dtype", "fp16", "--single-quant", "--blocksize", "128", "--reps", "7")
    (_, d), (_, m) = nf4_calls
    assert d["shapes"] == bench_nf4.QUICK_SHAPES and d["dtype"] == "fp16" and not d["double_quant"]
    assert m["shapes"] == bench_nf4.QUICK_KN and m["ms"] == bench_nf4.QUICK_M and m["dtypes"] == ["fp16"]
    assert (m["blocksize"], m["double_quant"], m["reps"]) == (128, False, 7) and "--quick" in m["title_note"]

    run("--only", "matmul", "--dtype", "fp32", "--dtypes", "fp16,bf16", "--m", "2,4", "--shapes", "4096x6144")
    assert [c[0] for c in nf4_calls] == ["matmul"]
    assert nf4_calls[0][1] | {"title_note": ""} == dict(shapes=[(4096, 6144)], ms=[2, 4], dtypes=["fp16", "bf16"],
                                                       blocksize=64, double_quant=True, reps=50, title_note="")
    run("--only", "matmul", "--dtype", "fp32")
    assert nf4_calls[0][1]["dtypes"] == ["bf16"]  # fp32 is the dequantization's; the matmul runs bf16

    rep = run("--only", "dequantize")
    assert [c[0] for c in nf4_calls] == ["dequantize"] and rep.table().startswith("== dequantize ==")
    run("--variants", "--shapes", "16384x16384")  # the design-space sweep is the dequantization kernel's
    assert [c[0] for c in nf4_calls] == ["dequantize"] and nf4_calls[0][1]["variants"]

    args = parse(monkeypatch, "bench", "nf4")
    args.family = None  # the all-families run: the quick sets, and it says so
    nf4_calls.clear()
    FAMILIES["nf4"].run(args)
    assert nf4_calls[1][1]["ms"] == bench_nf4.QUICK_M and "all-families" in nf4_calls[1][1]["title_note"]


def synthetic_rows(shapes=((4096, 4096), (8192, 8192), (4096, 28672)), ms=(1, 2, 16, 64, 256, 1024, 4096),
                   dtype="bf16", cublas=None, bnb=2.0, w4a16=0.95, errs=None):
    """Matmul rows with chosen ratios: cublas(m, i) -> ratio to cuBLAS of shape i (default 3.0); bnb, w4a16:
    ratios (None: no such peer); errs(m, i) -> the check errors (default all within tolerance)."""
    rows = []
    for m in ms:
        for i, (k, n) in enumerate(shapes):
            times = {"tilefish": 10.0, "cuBLAS": 10.0 * (cublas(m, i) if cublas else 3.0)}
            if bnb is not None:
                times["bitsandbytes"] = 10.0 * bnb
            if w4a16 is not None:
                times["W4A16 g64"] = 10.0 * w4a16
            e = (errs(m, i) if errs else None) or {"tilefish": 0.004, "cuBLAS": None, "bitsandbytes": 0.005,
                                                   "W4A16 g64": 0.003}
            rows.append(bench_nf4.matmul_row(dtype, k, n, m, times, e, label="skinny-8x4", weight_bytes=k * n // 2,
                                             copy_gbps=3000.0, peak_tflops=700.0, group=64, blocksize=64,
                                             double_quant=True))
    return rows


def summary_results(text: str) -> dict:
    """(dtype, m) -> the summary's result cell."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and cells[1].isdigit():
            out[(cells[0], int(cells[1]))] = cells[-1]
    return out


def test_matmul_row_rates_ratios_and_checks():
    small, large = synthetic_rows(shapes=[(4096, 4096)], ms=[64, 128])
    assert small.unit == "GB/s" and small.metric == pytest.approx((4096 * 4096 // 2 + 2 * 64 * 8192) / 10e-6 / 1e9)
    assert small.pct_ceiling == pytest.approx(100 * small.metric / 3000.0)
    assert large.unit == "TFLOP/s" and large.metric == pytest.approx(2 * 128 * 4096 * 4096 / 10e-6 / 1e12)
    assert large.pct_ceiling == pytest.approx(100 * large.metric / 700.0)
    assert small.ratios == {"cuBLAS": 3.0, "bitsandbytes": 2.0, "W4A16 g64": 0.95}
    assert small.impl == "tilefish [skinny-8x4]" and small.extra["check_ok"] and small.extra["plan"] == "skinny-8x4"
    assert small.extra["checks"] == {"tilefish": True, "bitsandbytes": True, "W4A16 g64": True}
    assert small.family == bench_nf4.MATMUL_FAMILY and small.case == "bf16 k4096 n4096 m64"
    bad = {"tilefish": float("nan"), "cuBLAS": None, "bitsandbytes": 0.5, "W4A16 g64": 0.003}
    row, = synthetic_rows(shapes=[(4096, 4096)], ms=[1], errs=lambda m, i: bad)
    assert row.impl.endswith("CHECK FAILED") and not row.extra["check_ok"]
    assert row.extra["checks"] == {"tilefish": False, "bitsandbytes": False, "W4A16 g64": True}
    assert bench_nf4.check_ok(1.6e-2, bench_nf4.CHECK_TOL["bf16"]) and not bench_nf4.check_ok(2.1e-3, 2e-3)
    assert not bench_nf4.check_ok(None, 1.0) and not bench_nf4.check_ok(math.inf, 1.0)


def test_cublas_targets():
    assert [bench_nf4.cublas_target(m) for m in (1, 2, 16, 64, 128, 256, 512, 1024, 4096, 8192)] == \
        [2.5, None, 2.0, 1.5, None, 1.0, None, 0.9, 0.9, 0.9]


def test_target_summary_pass_and_fail():
    assert bench_nf4.target_summary(synthetic_rows()) .count("| ok |") == 7
    # cuBLAS: the median over shapes is judged (one slow shape of three does not fail m = 1; two do);
    # no target at m = 2; at m = 1024 the target is 0.9x.
    ratios = {(1, 0): 1.0, (16, 0): 1.0, (16, 1): 1.9, (1024, 0): 0.5, (1024, 1): 0.91, (1024, 2): 0.5,
              (2, 0): 0.1, (2, 1): 0.1, (2, 2): 0.1, (4096, 0): 0.89, (4096, 1): 0.89}
    text = bench_nf4.target_summary(synthetic_rows(cublas=lambda m, i: ratios.get((m, i), 3.0)))
    res = summary_results(text)
    assert res[("bf16", 1)] == "ok" and res[("bf16", 2)] == "ok" and res[("bf16", 16)] == "MISS cuBLAS"
    assert res[("bf16", 1024)] == "MISS cuBLAS" and res[("bf16", 4096)] == "MISS cuBLAS"
    assert "| bf16 | 1 | 3.00x (2.5x) | 1.00x - 3.00x |" in text and "| bf16 | 2 | 0.10x (-) |" in text
    assert "4 of 7 (dtype, m) rows meet every target" in text
    # bitsandbytes: the least ratio of every shape; W4A16: NF4 at most 1.1x slower (ratio >= 1 / 1.1)
    res = summary_results(bench_nf4.target_summary(synthetic_rows(bnb=1.49, w4a16=1 / 1.1 + 1e-9)))
    assert set(res.values()) == {"MISS bitsandbytes"}
    res = summary_results(bench_nf4.target_summary(synthetic_rows(w4a16=0.90)))
    assert set(res.values()) == {"MISS W4A16 g64"}
    # a row whose check failed fails its m, with its misses still named
    bad = {"tilefish": 0.5, "cuBLAS": None, "bitsandbytes": 0.005, "W4A16 g64": 0.003}
    text = bench_nf4.target_summary(synthetic_rows(errs=lambda m, i: bad if (m, i) == (64, 1) else None,
                                                   cublas=lambda m, i: 1.0 if m == 64 else 3.0))
    assert summary_results(text)[("bf16", 64)] == "CHECK FAILED; MISS cuBLAS" and "| 2 / 3 |" in text
    assert "1 row(s) FAILED the correctness check" in text


def test_target_summary_without_bitsandbytes_and_per_dtype():
    within = {"tilefish": 1e-3, "cuBLAS": None, "W4A16 g64": 1e-3}  # fp16's tolerance is 2e-3
    rows = (synthetic_rows(bnb=None, ms=[1], errs=lambda m, i: within)
            + synthetic_rows(bnb=None, ms=[1], dtype="fp16", w4a16=0.8, errs=lambda m, i: within))
    text = bench_nf4.target_summary(rows)
    assert summary_results(text) == {("bf16", 1): "ok", ("fp16", 1): "MISS W4A16 g64"}
    assert "| n/a |" in text and "not judged" in text
    assert bench_nf4.target_summary([Row("nf4", "4096x4096", "tilefish", 1.0, 1.0, "GB/s")]) == ""


def test_target_summary_from_json_rows(tmp_path):
    rep = bench_nf4.combine(None, bench_nf4.NF4Report("matmul"))
    rep.rows = synthetic_rows(cublas=lambda m, i: 1.0)
    rep.to_json(tmp_path / "nf4.json")
    rows = json.loads((tmp_path / "nf4.json").read_text())["rows"]
    assert bench_nf4.target_summary(rows) == bench_nf4.target_summary(rep.rows)
    assert bench_nf4.target_summary([asdict(r) for r in rep.rows]) == bench_nf4.target_summary(rep.rows)
    assert len(Report.from_json(tmp_path / "nf4.json").rows) == len(rep.rows)


def test_nf4_report_sections_and_notes():
    deq = Report("dequantize -> bf16", {"copy GB/s": 3000.0, "write-only GB/s": 2900.0})
    deq.add(Row("nf4", "4096x4096", "tilefish", 10.0, 2000.0, "GB/s", 66.7, {"bitsandbytes": 1.5}))
    deq.notes.append("host overhead note")
    mm = bench_nf4.NF4Report("fused matmul", {"copy GB/s": 3000.0, "cuBLAS bf16 TFLOP/s": 700.0})
    mm.sections[bench_nf4.MATMUL_FAMILY] = mm.title
    mm.rows = synthetic_rows(ms=[1, 256])
    mm.notes.append("bf16 k8192 n8192 m64: bitsandbytes CHECK FAILED, relative error 0.5 > 0.016")
    both = bench_nf4.combine(deq, mm)
    text = both.table()
    assert text.index("== dequantize -> bf16 ==") < text.index("== fused matmul ==") < text.index("host overhead")
    assert "cuBLAS bf16 TFLOP/s 700.0" in text and "CHECK FAILED, relative error" in text
    assert "x W4A16 g64" in text and "TFLOP/s" in text and "GB/s" in text
    assert len(both.rows) == 1 + 6 and both.ceilings["write-only GB/s"] == 2900.0
    alone = bench_nf4.combine(None, mm)
    assert alone.table().startswith("== fused matmul ==") and alone.table().count("==") == 2
    with pytest.raises(ValueError):
        bench_nf4.combine(None, None)


def test_nf4_report_plot(tmp_path):
    pytest.importorskip("matplotlib")
    mm = bench_nf4.NF4Report("fused matmul")
    mm.rows = synthetic_rows()
    deq = Report("dequantize")
    deq.add(Row("nf4", "4096x4096", "tilefish", 10.0, 2000.0, "GB/s", 66.7, {"bitsandbytes": 1.5}))
    bench_nf4.combine(deq, mm).plot(tmp_path / "nf4.png")
    assert (tmp_path / "nf4.png").stat().st_size > 0


def test_check_matmul_args():
    bench_nf4.check_matmul_args(bench_nf4.MATMUL_KN, bench_nf4.MATMUL_M, bench_nf4.MATMUL_DTYPES)
    with pytest.raises(ValueError, match="n % 64"):
        bench_nf4.check_matmul_args([(4096, 4000)], [1], ["bf16"])
    with pytest.raises(ValueError, match="k % 64"):
        bench_nf4.check_matmul_args([(4000, 4096)], [1], ["bf16"])
    with pytest.raises(ValueError, match="activations"):
        bench_nf4.check_matmul_args([(4096, 4096)], [1], ["fp32"])
    with pytest.raises(ValueError, match="positive"):
        bench_nf4.check_matmul_args([(4096, 4096)], [0], ["bf16"])


def test_cli_bench_nf4_prints_table_and_summary(monkeypatch, capsys, tmp_path, nf4_calls):
    """`tilefish bench nf4` end to end without a GPU: both tables, the summary against the targets, the JSON."""
    import tilefish.bench.report

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tilefish.bench.report, "environment", lambda: {})  # it would ask the (absent) GPU
    assert cli.main(["bench", "nf4", "--json", str(tmp_path / "nf4.json")]) == 0
    out = capsys.readouterr().out
    assert out.index("== dequantize ==") < out.index("== matmul ==") < out.index("against the targets")
    assert "| bf16 | 1 | 3.00x (2.5x) |" in out and f"wrote {tmp_path / 'nf4.json'}" in out
    rows = json.loads((tmp_path / "nf4.json").read_text())["rows"]
    assert {r["family"] for r in rows} == {"nf4", bench_nf4.MATMUL_FAMILY}


@pytest.fixture
def cpu_matmul_bench(monkeypatch):
    """run_matmul's loop on the CPU (the ops' reference paths) with the GPU-only pieces replaced: the
    timing (each callable called once, then fixed times), the ceilings and the plan label."""
    timed = []

    def fake_timing(fns, **kw):
        timed.append(sorted(fns))
        for fn in fns.values():
            fn()
        times = {"tilefish": 10.0, "cuBLAS": 30.0, "bitsandbytes": 25.0}
        return {name: times.get(name, 9.5) for name in fns}

    monkeypatch.setattr(bench_nf4, "time_alternating_us", fake_timing)
    monkeypatch.setattr(bench_nf4, "copy_bandwidth_gbps", lambda: 3000.0)
    monkeypatch.setattr(bench_nf4, "cublas_tflops", lambda dtype: 700.0)
    monkeypatch.setattr(bench_nf4, "_plan_label", lambda m, n, k, group, dtype: f"plan-m{m}")
    monkeypatch.setattr(bench_nf4, "_bnb_module", lambda: None)
    return timed


def test_run_matmul_loop_on_cpu(cpu_matmul_bench):
    rep = bench_nf4.run_matmul(shapes=[(256, 128)], ms=[1, 3, 80], dtypes=["bf16", "fp16"], reps=4, device="cpu")
    assert [r.case for r in rep.rows] == [f"{d} k256 n128 m{m}" for d in ("bf16", "fp16") for m in (1, 3, 80)]
    assert cpu_matmul_bench == [["W4A16 g64", "cuBLAS", "tilefish"]] * 6
    for r in rep.rows:
        assert r.extra["check_ok"], r.extra["rel_err"]
        assert r.impl == f"tilefish [plan-m{r.extra['m']}]"
        assert r.extra["checks"] == {"tilefish": True, "W4A16 g64": True}
        assert r.ratios == {"cuBLAS": 3.0, "W4A16 g64": 0.95}
        assert r.unit == ("GB/s" if r.extra["m"] <= bench_nf4.SMALL_M else "TFLOP/s")
        assert r.extra["bytes"] == 256 * 128 // 2 + 256 * 128 // 64 * 2 + 2 * r.extra["m"] * (256 + 128)
    assert rep.ceilings == {"copy GB/s": 3000.0, "cuBLAS bf16 TFLOP/s": 700.0, "cuBLAS fp16 TFLOP/s": 700.0}
    assert any("bitsandbytes not importable" in n for n in rep.notes)
    assert not any("FAILED" in n or "raised" in n for n in rep.notes)
    text = bench_nf4.target_summary(rep.rows)
    assert set(summary_results(text).values()) == {"ok"} and "6 of 6" in text and "not judged" in text


def test_run_matmul_flags_a_wrong_result_and_a_failing_peer(cpu_matmul_bench, monkeypatch):
    import tilefish.ops.nf4
    import tilefish.ops.w4a16

    real = tilefish.ops.nf4.matmul_impl
    monkeypatch.setattr(tilefish.ops.nf4, "matmul_impl", lambda x, w, bias=None, **kw: real(x, w, bias, **kw) * 1.1)

    def broken(x, w, bias=None, **kw):
        raise RuntimeError("no kernel\nfor this")

    monkeypatch.setattr(tilefish.ops.w4a16, "matmul_impl", broken)
    rep = bench_nf4.run_matmul(shapes=[(256, 128)], ms=[2], reps=4, device="cpu")
    row, = rep.rows
    assert row.impl == "tilefish [plan-m2] CHECK FAILED" and not row.extra["check_ok"]
    assert row.extra["rel_err"]["tilefish"] == pytest.approx(0.1, rel=0.05) and row.ratios == {"cuBLAS": 3.0}
    assert any(n.startswith("bf16 k256 n128 m2: tilefish CHECK FAILED, relative error 0.") and n.endswith(" > 0.016")
               for n in rep.notes), rep.notes
    assert "bf16 k256 n128 m2: W4A16 g64 raised RuntimeError: no kernel" in rep.notes
    assert summary_results(bench_nf4.target_summary(rep.rows))[("bf16", 2)] == "CHECK FAILED; MISS W4A16 g64"
    assert not any("bitsandbytes" in n and "FAILED" in n for n in rep.notes)


def test_run_matmul_times_bitsandbytes_on_the_same_weights(cpu_matmul_bench, monkeypatch):
    """With bitsandbytes importable, its matmul_4bit gets the packed weight transposed (as Linear4bit
    passes self.weight.t()) and the quant state of the same NF4 weight, dequantizing to the activation dtype."""
    import types

    import tilefish.nf4

    seen = []

    def to_bnb(q):
        return q.codes.view(-1, 1), types.SimpleNamespace(q=q, dtype=q.dtype)

    def matmul_4bit(x, b, quant_state):
        seen.append((tuple(b.shape), quant_state.dtype))
        return (x.float() @ tilefish.nf4.dequantize(quant_state.q, torch.float32).t()).to(x.dtype)

    monkeypatch.setattr(tilefish.nf4, "to_bnb", to_bnb)
    monkeypatch.setattr(bench_nf4, "_bnb_module", lambda: types.SimpleNamespace(matmul_4bit=matmul_4bit))
    rep = bench_nf4.run_matmul(shapes=[(256, 128)], ms=[1, 5], dtypes=["fp16"], reps=4, device="cpu")
    assert seen == [((1, 256 * 128 // 2), torch.float16)] * 4  # the check's call and the timing's, per row
    assert [r.ratios["bitsandbytes"] for r in rep.rows] == [2.5, 2.5]
    assert all(r.extra["checks"]["bitsandbytes"] for r in rep.rows)
    assert not any("not importable" in n for n in rep.notes)


def test_warm_kernel_cache_compiles_the_runs_kernels_once(monkeypatch, tmp_path):
    """The matmul bench compiles the kernels its rows will launch in parallel processes first (into the
    disk cache the run then reads); a second warm-up finds them all cached. (A fake sm_90 device: the
    compiles need no GPU.)"""
    import types

    import tilefish.runtime
    from tilefish.ops import w4a16 as ops
    from tilefish.runtime.compiler import compile_kernel

    monkeypatch.setenv("TILEFISH_CACHE_DIR", str(tmp_path))
    info = types.SimpleNamespace(sm_count=132, cc=90, arch="sm_90", index=0)
    monkeypatch.setattr(tilefish.runtime, "device_info", lambda *a: info)
    monkeypatch.setattr(ops.launch, "device_clusters", lambda i, policy=None: ops.H200_CLUSTERS)
    note = bench_nf4.warm_kernel_cache([(4096, 4096)], [1], ["bf16"], 64, processes=2)
    assert note.startswith("kernel cache warmed before timing: 2 of the run's 2 kernels compiled")
    assert "failed" not in note
    cfg = ops.choose_config(1, 4096, 4096, 132, 90, 64, ops.H200_CLUSTERS, torch.bfloat16)
    for codebook in ("nf4", "int4"):
        assert compile_kernel(ops.kernel_spec(torch.bfloat16, cfg, 64, False, codebook), "sm_90").from_cache
    assert bench_nf4.warm_kernel_cache([(4096, 4096)], [1], ["bf16"], 64) == \
        "kernel cache: all 2 kernels of the run were cached"
    monkeypatch.setenv("TILEFISH_CACHE", "0")
    assert "disabled" in bench_nf4.warm_kernel_cache([(4096, 4096)], [1], ["bf16"], 64)


def test_compile_arch_accepts_the_listed_gpus_only(capsys):
    """--arch takes the archs of the GPUs tilefish runs on, repeated; anything else is a usage error (exit 2)
    naming the accepted list."""
    parser = cli.build_parser()
    assert parser.parse_args(["compile", "--arch", "sm_100", "--arch", "sm_120"]).arch == ["sm_100", "sm_120"]
    for bad in ("sm_75", "sm_90a", "sm_121", "90"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["compile", "--arch", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--arch" in err and repr(bad) in err, err
        assert all(arch in err for arch in cli.COMPILE_ARCHS), err


def test_compile_builds_the_kernels_of_each_arch(monkeypatch, capsys):
    """`tilefish compile --arch A --arch B`: one row for each kernel the dispatchers launch on that arch, in
    kernel_specs(arch=...)'s order (NVRTC replaced: no compile runs); no sm_90a kernel off sm_90."""
    import tilefish.runtime.compiler
    from tilefish.ops import kernel_specs
    from tilefish.runtime.compiler import CompiledKernel, Resources

    monkeypatch.setattr(tilefish.runtime.compiler, "compile_kernel", lambda spec, arch, use_cache=None: CompiledKernel(
        spec, arch, b"", spec.name, "", Resources(registers=32)))
    rc = cli.main(["compile", "--arch", "sm_120", "--arch", "sm_90"])
    out = capsys.readouterr().out
    rows = [ln.split()[:2] for ln in out.splitlines() if ln.startswith("sm_")]
    want = [[s.target(a), fam] for a in ("sm_120", "sm_90") for fam, s in kernel_specs(arch=a)]
    assert rc == 0 and rows == want and f"{len(want)} kernel(s), 0 failure(s)" in out
    assert {r[0] for r in rows} == {"sm_120", "sm_90", "sm_90a"}


# ---- `tilefish bench`'s command line: one subcommand per family, each with its own flags --------------------------

COMMON_BENCH_FLAGS = {"-h", "--help", "--out", "--json", "--plot", "--reps"}


def own_flags(family) -> set[str]:
    """The flags a family's add_arguments defines."""
    p = argparse.ArgumentParser(add_help=False)
    family.add_arguments(p)
    return {flag for action in p._actions for flag in action.option_strings}


def test_the_command_line_is_built_without_torch():
    code = "import sys, tilefish.cli as c; c.build_parser(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_bench_help_lists_the_families_and_each_family_shows_its_own_flags(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for name, family in FAMILIES.items():
        assert re.search(rf"^ +{name} +{re.escape(family.help)}$", out, re.M), (name, out)
    everyone = set().union(*(own_flags(f) for f in FAMILIES.values()))
    listed = set(re.findall(r"^  (?:-h, )?(--[a-z0-9-]+)", out, re.M))
    assert listed == {"--help", "--out", "--json", "--plot", "--reps", "--full"} and not listed & everyone, out
    for name, family in FAMILIES.items():
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", name, "--help"])
        out = capsys.readouterr().out
        usage = out.split("\n\n")[0]
        assert e.value.code == 0 and usage.startswith(f"usage: tilefish bench {name} ")
        assert set(re.findall(r"\[(--?[a-z0-9-]+)", usage)) == own_flags(family) | COMMON_BENCH_FLAGS - {"--help"}
        listed = set(re.findall(r"^  (?:-h, )?(--[a-z0-9-]+)", out, re.M))  # the options' flag column
        assert listed == own_flags(family) | COMMON_BENCH_FLAGS - {"-h"}, (name, out)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_family_rejects_every_flag_it_does_not_define(monkeypatch, capsys, name):
    """`tilefish bench sgemm --peers marlin` and the like: argparse's usage error for that family, exit 2."""
    monkeypatch.setattr(cli, "cmd_bench", lambda args: 0)
    foreign = set().union(*(own_flags(f) for f in FAMILIES.values())) - own_flags(FAMILIES[name])
    assert foreign
    for flag in sorted(foreign) + (["--peers"] if name == "sgemm" else []):
        with pytest.raises(SystemExit) as e:
            cli.main(["bench", name, flag, "marlin"] if flag == "--peers" else ["bench", name, flag])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"tilefish bench {name}: error: unrecognized arguments: {flag}" in err, err


def test_common_bench_flags_stand_before_or_after_the_family(monkeypatch):
    a = parse(monkeypatch, "bench", "--out", "d", "--reps", "7", "w4a16")
    assert (a.family, a.out, a.reps, a.json) == ("w4a16", "d", 7, None)
    a = parse(monkeypatch, "bench", "w4a16", "--out", "d", "--json", "x.json")
    assert (a.out, a.reps, a.json, a.plot) == ("d", 50, "x.json", None)
    a = parse(monkeypatch, "bench", "--full", "--reps", "9")
    assert (a.family, a.full, a.reps, a.out) == (None, True, 9, None)


def documented_bench_commands() -> list[tuple[str, str]]:
    """(file, what follows `bench`) of every `tilefish bench` command line in README.md, docs/*.md and
    scripts/*.sh: inline code, fenced code blocks (a line each) and gpu_job.sh's "name: command" steps."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "scripts").glob("*.sh"))]:
        text = path.read_text()
        fence = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)
        spans = [line for block in fence.findall(text) for line in block.splitlines()]
        rest = fence.sub("", text)
        spans += re.findall(r'"[a-z]+: ([^"]*)"', rest) if path.suffix == ".sh" else re.findall(r"`([^`]+)`", rest)
        for span in spans:
            m = re.search(r"(?:tilefish|-m tilefish\.cli) bench\b([^`]*)", " ".join(span.split(" #")[0].split()))
            if m and not m.group(1).lstrip().startswith("("):  # "tilefish bench (quick run) on ...": its screen
                found.append((path.name, m.group(1)))
    return found


def takes_value(family: str, flag: str) -> bool:
    p = argparse.ArgumentParser(add_help=False)
    FAMILIES[family].add_arguments(p)
    return flag in p._option_string_actions and p._option_string_actions[flag].nargs != 0


def expand(command: str) -> list[list[str]]:
    """A documented command's argv lists: <family> and [a|b|c] give one per choice, [--flag V] is kept, a
    placeholder value ("--shapes ...", "--shapes <the other half's>") drops its flag, and so does a flag named
    without its value at the end (a heading's `tilefish bench e2e --tp`); a parenthesized aside goes."""
    command = command.replace("<family>", "[" + "|".join(FAMILIES) + "]")
    command = re.sub(r"<[^>]*>", "...", re.sub(r"\([^)]*\)", "", command))
    if choice := re.search(r"\[([a-z0-9-]+(?:\|[a-z0-9-]+)+)\]", command):
        return [argv for c in choice.group(1).split("|") for argv in expand(command.replace(choice.group(0), c, 1))]
    argv: list[str] = []
    for token in command.replace("[", " ").replace("]", " ").split():
        if token == "...":
            if argv and argv[-1].startswith("--"):
                argv.pop()
            continue
        argv.append(token)
    if len(argv) > 1 and argv[0] in FAMILIES and takes_value(argv[0], argv[-1]):
        argv.pop()
    return [argv]


def test_every_documented_bench_command_parses(monkeypatch):
    commands = documented_bench_commands()
    assert len(commands) >= 30 and any(f == "gpu_job.sh" for f, _ in commands), commands
    seen = []
    monkeypatch.setattr(cli, "cmd_bench", lambda args: seen.append(args) or 0)
    for where, command in commands:
        for argv in expand(command):
            if "--help" in argv:
                with pytest.raises(SystemExit) as e:
                    cli.main(["bench", *argv])
                assert e.value.code == 0, (where, command, argv)
            else:
                assert cli.main(["bench", *argv]) == 0, (where, command, argv)
    assert {a.family for a in seen} == set(FAMILIES) | {None}
