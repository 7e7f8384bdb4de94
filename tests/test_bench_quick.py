"""`tilefish bench` with no family (bench/quick.py, bench/progress.py) on a machine without a GPU: the quick
plan, the progress counts and ETA, the summary screen, the results directory, Ctrl-C, --full. The families'
bench functions are replaced by fakes that report synthetic rows through Report.add, as the real ones do."""
from __future__ import annotations

import datetime
import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tilefish import cli
from tilefish.bench import e2e as bench_e2e
from tilefish.bench import e2e_generate as bench_e2e_generate
from tilefish.bench import hgemm as bench_hgemm
from tilefish.bench import moe as bench_moe
from tilefish.bench import nf4 as bench_nf4
from tilefish.bench import progress, quick
from tilefish.bench import sgemm as bench_sgemm
from tilefish.bench import w4a16 as bench_w4a16
from tilefish.bench.families import FAMILIES as BENCH_FAMILIES
from tilefish.bench.report import Report, Row

FAMILIES = {"w4a16", "nf4", "sgemm", "hgemm", "e2e", "moe"}
H100 = types.SimpleNamespace(index=0, name="NVIDIA H100 80GB HBM3", sm_count=132, cc=90, arch="sm_90", major=9,
                             minor=0, smem_per_block_optin=232448)


def parse(*argv):
    """The namespace `tilefish bench <argv>` hands to its command (which does not run)."""
    seen, saved = [], cli.cmd_bench
    cli.cmd_bench = lambda args: seen.append(args) or 0
    try:
        assert cli.main(["bench", *argv]) == 0
    finally:
        cli.cmd_bench = saved
    return seen[0]


# ---- the plan -------------------------------------------------------------------------------------------------

def test_quick_plan_is_small_covers_every_family_and_fits_two_minutes():
    steps = quick.quick_plan(parse())
    cases = [c for s in steps for c in s.cases]
    assert {s.family for s in steps} == FAMILIES
    assert all(s.cases for s in steps) and 20 <= len(cases) <= 60
    # the estimate the ETA starts from: measurements (the e2e step's two generate() compiles the largest part, the
    # MoE step's layer builds next), plus compiling ~40 kernels on 16 cores, inside 2 minutes with room for the
    # process start and the writing (the estimates run high: 58 s measured on an H100 for 104 s estimated before
    # the MoE step)
    assert sum(c.weight for c in cases) + progress.compile_s(40, 16) < 125
    full = quick.full_plan(parse("--full"))
    by_family = lambda plan: {f: sum(len(s.cases) for s in plan if s.family == f) for f in FAMILIES}  # noqa: E731
    assert all(by_family(full)[f] >= by_family(steps)[f] for f in FAMILIES)
    assert sum(by_family(full).values()) > 5 * len(cases)


def test_every_family_is_one_object_with_its_own_steps():
    """bench/families: one BenchFamily each, in the run's (and the summary's) order; its quick and --full steps
    are its own, with cases; it builds them from its own flags' defaults."""
    from tilefish.bench.family import BenchFamily, defaults

    assert list(BENCH_FAMILIES) == ["w4a16", "nf4", "sgemm", "hgemm", "e2e", "moe"]
    for name, fam in BENCH_FAMILIES.items():
        assert isinstance(fam, BenchFamily) and fam.name == name and fam.title and fam.help
        args = defaults(fam, reps=7)
        assert args.family is None and args.reps == 7
        for full in (False, True):
            steps = fam.steps(args, full)
            assert steps and all(s.family == name and s.cases for s in steps), (name, full)
        assert fam.headlines(Report("empty")) == [] and fam.heading(Report("empty")) == fam.title
    assert [s.family for s in quick.quick_plan(parse())] == ["w4a16", "nf4", "nf4", "sgemm", "hgemm", "e2e", "moe"]


def test_quick_plan_kernels_are_the_dispatchers_picks(monkeypatch):
    """The kernels warmed before the run are the ones its calls launch: the dispatcher's plan per (shape, m,
    dtype), NF4 and int4 codes for the NF4 matmul, the auto steps of the GEMM ladders."""
    from tilefish.ops import w4a16 as ops

    monkeypatch.setattr(ops.launch, "device_clusters", lambda info, policy=None: ops.H200_CLUSTERS)
    steps = {s.title: s for s in quick.quick_plan(parse())}
    w4 = steps["W4A16 vs cuBLAS"].kernels(H100)
    cfg = ops.choose_config(1, 4096, 4096, 132, 90, 128, ops.H200_CLUSTERS, torch.float16)
    assert ops.kernel_spec(torch.float16, cfg, 128, False) in w4
    mm = next(s for s in steps.values() if "matmul" in s.title).kernels(H100)
    assert any(dict(s.defines).get("TF_W4A16_NF4") for s in mm) and any(not s.defines for s in mm)
    assert all(s.supports("sm_90") for st in steps.values() for s in st.kernels(H100))
    assert any("sgemm" in s.source for s in steps["SGEMM auto vs cuBLAS"].kernels(H100))


