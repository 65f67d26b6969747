"""Binary activation frames: a fixed little-endian header, hop stamps, then raw tensor bytes.

Layout (all little-endian; docs/protocol.md has the table)::

    0   4  magic "SRF1"
    4   1  kind            0 prefill, 1 decode
    5   1  dtype           0 f32, 1 f16, 2 bf16
    6   1  flags           bit 0: the tail samples after this frame
    7   1  n_dims          dims of one position's hidden state (1..4)
    8  16  session id      raw uuid bytes
    24  4  step            decode step (0 during prefill)
    28  4  start position
    32  4  n positions
    36  1  n stamps
    37  3  reserved (zero)
    40     n_dims x u32 dims, then n_stamps x (u32 hop, u32 compute_us, u32 queue_us), then the payload

Token frames (the tail's sampled token, to the head) share the stamps and the byte order::

    0   4  magic "SRT1"
    4   1  finish          0 none, 1 stop, 2 length
    5   1  n stamps
    6   2  reserved (zero)
    8  16  session id
    24  4  seq             0 for the first generated token
    28  4  token id
    32  4  text bytes
    36     n_stamps x (u32 hop, u32 compute_us, u32 queue_us), then the text (UTF-8)
"""

from __future__ import annotations

import struct
import uuid

import numpy as np
import numpy.typing as npt

from schemas.frame import (
    FINISH_CODES,
    MAGIC,
    MAX_DIMS,
    TOKEN_MAGIC,
    FrameHeader,
    FrameKind,
    HopStamp,
    SampledToken,
    WireDType,
)

_FIXED = struct.Struct("<4sBBBB16sIIIB3x")
_STAMP = struct.Struct("<III")
_TOKEN = struct.Struct("<4sBB2x16sIII")
_FINISHES = {code: reason for reason, code in FINISH_CODES.items()}
_DIMS = [struct.Struct(f"<{n}I") for n in range(MAX_DIMS + 1)]
# Plain dict lookups: the decode path runs once per hop per token, often on cold caches, where every enum call and
# format-string parse costs several microseconds.
_KINDS = {int(k): k for k in FrameKind}
_DTYPES = {int(d): d for d in WireDType}
_F32, _F16, _U16, _U32 = np.dtype("<f4"), np.dtype("<f2"), np.dtype("<u2"), np.dtype("<u4")


