"""Copy one layer's output (the residual stream) out of a running llama.cpp graph.

libllama has no API to run a layer range and hand back hidden states: ``llama_get_embeddings*`` returns
``result_norm`` (after ``output_norm``), not a residual. What it does have is the scheduler's eval callback
(``llama_context_params.cb_eval``): before computing each graph node the scheduler asks (``ask=True``) whether
the caller wants that node's data; for a node the caller claims, it computes everything up to it, synchronizes and
calls again (``ask=False``) with the data ready. Every layer's output is named ``l_out-<il>``, so claiming that
node and copying it out gives the hidden states after layer ``il``; returning ``False`` from the ``ask=False``
call cancels the rest of the scheduler split, which skips ``output_norm`` and the lm_head on a CPU-only context
(one split). With layers offloaded to several devices later splits still run: the capture stays right, only the
saving is lost. Device-resident tensors are fine: the copy goes through ``ggml_backend_tensor_get``.

Usage (low-level llama-cpp-python API)::

    capture = LayerCapture(layer_index=n_layer - 1, n_embd=llama_model_n_embd(model))
    params = llama_context_default_params()
    params.kv_unified = True        # rows then come back in batch order
    capture.install(params)         # keep ``capture`` alive as long as the context
    ctx = llama_init_from_model(model, params)
    capture.arm(batch.n_tokens)     # every row must be requested as an output (batch.logits[i] = 1)
    llama_decode(ctx, batch)        # may run several ubatches: their rows are appended in order
    hidden = capture.take()         # float32, shape (batch.n_tokens, n_embd)

Row count and order: llama.cpp prunes the last layer of a model to the rows requested as outputs before its
post-attention norm, so when ``layer_index`` is the model's last layer only output rows exist (request all). With
``kv_unified=True`` the batch is split into ubatches in batch order; with ``kv_unified=False`` and several
sequences, rows come grouped by sequence instead, which this class cannot undo.

Cost: the scheduler calls back for every graph node (about 40 per layer for gemma3: 727 per decode step of the
18-layer 270M model). A ctypes callback costs ~8 us per call and takes the GIL each time: ~3 ms per step of a
9-layer shard, more than its compute, and far worse while the node's event loop holds the GIL. So the name check
runs in C (``capture_eval.c``, compiled at first use with the system C compiler and cached); only the claimed node
calls into Python, once per ubatch, to copy its rows. Without a working C compiler the Python callback is used,
with a warning (same results, slower). ``tests/bench/bench_ggml_capture.py`` measures both.

Several residual streams (deepseek4): V4's layers exchange ``hc_mult`` hyper-connection streams (``l_last-<il>`` is
``[n_embd, hc_mult, n_tokens]``), but llama.cpp's only input is one ``n_embd`` row per token, which the graph
repeats ``hc_mult`` times (``hc_init``). So a shard after the head claims ``hc_init`` too (``inject``): once the
scheduler has computed it, the ``ask=False`` call overwrites its rows with the previous shard's streams
(``feed``), before layer 0 reads them. On the CPU backend a computed node's buffer is the one later nodes read;
``ggml_backend_tensor_set`` works for device buffers as well, but then only if the node is not fused into its
consumers (the scheduler never fuses across a claimed node). The shard is fed token id 0 for every row (any id:
its value is overwritten), which keeps llama.cpp on its token path (``ubatch.embd`` would take deepseek4's media
path).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from actors.backend import Hidden
from actors.backends.llamacpp.library import library_dir
from schemas.errors import BackendError
from schemas.settings import Settings

_GGML_TYPE_F32 = 0
_GGML_MAX_DIMS = 4
_GGML_MAX_SRC = 10
_GGML_MAX_OP_PARAMS = 64
_GGML_MAX_NAME = 64
_F32_BYTES = 4


class _TensorHead(ctypes.Structure):
    """``struct ggml_tensor`` up to ``name`` (ggml.h at llama.cpp 0c1e57098); checked at runtime by ``_ggml()``."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (_GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _GGML_MAX_NAME),
    ]


