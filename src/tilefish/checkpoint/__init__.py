"""Load Hugging Face-format 4-bit checkpoints (safetensors) with tilefish layers.

    model, report = tilefish.load_quantized("path/to/Llama-GPTQ")        # builds the model (needs transformers)
    model, report = tilefish.load_quantized(model, "path/to/Llama-GPTQ") # into a model you built (meta is fine)

A checkpoint is a directory holding ``config.json``, whose ``quantization_config`` names the format, and either
``model.safetensors`` or ``model.safetensors.index.json`` plus the shards it names. Read:

* GPTQ 4-bit (``checkpoint_format`` "gptq" = v1 zeros, or "gptq_v2"), with or without act-order (``desc_act``),
  and AWQ 4-bit GEMM; group sizes -1, 32, 64, 128 (layouts in ``tilefish.quant.int4``) -> W4A16Linear;
* compressed-tensors ``pack-quantized`` 4-bit int weights, strategy group or channel, symmetric or not, with or
  without activation ordering (``weight_g_idx``; layout in ``tilefish.quant.compressed``) -> W4A16Linear;
* bitsandbytes 4-bit NF4 (``quant_method`` "bitsandbytes", ``load_in_4bit``, ``bnb_4bit_quant_type`` "nf4", with
  or without double quant): each Linear X stores bitsandbytes' Linear4bit entries (``X.weight`` packed bytes,
  ``X.weight.absmax``, ``X.weight.quant_map``, [``X.weight.nested_absmax``, ``X.weight.nested_quant_map``,]
  ``X.weight.quant_state.bitsandbytes__nf4`` JSON; layout in ``tilefish.quant.nf4``) -> NF4Linear;
* MoE experts -> tilefish.experts.QuantizedExperts in place of the model's dense experts module: gpt-oss MXFP4
  (``quant_method`` "mxfp4"), or one GPTQ / AWQ / compressed-tensors Linear per expert and projection (Mixtral's
  ``experts.<e>.w1 / w3 / w2``, Qwen-MoE's ``experts.<e>.gate_proj / up_proj / down_proj``); experts.py.

Loading is all or nothing. Every tensor header is checked against the model and the config first; then each new
layer and tensor is built into a staging area, reading one layer's tensors at a time (peak memory: the quantized
model plus one layer); only then is the model changed. After any error the model is exactly as it was.

Modules, in reading order: formats.py (config.json -> QuantFormat), files.py (the safetensors headers and
tensors), linears.py and bnb.py (a quantized Linear's tensors: checked, built), experts.py (MoE experts), plan.py
(what every tensor becomes, and the staging), load.py (load_quantized).
"""
from .files import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from .formats import CheckpointError, QuantFormat
from .load import load_quantized

__all__ = ["CheckpointError", "QuantFormat", "load_quantized", "CONFIG_FILE", "INDEX_FILE", "SINGLE_FILE"]
