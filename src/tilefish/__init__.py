"""tilefish: hand-written CUDA GEMM kernels for LLM inference, compiled at run time with NVRTC.

Import is light: kernels compile on first use (and are cached on disk).
"""
__version__ = "0.1.0"



__all__ = ["__version__", "nf4"]