# ---- the progress tracker --------------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_tracker_eta_from_the_first_second_and_counts_to_the_total():
    clock = Clock()
    phases = [progress.Phase("compile", [progress.Case("kernels", 10.0, counted=False)]),
              progress.Phase("a", [progress.Case("a1", 5.0), progress.Case("a2", 5.0)]),
              progress.Phase("b", [progress.Case("b1", 20.0)])]
    t = progress.Tracker(phases, clock)
    assert t.total_cases == 3 and t.eta() == pytest.approx(40.0)
    t.begin_phase(0)
    clock.t = 1.0
    assert 0 < t.completed_weight() < 10 and t.eta() < 40
    t.set_inner(0.5, "5/10 kernels")
    assert t.completed_weight() == pytest.approx(5.0) and "5/10 kernels" in t.label()
    clock.t = 100.0  # far past its estimate: the bar waits short of the phase's end
    assert t.completed_weight() < 10
    t.begin_phase(1)  # the compile phase ends: its weight is done, it counts no case
    assert t.cases_done == 0 and t.done_weight == 10.0
    t.case_done()
    assert t.cases_done == 1 and t.label() == "a: a2"
    t.begin_phase(2)  # a phase that reported fewer rows than cases settles them when it ends
    assert t.cases_done == 2
    t.end_phase()
    assert t.cases_done == t.total_cases == 3 and t.eta() == 0
    # slower than estimated: the ETA of what is left grows with it
    clock.t = 0.0
    slow = progress.Tracker([progress.Phase("a", [progress.Case(str(i), 10.0) for i in range(10)])], clock)
    slow.begin_phase(0)
    for i in range(5):
        clock.t += 30.0
        slow.case_done()
    assert slow.eta() > 50 * 2


def test_display_is_plain_text_unless_a_terminal_with_rich():
    t = progress.Tracker([progress.Phase("a", [progress.Case("x", 1.0)])])
    assert isinstance(progress.make_display(t, io.StringIO()), progress.PlainDisplay)
    assert not isinstance(progress.make_display(t, io.StringIO()), progress.RichDisplay)
    pytest.importorskip("rich")
    tty = io.StringIO()
    tty.isatty = lambda: True
    assert isinstance(progress.make_display(t, tty), progress.RichDisplay)
    assert not isinstance(progress.make_display(t, tty, rich=False), progress.RichDisplay)


def test_rich_display_runs_and_reaches_the_total():
    pytest.importorskip("rich")
    t = progress.Tracker([progress.Phase("a", [progress.Case("x", 1.0), progress.Case("y", 1.0)])])
    out = io.StringIO()
    with progress.RichDisplay(t, out) as d:
        d.begin_phase(0)
        d.case_done()
        d.set_inner(0.5, "inner step")
        d.case_done()
        d.end_phase()
    assert t.cases_done == 2 and "2/2 cases" in out.getvalue()


# ---- the whole run, with the families faked --------------------------------------------------------------------

def ratio_w4a16(m, k, n, dtype):
    """Synthetic ratios to cuBLAS: 3.0 at m = 1, 2.0 at m = 16 (bf16 k4096 n4096: 1.5), 1.0 above."""
    if m == 1:
        return 3.0
    if m == 16:
        return 1.5 if (dtype, k, n) == ("bf16", 4096, 4096) else 2.0
    return 1.0