_NAME_OFFSET: int = _TensorHead.name.offset

log = logging.getLogger(__name__)

_COPY_FN = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)

NATIVE_SOURCE = Path(__file__).with_name("capture_eval.c")


class _NativeCapture(ctypes.Structure):
    """``struct swarmroute_capture`` of capture_eval.c: the callback's user data."""

    _fields_ = [("name_offset", ctypes.c_int64), ("copy", _COPY_FN), ("key", ctypes.c_char * _GGML_MAX_NAME),
                ("inject_key", ctypes.c_char * _GGML_MAX_NAME)]


def native_library_path(directory: Path) -> Path:
    """Where the compiled callback is cached in ``directory``: keyed by the source and the machine, so an edit
    rebuilds it."""
    digest = hashlib.sha256(NATIVE_SOURCE.read_bytes() + platform.machine().encode()).hexdigest()[:16]
    return directory / f"capture_eval-{digest}.so"


def default_native_dir() -> Path:
    """``<SWARMROUTE_HOME>/native``: built artifacts live under the home the operator chose, like models."""
    return Settings().home / "native"


@functools.cache
def _native(directory: Path) -> Any | None:
    """The C eval callback (``swarmroute_capture_eval``), compiled once into ``directory``; ``None`` if no C
    compiler works here."""
    target = native_library_path(directory)
    if not target.exists():
        compiler = shlex.split(sysconfig.get_config_var("CC") or "cc") or ["cc"]
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            subprocess.run([*compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(NATIVE_SOURCE)],
                           check=True, capture_output=True, timeout=120)
            os.replace(partial, target)  # atomic: nodes starting together never load a half-written file
        except (OSError, subprocess.SubprocessError) as exc:
            detail = exc.stderr.decode(errors="replace").strip() if isinstance(exc, subprocess.CalledProcessError) \
                else str(exc)
            log.warning("could not compile the native layer-capture callback (%s); using the Python callback, "
                        "which costs ~3 ms more per decode step on a 9-layer shard", detail or type(exc).__name__)
            return None
    function = ctypes.CDLL(str(target)).swarmroute_capture_eval
    return ctypes.cast(function, llama_cpp.ggml_backend_sched_eval_callback)


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@dataclasses.dataclass(frozen=True, slots=True)
class _Ggml:
    """The few libggml-base functions llama-cpp-python does not bind."""

    tensor_get: Callable[[int, int, int, int], None]
    """``ggml_backend_tensor_get(tensor, dst, offset, size)``: works for host and device buffers alike."""
    tensor_set: Callable[[int, int, int, int], None]
    """``ggml_backend_tensor_set(tensor, src, offset, size)``."""


def _library_path() -> Path:
    return library_dir() / "libggml-base.so"


