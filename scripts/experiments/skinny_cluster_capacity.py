"""How many clusters of S CTAs of a skinny kernel this GPU holds at once (the driver's occupancy answer), S = 1..16:
the cluster split ("/x<S>" plans) launches tiles x S CTAs and needs every cluster resident at once.

    python scripts/experiments/skinny_cluster_capacity.py [label ...]
"""
import sys

import torch

from tilefish.ops.w4a16 import configs
from tilefish.runtime import get_kernel

for label in sys.argv[1:] or ["skinny-m8n256w1s3x2", "skinny-m8n128w2s6x2", "skinny-m8n64w4s12x2"]:
    cfg, _ = configs.parse_plan(label)
    kern = get_kernel(configs.kernel_spec(torch.float16, cfg, 128, False), 0)
    smem = cfg.smem_bytes(128, False)
    caps = [(c, kern.max_active_clusters(c, cfg.threads, smem)) for c in range(1, 17)]
    print(f"{torch.cuda.get_device_name()} {label} ({smem} B dynamic smem): "
          + ", ".join(f"{c}: {n} ({c * n} CTAs)" for c, n in caps))