@pytest.fixture
def fake_bench(monkeypatch):
    """Every family's bench function replaced (rows through Report.add, as the real ones), the GPU-only pieces
    (device, environment, kernel lists, compiles) stubbed. Returns the calls made: [(family, kwargs)]."""
    rec = types.SimpleNamespace(calls=[], interrupt_at={}, warmed=[])
    calls = rec.calls

    def maybe_interrupt(family, rep):
        if rec.interrupt_at.get(family) == len(rep.rows):
            raise KeyboardInterrupt

    def w4a16_run(shapes, ms, groups, dtypes, reps, **kw):
        calls.append(("w4a16", dict(shapes=shapes, ms=ms, groups=groups, dtypes=dtypes, reps=reps)))
        shapes, ms = shapes or bench_w4a16.DEFAULT_KN, ms or bench_w4a16.DEFAULT_M
        rep = Report("W4A16 GEMM vs cuBLAS", {"copy GB/s": 3000.0})
        for d in dtypes:
            for k, n in shapes:
                for g in groups:
                    for m in ms:
                        maybe_interrupt("w4a16", rep)
                        rep.add(Row("w4a16", f"{d} k{k} n{n} g{g} m{m}", "tilefish", 10.0, 1000.0, "GB/s",
                                    60.0 if m == 1 else 40.0, {"cuBLAS": ratio_w4a16(m, k, n, d)},
                                    {"m": m, "k": k, "n": n, "dtype": d}))
        return rep

    def nf4_run(shapes, **kw):
        calls.append(("nf4", dict(shapes=shapes, **kw)))
        rep = Report("NF4 dequantize", {"copy GB/s": 3000.0})
        for i, (r, c) in enumerate(shapes):
            rep.add(Row("nf4", f"{r}x{c}", "tilefish", 10.0, 2700.0, "GB/s", 90.0 - i, {"bitsandbytes": 1.8 + i / 10}))
            rep.add(Row("nf4", f"{r}x{c}", "bitsandbytes", 18.0, 1500.0, "GB/s", 50.0, {}))
        return rep

    def nf4_run_matmul(shapes, ms, dtypes, **kw):
        calls.append(("nf4_matmul", dict(shapes=shapes, ms=ms, dtypes=dtypes, **kw)))
        rep = bench_nf4.NF4Report("NF4 fused matmul", {"copy GB/s": 3000.0})
        with progress.InnerProgress(len(shapes) * len(ms)) as p:  # the real one draws its progress this way
            for d in dtypes:
                for k, n in shapes:
                    for m in ms:
                        p.step(f"{d} k{k} n{n} m{m}")
                        maybe_interrupt("nf4_matmul", rep)
                        times = {"tilefish": 10.0, "cuBLAS": 25.0 if m <= 16 else 11.0, "bitsandbytes": 20.0,
                                 "W4A16 g64": 9.0}
                        errs = {"tilefish": 1e-3, "cuBLAS": None, "bitsandbytes": 1e-3, "W4A16 g64": 1e-3}
                        rep.add(bench_nf4.matmul_row(d, k, n, m, times, errs, label="skinny", weight_bytes=k * n // 2,
                                                     copy_gbps=3000.0, peak_tflops=700.0, group=64, blocksize=64,
                                                     double_quant=True))
        return rep

    def gemm(family):
        def fake(shapes, *a, **kw):
            calls.append((family, dict(shapes=shapes)))
            rep = Report(f"{family} auto vs cuBLAS")
            for i, s in enumerate(shapes):
                case = f"{s}^3" if family == "sgemm" else f"{s[2]}{'x'.join(map(str, s[0]))}"
                rep.add(Row(family, case, "cuBLAS", 100.0, 50.0, "TFLOP/s", 100.0, {}))
                rep.add(Row(family, case, "tilefish auto", 100.0, 45.0, "TFLOP/s", 90.0, {"cuBLAS": 0.9 + i / 20}))
            return rep
        return fake

    def e2e_run(layers, batches, prefill, modes, impls, **kw):
        calls.append(("e2e", dict(layers=layers, batches=batches, prefill=prefill, modes=modes, impls=impls)))
        rep = Report("End-to-end decoder")
        with progress.InnerProgress(3) as p:
            for label in ("fp16: build", "fp16 compiled decode 1", "w4a16: build"):
                p.step(label)
        print("w4a16 (...): logits vs fp16 ...")  # e2e prints its checks: they go to log.txt, not the screen
        for b in batches:
            rep.add(Row("e2e", f"compiled decode b{b} ctx512", "fp16", 2000.0, 500.0, "tok/s", None, {}))
            rep.add(Row("e2e", f"compiled decode b{b} ctx512", "tilefish w4a16", 1100.0, 900.0, "tok/s", None,
                        {"fp16": 1.8}))
        return rep

    def generate_run(layers, batches, impls, new_tokens, report, **kw):
        calls.append(("e2e-generate", dict(layers=layers, batches=batches, impls=impls, new_tokens=new_tokens)))
        for b in batches:
            report.add(Row("e2e", f"generate decode b{b}", "fp16", 2500.0, 400.0, "tok/s", None, {}))
            report.add(Row("e2e", f"generate decode b{b}", "tilefish w4a16", 1400.0, 700.0, "tok/s", None,
                           {"fp16": 1.7}))
        return report

    def moe_run(models, tokens, impls, graphs=False, reps=50, title_note="", **kw):
        calls.append(("moe", dict(models=[m.name for m in models], tokens=tokens, impls=impls)))
        rep = Report("MoE layer", {"copy GB/s": 3000.0})
        for m in models:
            for t in tokens:
                maybe_interrupt("moe", rep)
                case, extra = f"{m.name} t{t}", {"model": m.name, "tokens": t}
                for impl in impls:
                    ours = impl in ("int4", "nf4", "mxfp4")
                    rep.add(Row("moe", case, m.label(impl), 10.0 if ours else 30.0, 900.0, "GB/s", 30.0,
                                {"best bf16": 3.0, "grouped_mm": 4.0} if ours else {}, dict(extra)))
                rep.add(Row("moe", case, "byte floor (int4 g128 bytes at the copy rate)", 3.0, 3000.0, "GB/s", 100.0,
                            {}, dict(extra)))
        return rep

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("tilefish.bench.report.environment", lambda: {"gpu": H100.name, "commit": "test"})
    monkeypatch.setattr("tilefish.runtime.device_info", lambda *a: H100)
    monkeypatch.setattr(bench_w4a16, "run", w4a16_run)
    monkeypatch.setattr(bench_nf4, "run", nf4_run)
    monkeypatch.setattr(bench_nf4, "run_matmul", nf4_run_matmul)
    monkeypatch.setattr(bench_sgemm, "run_auto", gemm("sgemm"))
    monkeypatch.setattr(bench_hgemm, "run_auto", gemm("hgemm"))
    monkeypatch.setattr(bench_e2e, "run", e2e_run)
    monkeypatch.setattr(bench_e2e_generate, "run", generate_run)
    monkeypatch.setattr(bench_moe, "run", moe_run)
    monkeypatch.setattr(bench_moe, "kernel_specs", lambda info, models, tokens, impls:
                        [("moe", m.name, t, i) for m in models for t in tokens for i in impls])
    # the kernels: a fake list, "compiled" by a fake warm-up that reports each one
    monkeypatch.setattr(bench_w4a16, "dispatched_kernels", lambda info, shapes, ms, dtypes, group, codebooks=("int4",):
                        [("w4a16", d, k, n, m, cb) for d in dtypes for k, n in shapes for m in ms for cb in codebooks])
    monkeypatch.setattr(bench_sgemm, "kernel_specs", lambda info, shapes, steps=("auto",):
                        [("sgemm", s) for s in shapes])
    monkeypatch.setattr(bench_hgemm, "kernel_specs", lambda info, shapes, steps=("auto",), dtype="fp16":
                        [("hgemm", s) for s in shapes])
    monkeypatch.setattr(progress, "uncached", lambda specs, arch: list(dict.fromkeys(specs)))

    def warm(specs, arch, on_done=None, processes=None):
        todo = list(dict.fromkeys(specs))
        for i in range(len(todo)):
            on_done(i + 1, len(todo))
        rec.warmed.append(todo)
        return f"kernel cache warmed before timing: {len(todo)} kernels (fake)"

    monkeypatch.setattr(quick, "warm_kernels", warm)
    return rec


