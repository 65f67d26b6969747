"""Binary activation frames: a fixed little-endian header, hop stamps, then raw tensor bytes.

Layout (all little-endian; docs/protocol.md has the table)::

    0   4  magic "SRF1"
    4   1  kind            0 prefill, 1 decode, 2 verify (a speculative window, issue #20: step = its id)
    5   1  dtype           0 f32, 1 f16, 2 bf16
    6   1  flags           bit 0: the tail samples after this frame; bit 1: token ids follow the payload
    7   1  n_dims          dims of one position's hidden state (1..4)
    8  16  session id      raw uuid bytes
    24  4  step            decode step (0 during prefill)
    28  4  start position
    32  4  n positions
    36  1  n stamps
    37  1  choice          0..255 (n > 1; zero before issue #19)
    38  1  group           n > 1 decode: how many choices' frames make up this step (each hop computes them in
                           one forward pass); 0 for a lone frame (zero before issue #19)
    39  1  epoch           the route's repair count (issue #18; zero before it)
    40     n_dims x u32 dims, then n_stamps x (u32 hop, u32 compute_us, u32 queue_us), then the payload, then,
           when flagged, n_positions x u32 token ids (the token each position stands for)

Token frames (the tail's sampled token, to the head) share the stamps and the byte order::

    0   4  magic "SRT1"
    4   1  finish          0 none, 1 stop, 2 length
    5   1  n stamps
    6   1  flags           bit 0: a logprobs section follows the text (zero in frames before issue #19);
                           bits 4-7: the route's epoch (issue #18; zero before it)
    7   1  choice          0..255 (n > 1; zero before issue #19)
    8  16  session id
    24  4  seq             0 for the first generated token of this choice
    28  4  token id
    32  4  text bytes
    36     n_stamps x (u32 hop, u32 compute_us, u32 queue_us), then the text (UTF-8), then, when flagged,
           f32 logprob of the token, u8 n_top, n_top x (u32 token id, f32 logprob), most likely first

Batches (issue #26: one request per pass per hop carrying every session's rows) wrap whole frames of either kind,
each unchanged, with the session token its session's requests carry (empty without capabilities)::

    0   4  magic "SRB1"
    4   2  n entries       1..256
    6   2  reserved        0
    8      per entry: u16 token length, u32 frame length, the token (ASCII), the frame ("SRF1" or "SRT1")
"""

from __future__ import annotations

import math
import struct
import uuid

import numpy as np
import numpy.typing as npt

from schemas.frame import (
    BATCH_MAGIC,
    FINISH_CODES,
    FRAME_FLAG_SAMPLE,
    FRAME_FLAG_TOKENS,
    MAGIC,
    MAX_BATCH,
    MAX_DIMS,
    MAX_FRAME_CHOICE,
    TOKEN_EPOCH_SHIFT,
    TOKEN_FLAG_LOGPROBS,
    TOKEN_MAGIC,
    FrameHeader,
    FrameKind,
    HopStamp,
    SampledToken,
    SampledWindow,
    WireDType,
)
from schemas.session import MAX_TOP_LOGPROBS, LogprobCandidate, TokenLogprobs

_FIXED = struct.Struct("<4sBBBB16sIIIBBBB")
_STAMP = struct.Struct("<III")
_TOKEN = struct.Struct("<4sBBBB16sIII")
_LOGPROB_HEAD = struct.Struct("<fB")
_WINDOW = struct.Struct("<4s16sIBBxx")
_LENGTH = struct.Struct("<I")
_BATCH = struct.Struct("<4sHH")
_ENTRY = struct.Struct("<HI")
WINDOW_MAGIC = b"SRW1"
_TOP = [struct.Struct("<" + "If" * n) for n in range(MAX_TOP_LOGPROBS + 1)]
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
    if not 0 <= header.choice <= MAX_FRAME_CHOICE:
        raise ValueError(f"choice {header.choice} outside 0..{MAX_FRAME_CHOICE}")
    if not 0 <= header.group <= 255 or not 0 <= header.epoch <= 255:
        raise ValueError(f"group {header.group} or epoch {header.epoch} outside 0..255")
    flags = FRAME_FLAG_SAMPLE if header.sample else 0
    if header.tokens is not None:
        if len(header.tokens) != header.n_positions:
            raise ValueError(f"{len(header.tokens)} token ids for {header.n_positions} positions")
        flags |= FRAME_FLAG_TOKENS
    parts = [
        _FIXED.pack(MAGIC, header.kind, header.dtype, flags, len(header.position_shape), header.session_id,
                    header.step, header.start_position, header.n_positions, len(header.stamps), header.choice,
                    header.group, header.epoch),
        _DIMS[len(header.position_shape)].pack(*header.position_shape),
    ]
    parts.append(_pack_stamps(header.stamps))
    parts.append(_to_wire(hidden, header.dtype))
    if header.tokens is not None:
        parts.append(struct.pack(f"<{header.n_positions}I", *header.tokens))
    return b"".join(parts)


