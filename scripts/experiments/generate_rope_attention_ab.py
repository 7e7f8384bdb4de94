"""generate()'s time a token with a decode step's attention as one rope_attention kernel a layer against the
rope_cache + transformers' attention path, same model, same process, alternating rounds (the 32-layer bench
at bf48fb2 gave host 2.25 ms a token against 1.27 at 8f35e6c). Per variant: ms a token (wall, GPU busy, host),
dynamo's counters after the run (graph breaks, CUDA graph skips, unique graphs), and from a profile of
generate(16): dynamo's cache lookups, compiled-region calls and graph launches with their mean CPU time.

    python scripts/experiments/generate_rope_attention_ab.py [layers] [rounds]
"""
import collections
import sys

import torch
from torch._dynamo.utils import counters

from tilefish.bench import e2e_generate as eg
from tilefish.bench import e2e_models
from tilefish.decoder import FusedAttention

ONE_KERNEL = FusedAttention._one_kernel_step


def profile_counts(model, ids):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eg._generate(model, ids, 16)
        torch.cuda.synchronize()
    ka = {k.key: k for k in prof.key_averages()}
    out = {}
    for key in ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "cudaGraphLaunch", "Pregraph bytecode"):
        hits = [v for k, v in ka.items() if k.startswith(key)]
        if hits:
            n = sum(h.count for h in hits)
            out[key] = (n, sum(h.cpu_time_total for h in hits) / n)
    return out


def main():
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    cfg = e2e_models.default_config("llama3-8b", layers)
    model, summary = eg._build(cfg, "w4a16", torch.device("cuda"), 0, "auto")
    print(torch.cuda.get_device_name(), f"{layers} layers;", summary, flush=True)
    ids = torch.randint(3, cfg.vocab_size, (1, eg.PROMPT), generator=torch.Generator().manual_seed(1)).cuda()
    for r in range(rounds):
        for variant in ("rope_attention", "rope_cache"):
            FusedAttention._one_kernel_step = ONE_KERNEL if variant == "rope_attention" else (lambda *a: False)
            torch._dynamo.reset()
            counters.clear()
            m = eg._measure(model, cfg.vocab_size, 1, eg.PROMPT, 128, 3, torch.device("cuda"))
            c = {"graph_breaks": sum(counters["graph_break"].values()),
                 "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
                 "unique_graphs": counters["stats"]["unique_graphs"]}
            prof = profile_counts(model, ids)
            print(f"round {r} {variant:15s} {m['ms_per_token']:.3f} ms a token = GPU {m['gpu_ms_per_token']:.3f} + "
                  f"host {m['host_ms_per_token']:.3f}; compile {m['setup_s']:.1f} s; {c}", flush=True)
            for key, (n, us) in prof.items():
                print(f"    {key}: {n} calls in generate(16), {us:.0f} us CPU each")
    FusedAttention._one_kernel_step = ONE_KERNEL


if __name__ == "__main__":
    main()
