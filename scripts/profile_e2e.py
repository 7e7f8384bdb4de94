"""Where a decode step's GPU time goes: the e2e bench's compiled + CUDA-graph step under the torch
profiler, kernel time summed by kind (W4A16 GEMMs, cuBLAS GEMMs, attention, Triton / other), for
fp16 and W4A16, per layer and in total.

Usage (device): python scripts/profile_e2e.py [layers] [batch ...]   (default 8 layers, batch 1 16;
MODEL=hf|builtin, KERNELS=1 lists every kernel, IMPLS=fp16,fp16-gqa,w4a16 (default; also bench e2e's w4a16-hf, and
w4a16-nopdl: w4a16 captured under LaunchPolicy(programmatic=False), w4a16-norope: w4a16 with transformers'
attention forward, i.e. no rope_cache kernel, w4a16-ropecache: decode steps with rope_cache and the attention
function instead of the one rope_attention kernel, w4a16-onesplit: rope_attention with each kv head's whole cache in
one CTA, no split to combine, w4a16-l2combine: rope_attention's splits combined through L2 instead of a cluster,
w4a16-allslots: rope_attention over caches of any length, past the routing's MAX_FUSED_SLOTS),
LM_HEAD=auto|quantize|dense: quantize_model's lm_head,
default auto), CONTEXTS=512 (default) or a list such as 32,160,512,2048: the positions a step decodes at (the cache
holds that many random K/V rows; rope_attention against rope_cache + SDPA by cache length:
IMPLS=w4a16-ropecache,w4a16,w4a16-onesplit CONTEXTS=32,96,160,480,1024,2048,4064 python scripts/profile_e2e.py 8 1 16),
ARCH=llama3-8b (default) | qwen3-8b | qwen3-moe: bench e2e's --arch models (qwen3-8b takes the Llama's variants;
qwen3-moe, bf16, IMPLS such as int4-norope,int4)

"""
import contextlib
import os
import sys
from collections import defaultdict

import torch

from tilefish.bench import e2e, e2e_models
from tilefish.ops import rope_attention as rope_attention_ops
from tilefish.ops import w4a16 as ops


def kind(name: str) -> str:
    n = name.lower()
    if name.startswith("triton"):  # inductor names its kernels after the ops they fuse, w4a16_matmul among them
        return "triton (fused elementwise, norms, rope)"
    if "w4a16" in n:
        return "W4A16 GEMM"
    if "rms_norm" in n:
        return "tilefish norm"
    if "rope_cache" in n:
        return "tilefish rope + cache write"
    if "rope_attention" in n:
        return "tilefish rope + cache write + attention"
    if "gemv" in n or "gemm" in n or "xmma" in n or "cutlass" in n or "nvjet" in n:
        return "cuBLAS GEMM"
    if "attention" in n or "fmha" in n or "flash" in n or "sdpa" in n or "lean_reduction" in n:  # cuDNN's reduction too
        return "attention"
    return "other"