@functools.cache
def _ggml() -> _Ggml:
    """Bind libggml-base (the copy libllama already loaded) and check ``_TensorHead`` against the real layout."""
    lib = ctypes.CDLL(str(_library_path()))
    lib.ggml_init.argtypes, lib.ggml_init.restype = [_InitParams], ctypes.c_void_p
    lib.ggml_free.argtypes, lib.ggml_free.restype = [ctypes.c_void_p], None
    lib.ggml_tensor_overhead.argtypes, lib.ggml_tensor_overhead.restype = [], ctypes.c_size_t
    lib.ggml_new_tensor_2d.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.ggml_new_tensor_2d.restype = ctypes.c_void_p
    lib.ggml_set_name.argtypes, lib.ggml_set_name.restype = [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p
    lib.ggml_get_name.argtypes, lib.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_void_p
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_set.restype = None
    _check_layout(lib)
    return _Ggml(tensor_get=lib.ggml_backend_tensor_get, tensor_set=lib.ggml_backend_tensor_set)


def _check_layout(lib: ctypes.CDLL) -> None:
    # The hot path reads the name and shape straight from the struct: a different ggml build must fail loudly here,
    # not compare garbage.
    ctx = lib.ggml_init(_InitParams(mem_size=4 * lib.ggml_tensor_overhead(), mem_buffer=None, no_alloc=True))
    if not ctx:
        raise BackendError("ggml_init failed while checking the ggml_tensor layout")
    try:
        t = lib.ggml_new_tensor_2d(ctx, _GGML_TYPE_F32, 3, 5)
        lib.ggml_set_name(t, b"l_out-7")
        head = _TensorHead.from_address(t)
        ok = (lib.ggml_get_name(t) == t + _NAME_OFFSET and head.name == b"l_out-7" and head.type == _GGML_TYPE_F32
              and list(head.ne) == [3, 5, 1, 1] and list(head.nb) == [4, 12, 60, 60])
    finally:
        lib.ggml_free(ctx)
    if not ok:
        raise BackendError(f"ggml_tensor layout of {_library_path()} differs from the one ggml_capture was written for")


def tensor_name(tensor: int) -> str:
    """The name of the ggml tensor at address ``tensor`` (as an eval callback receives it); for diagnostics."""
    _ggml()  # the layout check
    name: bytes = _TensorHead.from_address(tensor).name
    return name.decode(errors="replace")


@dataclasses.dataclass(slots=True)
class CaptureStats:
    """What a ``LayerCapture`` did since it was made (or since ``reset_stats``)."""

    captures: int = 0
    """Tensors copied out: one per ubatch."""
    rows: int = 0
    """Hidden-state rows copied out."""
    bytes: int = 0
    copy_seconds: float = 0.0
    """Time spent in the ``ask=False`` path (shape checks + copy), not the per-node name checks."""
    ask_calls: int = 0
    """Name checks (``ask=True`` calls); counted only when the capture was made with ``count_asks=True``."""
    injected_rows: int = 0
    """Input rows written into the graph (``inject``)."""


class LayerCapture:
    """Claims the ``<node>-<layer_index>`` node (``l_out``) of every graph a llama.cpp context computes and copies
    it out; with ``inject``, also overwrites that input node with rows given to ``feed``.

    One instance per context, used from the thread that calls ``llama_decode``. The ``callback`` must stay
    referenced for as long as the context lives (ctypes frees the trampoline with the object).
    """

    def __init__(self, layer_index: int | None, n_embd: int, *, stop_after: bool = True, count_asks: bool = False,
                 native_dir: Path | None = None, node: str = "l_out", streams: int = 1, inject: str = "") -> None:
        """``layer_index`` is numbered as the loaded model numbers its layers (a shard GGUF counts from 0); ``None``
        copies nothing out (a tail that only takes ``inject``ed input).

        ``stop_after``: cancel the rest of the graph once the layer is copied (skips ``output_norm`` + lm_head and,
        in a full model, the later layers and their KV writes). ``count_asks``: count name checks in ``stats``,
        at the price of a counter increment per graph node. ``native_dir``: where the C callback is compiled and
        cached (default ``default_native_dir()``). ``node``: the layer-output name stem (``l_last`` for
        deepseek4). ``streams``: residual streams per position (a row is ``streams * n_embd`` floats; the node is
        ``[n_embd, streams, rows]`` when ``streams > 1``). ``inject``: the input node to overwrite (``hc_init``).
        """
        if (layer_index is not None and layer_index < 0) or n_embd <= 0 or streams <= 0:
            raise ValueError(f"bad layer_index {layer_index}, n_embd {n_embd} or streams {streams}")
        if layer_index is None and not inject:
            raise ValueError("a LayerCapture must copy a layer out, write an input in, or both")
        self.layer_index = layer_index
        self.n_embd = n_embd
        self.streams = streams
        self.row = n_embd * streams
        self.stop_after = stop_after
        self.stats = CaptureStats()
        self._ggml = _ggml()
        self._label = "" if layer_index is None else f"{node}-{layer_index}"
        self._key = self._label.encode() + b"\0"
        self._inject = inject.encode()
        self._out: Hidden | None = None
        self._filled = 0
        self._in: Hidden | None = None
        self._written = 0
        self._error: str | None = None
        native = None if count_asks else _native(native_dir or default_native_dir())
        self.native = native is not None
        """Whether the name checks run in C (see the module docstring)."""
        if native is not None:
            self._copy_fn = _COPY_FN(self._copy)
            self._user_data = _NativeCapture(name_offset=_NAME_OFFSET, copy=self._copy_fn, key=self._key,
                                             inject_key=self._inject + b"\0")
            self._callback = native
        else:
            self._callback = llama_cpp.ggml_backend_sched_eval_callback(self._make_callback(count_asks))

    @property
    def callback(self) -> Any:
        """The ctypes function pointer for ``llama_context_params.cb_eval`` (a ``ggml_backend_sched_eval_callback``)."""
        return self._callback

    @property
    def copies_out(self) -> bool:
        return self.layer_index is not None

    @property
    def writes_in(self) -> bool:
        return bool(self._inject)

    def install(self, params: llama_cpp.llama_context_params) -> None:
        """Put the callback into context params (before ``llama_init_from_model``)."""
        params.cb_eval = self._callback
        params.cb_eval_user_data = ctypes.cast(ctypes.pointer(self._user_data), ctypes.c_void_p) if self.native \
            else ctypes.c_void_p()

    @property
    def armed(self) -> bool:
        return self._out is not None

    def arm(self, n_rows: int) -> None:
        """Expect ``n_rows`` rows (all ubatches of the next decode together); drops any earlier partial capture."""
        if n_rows <= 0:
            raise ValueError(f"n_rows must be positive, got {n_rows}")
        self._out = np.empty((n_rows, self.row), dtype=np.float32)
        self._filled = 0
        self._error = None

    def feed(self, rows: Hidden) -> None:
        """The input rows of the next decode (``(n, streams * n_embd)`` float32, batch order), written into the
        ``inject`` node ubatch by ubatch."""
        if not self._inject:
            raise BackendError("this capture writes no input node")
        self._in = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, self.row)
        self._written = 0
        self._error = None

    def fed(self) -> None:
        """After the decode: raises ``BackendError`` unless every fed row went into the graph."""
        rows, written, error = self._in, self._written, self._error
        self._in, self._written = None, 0
        if error is not None:
            self._error = None
            raise BackendError(f"writing {self._inject.decode()} failed: {error}")
        if rows is None or written != rows.shape[0]:
            n = 0 if rows is None else rows.shape[0]
            raise BackendError(f"wrote {written} of {n} input rows into {self._inject.decode()}")

    def take(self) -> Hidden:
        """The captured rows, shape ``(n_rows, streams * n_embd)``; disarms. Raises ``BackendError`` if
        incomplete or failed."""
        out, filled, error = self._out, self._filled, self._error
        self._out, self._filled, self._error = None, 0, None
        if out is None:
            raise BackendError("LayerCapture.take() without arm()")
        if error is not None:
            raise BackendError(f"capture of {self._label} failed: {error}")
        if filled != out.shape[0]:
            raise BackendError(f"captured {filled} of {out.shape[0]} rows of {self._label} "
                               "(were all rows requested as outputs, and does the layer exist?)")
        return out

    def reset_stats(self) -> None:
        self.stats = CaptureStats()

    def _make_callback(self, count_asks: bool) -> Callable[[int, bool, int | None], bool]:
        # Locals, not attributes: this runs for every graph node. One 8-byte load settles almost every node
        # ("l_out-<il>\0" is at least 8 bytes); only names sharing those 8 bytes reach the full compare.
        key, n_key, name_offset = self._key, len(self._key), _NAME_OFFSET
        prefix = int.from_bytes(key[:8].ljust(8, b"\0"), "little") if self.layer_index is not None else -1
        inject, n_inject = self._inject + b"\0", len(self._inject) + 1
        load_u64, string_at, on_claimed = ctypes.c_uint64.from_address, ctypes.string_at, self._copy

        def claims(name: int) -> bool:
            return (load_u64(name).value == prefix and string_at(name, n_key) == key) or \
                (n_inject > 1 and string_at(name, n_inject) == inject)

        def on_eval(tensor: int, ask: bool, _user_data: int | None) -> bool:
            if ask:
                return claims(tensor + name_offset)
            return on_claimed(tensor)

        def on_eval_counting(tensor: int, ask: bool, _user_data: int | None) -> bool:
            if ask:
                self.stats.ask_calls += 1
                return claims(tensor + name_offset)
            return on_claimed(tensor)

        return on_eval_counting if count_asks else on_eval

    def _copy(self, tensor: int) -> bool:
        """The ``ask=False`` call: returns whether the scheduler should go on computing the graph."""
        head = _TensorHead.from_address(tensor)
        if self._inject and head.name == self._inject:
            return self._write(tensor, head)
        out = self._out
        if out is None:
            return True
        started = time.perf_counter()
        try:
            rows = self._check(head, out.shape[0] - self._filled, self._label)
            dst = out[self._filled:self._filled + rows]
            self._ggml.tensor_get(tensor, dst.ctypes.data, 0, dst.nbytes)
        except Exception as e:  # noqa: BLE001 - an exception cannot cross the C callback; take() reports it
            self._error = f"{type(e).__name__}: {e}"
            return False
        self._filled += rows
        s = self.stats
        s.captures, s.rows, s.bytes = s.captures + 1, s.rows + rows, s.bytes + dst.nbytes
        s.copy_seconds += time.perf_counter() - started
        return not self.stop_after

    def _write(self, tensor: int, head: _TensorHead) -> bool:
        rows_in = self._in
        try:
            if rows_in is None:
                raise BackendError("no input rows were fed for this decode")
            rows = self._check(head, rows_in.shape[0] - self._written, self._inject.decode())
            src = rows_in[self._written:self._written + rows]
            self._ggml.tensor_set(tensor, src.ctypes.data, 0, src.nbytes)
        except Exception as e:  # noqa: BLE001 - an exception cannot cross the C callback; fed() reports it
            self._error = f"{type(e).__name__}: {e}"
            return False  # cancels the rest of the graph: nothing is computed from the repeated input
        self._written += rows
        self.stats.injected_rows += rows
        return True

    def _check(self, head: _TensorHead, room: int, label: str) -> int:
        n_embd = head.ne[0]
        if head.type != _GGML_TYPE_F32:
            raise BackendError(f"{label} has ggml type {head.type}, expected F32")
        if self.streams == 1:
            rows, shape_ok = head.ne[1], head.ne[2] == 1 and head.ne[3] == 1
            expected = f"[{self.n_embd}, rows]"
        else:
            rows, shape_ok = head.ne[2], head.ne[1] == self.streams and head.ne[3] == 1
            expected = f"[{self.n_embd}, {self.streams}, rows]"
        if n_embd != self.n_embd or not shape_ok:
            raise BackendError(f"{label} has shape {list(head.ne)}, expected {expected}")
        if head.nb[0] != _F32_BYTES or head.nb[1] != _F32_BYTES * n_embd or \
                (self.streams > 1 and head.nb[2] != _F32_BYTES * self.row):
            raise BackendError(f"{label} is not contiguous (nb={list(head.nb)})")
        if rows > room:
            raise BackendError(f"{label} brought {rows} rows with room for {room} (arm() or feed() too small)")
        return int(rows)
