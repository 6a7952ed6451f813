"""kdev: develop and validate custom CUDA kernels for tree speculative decoding on MLA models."""

__version__ = "0.1.0"
