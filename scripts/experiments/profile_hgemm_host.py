"""Host cost of one step-07 hgemm call, piece by piece (microseconds per call, 64^3 fp16)."""
import time

import torch

from tilefish.ops import hgemm as ops
from tilefish.runtime import get_kernel, launch, i32, tensor_map_2d
from tilefish.runtime.device import device_info

a = torch.randn(64, 64, device="cuda", dtype=torch.float16)
b = torch.randn(64, 64, device="cuda", dtype=torch.float16)
c = torch.empty(64, 64, device="cuda", dtype=torch.float16)
cfg = ops.select(64, 64, "auto", 132, 90)
ops.hgemm(a, b)
torch.cuda.synchronize()
kern = get_kernel(cfg.spec(a.dtype, False), a.device)
ma, mb, mc = tensor_map_2d(a, cfg.BM, 64), tensor_map_2d(b, 64, 64), tensor_map_2d(c, 64, 64)
fit = kern.max_active_clusters(cfg.CLUSTER, cfg.threads, cfg.dynamic_smem)


def t(name, fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:40s} {dt:7.2f} us")


t("hgemm (auto, step 07)", lambda: ops.hgemm(a, b))
t("hgemm step 06", lambda: ops.hgemm(a, b, kernel="06_rasterized"))
t("device_info", lambda: device_info(0))
t("select", lambda: ops.select(64, 64, "auto", 132, 90))
t("get_kernel", lambda: get_kernel(cfg.spec(a.dtype, False), a.device))
t("tensor_map_2d x3", lambda: (tensor_map_2d(a, cfg.BM, 64), tensor_map_2d(b, 64, 64), tensor_map_2d(c, 64, 64)))
t("max_active_clusters", lambda: kern.max_active_clusters(cfg.CLUSTER, cfg.threads, cfg.dynamic_smem))
t("launch (maps as args)", lambda: launch(kern, cfg.grid(64, 64, 132, fit), cfg.threads, ma, mb, mc, c.data_ptr(),
                                        i32(64), i32(64), i32(64), smem=cfg.dynamic_smem, cluster=cfg.CLUSTER))
t("torch.empty", lambda: torch.empty(64, 64, dtype=a.dtype, device=a.device))
t("torch.matmul", lambda: torch.matmul(a, b, out=c))