def test_quick_run_end_to_end(fake_bench, tmp_path, capsys):
    out = tmp_path / "res"
    assert cli.main(["bench", "--out", str(out)]) == 0
    screen, err = capsys.readouterr()
    fams = [c[0] for c in fake_bench.calls]
    assert fams == ["w4a16", "nf4", "nf4_matmul", "sgemm", "hgemm", "e2e", "e2e-generate", "moe"]
    assert fake_bench.warmed and len(fake_bench.warmed[0]) > 10  # every step's kernels, once, before timing
    # progress: one line per case on stderr (not a terminal), counting across families up to the total
    total = sum(len(s.cases) for s in quick.quick_plan(parse()))
    assert f"{total}/{total} cases" in err and f"1/{total} cases" in err
    assert "w4a16 (...): logits" not in screen and "w4a16 (...): logits" in (out / "log.txt").read_text()
    # the summary screen: per family its headlines
    assert "tilefish bench (quick run) on NVIDIA H100 80GB HBM3" in screen and f"{total} of {total} cases" in screen
    line = next(ln for ln in screen.splitlines() if "vs cuBLAS, m<=16" in ln)
    # m <= 16 over 2 dtypes x 3 shapes x (3.0 at m=1, 2.0 at m=16 but one 1.5): median 2.5, worst 1.5 on its case
    assert "median   2.50x" in line and "worst   1.50x  bf16 k4096 n4096 g128 m16" in line and "(12 cases)" in line
    assert "vs cuBLAS, m>=256" in screen and "of copy bandwidth (3,000 GB/s), m<=16" in screen
    deq = next(ln for ln in screen.splitlines() if "dequantize, of copy bandwidth (3,000 GB/s)" in ln)
    assert "worst     89%  16384x16384  (2 cases)" in deq
    assert "median   2.00x" in next(ln for ln in screen.splitlines() if "matmul vs bitsandbytes, m<=16" in ln)
    assert "matmul vs W4A16 (int4, same group), m>=256" in screen
    assert "auto (best ladder step) vs cuBLAS" in screen and "auto vs cuBLAS, LLM projections" in screen
    assert "tilefish w4a16 vs fp16, compiled decode b1" in screen and "1.80x  900 tok/s" in screen
    assert "tilefish w4a16 vs fp16, generate decode b1" in screen and "1.70x  700 tok/s" in screen  # the user's loop
    assert "1 token, of copy bandwidth (3,000 GB/s)" in screen and "1 token, vs best bf16" in screen  # MoE
    assert "checks: no failed output check" in screen and "INTERRUPTED" not in screen
    # the results: a JSON per family, summary.json with the headlines, tables.txt
    for fam in FAMILIES:
        rec = json.loads((out / f"{fam}.json").read_text())
        assert rec["rows"] and rec["environment"]["commit"] == "test"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["mode"] == "quick" and not summary["run"]["interrupted"]
    assert summary["run"]["cases_done"] == summary["run"]["cases_total"] == total
    assert {r["family"] for r in summary["rows"]} >= {"w4a16", "nf4", bench_nf4.MATMUL_FAMILY, "sgemm", "hgemm"}
    assert set(summary["headlines"]) == FAMILIES and len(Report.from_json(out / "summary.json").rows) > 0
    assert "== NF4: dequantization and fused matmul ==" in (out / "tables.txt").read_text()
    assert f"results: {out}/" in screen
    assert progress.InnerProgress.display is None  # e2e's own progress draws itself again after the run


