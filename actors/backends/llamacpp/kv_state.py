"""One session's KV cells in and out of a llama.cpp context: export a range of positions as a blob, import blobs,
and truncate (issue #18 snapshots and reuse, issue #20 rollback).

Everything goes through llama.cpp's public per-sequence API. A *range* of positions is exported by tagging the
session's cells of that range with a scratch sequence (``llama_memory_seq_cp`` on the unified cache only adds a
sequence id to the cells; nothing is copied) and serializing the scratch sequence (``llama_state_seq_get_data``);
an import restores a blob into the scratch sequence (``llama_state_seq_set_data`` clears its destination first) and
tags the restored cells with the session's sequence. So a snapshot is a chain of segments, each holding only the
positions it adds: a session's snapshot costs its KV once, not once per segment.

Sliding-window layers: llama.cpp writes only the cells still inside the window of a sequence's last position
(older ones are masked and may be reused), so a segment of ``[0, P)`` holds every global layer's cells but only the
window's cells of the windowed layers (a piece exports every cell of its positions that is still there, so a chain
of pieces keeps them all until llama.cpp reuses them). ``continues`` checks that an imported prefix has every cell
its next position attends to.

deepseek4 (``whole_sequences``): llama.cpp's V4 cache (``llama_kv_cache_dsv4``) copies only whole sequences
(``seq_cp`` asserts "DSV4 only supports full sequence copies", an abort) and drops only positions past the end or
within its rollback ring (``seq_rm``). Its compressor frontier (the unfinished 4- and 128-position blocks) cannot be
cut at an arbitrary position either. So a V4 export is the whole sequence, ``[0, position)``, serialized straight
from the session's own sequence, and an import restores it into an empty session; a range starting after 0 is
refused with ``SnapshotError`` (a snapshot chain then restarts from position 0). The backend gives the V4 context a
rollback ring (``n_rs_seq``) as deep as a verify window, so speculation's rejected positions can be dropped; a
deeper cut (prefix reuse of a shorter prefix) is refused with ``SnapshotError``.

Not thread-safe: the backend calls these under its lock, on its worker thread.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import llama_cpp

from schemas.errors import BackendError, SnapshotError

_PIECES = struct.Struct("<I")
_PIECE = struct.Struct("<Q")


def _pieces(blob: bytes) -> list[bytes]:
    """The pieces of an ``export``; ``SnapshotError`` for bytes that are not one."""
    view = memoryview(blob)
    if len(view) < _PIECES.size:
        raise SnapshotError("a KV blob of fewer than 4 bytes")
    (count,), at, pieces = _PIECES.unpack_from(view), _PIECES.size, []
    for _ in range(count):
        if at + _PIECE.size > len(view):
            raise SnapshotError("a KV blob cut short")
        (size,) = _PIECE.unpack_from(view, at)
        at += _PIECE.size
        if at + size > len(view):
            raise SnapshotError("a KV blob cut short")
        pieces.append(bytes(view[at:at + size]))
        at += size
    if at != len(view):
        raise SnapshotError(f"{len(view) - at} bytes after the last piece of a KV blob")
    return pieces


class KvCells:
    """The KV operations on one context's unified cache, with ``scratch`` a sequence id no session uses."""

    def __init__(self, ctx: Any, memory: Any, scratch: int, n_swa: int, *, whole_sequences: bool = False) -> None:
        self._ctx = ctx
        self._memory = memory
        self._scratch = scratch
        self.n_swa = n_swa
        """Sliding window of the model's windowed layers; 0 when it has none."""
        self.whole_sequences = whole_sequences
        """The cache moves only whole sequences (deepseek4; see the module docstring)."""

    def export_whole(self, seq: int, start: int, end: int, held: int) -> bytes:
        """``export`` for a cache that moves whole sequences: ``[0, held)`` only."""
        if start != 0 or end != held:
            raise SnapshotError(f"this model's state (deepseek4's cache, or recurrent) exports only a whole sequence "
                                f"[0, {held}), not [{start}, {end}): its compressor state cannot be cut there")
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        written = int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq))
        if written <= 0 or written > size:
            raise BackendError(f"llama.cpp wrote {written} bytes of state for positions [0, {end})")
        return _PIECES.pack(1) + _PIECE.pack(written) + bytes(memoryview(buf)[:written])

    def load_whole(self, seq: int, blobs: list[bytes], held: int) -> None:
        """``load`` for a cache that moves whole sequences: one export into an empty sequence."""
        if held != 0 or len(blobs) != 1:
            raise SnapshotError(f"this model's state (deepseek4's cache, or recurrent) imports one whole-sequence "
                                f"export into an empty session; got {len(blobs)} blobs for a session at {held}")
        pieces = _pieces(blobs[0])
        if len(pieces) != 1:
            raise SnapshotError(f"a whole-sequence KV export has one piece, this one {len(pieces)}")
        piece = pieces[0]
        buf = (ctypes.c_uint8 * len(piece)).from_buffer_copy(piece)
        if int(llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(piece), seq)) == 0:
            raise SnapshotError("llama.cpp refused the KV state (another model or layer range, or a cache without "
                                "room for it)")

    def export(self, seq: int, start: int, end: int) -> bytes:
        """llama.cpp's serialized state of positions ``[start, end)`` of sequence ``seq``, in pieces of at most one
        window: a piece holds every cell of its positions that the sequence still has, so an import rebuilds the
        same cells in the same order, and a session rebuilt on an idle node computes what the original did."""
        step = min(self.n_swa, end - start) if self.n_swa else end - start
        pieces = [self._export_piece(seq, a, min(a + step, end)) for a in range(start, end, step)]
        return _PIECES.pack(len(pieces)) + b"".join(_PIECE.pack(len(p)) + p for p in pieces)

    def _export_piece(self, seq: int, start: int, end: int) -> bytes:
        scratch = self._scratch
        llama_cpp.llama_memory_seq_rm(self._memory, scratch, -1, -1)
        try:
            llama_cpp.llama_memory_seq_cp(self._memory, seq, scratch, start, end)
            size = int(llama_cpp.llama_state_seq_get_size(self._ctx, scratch))
            buf = (ctypes.c_uint8 * size)()
            written = int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, scratch))
        finally:
            llama_cpp.llama_memory_seq_rm(self._memory, scratch, -1, -1)
        if written <= 0 or written > size:
            raise BackendError(f"llama.cpp wrote {written} bytes of state for positions [{start}, {end})")
        return bytes(memoryview(buf)[:written])

    def load(self, seq: int, blob: bytes) -> None:
        """Add the cells of ``blob`` (an ``export``) to sequence ``seq``. ``SnapshotError`` if llama.cpp refuses it
        (another model's or layer range's state, or no room in the cache)."""
        for piece in _pieces(blob):
            self._load_piece(seq, piece)

    def _load_piece(self, seq: int, blob: bytes) -> None:
        scratch = self._scratch
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        try:
            read = int(llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(blob), scratch))
            if read == 0:
                raise SnapshotError("llama.cpp refused the KV state (another model or layer range, or a cache "
                                    "without room for it)")
            llama_cpp.llama_memory_seq_cp(self._memory, scratch, seq, -1, -1)
        finally:
            llama_cpp.llama_memory_seq_rm(self._memory, scratch, -1, -1)

    def truncate(self, seq: int, position: int) -> None:
        """Drop every cell of ``seq`` at ``position`` or later."""
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq, position, -1):
            if self.whole_sequences:
                ring = int(llama_cpp.llama_n_rs_seq(self._ctx))
                raise SnapshotError(f"this model's state (deepseek4's cache, or recurrent) drops at most the last "
                                    f"{ring} positions, once between two decodes (its rollback ring), or all of "
                                    f"them; not the positions from {position} on")
            raise BackendError(f"llama.cpp could not drop positions from {position} on")

    def span(self, seq: int) -> tuple[int, int]:
        """(lowest, highest) position ``seq`` holds; (-1, -1) when it holds none."""
        return (int(llama_cpp.llama_memory_seq_pos_min(self._memory, seq)),
                int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq)))

    def continues(self, seq: int, held: int) -> bool:
        """Whether sequence ``seq``, holding positions ``[0, held)``, has every cell position ``held`` attends to:
        llama.cpp keeps a sequence's positions contiguous from its lowest (``llama_memory_seq_pos_min``, which for
        windowed layers says where their cells start) to its highest."""
        if held <= 0:
            return True
        low, high = self.span(seq)
        if high != held - 1:
            return False
        if self.whole_sequences:
            # A whole-sequence import brings every cell and compressor row the sequence had; the V4 cache reports
            # only its newest raw cell as the lowest position.
            return True
        return low <= 0 or (self.n_swa > 0 and low <= held - self.n_swa + 1)
