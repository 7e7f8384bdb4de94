"""How much logits error an int4 lm_head adds, against the error the 4-bit decoder already has
(issue 41 item 4: quantize_model's lm_head="auto" rule, measured against the dense twin).

The bench's Llama-3-8B-shaped HF model (random weights, seed 0), `layers` decoder layers, fp16:
  decoder  = rel(logits of the int4 decoder + the dense lm_head, fp16 logits)
  lm_head  = rel(int4 lm_head(h), dense lm_head(h)) on the same final hidden states h
  top-1    = how often the int4 lm_head's argmax is the dense lm_head's, on those h
and the auto rule's weight errors (report.lm_head). Prints one table.

Usage (device): python scripts/experiments/lm_head_error.py [layers ...]   (default 2 8 32)
"""
import copy
import sys

import torch

from tilefish.bench import e2e
from tilefish.convert import quantize_model
from tilefish.models.llama import LlamaConfig
from tilefish.nn import W4A16Linear


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.no_grad()
def measure(layers: int, device: torch.device) -> dict:
    cfg = LlamaConfig.llama3_8b(layers)
    torch.manual_seed(0)
    runner = e2e._HF(cfg, device)
    reference = e2e._logits(runner, cfg.vocab_size, device)
    dense_head = copy.deepcopy(runner.model.lm_head)
    report = quantize_model(runner.model, group_size=128)   # lm_head="auto", the default
    int4_head = runner.model.lm_head
    runner.model.lm_head = dense_head                       # the int4 decoder with the dense head
    hidden = []
    hook = dense_head.register_forward_hook(lambda m, args, out: hidden.append(args[0]))
    decoder = e2e._logits(runner, cfg.vocab_size, device)
    hook.remove()
    h = hidden[-1]
    if not isinstance(int4_head, W4A16Linear):              # the rule kept it dense: measure the int4 one anyway
        int4_head = W4A16Linear.from_linear(dense_head, group_size=128)
    dense_logits, int4_logits = dense_head(h).float(), int4_head(h).float()
    out = {"layers": layers, "decoder_rel": rel(decoder, reference), "lm_head_rel": rel(int4_logits, dense_logits),
           "top1_agree": float((int4_logits.argmax(-1) == dense_logits.argmax(-1)).float().mean()),
           "rule": report.lm_head}
    del runner, dense_head, int4_head
    torch.cuda.empty_cache()
    return out


def main():
    layer_counts = [int(v) for v in sys.argv[1:]] or [2, 8, 32]
    device = torch.device("cuda")
    print(f"GPU {torch.cuda.get_device_name()}; Llama-3-8B shapes, random weights (seed 0), fp16, g128, "
          f"{e2e.CHECK_TOKENS}-token prompt")
    rows = [measure(n, device) for n in layer_counts]
    print(f"{'layers':>6} {'decoder rel err':>16} {'int4 lm_head rel err':>21} {'top-1 agree':>12}")
    for r in rows:
        print(f"{r['layers']:>6} {r['decoder_rel']:>16.4f} {r['lm_head_rel']:>21.4f} {r['top1_agree']:>12.3f}"
              f"   lm_head: {r['rule']}")


if __name__ == "__main__":
    main()
