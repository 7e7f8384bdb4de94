"""A pytest plugin (and a precompile step) for running the GPU tests on an experiment build of the skinny kernel:
every skinny kernel loaded gets the -D switches of env SKINNY_DEFINES (a comma list), e.g.

    SKINNY_DEFINES=TF_SK_PEEK python -m pytest -p skinny_define_plugin tests/test_w4a16_gpu.py   # PYTHONPATH=scripts/experiments
    SKINNY_DEFINES=TF_SK_PEEK python scripts/experiments/skinny_define_plugin.py sm_90           # fill the kernel cache
"""
from __future__ import annotations

import dataclasses
import os
import sys

import tilefish.ops.w4a16.launch as w4a16_launch
from tilefish.ops.w4a16.configs import SKINNY_SOURCE

DEFINES = tuple((d, "1") for d in os.environ.get("SKINNY_DEFINES", "").split(",") if d)


def with_defines(spec):
    return dataclasses.replace(spec, defines=spec.defines + DEFINES) if spec.source == SKINNY_SOURCE else spec


_get = w4a16_launch.get_kernel
w4a16_launch.get_kernel = lambda spec, device=None: _get(with_defines(spec), device)
w4a16_launch._kernels.clear()


if __name__ == "__main__":
    from tilefish.ops import kernel_specs
    from tilefish.runtime import compile_many

    arch = sys.argv[1]
    specs = [with_defines(s) for _, s in kernel_specs(arch=arch) if s.source == SKINNY_SOURCE and s.supports(arch)]
    results = compile_many([(s, arch) for s in specs], int(os.environ.get("JOBS", "2")))
    bad = [(s.name, r) for s, (r, _) in zip(specs, results) if r is None or r.spills]
    print(f"{len(specs)} skinny kernels with {DEFINES}: {len(bad)} failed or spilled", bad[:5])
    sys.exit(1 if bad else 0)