def _to_wire(hidden: npt.NDArray[np.floating], dtype: WireDType) -> bytes:
    x = np.ascontiguousarray(hidden, dtype=_F32)
    if dtype is WireDType.F32:
        return x.tobytes()
    if dtype is WireDType.BF16:
        # Round to nearest even on the upper half of the f32 bits: bf16 is f32 with a shorter mantissa.
        u = x.view(_U32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(_U16).tobytes()
    with np.errstate(over="ignore"):
        half = x.astype(_F16)
    if not np.isfinite(half).all() and np.isfinite(x).all():
        raise ValueError(f"hidden state exceeds the f16 range (|x| up to {float(np.abs(x).max()):.4g} > 65504): "
                         "use bf16 or f32 on the wire for this model")
    return half.tobytes()


def _from_wire(payload: memoryview, dtype: WireDType) -> npt.NDArray[np.float32]:
    if dtype is WireDType.F32:
        return np.frombuffer(payload, dtype=_F32)
    if dtype is WireDType.BF16:
        return (np.frombuffer(payload, dtype=_U16).astype(_U32) << 16).view(_F32)
    return np.frombuffer(payload, dtype=_F16).astype(_F32)
MAX_STAMPS = 64


class FrameDecodeError(ValueError):
    """The bytes are not a valid frame; the message says exactly what is wrong."""


def session_bytes(session_id: str) -> bytes:
    """A session id (32 hex chars) as the 16 raw bytes the frame carries."""
    try:
        return uuid.UUID(hex=session_id).bytes
    except ValueError as exc:
        raise ValueError(f"session id {session_id!r} is not a 32-digit hex uuid") from exc


def session_str(raw: bytes) -> str:
    return uuid.UUID(bytes=raw).hex


def header_size(n_dims: int, n_stamps: int) -> int:
    return _FIXED.size + 4 * n_dims + _STAMP.size * n_stamps


def encode(header: FrameHeader, hidden: npt.NDArray[np.floating]) -> bytes:
    """Serialize ``hidden`` (shape ``(n_positions, *position_shape)``) under ``header``, converting to its dtype."""
    expected = (header.n_positions, *header.position_shape)
    if tuple(hidden.shape) != expected:
        raise ValueError(f"hidden states have shape {tuple(hidden.shape)}, header says {expected}")
    if not 1 <= len(header.position_shape) <= MAX_DIMS:
        raise ValueError(f"position shape must have 1..{MAX_DIMS} dims, got {header.position_shape}")
    if header.n_positions < 1 or any(d < 1 for d in header.position_shape):
        raise ValueError(f"a frame needs at least one position and no empty dimension, got {expected}")
    flags = 1 if header.sample else 0
    parts = [
        _FIXED.pack(MAGIC, header.kind, header.dtype, flags, len(header.position_shape), header.session_id,
                    header.step, header.start_position, header.n_positions, len(header.stamps)),
        _DIMS[len(header.position_shape)].pack(*header.position_shape),
    ]
    parts.append(_pack_stamps(header.stamps))
    parts.append(_to_wire(hidden, header.dtype))
    return b"".join(parts)


def decode(data: bytes) -> tuple[FrameHeader, npt.NDArray[np.float32]]:
    """Parse a frame; the hidden states come back as float32 ``(n_positions, *position_shape)``."""
    if len(data) < _FIXED.size:
        raise FrameDecodeError(f"frame is {len(data)} bytes, shorter than the {_FIXED.size}-byte fixed header")
    magic, kind, dtype, flags, n_dims, sid, step, start, n_pos, n_stamps = _FIXED.unpack_from(data, 0)
    if magic != MAGIC:
        raise FrameDecodeError(f"bad magic {magic!r}, expected {MAGIC!r}")
    frame_kind, wire_dtype = _KINDS.get(kind), _DTYPES.get(dtype)
    if frame_kind is None:
        raise FrameDecodeError(f"unknown frame kind {kind} (expected 0 prefill or 1 decode)")
    if wire_dtype is None:
        raise FrameDecodeError(f"unknown dtype {dtype} (expected 0 f32, 1 f16 or 2 bf16)")
    if not 1 <= n_dims <= MAX_DIMS:
        raise FrameDecodeError(f"n_dims {n_dims} outside 1..{MAX_DIMS}")
    if n_pos < 1:
        raise FrameDecodeError("frame carries no positions")
    hsize = header_size(n_dims, n_stamps)
    if len(data) < hsize:
        raise FrameDecodeError(f"frame is {len(data)} bytes, header alone needs {hsize}")
    shape = _DIMS[n_dims].unpack_from(data, _FIXED.size)
    if 0 in shape:
        raise FrameDecodeError(f"position shape {shape} has a zero dimension")
    at = _FIXED.size + 4 * n_dims
    stamps = _unpack_stamps(data, at, n_stamps)
    header = FrameHeader(session_id=sid, kind=frame_kind, dtype=wire_dtype, start_position=start,
                         n_positions=n_pos, position_shape=tuple(shape), step=step, sample=bool(flags & 1),
                         stamps=stamps)
    payload = memoryview(data)[hsize:]
    if len(payload) != header.payload_bytes:
        raise FrameDecodeError(
            f"payload is {len(payload)} bytes; {n_pos} positions of {tuple(shape)} {wire_dtype.label} need "
            f"{header.payload_bytes}")
    hidden = _from_wire(payload, wire_dtype).reshape((n_pos, *shape))
    # A NaN or inf would poison the session's KV for good (every later position attends to it): refuse it here.
    if not np.isfinite(hidden).all():
        raise FrameDecodeError("frame carries non-finite activations (NaN or inf)")
    return header, hidden


def encode_token(token: SampledToken) -> bytes:
    """A token frame: a few fixed fields, the stamps, then the text; a fraction of what JSON costs to build and
    parse on the per-token path."""
    stamps = _pack_stamps(token.stamps)
    text = token.text.encode()
    head = _TOKEN.pack(TOKEN_MAGIC, FINISH_CODES[token.finish_reason], len(token.stamps), token.session_id,
                       token.seq, token.token, len(text))
    return b"".join((head, stamps, text))


def decode_token(data: bytes) -> SampledToken:
    """Parse a token frame; raises FrameDecodeError saying exactly what is wrong."""
    if len(data) < _TOKEN.size:
        raise FrameDecodeError(f"token frame is {len(data)} bytes, shorter than the {_TOKEN.size}-byte header")
    magic, finish, n_stamps, sid, seq, token, n_text = _TOKEN.unpack_from(data, 0)
    if magic != TOKEN_MAGIC:
        raise FrameDecodeError(f"bad magic {magic!r}, expected {TOKEN_MAGIC!r}")
    if finish not in _FINISHES:
        raise FrameDecodeError(f"unknown finish code {finish} (expected 0 none, 1 stop or 2 length)")
    at = _TOKEN.size + _STAMP.size * n_stamps
    if len(data) != at + n_text:
        raise FrameDecodeError(f"token frame is {len(data)} bytes; {n_stamps} stamps and {n_text} text bytes "
                               f"need {at + n_text}")
    try:
        text = data[at:].decode()
    except UnicodeDecodeError as exc:
        raise FrameDecodeError(f"token text is not UTF-8: {exc}") from None
    return SampledToken(session_id=sid, seq=seq, token=token, text=text, finish_reason=_FINISHES[finish],
                        stamps=_unpack_stamps(data, _TOKEN.size, n_stamps))


def _pack_stamps(stamps: tuple[HopStamp, ...]) -> bytes:
    if len(stamps) > MAX_STAMPS:
        raise ValueError(f"at most {MAX_STAMPS} hop stamps")
    return b"".join(_STAMP.pack(s.hop_index, s.compute_us, s.queue_us) for s in stamps)


def _unpack_stamps(data: bytes, at: int, n: int) -> tuple[HopStamp, ...]:
    return tuple(HopStamp(*_STAMP.unpack_from(data, at + _STAMP.size * i)) for i in range(n))
