"""Tiny GGUF models with seeded random weights, one per llama.cpp architecture, built without any download.

Why ``gguf``'s writer straight from per-architecture tensor tables, not transformers + ``convert_hf_to_gguf.py``:
the converter is not part of any installed package (it lives in llama.cpp's source tree), transformers would add a
torch dependency and seconds per model, and a table transcribed from llama.cpp's own ``load_arch_tensors`` is what
llama.cpp checks a file against anyway. Building the whole matrix takes well under a second per model.
"""

from artifacts.synthetic.architectures import BUILDERS, Dims
from artifacts.synthetic.builder import QUANT_TYPES, ModelBuilder, TensorSpec

__all__ = ["BUILDERS", "QUANT_TYPES", "Dims", "ModelBuilder", "TensorSpec"]