def test_ctrl_c_writes_what_was_measured_and_returns_130(fake_bench, tmp_path, capsys):
    fake_bench.interrupt_at["nf4_matmul"] = 4  # in the NF4 matmul, after 4 of its 9 rows
    out = tmp_path / "res"
    assert cli.main(["bench", "--out", str(out)]) == 130
    screen = capsys.readouterr().out
    assert [c[0] for c in fake_bench.calls] == ["w4a16", "nf4", "nf4_matmul"]
    assert len(json.loads((out / "w4a16.json").read_text())["rows"]) == 24
    nf4_rows = json.loads((out / "nf4.json").read_text())["rows"]
    assert sum(r["family"] == bench_nf4.MATMUL_FAMILY for r in nf4_rows) == 4
    assert sum(r["family"] == "nf4" for r in nf4_rows) == 4  # the dequantization, finished before
    assert not (out / "sgemm.json").exists() and not (out / "e2e.json").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["interrupted"] and summary["run"]["cases_done"] == 24 + 2 + 4
    assert "INTERRUPTED" in screen and "interrupted (Ctrl-C)" in screen and "not run: sgemm, hgemm, e2e, moe" in screen
    assert "vs cuBLAS, m<=16" in screen and "matmul vs cuBLAS, m<=16" in screen


def test_ctrl_c_in_the_first_family(fake_bench, tmp_path, capsys):
    fake_bench.interrupt_at["w4a16"] = 5
    assert cli.main(["bench", "--out", str(tmp_path)]) == 130
    rows = json.loads((tmp_path / "w4a16.json").read_text())["rows"]
    assert len(rows) == 5 and "interrupted" in json.loads((tmp_path / "w4a16.json").read_text())["notes"][-1]
    assert "INTERRUPTED" in capsys.readouterr().out


def test_default_directory_is_per_gpu_and_date(fake_bench, tmp_path, monkeypatch, capsys):
    assert quick.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert quick.gpu_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert quick.default_out_dir("NVIDIA H200", datetime.date(2026, 11, 27)) == \
        Path("tilefish-results/h200-2026-11-27")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench"]) == 0
    where = tmp_path / "tilefish-results" / f"h100-80gb-hbm3-{datetime.date.today().isoformat()}"
    assert (where / "summary.json").exists() and (where / "w4a16.json").exists()
    assert "results: tilefish-results/h100-80gb-hbm3-" in capsys.readouterr().out


