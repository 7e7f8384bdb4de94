"""The host cost of dynamo's guard check on a compiled decode step (CPU): a tiny Llama of LAYERS layers, dense or
tilefish W4A16, compiled by generate() as HF does (static cache, mode reduce-overhead, compile allowed on the CPU),
then its cache entry's guard manager checked 200 times on the frame locals of a decode call (captured from an
eager call of the same step). The question it answers: does a tilefish model make the per-token guard check
slower than a dense one?

    python scripts/experiments/guard_check_time.py LAYERS dense|w4a16
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import torch
from transformers import CompileConfig
import tilefish
from hf_families import build
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
LAYERS = int(sys.argv[1]); impl = sys.argv[2]
model = build("llama", torch.float16, num_hidden_layers=LAYERS)
if impl != "dense":
    tilefish.quantize_model(model, clip_search=False)
ids = torch.randint(3, 500, (1, 8))
cc = CompileConfig(fullgraph=False, mode="reduce-overhead"); cc._compile_all_devices = True
gen = lambda n, **kw: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache_implementation="static",
                               pad_token_id=0, compile_config=cc, **kw)
gen(4)
code = model.forward.__func__.__code__
gm = _debug_get_cache_entry_list(code)[0].guard_manager
# capture the frame locals of the next compiled call: swap the compiled call for one that records
captured = []
real = model.get_compiled_call
def spy(cfg):
    f = real(cfg)
    def call(*a, **k):
        def tracer(frame, event, arg):
            if event == "call" and frame.f_code is code and not captured:
                captured.append(dict(frame.f_locals))
        sys.setprofile(tracer)
        try:
            return model.__call__(*a, **k)   # eager, only to see the locals
        finally:
            sys.setprofile(None)
    return call
model.get_compiled_call = spy
gen(3)
model.get_compiled_call = real
loc = captured[-1]
torch.set_grad_enabled(False)
assert gm.check(loc), gm.check_verbose(loc).verbose_code_parts[:3]
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(200):
        gm.check(loc)
    print(f"{impl} {LAYERS} layers: guard check {1e6*(time.perf_counter()-t0)/200:.1f} us")
