"""Snapshot segments on the wire: the metadata and the KV bytes of one segment in one binary body.

Layout (little-endian)::

    0   4  magic "SRS1"
    4   4  metadata bytes (m)
    8   m  metadata: a msgpack ``schemas.snapshot.SnapshotSegment``
    8+m    the KV blob (``size`` bytes, sha256 ``digest``)

``decode`` refuses a body whose blob does not hash to its metadata's digest, so a flipped byte anywhere in the KV is
a ``SnapshotError`` (a flipped byte in the metadata fails its msgpack or validation, or names other content).
"""

from __future__ import annotations

import hashlib
import struct

from bus import codec
from schemas.errors import SnapshotError
from schemas.snapshot import SnapshotSegment

MAGIC = b"SRS1"

_HEAD = struct.Struct("<4sI")


def digest_of(kv: bytes) -> str:
    return hashlib.sha256(kv).hexdigest()


def encode(segment: SnapshotSegment, kv: bytes) -> bytes:
    meta = codec.encode(segment)
    return _HEAD.pack(MAGIC, len(meta)) + meta + kv


def decode(data: bytes) -> tuple[SnapshotSegment, bytes]:
    """The segment and its KV bytes, checked against the digest; ``SnapshotError`` saying what is wrong."""
    if len(data) < _HEAD.size:
        raise SnapshotError(f"a snapshot body of {len(data)} bytes is shorter than its header")
    magic, n_meta = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError(f"bad snapshot magic {magic!r}, expected {MAGIC!r}")
    if _HEAD.size + n_meta > len(data):
        raise SnapshotError("snapshot metadata runs past the end of the body")
    try:
        segment = codec.decode(data[_HEAD.size:_HEAD.size + n_meta], SnapshotSegment)
    except codec.DecodeError as exc:
        raise SnapshotError(f"snapshot metadata: {exc}") from None
    kv = data[_HEAD.size + n_meta:]
    check(segment, kv)
    return segment, kv


def check(segment: SnapshotSegment, kv: bytes) -> None:
    if len(kv) != segment.size:
        raise SnapshotError(f"snapshot segment {segment.index} of session {segment.session_id} has {len(kv)} KV "
                            f"bytes, its metadata says {segment.size}")
    if digest_of(kv) != segment.digest:
        raise SnapshotError(f"snapshot segment {segment.index} of session {segment.session_id} fails its sha256 "
                            f"(corrupt or substituted)")
