"""The llama.cpp backend (the performance path): a GGUF, whole or one layer range, through llama-cpp-python.

The modules import llama_cpp; import what you need from them (``backend.LlamaCppBackend``, ``load_llamacpp``), so
that importing this package costs nothing.
"""
