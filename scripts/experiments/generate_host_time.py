"""Where generate()'s host time per token goes for a tilefish model (H100 finding: 8 layers, tilefish W4A16
1.57 ms host a token against fp16's 1.08). Counts the eager W4A16 launches during compiled decode steps
(graph replays should launch none), the graph launches per step, and the inductor graph partitions."""
import collections
import time

import torch
import transformers

import tilefish
from tilefish.bench.e2e import _default_dtype
from tilefish.models.llama import LlamaConfig, hf_config
from tilefish.ops.w4a16 import launch


def build(impl, layers=8):
    torch.manual_seed(0)
    with _default_dtype(torch.float16), torch.device("cuda"):
        model = transformers.LlamaForCausalLM(hf_config(LlamaConfig.llama3_8b(layers))).eval()
    if impl == "w4a16":
        tilefish.quantize_model(model, clip_search=False)
    if impl == "tilefish-nf4":
        tilefish.quantize_model(model, "nf4")
    return model


def main():
    print("graph_partition:", getattr(torch._inductor.config, "graph_partition", None))
    calls = collections.Counter()
    real = launch.LaunchPlan.launch

    def counting(self, *a):
        calls["launch"] += 1
        return real(self, *a)

    launch.LaunchPlan.launch = counting
    for impl in ("fp16", "w4a16", "tilefish-nf4"):
        model = build(impl)
        ids = torch.randint(3, 1000, (1, 32), device="cuda")
        gen = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,  # noqa: E731
                                       cache_implementation="static", pad_token_id=0)
        gen(16), gen(16)
        calls.clear()
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen(16)
            torch.cuda.synchronize()
        names = collections.Counter(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU)
        print(impl, "eager W4A16 LaunchPlan.launch calls in gen(16) (the prefill):", calls["launch"])
        ka = {k.key: k for k in prof.key_averages()}
        for key in ("TorchDynamo Cache Lookup", "Torch-Compiled Region: 0/0", "cudaGraphLaunch", "Pregraph bytecode"):
            if key in ka:
                print(f"  {key}: {ka[key].cpu_time_total / ka[key].count:.0f} us x {ka[key].count}")
        walls = []
        for _ in range(3):
            torch.cuda.synchronize(); t0 = time.perf_counter(); gen(16); torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        print(f"  gen(16) median {1e3 * sorted(walls)[1]:.1f} ms")
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
