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
