"""Launch HGEMM step 07 (TUNED) and cuBLAS (torch.matmul) once each at 4096^3 and 8192^3 (fp16)
inside a profiler range, for scripts/experiments/ncu_hgemm7_vs_cublas.sh."""
import torch
from tilefish.ops import hgemm as ops
cases = []
for n in (4096, 8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.float16); b = torch.randn(n, n, device="cuda", dtype=torch.float16)
    cases.append((a, b))
    ops.hgemm(a, b, kernel="07_wgmma_tma"); torch.matmul(a, b)
torch.cuda.synchronize()
torch.cuda.profiler.start()
for a, b in cases:
    ops.hgemm(a, b, kernel="07_wgmma_tma"); torch.matmul(a, b)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
