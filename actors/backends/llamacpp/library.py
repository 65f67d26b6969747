"""Where the llama.cpp libraries this process runs come from.

llama-cpp-python loads ``libllama.so`` from its own ``lib`` directory, or from ``LLAMA_CPP_LIB_PATH`` when that is
set (another build of llama.cpp: issue #28's cross-build spot checks run nodes of two builds). The few ggml functions
we bind ourselves must come from the copy that libllama loaded: a second copy of libggml under another path is a
second backend registry (its buffer types are not the ones the model loads with) and a second set of tensor
functions."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as _binding


def library_dir() -> Path:
    """The directory llama-cpp-python loaded ``libllama.so`` from (its ``lib``, or ``LLAMA_CPP_LIB_PATH``)."""
    base = getattr(_binding, "_base_path", None)
    return Path(base) if base is not None else Path(llama_cpp.__file__).parent / "lib"
