"""Keep ggml's AMX buffer type out of llama.cpp in test processes (temporary: the lead's guard on main replaces it).

On a CPU with AMX, a natively built llama.cpp places weights in the AMX buffer type and crashes on the first matrix
multiply (upstream llama.cpp #20824). Removing "AMX" from the CPU device's extra buffer-type list before any model is
loaded keeps the REPACK path (``use_extra_bufts = False`` would drop it too). The list is a static array inside
libggml-cpu, so editing it in place affects every later model load in this process.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

_done = False


def keep_amx_out() -> None:
    """Idempotent; call before loading any model in this process."""
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
    reg = base.ggml_backend_dev_backend_reg(dev)
    address = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if address:
        get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
        arr = get_extra(dev)
        n = 0
        while arr[n]:
            n += 1
        keep = [arr[i] for i in range(n) if base.ggml_backend_buft_name(arr[i]) != b"AMX"]
        for i, p in enumerate(keep):
            arr[i] = p
        arr[len(keep)] = None
    _done = True
