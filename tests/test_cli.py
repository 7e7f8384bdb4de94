"""The command line on a machine without a GPU."""
from __future__ import annotations

import subprocess
import sys

import torch


def run(*args):
    return subprocess.run([sys.executable, "-m", "tilefish.cli", *args], capture_output=True, text=True, timeout=600)


def test_info_runs_without_gpu():
    r = run("info")
    assert r.returncode == 0, r.stderr
    assert "NVRTC" in r.stdout and "kernel cache" in r.stdout


def test_compile_prints_resources(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tilefish.cli", "compile", "--arch", "sm_90"], capture_output=True,
                       text=True, timeout=600, env={**__import__("os").environ, "TILEFISH_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nf4_dequantize" in r.stdout and " 0 failure(s)" in r.stdout


def test_bench_without_gpu_says_so():
    if torch.cuda.is_available():
        return
    r = run("bench", "nf4")
    assert r.returncode == 2 and "GPU" in r.stderr


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
    monkeypatch.setattr(tilefish.ops, "kernel_specs", lambda include_variants=False: [("nf4", hot), ("nf4", cold)])
    monkeypatch.setattr(tilefish.runtime, "compile_kernel",
                        lambda spec, arch, use_cache=None: CompiledKernel(spec, arch, b"", spec.name, "", Resources()))
    rc = cli.cmd_compile(argparse.Namespace(arch=["sm_90"], all=False, jobs=1))
    out = capsys.readouterr().out
    assert rc == 1 and "1 failure(s)" in out and "NO PTXAS REPORT" in out