def decode(data: bytes) -> tuple[FrameHeader, npt.NDArray[np.float32]]:
    """Parse a frame; the hidden states come back as float32 ``(n_positions, *position_shape)``."""
    if len(data) < _FIXED.size:
        raise FrameDecodeError(f"frame is {len(data)} bytes, shorter than the {_FIXED.size}-byte fixed header")
    magic, kind, dtype, flags, n_dims, sid, step, start, n_pos, n_stamps, choice, group, epoch = \
        _FIXED.unpack_from(data, 0)
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
    if flags & ~(FRAME_FLAG_SAMPLE | FRAME_FLAG_TOKENS):
        raise FrameDecodeError(f"unknown frame flags {flags:#04x} (bit 0: sample, bit 1: token ids)")
    hsize = header_size(n_dims, n_stamps)
    if len(data) < hsize:
        raise FrameDecodeError(f"frame is {len(data)} bytes, header alone needs {hsize}")
    shape = _DIMS[n_dims].unpack_from(data, _FIXED.size)
    if 0 in shape:
        raise FrameDecodeError(f"position shape {shape} has a zero dimension")
    at = _FIXED.size + 4 * n_dims
    stamps = _unpack_stamps(data, at, n_stamps)
    payload = memoryview(data)[hsize:]
    size = n_pos * wire_dtype.itemsize * math.prod(shape)
    tokens = None
    if flags & FRAME_FLAG_TOKENS:
        if len(payload) != size + 4 * n_pos:
            raise FrameDecodeError(
                f"payload is {len(payload)} bytes; {n_pos} positions of {tuple(shape)} {wire_dtype.label} and "
                f"their token ids need {size + 4 * n_pos}")
        tokens = struct.unpack_from(f"<{n_pos}I", payload, size)
        payload = payload[:size]
    elif len(payload) != size:
        raise FrameDecodeError(
            f"payload is {len(payload)} bytes; {n_pos} positions of {tuple(shape)} {wire_dtype.label} need {size}")
    header = FrameHeader(session_id=sid, kind=frame_kind, dtype=wire_dtype, start_position=start,
                         n_positions=n_pos, position_shape=tuple(shape), step=step,
                         sample=bool(flags & FRAME_FLAG_SAMPLE), stamps=stamps, choice=choice, group=group,
                         epoch=epoch, tokens=tokens)
    hidden = _from_wire(payload, wire_dtype).reshape((n_pos, *shape))
    # A NaN or inf would poison the session's KV for good (every later position attends to it): refuse it here.
    if not np.isfinite(hidden).all():
        raise FrameDecodeError("frame carries non-finite activations (NaN or inf)")
    return header, hidden


def encode_token(token: SampledToken) -> bytes:
    """A token frame: a few fixed fields, the stamps, the text, then the logprobs when the session asked for them
    (nothing otherwise); a fraction of what JSON costs to build and parse on the per-token path."""
    if not 0 <= token.choice <= MAX_FRAME_CHOICE:
        raise ValueError(f"choice {token.choice} outside 0..{MAX_FRAME_CHOICE}")
    stamps = _pack_stamps(token.stamps)
    text = token.text.encode()
    lp = token.logprobs
    if not 0 <= token.epoch <= 0xF:
        raise ValueError(f"epoch {token.epoch} outside 0..15")
    flags = (0 if lp is None else TOKEN_FLAG_LOGPROBS) | token.epoch << TOKEN_EPOCH_SHIFT
    head = _TOKEN.pack(TOKEN_MAGIC, FINISH_CODES[token.finish_reason], len(token.stamps), flags, token.choice,
                       token.session_id, token.seq, token.token, len(text))
    if lp is None:
        return b"".join((head, stamps, text))
    return b"".join((head, stamps, text, _pack_logprobs(lp)))


