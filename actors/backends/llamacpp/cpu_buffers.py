"""Which CPU buffer types ggml may put a model's weights in: every one but AMX, unless the operator allows it.

Why: pip builds llama-cpp-python natively, so on a CPU with AMX (Sapphire Rapids and later; ``AMX_INT8 = 1`` in
``llama_print_system_info()``) ggml offers its AMX buffer type first and llama.cpp places the quantized weights
there. On some of those machines the first matrix multiply in that buffer type kills the process (SIGSEGV or
SIGILL in ``ggml_backend_amx_mul_mat``; upstream llama.cpp #20824, closed without a fix). Which machines crash is
not ours to choose, and a cached native wheel brings the crash with it whatever build flags a later install sets,
so the guard works at run time, on whatever build is installed.

How: llama.cpp asks the CPU device for its extra buffer types once per model load, through the public
``ggml_backend_dev_get_extra_bufts`` procedure of the CPU backend registry, which returns a NULL-terminated array
(``[AMX, CPU_REPACK, NULL]`` on such a build). We drop AMX from that array before any model loads, in place, and
put it back if a later caller allows it. ``CPU_REPACK`` stays: it is what makes Q4_K/Q4_0/IQ4 decode fast on
AVX2/AVX-512 CPUs (``use_extra_bufts = False`` would drop it too; docs/llamacpp-backend.md has the measured cost
of each choice). Compute in ggml's CPU backend goes to the AMX kernels only for weights that live in an AMX
buffer, so with none there the AMX code never runs.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable

from actors.backends.llamacpp.library import library_dir

__all__ = ["AMX", "BufferTypes", "buffer_types", "filter_buffer_types"]

AMX = "AMX"
"""The name ggml gives its AMX buffer type (``ggml-cpu/amx/amx.cpp``)."""

_CPU_DEVICE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU
_ExtraBufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


def filter_buffer_types(array: ctypes.Array[ctypes.c_void_p] | ctypes._Pointer[ctypes.c_void_p],
                        original: list[int], keep: Callable[[int], bool]) -> list[int]:
    """Rewrite the NULL-terminated ``array`` (room for ``len(original) + 1`` entries) as the entries of ``original``
    that ``keep`` accepts, in order, then NULL. Returns what it wrote (without the NULL)."""
    kept = [p for p in original if keep(p)]
    for i, pointer in enumerate(kept):
        array[i] = pointer
    array[len(kept)] = None
    return kept


class BufferTypes:
    """The CPU device's extra buffer types, as llama.cpp will see them at the next model load."""

    def __init__(self) -> None:
        lib = library_dir()
        ggml = ctypes.CDLL(str(lib / "libggml.so"))
        base = ctypes.CDLL(str(lib / "libggml-base.so"))
        ggml.ggml_backend_dev_by_type.argtypes, ggml.ggml_backend_dev_by_type.restype = [ctypes.c_int], ctypes.c_void_p
        base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
        base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
        base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
        base.ggml_backend_buft_name.argtypes, base.ggml_backend_buft_name.restype = [ctypes.c_void_p], ctypes.c_char_p
        self._name_of = base.ggml_backend_buft_name
        self._lock = threading.Lock()
        self._array: ctypes._Pointer[ctypes.c_void_p] | None = None
        self._original: list[int] = []
        device = ggml.ggml_backend_dev_by_type(_CPU_DEVICE)
        if not device:
            return
        address = base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(device),
                                                         b"ggml_backend_dev_get_extra_bufts")
        if not address:
            return
        self._array = _ExtraBufts(address)(device)
        i = 0
        while self._array[i]:
            self._original.append(int(self._array[i]))
            i += 1

    def name(self, buft: int) -> str:
        return bytes(self._name_of(buft) or b"").decode(errors="replace")

    @property
    def available(self) -> list[str]:
        """Every extra buffer type this build offers on this CPU, allowed or not."""
        return [self.name(p) for p in self._original]

    @property
    def active(self) -> list[str]:
        """The extra buffer types the next model load may use."""
        if self._array is None:
            return []
        names, i = [], 0
        while self._array[i]:
            names.append(self.name(int(self._array[i])))
            i += 1
        return names

    def allow_amx(self, allowed: bool) -> list[str]:
        """Offer AMX to the next model loads or not; returns the active list. Idempotent and reversible."""
        with self._lock:
            if self._array is not None:
                filter_buffer_types(self._array, self._original, lambda p: allowed or self.name(p) != AMX)
            return self.active


@functools.cache
def buffer_types() -> BufferTypes:
    """The process's one view of the CPU device's buffer types (llama.cpp's backend must be initialised)."""
    return BufferTypes()
