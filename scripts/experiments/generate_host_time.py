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
    return model


def main():
    print("graph_partition:", getattr(torch._inductor.config, "graph_partition", None))
    calls = collections.Counter()
    real = launch.LaunchPlan.launch

    def counting(self, *a):
        calls["launch"] += 1
        return real(self, *a)

    launch.LaunchPlan.launch = counting
    for impl in ("fp16", "w4a16"):
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
        print(impl, "eager W4A16 LaunchPlan.launch calls in gen(16):", calls["launch"])
        for key in ("cudaGraphLaunch", "cuLaunchKernelEx", "cudaLaunchKernel", "cuLaunchKernel"):
            print(f"  {key}: {names.get(key, 0)}")
        top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        print(top)
        for n in (16, 64):
            torch.cuda.synchronize(); t0 = time.perf_counter(); gen(n); torch.cuda.synchronize()
            print(f"  gen({n}) {1e3 * (time.perf_counter() - t0):.1f} ms")
        del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
