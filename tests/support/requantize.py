"""Another quantization of the bundled model (issue #28's bad node that serves a cheaper one while advertising the
original): llama.cpp's own quantizer, through llama-cpp-python's binding of ``llama_model_quantize``, requantizing
the Q4_K_M file (its tensors dequantized, then quantized again). ~1.5 s on one core; cached by path."""

from __future__ import annotations

import ctypes
from pathlib import Path

FTYPES = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def requantize(source: Path, target_dir: Path, kind: str = "q4_0") -> Path:
    import llama_cpp

    target = target_dir / f"{source.stem}-{kind}.gguf"
    if target.exists():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.allow_requantize = True
    params.nthread = 1
    partial = target.with_suffix(".partial")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {kind}) returned {rc}")
    partial.rename(target)
    return target
