"""Which W4A16 plan is fastest for each decode GEMM *in the model's chain* (programmatic launch from the kernel
ahead, a cuDNN kernel ahead of o), against the dispatcher's pick, which was fitted on kernels timed alone.

Each variant forces one plan for one of a layer's four GEMMs at m = 1 through a tuned table (TILEFISH_TUNED=<file>,
ops/w4a16/tuned.py) and captures the e2e bench's decode step (scripts/profile_e2e.py's captured_step, 8 layers by
default); all variants' graphs are then replayed in alternating rounds in this one process.

    python scripts/experiments/chain_plans.py [layers] [batch] [rounds]     (env CONTEXT: cache positions, default 512)
Env VARIANTS: a comma list of name=ENTRY|ENTRY|... (default below; "default" is the dispatcher's own choice),
an ENTRY being @field=0|1 (a LaunchPolicy switch captured under, e.g. @wide_clusters=0),
+module:function (function(model) called on the converted model before the capture: an experiment's forward, e.g.
+norm_fold:install, from docs/attempts/norm_fold.patch),
KxN:plan (that weight's plan at this batch) or KxN:plan:DEFINE+DEFINE or ::DEFINE+DEFINE: kernels
built with those defines (DEFINE or NAME=VALUE) (an experiment's -D switch in a kernel source, each added to the source its prefix
names: kernel_defines.DEFINE_SOURCES). E.g. the o projection on the skinny kernel, and that plus a rope_attention build
with an experiment switch:
    VARIANTS='o-skinny=4096x4096:skinny-m8n256w1s3x2,o-skinny-x=4096x4096:skinny-m8n256w1s3x2:TF_RA_SWITCH' ...
"""
from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from tilefish.bench import e2e
from tilefish.models.llama import LlamaConfig
from tilefish.ops.w4a16 import LaunchPolicy, launch_policy, tuned
from tilefish.runtime import device_info

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import profile_e2e  # noqa: E402
from kernel_defines import use_defines  # noqa: E402

DEFAULT = ("o-skinny=4096x4096:skinny-m8n256w1s3x2,o-skinny8x1=4096x4096:skinny-m8n256w2s8x1,"
           "qkv-skinny8x1=4096x6144:skinny-m8n256w2s8x1,gate_up-skinny8x1=4096x28672:skinny-m8n256w2s8x1,"
           "down-skinny8x1=14336x4096:skinny-m8n256w2s8x1,down-skinny-n128=14336x4096:skinny-m8n128w2s6x2")


def table_file(key: str, plans: list[tuple[int, int, str]], m: int, folder: str) -> str:
    entries = [{"dtype": dt, "scales": "grouped", "codebook": "int4", "k": k, "n": n, "m": m, "plan": plan}
               for k, n, plan in plans for dt in ("fp16", "bf16")]
    path = os.path.join(folder, f"table_{len(os.listdir(folder))}.json")
    Path(path).write_text(json.dumps({"format": 1, "key": key, "entries": entries}))
    return path


def parse_variant(spec: str) -> tuple[list[tuple[int, int, str]], tuple[str, ...], dict, list[str]]:
    """ENTRY|ENTRY|... -> ([(k, n, plan), ...], defines, LaunchPolicy switches, ["module:function", ...])."""
    plans, defines, switches, hooks = [], [], {}, []
    for entry in spec.split("|"):
        if entry.startswith("+"):
            hooks.append(entry[1:])
            continue
        if entry.startswith("@"):
            field, _, value = entry[1:].partition("=")
            switches[field] = value not in ("0", "false", "False")
            continue
        shape, plan, extra = (entry.split(":") + ["", ""])[:3]
        if shape:
            k, n = map(int, shape.split("x"))
            plans.append((k, n, plan))
        defines += [d for d in extra.split("+") if d]
    return plans, tuple(defines), switches, hooks


def main():
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    context = int(os.environ.get("CONTEXT", 512))  # positions in the cache before the step
    cfg = LlamaConfig.llama3_8b(layers)
    dev = torch.device("cuda")
    info = device_info(0)
    key = tuned.gpu_key(info.name, info.sm_count)
    variants = {"default": None}
    for item in os.environ.get("VARIANTS", DEFAULT).split(","):
        name, _, spec = item.partition("=")
        variants[name] = parse_variant(spec)
    folder = tempfile.mkdtemp()
    replays = {}
    for name, v in variants.items():
        os.environ["TILEFISH_TUNED"] = "1" if v is None or not v[0] else table_file(key, v[0], batch, folder)
        use_defines(() if v is None else v[1])
        tuned.forget_tables()
        torch._dynamo.reset()
        torch.manual_seed(0)
        runner = e2e._HF(cfg, dev)
        policy = LaunchPolicy(**({} if v is None else v[2]))
        try:
            with torch.no_grad(), launch_policy(policy):
                profile_e2e.convert_variant(runner, "w4a16")
                for hook in [] if v is None else v[3]:
                    module, _, function = hook.partition(":")
                    getattr(importlib.import_module(module), function)(runner.model)
                replays[name] = (runner, profile_e2e.captured_step(runner, cfg, batch, dev, context))
        except ValueError as e:  # e.g. a forced plan this GPU cannot launch: the other variants still run
            print(f"{name}: not run: {e}", flush=True)
            continue
        plans = sorted({(m.weight4.k, m.weight4.n) for m in runner.model.modules() if hasattr(m, "weight4")})
        print(f"{name}: captured ({len(plans)} weight shapes)", flush=True)
    times = {name: [] for name in replays}
    for _ in range(rounds):
        for name, (_, replay) in replays.items():
            times[name].append(e2e._time_ms(replay, dev, 30) * 1e3)
    base = statistics.median(times["default"])
    print(f"GPU {torch.cuda.get_device_name()}, {layers} layers, batch {batch}, context {context}, {rounds} alternating rounds "
          f"(us a step: median, min-max)")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:22s} {med:8.1f}  ({min(ts):.1f}-{max(ts):.1f})  {base / med:.3f}x default  "
              f"{(med - base) / layers:+.2f} us a layer")


if __name__ == "__main__":
    main()
