"""The read floor of the W4A16 benchmark shapes in the bench harness (H200): an empty kernel, and a
device-to-device copy / torch.sum of as many bytes as each shape's packed int4 weight (docs/w4a16.md,
"What bounds m <= 16 on small weights"). Usage: python scripts/bench_read_floor.py"""
import torch
from tilefish.bench.timing import time_cuda
SH=[(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (8192, 10240), (8192, 8192), (8192, 57344), (28672, 8192)]
e = torch.empty(1, device="cuda")
print("empty kernel", round(time_cuda(lambda: e.add_(0), reps=100).median_us, 2))
for k, n in SH:
    b = n * k // 2
    src = torch.randint(0, 100, (b // 4,), device="cuda", dtype=torch.int32); dst = torch.empty_like(src)
    tc = time_cuda(lambda: dst.copy_(src), reps=50).median_us
    ts = time_cuda(lambda: src.sum(), reps=50).median_us
    print(f"k{k} n{n} {b/1e6:.1f} MB copy {tc:.1f} us  sum {ts:.1f} us")