def profile_step(replay, steps=5):
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    by = defaultdict(float)
    count = defaultdict(int)
    names = defaultdict(int)
    every = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by[kind(ev.name)] += ev.device_time_total / steps
            count[kind(ev.name)] += 1
            every[ev.name[:90]] += ev.device_time_total / steps
            names[ev.name[:90]] += 1
    shown = [n for n in names if kind(n) == "W4A16 GEMM" or os.environ.get("KERNELS") == "1"]
    for name in sorted(shown, key=lambda n: -every[n]):
        print(f"    {names[name] // steps:3d} a step, {every[name]:8.1f} us a step: {name}")
    return by, {k: v // steps for k, v in count.items()}


def launch_policy_for(impl: str):
    """The launch-policy context a variant's steps are converted and captured under (-nopdl: no programmatic
    launch; the launches made while a step is captured keep the policy active then)."""
    if impl.endswith("-nopdl"):
        return ops.launch_policy(ops.LaunchPolicy(programmatic=False))
    return contextlib.nullcontext()


@contextlib.contextmanager
def rope_attention_plan_for(impl: str):
    """The rope_attention plan a variant's steps are captured under (-onesplit: one CTA a kv head's whole cache,
    so no split combine; -l2combine: the splits combined through L2, with no split limit, as on GPUs without
    clusters; -allslots: decode steps take rope_attention over caches of any length; the names are looked up at
    each launch or trace, so the patch holds while the steps are compiled and captured)."""
    patches = {}
    if impl.endswith("-onesplit"):
        patches["plan_chunk"] = lambda batch, kv_heads, slots, sm_count, max_splits=None: -(-slots // 64) * 64
    if impl.endswith("-l2combine"):
        patches["uses_clusters"] = lambda gpu: False
    if impl.endswith("-allslots"):  # the routing's cache-length limit lifted (the batch limit kept)
        patches["MAX_FUSED_SLOTS"] = 1 << 30
    real = {name: getattr(rope_attention_ops, name) for name in patches}
    for name, fn in patches.items():
        setattr(rope_attention_ops, name, fn)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(rope_attention_ops, name, fn)


def _without_norms(base: type) -> type:
    """The fused decoder layer minus its norms (and the add ahead of the second): x -> q/k/v, attention, o ->
    gate_up -> down + x. An upper bound on what folding the norms into the GEMMs could save; not a model."""
    class WithoutNorms(base):
        def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
            attn, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
            return self.mlp.forward_residual(attn, hidden_states)
    return WithoutNorms


def convert_variant(runner, impl: str) -> None:
    """runner's model as `impl` (bench e2e's variants, with the -nopdl / -norope / -ropecache suffixes), each layer
    compiled."""
    base = impl.removesuffix("-nopdl").removesuffix("-norope").removesuffix("-ropecache").removesuffix("-onesplit")
    base = base.removesuffix("-l2combine").removesuffix("-allslots").removesuffix("-nonorms")
    e2e._convert(runner, base, os.environ.get("LM_HEAD", "auto"))
    if impl.endswith("-nonorms"):  # timing only, wrong math: the fused layer without its two norm kernels
        for layer in runner.model.model.layers:
            layer.__class__ = _without_norms(type(layer))
    if impl.endswith("-norope"):  # transformers' attention forward: no rope_cache kernel
        for layer in runner.model.model.layers:
            layer.self_attn.__class__ = layer.self_attn._tilefish_base
    if impl.endswith("-ropecache"):  # decode steps take rope_cache and the attention function, not rope_attention
        for layer in runner.model.model.layers:
            layer.self_attn._one_kernel_step = lambda *args: False
    for layer in runner.model.model.layers:
        layer.compile(fullgraph=True, dynamic=False)


def captured_step(runner, cfg, batch: int, dev, context: int = 512):
    """One decode step at position `context` over a cache of random K/V, captured in a CUDA graph: its replay,
    which keeps the step's inputs alive (the graph reads them where they were at capture)."""
    runner.setup(batch, e2e._round_up(context + 1, e2e.CACHE_ALIGN))
    for t in runner.kv_tensors():
        t.normal_()
    ids = torch.randint(cfg.vocab_size, (batch, 1), device=dev)
    pos = torch.arange(context, context + 1, device=dev)
    graph_replay = e2e._captured(lambda: runner.step(ids, pos))

    def replay(inputs=(ids, pos)):  # the default argument holds the inputs
        graph_replay()
    return replay


def main():
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    batches = [int(v) for v in sys.argv[2:]] or [1, 16]
    contexts = [int(v) for v in os.environ.get("CONTEXTS", "512").split(",")]
    model = os.environ.get("MODEL", "hf")
    Runner = e2e._HF if model == "hf" else e2e._Builtin
    arch = os.environ.get("ARCH", e2e_models.DEFAULT_ARCH)
    cfg = e2e_models.default_config(arch, layers)
    dev = torch.device("cuda")
    print(f"GPU {torch.cuda.get_device_name()}, {model} model ({arch}), {layers} layers")
    # each (batch, cache length) is one more graph of the compiled layer (dynamic=False): allow all of them
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(batches) * len(contexts))
    for impl in os.environ.get("IMPLS", "fp16,fp16-gqa,w4a16").split(","):
        torch.manual_seed(0)
        runner = Runner(cfg, dev)
        with torch.no_grad(), launch_policy_for(impl), rope_attention_plan_for(impl):
            convert_variant(runner, impl)
            for b in batches:
                for context in contexts:
                    replay = captured_step(runner, cfg, b, dev, context)
                    wall = e2e._time_ms(replay, dev, 30)
                    by, count = profile_step(replay)
                    total = sum(by.values())
                    print(f"{impl} batch {b} context {context}: step {wall * 1e3:,.0f} us (graph replay), "
                          f"kernels {total:,.0f} us")
                    for k, us in sorted(by.items(), key=lambda kv: -kv[1]):
                        print(f"    {k:42s} {us:9,.1f} us  {us / layers:7.1f} us a layer  ({count[k]} kernels a step)")
                    runner.free()
        del runner
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