def test_full_runs_every_familys_complete_suite(fake_bench, tmp_path, monkeypatch, capsys):
    seen = []

    def family(name):
        def run(args):
            seen.append((name, args.family))
            rep = Report(name)
            rep.add(Row(name, "case", "tilefish", 1.0, 1.0, "GB/s", None, {"cuBLAS": 1.0}, {"m": 1}))
            return rep
        return run

    for name, fam in BENCH_FAMILIES.items():
        monkeypatch.setattr(fam, "run", family(name))
    assert cli.main(["bench", "--full", "--out", str(tmp_path)]) == 0
    assert sorted(seen) == sorted((name, None) for name in BENCH_FAMILIES)  # each once, as the all-families run
    assert not fake_bench.calls  # none of the quick plan's calls
    assert "tilefish bench (full run)" in capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["mode"] == "full"


@pytest.mark.parametrize("argv, says", [(["--full", "nf4"], "--full is for the all-families run"),
                                        (["--shapes", "4096x4096"], "--shapes applies to one family"),
                                        (["--m", "1,2"], "--m applies to one family"),
                                        (["--full", "--variants"], "--variants applies to one family"),
                                        (["nf4", "--full"], "unrecognized arguments: --full"),
                                        (["sgemm", "--peers", "marlin"], "unrecognized arguments: --peers marlin")])
def test_bench_flag_combinations_refused(fake_bench, capsys, argv, says):
    """Exit status 2 with the reason: from the command (--full with a family) or the parser (a family's flag
    without it, a flag the named family does not define)."""
    try:
        rc = cli.main(["bench", *argv])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and says in capsys.readouterr().err and not fake_bench.calls


def test_one_family_keeps_its_behaviour_and_takes_out(fake_bench, tmp_path, capsys):
    assert cli.main(["bench", "w4a16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== W4A16 GEMM vs cuBLAS ==" in out and "Against the targets" in out
    assert len(json.loads((tmp_path / "w4a16.json").read_text())["rows"]) == 8 * 11 * 2 * 2
    assert list(fake_bench.calls[0][1]["groups"]) == [128, -1]


def test_headlines_skip_failed_checks_and_report_them():
    rows = [bench_nf4.matmul_row("bf16", 4096, 4096, m, {"tilefish": 10.0, "cuBLAS": 30.0}, errs,
                                 label="x", weight_bytes=1, copy_gbps=3000.0, peak_tflops=700.0, group=64,
                                 blocksize=64, double_quant=True)
            for m, errs in ((1, {"tilefish": 1e-3}), (16, {"tilefish": 0.5}))]
    rep = Report("nf4")
    rep.rows = rows
    heads = quick.family_headlines("nf4", rep)
    line = next(h for h in heads if h["label"] == "matmul vs cuBLAS, m<=16")
    assert line["n"] == 1 and line["median"] == pytest.approx(3.0)
    assert quick.problems({"nf4": rep}) == ["nf4: bf16 k4096 n4096 m16 tilefish [x] CHECK FAILED"]


def test_bench_without_gpu_says_so_for_the_all_families_run():
    if torch.cuda.is_available():
        return
    r = subprocess.run([sys.executable, "-m", "tilefish.cli", "bench"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "GPU" in r.stderr


def test_a_failing_family_costs_neither_the_others_nor_its_rows(fake_bench, tmp_path, monkeypatch, capsys):
    def broken(sizes, reps=50):
        rep = Report("sgemm")
        rep.add(Row("sgemm", "1024^3", "tilefish auto", 1.0, 1.0, "TFLOP/s", 90.0, {"cuBLAS": 0.9}))
        raise RuntimeError("no kernel image\nsecond line")

    monkeypatch.setattr(bench_sgemm, "run_auto", broken)
    assert cli.main(["bench", "--out", str(tmp_path)]) == 1
    screen = capsys.readouterr().out
    assert [c[0] for c in fake_bench.calls][-4:] == ["hgemm", "e2e", "e2e-generate", "moe"]  # the families after it
    assert "SGEMM auto vs cuBLAS FAILED (RuntimeError: no kernel image)" in screen
    assert len(json.loads((tmp_path / "sgemm.json").read_text())["rows"]) == 1
    assert "RuntimeError: no kernel image" in (tmp_path / "log.txt").read_text()
