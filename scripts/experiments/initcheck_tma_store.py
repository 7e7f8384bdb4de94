"""Why initcheck reports HGEMM step 07's TMA-store outputs, checked: one config, one shape (m 261, n 264,
k 200), three runs, each its own process under compute-sanitizer initcheck:

  for v in tma direct prefilled; do PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck \
      python scripts/experiments/initcheck_tma_store.py $v; done

  tma         TMA_STORE=1, output torch.empty (fresh cudaMalloc): expected to be reported on the copy back
  direct      the same config with TMA_STORE=0: expected clean
  prefilled   TMA_STORE=1, output NaN-filled first: expected clean, and every NaN overwritten
Each run prints its relative error to the float64 reference and whether any NaN is left. Same error, no NaN,
and only `tma` reported: initcheck does not track TMA stores (UTMASTG), the kernel writes every element.
scripts/sanitize_all.py relies on this (it NaN-fills those outputs under initcheck)."""
import sys
from pathlib import Path

import torch

try:
    from tilefish.ops import hgemm
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "src"))
    from tilefish.ops import hgemm

VARIANTS = ("tma", "direct", "prefilled")


def main(variant: str) -> None:
    if variant not in VARIANTS:
        raise SystemExit(f"variant must be one of {VARIANTS}, got {variant!r}")
    cfg = hgemm.TUNED_SMALL["07_wgmma_tma"]
    if variant == "direct":
        cfg = hgemm._direct_store(cfg)
    g = torch.Generator().manual_seed(7)
    m, n, k = 261, 264, 200
    x = torch.randn(m, k, generator=g).half()
    y = torch.randn(n, k, generator=g).half()
    ref = x.double() @ y.double().t()
    if variant == "prefilled":
        out = torch.full((m, n), float("nan"), dtype=torch.half, device="cuda")
    else:
        out = torch.empty(m, n, dtype=torch.half, device="cuda")
    hgemm.launch_config(cfg, x.cuda(), y.cuda(), out, True)
    o = out.cpu().double()
    print(variant, cfg, "rel_err", ((o - ref).norm() / ref.norm()).item(), "nan_left", bool(torch.isnan(o).any()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