def encode_window(window: SampledWindow) -> bytes:
    """The tail's verdict on a verify window (issue #20): a small header, then each emitted token as a token frame
    behind its u32 length (``docs/protocol.md``, "Verify windows")."""
    parts = [_WINDOW.pack(WINDOW_MAGIC, window.session_id, window.window, window.accepted, len(window.tokens))]
    for token in window.tokens:
        frame = encode_token(token)
        parts += (_LENGTH.pack(len(frame)), frame)
    return b"".join(parts)


def decode_window(data: bytes) -> SampledWindow:
    if len(data) < _WINDOW.size:
        raise FrameDecodeError(f"window frame is {len(data)} bytes, shorter than its {_WINDOW.size}-byte header")
    magic, sid, window, accepted, n = _WINDOW.unpack_from(data, 0)
    if magic != WINDOW_MAGIC:
        raise FrameDecodeError(f"bad magic {magic!r}, expected {WINDOW_MAGIC!r}")
    if n < 1 or accepted >= max(n, 1) + 32:
        raise FrameDecodeError(f"a window frame of {n} tokens with {accepted} accepted drafts")
    at, tokens = _WINDOW.size, []
    for _ in range(n):
        if at + 4 > len(data):
            raise FrameDecodeError("window frame cut short")
        (size,) = _LENGTH.unpack_from(data, at)
        at += 4
        token = decode_token(data[at:at + size])
        if token.session_id != sid:
            raise FrameDecodeError("a window frame's token names another session")
        tokens.append(token)
        at += size
    if at != len(data):
        raise FrameDecodeError(f"{len(data) - at} bytes after the window frame's last token")
    return SampledWindow(session_id=sid, window=window, accepted=accepted, tokens=tuple(tokens))


def encode_batch(entries: list[tuple[bytes, str]]) -> bytes:
    """Frames (activation or token frames, as ``encode`` and ``encode_token`` made them) with each one's session
    token, in one body (the module's docstring has the layout)."""
    if not 1 <= len(entries) <= MAX_BATCH:
        raise ValueError(f"a batch carries 1..{MAX_BATCH} frames, got {len(entries)}")
    parts = [_BATCH.pack(BATCH_MAGIC, len(entries), 0)]
    for frame, token in entries:
        raw = token.encode("ascii")
        parts += (_ENTRY.pack(len(raw), len(frame)), raw, frame)
    return b"".join(parts)


def decode_batch(data: bytes) -> list[tuple[bytes, str]]:
    """The (frame, session token) entries of a batch, frames still encoded; FrameDecodeError saying what is wrong
    with the container (each frame is checked where it is decoded)."""
    if len(data) < _BATCH.size:
        raise FrameDecodeError(f"batch is {len(data)} bytes, shorter than its {_BATCH.size}-byte header")
    magic, n, reserved = _BATCH.unpack_from(data, 0)
    if magic != BATCH_MAGIC:
        raise FrameDecodeError(f"bad magic {magic!r}, expected {BATCH_MAGIC!r}")
    if not 1 <= n <= MAX_BATCH or reserved:
        raise FrameDecodeError(f"a batch of {n} entries (1..{MAX_BATCH}) with reserved bytes {reserved}")
    at, entries = _BATCH.size, []
    for i in range(n):
        if at + _ENTRY.size > len(data):
            raise FrameDecodeError(f"batch cut short at entry {i} of {n}")
        n_token, n_frame = _ENTRY.unpack_from(data, at)
        at += _ENTRY.size
        end = at + n_token + n_frame
        if end > len(data):
            raise FrameDecodeError(f"batch entry {i} needs {n_token + n_frame} bytes, {len(data) - at} are left")
        try:
            token = data[at:at + n_token].decode("ascii")
        except UnicodeDecodeError:
            raise FrameDecodeError(f"batch entry {i}'s session token is not ASCII") from None
        entries.append((data[at + n_token:end], token))
        at = end
    if at != len(data):
        raise FrameDecodeError(f"{len(data) - at} bytes after the batch's last entry")
    return entries


