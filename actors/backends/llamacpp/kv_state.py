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

Per-sequence streams (``streams=True``, the batch-invariant layout): none of the above tagging works across
streams, so a range is cut out of the sequence's whole state and an import merges the sequence's cells with the
imported ones (``kv_format``); a piece is one stream-free ``kv_format.pack``, and a windowed layer's cells older
than the window of the highest position are dropped on import (they are masked, and would not fit its stream).

Not thread-safe: the backend calls these under its lock, on its worker thread.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

import llama_cpp
import numpy as np

from actors.backends.llamacpp import kv_format
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

    def __init__(self, ctx: Any, memory: Any, scratch: int, n_swa: int, streams: bool = False,
                 swa_cells: int = 0, *, whole_sequences: bool = False) -> None:
        self._ctx = ctx
        self._memory = memory
        self._scratch = scratch
        self.n_swa = n_swa
        """Sliding window of the model's windowed layers; 0 when it has none."""
        self.whole_sequences = whole_sequences
        """The cache moves only whole sequences (deepseek4; see the module docstring)."""
        self.streams = streams
        """One KV stream per sequence (``kv_unified = false``); the context has ``scratch + 1`` of them."""
        self.swa_cells = swa_cells
        """With streams: cells of a windowed layer's stream (a ring its positions go round)."""

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
        if self.streams:
            cells = [None if c is None else c.select((c.positions >= start) & (c.positions < end))
                     for c in self._sections(seq, self._state(seq))]
            piece = kv_format.pack(cells)
            return _PIECES.pack(1) + _PIECE.pack(len(piece)) + piece
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

    def load_all(self, seq: int, blobs: list[bytes]) -> None:
        """``load`` every blob, in order (with streams, one restore of the merged cells)."""
        if not self.streams:
            for blob in blobs:
                self.load(seq, blob)
            return
        before = self._state(seq)
        current = self._sections(seq, before)
        pieces = [kv_format.unpack(p) for blob in blobs for p in _pieces(blob)]
        if any(len(p) != len(current) for p in pieces):
            raise SnapshotError("KV state of another model or layer range (its caches differ)")
        merged = [kv_format.merge([cells, *(p[i] for p in pieces)]) for i, cells in enumerate(current)]
        if self.n_swa and merged[-1] is not None:
            pos = merged[-1].positions
            merged[-1] = merged[-1].select(pos > pos.max() - self.n_swa)
            if len(merged) > 1 and self.swa_cells:
                merged[-1] = self._in_place(merged[-1])
        for cells in merged:
            if cells is not None and np.unique(cells.positions).size != cells.n:
                raise SnapshotError("KV pieces that overlap (a position imported twice)")
        n_stream = self._scratch + 1
        body = b"".join(kv_format.stream_bytes(c, n_stream, seq) for c in merged)
        self._restore(seq, before[:kv_format.HEADER] + body, before)

    def _in_place(self, cells: kv_format.Cells) -> kv_format.Cells:
        """A windowed stream's cells in the order that restores each at the cell it had: a session's position ``p``
        sits at cell ``p % swa_cells`` (each pass takes the cells after the last one, round the ring, and those
        hold positions out of the window), and a restore fills the stream from cell 0 in order. Cells before the
        window's first get placeholders at positions every later query masks. The order of the cells in a stream
        is the order attention sums them in, so a session rebuilt so computes what the original did."""
        pos = cells.positions.astype(np.int64)
        ring, first = self.swa_cells, int(pos.min())
        if len(pos) >= ring or int(pos.max()) - first + 1 != len(pos):
            return cells  # not one run of positions: restored packed (close, not bit for bit)
        slots = pos % ring
        top = int(slots.max())
        gaps = np.setdiff1d(np.arange(top + 1), slots)
        filler = gaps + ring * ((first - 1 - gaps) // ring)  # the latest position before ``first`` at that cell
        if len(gaps) and int(filler.min()) < 0:
            return cells
        both = kv_format.merge([cells.blank(filler), cells]) if len(gaps) else cells
        assert both is not None
        order = np.argsort(np.concatenate([gaps, slots]) if len(gaps) else slots, kind="stable")
        return both.select(order)

    def _state(self, seq: int) -> bytes:
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        written = int(llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq))
        if written != size:
            raise BackendError(f"llama.cpp wrote {written} of {size} bytes of state for sequence {seq}")
        return bytes(buf)

    def _sections(self, seq: int, state: bytes) -> list[kv_format.Cells | None]:
        """Each cache's cells of ``seq``, whose whole state is ``state``."""
        partial = int(llama_cpp.llama_state_seq_get_size_ext(self._ctx, seq,
                                                             llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        sections = []
        head = kv_format.HEADER
        for section in kv_format.split_sections(state[head:], partial - head):
            n_stream, cells = kv_format.stream_cells(section)
            if n_stream != self._scratch + 1:
                raise BackendError(f"llama.cpp wrote {n_stream} KV streams, the context has {self._scratch + 1}")
            sections.append(cells)
        return sections

    def _restore(self, seq: int, data: bytes, before: bytes) -> None:
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if int(llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(data), seq)) != len(data):
            back = (ctypes.c_uint8 * len(before)).from_buffer_copy(before)
            llama_cpp.llama_state_seq_set_data(self._ctx, back, len(before), seq)
            raise SnapshotError("llama.cpp refused the KV state (another model or layer range, or a stream "
                                "without room for it)")

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
