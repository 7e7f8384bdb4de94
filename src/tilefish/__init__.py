"""tilefish: hand-written CUDA GEMM kernels for LLM inference, compiled at run time with NVRTC.

Import is light: kernels compile on first use (and are cached on disk).
"""
__version__ = "0.1.0"

import importlib as _importlib

# sgemm / hgemm: modules that are called as the op (tilefish.hgemm(a, b)) and hold its plan (tilefish.hgemm.plan)
_LAZY = ("nf4", "w4a16", "sgemm", "hgemm", "nn", "reference", "runtime", "ops", "quant", "bench", "convert",
         "checkpoint", "models", "moe", "experts", "attention", "decoder", "norm")
# Functions re-exported lazily: name -> submodule.
_FUNCTIONS = {"quantize_model": "convert", "ConversionReport": "convert", "load_quantized": "checkpoint",
              "save_quantized": "export", "use_gqa_attention": "attention", "use_fused_forward": "decoder",
              "restore_forward": "decoder"}


def __getattr__(name):  # submodules load on first use: `import tilefish` stays light
    if name == "GpuSpec":
        from .runtime.device import GpuSpec

        return GpuSpec
    if name in _FUNCTIONS:
        return getattr(_importlib.import_module(f".{_FUNCTIONS[name]}", __name__), name)
    if name in _LAZY:
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'tilefish' has no attribute {name!r}")


__all__ = ["__version__", "GpuSpec", "nf4", "w4a16", "nn", "sgemm", "hgemm", "quantize_model", "load_quantized",
           "save_quantized", "ConversionReport", "use_gqa_attention", "use_fused_forward", "restore_forward"]
