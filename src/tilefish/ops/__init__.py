"""One module per op family: validate -> pick a configuration -> get the kernel -> launch."""
from __future__ import annotations


def kernel_specs(include_variants: bool = False):
    """Every kernel variant the library can dispatch, as (family, KernelSpec) pairs.

    include_variants adds the benchmark-only design-space variants (tilefish bench --variants).
    """
    import importlib

    nf4 = importlib.import_module(".nf4", __name__)
    w4a16 = importlib.import_module(".w4a16", __name__)
    sgemm = importlib.import_module(".sgemm", __name__)
    hgemm = importlib.import_module(".hgemm", __name__)

    specs = [("nf4", s) for s in nf4.dispatch_specs()]
    specs += [("w4a16", s) for s in w4a16.dispatch_specs()]
    specs += [("sgemm", s) for s in sgemm.dispatch_specs()]
    specs += [("hgemm", s) for s in hgemm.dispatch_specs()]
    if include_variants:
        import torch

        specs += [("nf4", nf4.kernel_spec(torch.bfloat16, True, c)) for c in nf4.variant_configs()]
        specs += [("w4a16", s) for s in w4a16.variant_specs()]
        specs += [("sgemm", s) for s in sgemm.variant_specs()]
        specs += [("hgemm", s) for s in hgemm.variant_specs()]
    seen, out = set(), []
    for fam, s in specs:
        if s not in seen:
            seen.add(s)
            out.append((fam, s))
    return out