def _pack_logprobs(lp: TokenLogprobs) -> bytes:
    n = len(lp.top)
    if n > MAX_TOP_LOGPROBS:
        raise ValueError(f"at most {MAX_TOP_LOGPROBS} top logprobs, got {n}")
    flat: list[float | int] = []
    for c in lp.top:
        flat += (c.token, c.logprob)
    return _LOGPROB_HEAD.pack(lp.logprob, n) + _TOP[n].pack(*flat)


def decode_token(data: bytes) -> SampledToken:
    """Parse a token frame; raises FrameDecodeError saying exactly what is wrong."""
    if len(data) < _TOKEN.size:
        raise FrameDecodeError(f"token frame is {len(data)} bytes, shorter than the {_TOKEN.size}-byte header")
    magic, finish, n_stamps, flags, choice, sid, seq, token, n_text = _TOKEN.unpack_from(data, 0)
    if magic != TOKEN_MAGIC:
        raise FrameDecodeError(f"bad magic {magic!r}, expected {TOKEN_MAGIC!r}")
    if finish not in _FINISHES:
        raise FrameDecodeError(f"unknown finish code {finish} (expected 0 none, 1 stop or 2 length)")
    if flags & 0x0F & ~TOKEN_FLAG_LOGPROBS:
        raise FrameDecodeError(f"unknown token frame flags {flags:#04x} (bit 0: logprobs, bits 4-7: epoch)")
    at = _TOKEN.size + _STAMP.size * n_stamps
    end = at + n_text
    logprobs = None
    if flags & TOKEN_FLAG_LOGPROBS:
        logprobs = _unpack_logprobs(data, end, token)
        expected = end + _LOGPROB_HEAD.size + _TOP[len(logprobs.top)].size
    else:
        expected = end
    if len(data) != expected:
        what = " and a logprobs section" if logprobs is not None else ""
        raise FrameDecodeError(f"token frame is {len(data)} bytes; {n_stamps} stamps, {n_text} text bytes{what} "
                               f"need {expected}")
    try:
        text = data[at:end].decode()
    except UnicodeDecodeError as exc:
        raise FrameDecodeError(f"token text is not UTF-8: {exc}") from None
    return SampledToken(session_id=sid, seq=seq, token=token, text=text, finish_reason=_FINISHES[finish],
                        stamps=_unpack_stamps(data, _TOKEN.size, n_stamps), choice=choice, logprobs=logprobs,
                        epoch=flags >> TOKEN_EPOCH_SHIFT)


def _unpack_logprobs(data: bytes, at: int, token: int) -> TokenLogprobs:
    if len(data) < at + _LOGPROB_HEAD.size:
        raise FrameDecodeError(f"token frame is {len(data)} bytes: flagged logprobs section missing at byte {at}")
    logprob, n = _LOGPROB_HEAD.unpack_from(data, at)
    if n > MAX_TOP_LOGPROBS:
        raise FrameDecodeError(f"logprobs section lists {n} alternatives, more than {MAX_TOP_LOGPROBS}")
    at += _LOGPROB_HEAD.size
    if len(data) < at + _TOP[n].size:
        raise FrameDecodeError(f"token frame is {len(data)} bytes; its {n} top logprobs need {at + _TOP[n].size}")
    flat = _TOP[n].unpack_from(data, at)
    if not all(math.isfinite(x) and x <= 0.0 for x in (logprob, *flat[1::2])):
        raise FrameDecodeError("logprobs must be finite and <= 0")
    # model_construct: the fields were just checked, and a validated model costs tens of microseconds per token.
    top = [LogprobCandidate.model_construct(token=flat[i], logprob=flat[i + 1]) for i in range(0, 2 * n, 2)]
    return TokenLogprobs.model_construct(token=token, logprob=logprob, top=top)


def _pack_stamps(stamps: tuple[HopStamp, ...]) -> bytes:
    if len(stamps) > MAX_STAMPS:
        raise ValueError(f"at most {MAX_STAMPS} hop stamps")
    return b"".join(_STAMP.pack(s.hop_index, s.compute_us, s.queue_us) for s in stamps)


def _unpack_stamps(data: bytes, at: int, n: int) -> tuple[HopStamp, ...]:
    return tuple(HopStamp(*_STAMP.unpack_from(data, at + _STAMP.size * i)) for i in range(n))
