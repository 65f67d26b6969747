"""Bencoding (BEP 3), so a torrent's info-hash can be computed from a manifest without libtorrent."""

from __future__ import annotations

from typing import Any


def bencode(value: Any) -> bytes:
    """Encode int, bytes, str (as UTF-8), list and dict (keys sorted as raw bytes, as BEP 3 requires)."""
    out = bytearray()
    _encode(value, out)
    return bytes(out)


def _encode(value: Any, out: bytearray) -> None:
    if isinstance(value, bool):
        raise TypeError("bencode has no booleans")
    if isinstance(value, int):
        out += b"i%de" % value
    elif isinstance(value, str):
        _encode(value.encode("utf-8"), out)
    elif isinstance(value, bytes | bytearray):
        out += b"%d:" % len(value)
        out += value
    elif isinstance(value, list | tuple):
        out += b"l"
        for item in value:
            _encode(item, out)
        out += b"e"
    elif isinstance(value, dict):
        out += b"d"
        keyed = sorted(((k.encode("utf-8") if isinstance(k, str) else k), v) for k, v in value.items())
        for key, item in keyed:
            _encode(key, out)
            _encode(item, out)
        out += b"e"
    else:
        raise TypeError(f"cannot bencode {type(value).__name__}")
