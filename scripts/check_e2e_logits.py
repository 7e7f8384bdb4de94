"""Where a quantized model's logits differ from fp16's: the kernels, or the 4-bit weights?

Builds the Llama-3-8B-shaped HF model (random weights) with L layers, quantizes it (W4A16 g128,
fused), and compares, on one 64-token prompt (eager, no cache): W4A16 model vs fp16, W4A16 model vs
the same model with every W4A16 layer replaced by a dense fp16 Linear holding its exactly
dequantized weight (the kernels' error alone), and that dequantized model vs fp16 (the weights').
Also the hidden state's relative distance after each layer (W4A16 vs fp16).

Usage (device): python scripts/check_e2e_logits.py [layers ...]   (default 2 32)
"""
import sys

import torch
from tilefish.bench.e2e import _HF
from tilefish.convert import dequantize_model, quantize_model
from tilefish.models.llama import LlamaConfig


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def hidden_states(model, ids):
    return [h for h in model(ids, output_hidden_states=True, use_cache=False).hidden_states]


def main():
    for layers in [int(v) for v in sys.argv[1:]] or [2, 32]:
        torch.manual_seed(0)
        runner = _HF(LlamaConfig.llama3_8b(layers), torch.device("cuda"))
        model = runner.model
        ids = torch.randint(128256, (1, 64), generator=torch.Generator().manual_seed(1234)).cuda()
        with torch.no_grad():
            h16 = hidden_states(model, ids)
            l16 = model(ids, use_cache=False).logits
            quantize_model(model)
            hq = hidden_states(model, ids)
            lq = model(ids, use_cache=False).logits
            dequantize_model(model)
            ld = model(ids, use_cache=False).logits
        print(f"{layers} layers: logits w4a16 vs fp16 {rel(lq, l16):.4f}; w4a16 kernels vs dense dequantized "
              f"{rel(lq, ld):.5f}; dense dequantized vs fp16 {rel(ld, l16):.4f}")
        print("  hidden state distance w4a16 vs fp16 by layer: "
              + " ".join(f"{rel(a, b):.3f}" for a, b in zip(hq, h16)))
        del runner, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
