"""Experiment builds of tilefish's kernels: an experiment's -D switches (each on the kernel source its prefix names,
DEFINE_SOURCES; DEFINE or NAME=VALUE) for every kernel loaded from then on. Used by chain_plans.py, as a pytest
plugin (the GPU tests on an experiment build) and to fill the kernel cache with those builds:

    KERNEL_DEFINES=TF_SK_PEEK PYTHONPATH=scripts/experiments python -m pytest -p kernel_defines tests/test_w4a16_gpu.py
    KERNEL_DEFINES=TF_SK_PEEK python scripts/experiments/kernel_defines.py sm_90      # compile them into the cache
"""
from __future__ import annotations

import dataclasses
import os
import sys

import tilefish.ops.rope_attention as rope_attention_ops
import tilefish.ops.w4a16.launch as w4a16_launch

# An experiment define's prefix -> the kernel source it belongs to.
DEFINE_SOURCES = {"TF_RA_": "attention/rope_attention.cu", "TF_SK_": "w4a16/skinny.cu"}
_get_kernel = {mod: mod.get_kernel for mod in (rope_attention_ops, w4a16_launch)}


def with_defines(spec, defines: tuple[str, ...]):
    """spec with those of `defines` that belong to its source."""
    extra = tuple(tuple(d.split("=", 1)) if "=" in d else (d, "1") for d in defines
                  if any(d.startswith(p) and spec.source == src for p, src in DEFINE_SOURCES.items()))
    return dataclasses.replace(spec, defines=spec.defines + extra) if extra else spec


def use_defines(defines: tuple[str, ...]) -> None:
    """Kernels loaded from now on get `defines` (each on the source its prefix names); () undoes it."""
    w4a16_launch._kernels.clear()
    for mod, get in _get_kernel.items():
        mod.get_kernel = lambda spec, device=None, _get=get: _get(with_defines(spec, defines), device)


ENV_DEFINES = tuple(d for d in os.environ.get("KERNEL_DEFINES", "").split(",") if d)
if ENV_DEFINES:
    use_defines(ENV_DEFINES)


if __name__ == "__main__":
    from tilefish.ops import kernel_specs
    from tilefish.runtime import compile_many

    arch = sys.argv[1]
    sources = {src for p, src in DEFINE_SOURCES.items() if any(d.startswith(p) for d in ENV_DEFINES)}
    specs = [with_defines(s, ENV_DEFINES) for _, s in kernel_specs(arch=arch) if s.source in sources and s.supports(arch)]
    results = compile_many([(s, arch) for s in specs], int(os.environ.get("JOBS", "2")))
    bad = [(s.name, r) for s, (r, _) in zip(specs, results) if r is None or r.spills]
    print(f"{len(specs)} kernels with {ENV_DEFINES}: {len(bad)} failed or spilled", bad[:5])
    sys.exit(1 if bad else 0)
