"""llama.cpp's per-sequence KV state bytes, taken apart for a cache with one stream per sequence.

With ``kv_unified = false`` every sequence has its own KV stream (batch invariance: ``backend.py``), and two things
the unified cache gave for free are gone: tagging a range of a sequence's cells with a scratch sequence (a
cross-stream ``llama_memory_seq_cp`` copies a whole stream, and only at the next decode), and adding cells to a
sequence without dropping the ones it has (``llama_state_seq_set_data`` clears its destination first). So a range is
exported by serializing the whole sequence and keeping the cells of that range, and an import merges the sequence's
own cells with the imported ones and restores them in one call.

The bytes are ``llama_state_seq_get_data``'s: a header (u32 magic, i32 sequence id; src/llama-context.cpp at
0c1e57098), then what ``llama_kv_cache::state_write`` writes for the sequence (src/llama-kv-cache.cpp), once per
cache of the context (an iSWA model has two: the global layers', then the windowed layers'), each::

    u32 n_stream; per stream: u32 cell_count; if cell_count: cells, data
    cells: cell_count x (i32 pos, u32 n_seq_id = 1, [12-byte ext: M-RoPE / PLE models], i32 seq_id)
    data:  u32 v_trans, u32 n_layer; n_layer x (i32 k_type, u64 k_row, cell_count rows);
           per layer with V: (i32 v_type, u64 v_row, cell_count rows), or transposed
           (i32 v_type, u32 v_el, u32 n_embd_v, n_embd_v x cell_count elements)

Only the sequence's own stream has cells. A piece (``pack``) carries each cache's cells without the stream layout,
so it restores into any stream of any context of the same model and layer range (nodes may differ in
``max_sessions``). Every length is checked: bytes that are not such a state raise ``SnapshotError``.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from schemas.errors import SnapshotError

MAGIC = b"KVS1"
HEADER = 8
"""``llama_state_seq_get_data``'s header before the caches' parts: u32 magic, i32 sequence id."""
_U32 = struct.Struct("<I")
_SECTION = struct.Struct("<IQ")
_DATA_HEAD = struct.Struct("<II")
_HEAD = 12
"""Every per-layer header is 12 bytes: (i32 type, u64 row size), or (i32 type, u32 element size, u32 rows)."""
_CELL = 12
_CELL_EXT = 24

Bytes = npt.NDArray[np.uint8]


@dataclasses.dataclass
class Cells:
    """One cache's cells of one sequence: per-cell records and per-layer data, cells along axis 0 (axis 1 of a
    transposed V)."""

    records: Bytes
    """(cells, 12 or 24): pos, n_seq_id, [ext], seq_id."""
    v_trans: int
    k: list[tuple[bytes, Bytes]]
    v: list[tuple[bytes, Bytes]]

    @property
    def n(self) -> int:
        return int(self.records.shape[0])

    @property
    def positions(self) -> npt.NDArray[np.int32]:
        return self.records[:, :4].copy().view("<i4").reshape(-1)

    def select(self, keep: npt.NDArray[np.bool_] | npt.NDArray[np.intp]) -> Cells:
        """The cells ``keep`` picks (a mask, or indices in the order wanted)."""
        return Cells(self.records[keep], self.v_trans, [(h, d[keep]) for h, d in self.k],
                     [(h, d[:, keep] if self.v_trans else d[keep]) for h, d in self.v])

    def blank(self, positions: npt.NDArray[np.int64]) -> Cells:
        """Cells at ``positions`` laid out like these, their keys and values zero (placeholders that hold a stream's
        cells in place, at positions every later query masks)."""
        n = len(positions)
        records = np.repeat(self.records[:1], n, axis=0)
        records[:, :4] = positions.astype("<i4").view(np.uint8).reshape(n, 4)
        if records.shape[1] == _CELL_EXT:
            records[:, 8:20] = 0
        return Cells(records, self.v_trans, [(h, np.zeros((n, d.shape[1]), np.uint8)) for h, d in self.k],
                     [(h, np.zeros((d.shape[0], n, d.shape[2]) if self.v_trans else (n, d.shape[1]), np.uint8))
                      for h, d in self.v])

    def to_bytes(self) -> bytes:
        if not self.n:
            return b""
        parts = [self.records.tobytes(), _DATA_HEAD.pack(self.v_trans, len(self.k))]
        for head, data in (*self.k, *self.v):
            parts += [head, data.tobytes()]
        return b"".join(parts)


def parse_cells(payload: bytes, count: int) -> Cells:
    """The cells of one stream (``count`` of them, ``payload`` from the first cell to the stream's end)."""
    for size in (_CELL, _CELL_EXT):
        cells = _try_parse(payload, count, size)
        if cells is not None:
            return cells
    raise SnapshotError(f"not llama.cpp KV state of {count} cells ({len(payload)} bytes)")


def _try_parse(payload: bytes, count: int, size: int) -> Cells | None:
    raw = np.frombuffer(payload, dtype=np.uint8)
    at = count * size
    if count <= 0 or len(raw) < at + _DATA_HEAD.size:
        return None
    records = raw[:at].reshape(count, size)
    if np.any(records[:, 4:8].copy().view("<u4") != 1):
        return None
    v_trans, n_layer = _DATA_HEAD.unpack_from(payload, at)
    at += _DATA_HEAD.size
    if v_trans > 1:
        return None
    k: list[tuple[bytes, Bytes]] = []
    v: list[tuple[bytes, Bytes]] = []
    while at < len(raw):
        if at + _HEAD > len(raw):
            return None
        head = payload[at:at + _HEAD]
        at += _HEAD
        transposed = v_trans and len(k) == n_layer
        if transposed:
            el, rows = struct.unpack_from("<II", head, 4)
            size_row = rows * count * el
        else:
            (size_row,) = struct.unpack_from("<Q", head, 4)
            size_row *= count
        if at + size_row > len(raw) or size_row == 0:
            return None
        data = raw[at:at + size_row]
        at += size_row
        entry = data.reshape(rows, count, el) if transposed else data.reshape(count, -1)
        (k if len(k) < n_layer else v).append((head, entry))
    if len(k) != n_layer or len(v) > n_layer:
        return None
    return Cells(records.copy(), int(v_trans), k, v)


def split_sections(state: bytes, last_size: int) -> list[bytes]:
    """The per-cache parts of ``llama_state_seq_get_data``'s bytes after ``HEADER``; ``last_size`` is the size
    llama.cpp gives (less ``HEADER``) with
    ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` (an iSWA cache writes only its windowed layers then; any other cache
    ignores the flag and writes everything)."""
    if 0 < last_size < len(state):
        return [state[:len(state) - last_size], state[len(state) - last_size:]]
    return [state]


def stream_cells(section: bytes) -> tuple[int, Cells | None]:
    """``(n_stream, cells)`` of one cache's part: the cells of the one stream that has any (``None``: none has)."""
    if len(section) < _U32.size:
        raise SnapshotError("llama.cpp KV state cut short")
    (n_stream,) = _U32.unpack_from(section)
    if len(section) < _U32.size * (1 + n_stream):
        raise SnapshotError("llama.cpp KV state cut short")
    counts = np.frombuffer(section, dtype="<u4", count=n_stream, offset=_U32.size)
    nonzero = np.flatnonzero(counts)
    if len(nonzero) == 0:
        if len(section) != _U32.size * (1 + n_stream):
            raise SnapshotError("llama.cpp KV state of no cells has trailing bytes")
        return n_stream, None
    s = int(nonzero[0])
    start, end = _U32.size * (s + 2), len(section) - _U32.size * (n_stream - 1 - s)
    tail = np.frombuffer(section[end:], dtype="<u4")
    if end <= start or np.any(tail != 0):
        raise SnapshotError("llama.cpp KV state holds cells of more than one stream")
    return n_stream, parse_cells(section[start:end], int(counts[s]))


def stream_bytes(cells: Cells | None, n_stream: int, stream: int) -> bytes:
    """One cache's part as llama.cpp reads it back into ``stream`` of a context of ``n_stream`` streams."""
    counts = [0] * n_stream
    body = b""
    if cells is not None and cells.n:
        counts[stream], body = cells.n, cells.to_bytes()
    head = _U32.pack(n_stream) + b"".join(_U32.pack(c) for c in counts[:stream + 1])
    return head + body + b"".join(_U32.pack(c) for c in counts[stream + 1:])


def pack(sections: Sequence[Cells | None]) -> bytes:
    """A stream-free piece of one sequence's cells, one entry per cache."""
    parts = [MAGIC, _U32.pack(len(sections))]
    for cells in sections:
        body = b"" if cells is None else cells.to_bytes()
        parts += [_SECTION.pack(0 if cells is None else cells.n, len(body)), body]
    return b"".join(parts)


def unpack(piece: bytes) -> list[Cells | None]:
    """The caches' cells of a ``pack``; ``SnapshotError`` for anything else (a unified cache's raw state
    included)."""
    if piece[:len(MAGIC)] != MAGIC:
        raise SnapshotError("a KV piece not from a node with per-sequence KV streams (batch-invariant nodes "
                            "exchange KV only with each other)")
    at = len(MAGIC)
    if len(piece) < at + _U32.size:
        raise SnapshotError("a KV piece cut short")
    (n,), at = _U32.unpack_from(piece, at), at + _U32.size
    out: list[Cells | None] = []
    for _ in range(n):
        if at + _SECTION.size > len(piece):
            raise SnapshotError("a KV piece cut short")
        count, size = _SECTION.unpack_from(piece, at)
        at += _SECTION.size
        if at + size > len(piece):
            raise SnapshotError("a KV piece cut short")
        out.append(parse_cells(piece[at:at + size], count) if count else None)
        at += size
    if at != len(piece):
        raise SnapshotError(f"{len(piece) - at} bytes after the last section of a KV piece")
    return out


def merge(parts: Sequence[Cells | None]) -> Cells | None:
    """The cells of ``parts`` (one cache's), in order; ``SnapshotError`` if their layers differ."""
    present = [p for p in parts if p is not None and p.n]
    if not present:
        return None
    first = present[0]
    shape = _layout(first)
    for other in present[1:]:
        if _layout(other) != shape:
            raise SnapshotError("KV pieces of different layer layouts (another model or layer range)")
    if len(present) == 1:
        return first
    axis = 1 if first.v_trans else 0
    return Cells(np.concatenate([p.records for p in present]), first.v_trans,
                 [(h, np.concatenate([p.k[i][1] for p in present])) for i, (h, _) in enumerate(first.k)],
                 [(h, np.concatenate([p.v[i][1] for p in present], axis=axis)) for i, (h, _) in enumerate(first.v)])


def _layout(cells: Cells) -> tuple[object, ...]:
    return (cells.records.shape[1], cells.v_trans, tuple(h for h, _ in cells.k), tuple(h for h, _ in cells.v))
