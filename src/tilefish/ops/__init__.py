"""One module per op family: validate -> pick a configuration -> get the kernel -> launch."""
from __future__ import annotations


def kernel_specs(include_variants: bool = False):
    """Every kernel variant the library can dispatch, as (family, KernelSpec) pairs.

    include_variants adds the benchmark-only design-space variants (tilefish bench --variants).
    """
    from . import nf4, w4a16

    specs = [("nf4", s) for s in nf4.dispatch_specs()]
    specs += [("w4a16", s) for s in w4a16.dispatch_specs()]
    if include_variants:
        import torch

        specs += [("nf4", nf4.kernel_spec(torch.bfloat16, True, c)) for c in nf4.variant_configs()]
    seen, out = set(), []
    for fam, s in specs:
        if s not in seen:
            seen.add(s)
            out.append((fam, s))
    return out
