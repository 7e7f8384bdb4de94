"""One decode step's attention (Llama-3-8B heads: 32 query heads on 8 KV heads, d 128, an additive mask
over a static cache), four ways, each compiled (fullgraph) and replayed in a CUDA graph, L2 flushed:

  repeat     transformers' sdpa: K/V repeated to 32 heads, then SDPA
  fold-sdpa  the query heads of a KV head folded into rows, one SDPA call (tilefish_sdpa before the decode path)
  fold-math  the same fold, written as transformers' eager attention: matmul, scale, mask, fp32 softmax, matmul
  gqa-flag   SDPA's own enable_gqa=True with the mask

Usage (device): python scripts/experiments/gqa_attention_paths.py
"""
import torch
import torch.nn.functional as F

from tilefish.bench.timing import flush_l2

HEADS, KV, D = 32, 8, 128


def repeat(q, k, v, mask):
    g = HEADS // KV
    k = k[:, :, None].expand(-1, -1, g, -1, -1).reshape(k.shape[0], HEADS, k.shape[2], D)
    v = v[:, :, None].expand(-1, -1, g, -1, -1).reshape(v.shape[0], HEADS, v.shape[2], D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def fold_sdpa(q, k, v, mask):
    b, h, t, d = q.shape
    out = F.scaled_dot_product_attention(q.reshape(b, KV, h // KV * t, d), k, v, attn_mask=mask)
    return out.reshape(b, h, t, d)


def fold_math(q, k, v, mask):
    b, h, t, d = q.shape
    w = torch.matmul(q.reshape(b, KV, h // KV * t, d), k.transpose(-1, -2)) * d ** -0.5 + mask
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v).reshape(b, h, t, d)


def gqa_flag(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def timed(fn, args, reps=200):
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    times = []
    for _ in range(reps):
        flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main():
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64  # one graph a shape, 12 shapes
    paths = {"repeat": repeat, "fold-sdpa": fold_sdpa, "fold-math": fold_math, "gqa-flag": gqa_flag}
    compiled = {n: torch.compile(f, fullgraph=True, dynamic=False) for n, f in paths.items()}
    print(f"GPU {torch.cuda.get_device_name()}; fp16, 32 query heads on 8 KV heads, d 128, one query token, "
          "additive mask with the last half of the cache hidden; us per call (median, CUDA graph, L2 flushed)")
    print(f"{'batch':>5} {'cache':>6} " + " ".join(f"{n:>10}" for n in paths) + "   max rel err vs repeat")
    for b in (1, 4, 16, 64):
        for s in (576, 2048, 8192):
            q = torch.randn(b, HEADS, 1, D, device="cuda", dtype=torch.float16)
            k = torch.randn(b, KV, s, D, device="cuda", dtype=torch.float16)
            v = torch.randn(b, KV, s, D, device="cuda", dtype=torch.float16)
            mask = torch.zeros(b, 1, 1, s, device="cuda", dtype=torch.float16)
            mask[..., s // 2:] = torch.finfo(torch.float16).min
            ref = repeat(q, k, v, mask).float()
            us, errs = [], []
            for n, f in compiled.items():
                us.append(timed(f, (q, k, v, mask)))
                errs.append(float((f(q, k, v, mask).float() - ref).norm() / ref.norm()))
            print(f"{b:>5} {s:>6} " + " ".join(f"{u:>10.1f}" for u in us) + "   " + " ".join(f"{e:.1e}" for e in errs))


if __name__ == "__main__":
    main()
