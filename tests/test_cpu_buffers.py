"""The AMX guard: which CPU buffer types llama.cpp may put weights in, checked on this machine's real build."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backends.llamacpp.cpu_buffers import AMX, buffer_types, filter_buffer_types  # noqa: E402


def test_filter_rewrites_the_null_terminated_array_in_place() -> None:
    array = (ctypes.c_void_p * 4)(0x10, 0x20, 0x30, None)
    names = {0x10: "AMX", 0x20: "CPU_REPACK", 0x30: "KLEIDIAI"}
    kept = filter_buffer_types(array, [0x10, 0x20, 0x30], lambda p: names[p] != "AMX")
    assert kept == [0x20, 0x30]
    assert [array[0], array[1], array[2]] == [0x20, 0x30, None]
    back = filter_buffer_types(array, [0x10, 0x20, 0x30], lambda p: True)
    assert back == [0x10, 0x20, 0x30] and array[3] is None


def test_the_guard_drops_amx_only_and_is_reversible() -> None:
    llama_cpp.llama_backend_init()
    types = buffer_types()
    available = types.available
    assert types.allow_amx(False) == [n for n in available if n != AMX]
    assert types.allow_amx(True) == available
    assert types.allow_amx(False) == [n for n in available if n != AMX]  # the state every test runs in


def test_the_build_reports_amx_exactly_when_it_offers_the_amx_buffer_type() -> None:
    llama_cpp.llama_backend_init()
    reports_amx = "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()
    assert (AMX in buffer_types().available) == reports_amx


_LOAD = """
import sys, llama_cpp
from actors.backends.llamacpp.cpu_buffers import buffer_types
llama_cpp.llama_backend_init()
buffer_types().allow_amx(sys.argv[2] == "allow")
llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=True)
"""


def _load_log(model: Path, policy: str) -> str:
    done = subprocess.run([sys.executable, "-c", _LOAD, str(model), policy], capture_output=True, timeout=120,
                          check=True)
    return done.stderr.decode(errors="replace")


@pytest.mark.slow
def test_guarded_weights_land_in_cpu_repack_and_never_in_amx(gemma_path: Path) -> None:
    """llama.cpp's own load log says where the weights went: with the guard, the Q4_K weights are repacked (the
    fast path) and nothing is in an AMX buffer, whether or not this CPU has AMX."""
    log = _load_log(gemma_path, "guard")
    assert "CPU_REPACK model buffer size" in log, log[-2000:]
    assert "AMX model buffer size" not in log, log[-2000:]
    if AMX in buffer_types().available:  # on an AMX build, the guard is what kept it out
        assert "AMX model buffer size" in _load_log(gemma_path, "allow")
