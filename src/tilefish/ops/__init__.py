"""One module per op family: validate -> pick a configuration -> get the kernel -> launch."""
from __future__ import annotations


def kernel_specs(include_variants: bool = False, arch: str | None = None):
    """Every kernel variant the library can dispatch, as (family, KernelSpec) pairs.

    include_variants adds the benchmark-only design-space variants (tilefish bench --variants).
    arch ("sm_86"): only the variants the dispatchers can launch on a GPU of that arch (None: every arch).
    """
    import importlib
    import inspect

    nf4 = importlib.import_module(".nf4", __name__)
    w4a16 = importlib.import_module(".w4a16", __name__)
    sgemm = importlib.import_module(".sgemm", __name__)
    hgemm = importlib.import_module(".hgemm", __name__)
    moe = importlib.import_module(".moe_kernels", __name__)
    norm = importlib.import_module(".norm", __name__)
    rope = importlib.import_module(".rope_cache", __name__)
    rope_attention = importlib.import_module(".rope_attention", __name__)

    # W4A16's dispatch_specs may not take arch: then its specs are filtered by supports(arch) below
    w4_arch = {"arch": arch} if "arch" in inspect.signature(w4a16.dispatch_specs).parameters else {}
    specs = [("nf4", s) for s in nf4.dispatch_specs(arch=arch)]
    specs += [("w4a16", s) for s in w4a16.dispatch_specs(**w4_arch)]
    specs += [("sgemm", s) for s in sgemm.dispatch_specs(arch=arch)]
    specs += [("hgemm", s) for s in hgemm.dispatch_specs(arch=arch)]
    specs += [("moe", s) for s in moe.kernel_specs(arch=arch)]
    specs += [("norm", s) for s in norm.dispatch_specs(arch=arch)]
    specs += [("rope_cache", s) for s in rope.dispatch_specs(arch=arch)]
    specs += [("rope_attention", s) for s in rope_attention.dispatch_specs(arch=arch)]
    if include_variants:
        import torch

        specs += [("nf4", nf4.kernel_spec(torch.bfloat16, True, c)) for c in nf4.variant_configs()]
        specs += [("w4a16", s) for s in w4a16.variant_specs()]
        specs += [("sgemm", s) for s in sgemm.variant_specs()]
        specs += [("hgemm", s) for s in hgemm.variant_specs()]
    seen, out = set(), []
    for fam, s in specs:
        if s not in seen and (arch is None or s.supports(arch)):
            seen.add(s)
            out.append((fam, s))
    return out
