"""Weight formats in pure torch (CPU and GPU): quantize, pack, repack, import/export.

Submodules are imported on demand (``tilefish.quant.nf4``); nothing heavy happens here.
"""
