"""Host time per eager call of the MoE expert op (what a user running eager PyTorch pays per layer), beside
F.linear's on one of the layer's projections and transformers' bf16 experts module (grouped_mm), interleaved
(bench.timing.host_overhead_paired_us), at each token count of --tokens: the converted module (QuantizedExperts,
which keeps its decode launches per call signature), the functional op (on its automatic path,
moe_decode.takes_decode_path, named in each case's header) and the launcher forced down each path.

A sample is --calls eager calls after a sync (100 by default: a few hundred launches, so the host should not
wait on a full launch queue where the kernels take longer than the host; with 500, as the H100 record
bench/results/h100/moe_host_0e60b81.txt ran, such a row can read the kernels' time instead). --profile adds
cProfile's functions with the most time of their own over --calls calls of the functional op, each case.

    python scripts/experiments/moe_host.py --models qwen3-30b-a3b,mixtral-8x7b --tokens 1,2,4,8,16 [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
import torch.nn.functional as F

from tilefish.bench import moe as bm
from tilefish.bench.moe_shapes import parse_models
from tilefish.bench.timing import host_overhead_paired_us
from tilefish.experts import QuantizedExperts
from tilefish.moe import moe_experts
from tilefish.ops.moe_decode import takes_decode_path
from tilefish.ops.moe_kernels import grouped_experts_cuda
from tilefish.ops.w4a16.workspace import new_counters

BASE = "F.linear (one gate_up weight)"
AUTO = "tilefish.moe.moe_experts (auto path)"


def auto_label(path: str) -> str:
    return f"tilefish.moe.moe_experts (auto: {path})"


def parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated positive ints, got {text!r}") from None
    if not tokens or min(tokens) < 1:
        raise argparse.ArgumentTypeError(f"--tokens takes comma-separated positive ints, got {text!r}")
    return tokens


def profile(fn, calls: int, top: int = 25) -> str:
    """cProfile's `top` functions by their own time over `calls` calls of fn (after a warm call), as text:
    own and cumulative us and calls per call of fn (cProfile's overhead included: compare rows, not totals)."""
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"{'own us':>8s} {'cum us':>8s} {'calls':>6s}  function (per call of the op)"]
    for (file, line, name), (_, n, own, cum, _) in rows:
        where = name if file == "~" else f"{file.split('/src/')[-1]}:{line}({name})"
        lines.append(f"{own / calls * 1e6:8.2f} {cum / calls * 1e6:8.2f} {n / calls:6.1f}  {where}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen3-30b-a3b,gpt-oss-20b")
    p.add_argument("--tokens", type=parse_tokens, default=parse_tokens("1,2,4,8,16"),
                   help="token counts, comma-separated (default 1,2,4,8,16)")
    p.add_argument("--calls", type=int, default=100, help="eager calls a sample (default 100)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds, median taken (default 5)")
    p.add_argument("--profile", action="store_true", help="cProfile the functional op at each token count")
    a = p.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name())
    print(f"host us per eager call: median of {a.rounds} interleaved rounds of {a.calls} calls")
    for model in parse_models(a.models):
        module = bm.dense_experts(model, dev)
        gu, dn, gb, db, act = bm.quantized_weights(module, model, "int4")
        weight = torch.randn(2 * model.inter, model.hidden, device=dev, dtype=torch.bfloat16)
        counters = new_counters(dev)
        layer = QuantizedExperts(gu, dn, act, gb, db)
        grouped = bm.with_implementation(module, model, "grouped_mm")
        table: dict[str, dict[int, float]] = {}
        for t in a.tokens:
            ids, w = bm.routing(model, t, dev)
            x = torch.randn(t, model.hidden, device=dev, dtype=torch.bfloat16)
            path = "decode" if takes_decode_path(t, model.topk, model.experts) else "grouped"
            print(f"{model.name} t{t}: {t * model.topk} slots of {model.experts} experts, top-{model.topk}; "
                  f"auto path {path}; routing weights {w.dtype}")
            fns = {BASE: lambda: F.linear(x, weight),
                   "QuantizedExperts (eager module)": lambda: layer(x, ids, w),
                   AUTO: lambda: moe_experts(x, ids, w, gu, dn, act, gb, db),
                   "grouped_experts_cuda decode": lambda: grouped_experts_cuda(x, ids, w, gu, dn, act, gb, db,
                                                                                counters, "decode"),
                   "grouped_experts_cuda grouped": lambda: grouped_experts_cuda(x, ids, w, gu, dn, act, gb, db,
                                                                                 counters, "grouped")}
            if grouped is not None:
                fns["transformers grouped_mm experts (bf16)"] = lambda: grouped(x, ids, w.to(x.dtype))
            for name, fn in list(fns.items()):
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - a peer whose forward takes other arguments is left out
                    print(f"{model.name} t{t}: {name} left out ({type(e).__name__}: {e})")
                    del fns[name]
            torch.cuda.synchronize()
            us = host_overhead_paired_us(fns, calls=a.calls, rounds=a.rounds)
            base = us[BASE]
            for name, v in us.items():
                table.setdefault(name, {})[t] = v
                label = auto_label(path) if name == AUTO else name
                print(f"{model.name:16s} t{t:<4d} {label:42s} {v:7.1f} us host a call ({v / base:.2f}x F.linear)",
                      flush=True)
            if a.profile:
                print(f"--- cProfile, {model.name} t{t}, {auto_label(path)}, {a.calls} calls ---")
                print(profile(fns[AUTO], a.calls), flush=True)
            del fns, ids, w, x
        print(f"\n{model.name}: host us per eager call by tokens (auto path: "
              + ", ".join(f"t{t} {'decode' if takes_decode_path(t, model.topk, model.experts) else 'grouped'}"
                          for t in a.tokens) + ")")
        print(f"{'':42s}" + "".join(f"{'t' + str(t):>9s}" for t in a.tokens))
        for name, row in table.items():
            print(f"{name:42s}" + "".join(f"{row[t]:9.1f}" if t in row else f"{'-':>9s}" for t in a.tokens))
        print(flush=True)
        del layer, grouped, module, gu, dn, gb, db, weight, counters
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
