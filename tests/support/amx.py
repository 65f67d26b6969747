"""Keep llama.cpp's AMX buffer type out of model loading (a stopgap until main's guard lands; swap this module
for it at merge).

On a CPU with AMX, the natively built llama.cpp of llama-cpp-python 0.3.36 places weights in the AMX buffer type
and then crashes (SIGILL/SIGSEGV) on the first matrix multiply. The CPU backend hands out its "extra" buffer types
as a NULL-terminated static array; removing AMX from it before any model is loaded makes llama.cpp fall back to the
repacked CPU types. Call ``keep_amx_out()`` before constructing a backend or llama-cpp-python's ``Llama``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

_done = False


def keep_amx_out() -> None:
    """Idempotent; must run before the first model load of the process."""
    global _done
    if _done:
        return
    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    ggml = ctypes.CDLL(str(lib / "libggml.so"))
    base = ctypes.CDLL(str(lib / "libggml-base.so"))
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    llama_cpp.llama_backend_init()
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(
        base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev),
                                               b"ggml_backend_dev_get_extra_bufts"))
    arr = get_extra(dev)
    n = 0
    while arr[n]:
        n += 1
    keep = [arr[i] for i in range(n) if base.ggml_backend_buft_name(arr[i]) != b"AMX"]
    for i, p in enumerate(keep):
        arr[i] = p
    arr[len(keep)] = None
    _done = True
