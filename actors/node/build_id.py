"""A node's backend build (issue #28): nodes of one build compute the same bytes for the same input, so their spot
checks compare exactly; across builds they compare within a band.

The id covers what changes the numbers: the backend and its library version (``BackendInfo.version``: llama.cpp's
build and its CPU buffer types, or torch's and transformers' versions) and, for llama.cpp, the CPU features and
build flags it reports (``llama_print_system_info``: AVX2, AVX512, AMX, OpenMP...).

The *kernels* id leaves the CPU features out: builds of one llama.cpp version with the same CPU buffer types run the
same kernel family (the same quantization of activations, the same repacked weights) and differ by rounding only
(~1e-6 relative, measured between an AVX-512 and an AVX2 build), so their checks use the tight band; another kernel
family (plain against repacked) differs as much as another quantization (~1.5e-2, measured) and gets the wide one."""

from __future__ import annotations

import hashlib

from schemas.node import BackendInfo


def build_id(info: BackendInfo) -> str:
    features = ""
    if info.kind == "llamacpp":
        try:
            import llama_cpp

            features = bytes(llama_cpp.llama_print_system_info()).decode(errors="replace")
        except ImportError:
            features = "?"
    digest = hashlib.sha256(f"{info.kind}\n{info.version}\n{features}".encode()).hexdigest()[:16]
    return f"{info.kind}-{digest}"


def kernels_id(info: BackendInfo) -> str:
    digest = hashlib.sha256(f"{info.kind}\n{info.version}".encode()).hexdigest()[:16]
    return f"{info.kind}-{digest}"
