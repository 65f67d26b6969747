"""The activation frame header: what travels, in binary, ahead of the hidden-state bytes of one hop.

The layout is fixed-size little-endian so that a node in any language can parse it without msgpack (see
docs/protocol.md). ``bus.frame`` encodes and decodes it; this module only describes it.
"""

from __future__ import annotations

import dataclasses
import enum

from schemas.session import FinishReason, TokenLogprobs

MAGIC = b"SRF1"
TOKEN_MAGIC = b"SRT1"
BATCH_MAGIC = b"SRB1"
"""A batch (issue #26): several sessions' decode frames or token frames to one node in one request."""
MAX_BATCH = 256
"""Most entries one batch carries (a hop's sessions: far more than any node's ``max_sessions``)."""
MAX_DIMS = 4


class WireDType(enum.IntEnum):
    """f32 is bit-exact; bf16 halves the bytes and keeps f32's range (Gemma's residual stream overflows f16);
    f16 halves the bytes with more mantissa but a 65504 ceiling."""

    F32 = 0
    F16 = 1
    BF16 = 2

    @property
    def itemsize(self) -> int:
        return 4 if self is WireDType.F32 else 2

    @property
    def label(self) -> str:
        return {WireDType.F32: "f32", WireDType.F16: "f16", WireDType.BF16: "bf16"}[self]

    @classmethod
    def parse(cls, label: str) -> WireDType:
        try:
            return {"f32": cls.F32, "f16": cls.F16, "bf16": cls.BF16}[label]
        except KeyError:
            raise ValueError(f"unknown wire dtype {label!r}: expected f32, bf16 or f16") from None


class FrameKind(enum.IntEnum):
    PREFILL = 0
    DECODE = 1
    VERIFY = 2
    """A speculative window (issue #20): the last sampled token and the head's drafts, ``step`` the window's id."""


@dataclasses.dataclass(frozen=True, slots=True)
class HopStamp:
    """Compute and queue time one hop spent on this step; appended by every hop, read by the head."""

    hop_index: int
    compute_us: int
    queue_us: int


@dataclasses.dataclass(frozen=True, slots=True)
class FrameHeader:
    """One hop's worth of hidden states: ``n_positions`` rows of ``position_shape`` starting at ``start_position``.

    ``sample`` tells the tail to sample a token after this frame (the last prefill chunk, and every decode step).
    ``step`` is the decode step (0 for prefill chunks, which are ordered by ``start_position``).
    """

    session_id: bytes  # 16 raw bytes (uuid)
    kind: FrameKind
    dtype: WireDType
    start_position: int
    n_positions: int
    position_shape: tuple[int, ...]
    step: int = 0
    sample: bool = False
    stamps: tuple[HopStamp, ...] = ()
    choice: int = 0
    """n > 1: the choice these hidden states belong to (0..255; one frame per choice and step)."""
    group: int = 0
    """n > 1 decode: how many choices' frames make up this step; a hop computes them together, in one forward pass
    (0: a lone frame, computed as it comes)."""
    epoch: int = 0
    """The route's repair count (issue #18) when the frame was sent: a hop refuses frames of an older epoch."""
    tokens: tuple[int, ...] | None = None
    """The token id each position stands for, when sent (decode frames: every hop then knows which tokens its KV
    holds, for snapshots' prefix hashes and prefix reuse)."""

    @property
    def payload_bytes(self) -> int:
        n = self.n_positions * self.dtype.itemsize
        for d in self.position_shape:
            n *= d
        return n


FINISH_CODES: dict[FinishReason | None, int] = {None: 0, "stop": 1, "length": 2}
"""How a token frame carries ``finish_reason`` (schemas.session.FinishReason)."""

TOKEN_FLAG_LOGPROBS = 1
"""Token frame flag: a logprobs section follows the text."""

TOKEN_EPOCH_SHIFT = 4
"""Token frame flags, bits 4-7: the route's epoch (issue #18; at most ``schemas.session.MAX_EPOCH``)."""

FRAME_FLAG_SAMPLE = 1
"""Activation frame flag: the tail samples after this frame."""

FRAME_FLAG_TOKENS = 2
"""Activation frame flag: one u32 token id per position follows the payload."""

MAX_FRAME_CHOICE = 255
"""Activation and token frames carry their choice index (n > 1) in one byte."""


@dataclasses.dataclass(frozen=True, slots=True)
class SampledToken:
    """A token frame: the tail's sampled token on its way to the head, in binary (``bus.frame.encode_token``).
    The head turns it into a ``TokenEvent`` for the gateway, naming each stamp's node from its route."""

    session_id: bytes  # 16 raw bytes (uuid)
    seq: int
    token: int
    text: str = ""
    finish_reason: FinishReason | None = None
    stamps: tuple[HopStamp, ...] = ()
    choice: int = 0
    """The choice this token belongs to (n > 1); ``seq`` counts that choice's tokens."""
    logprobs: TokenLogprobs | None = None
    """Ids and logprobs only (``bytes`` unset): the head resolves the bytes."""
    epoch: int = 0
    """The route's repair count when the tail sampled it (issue #18): the head drops tokens of an older epoch."""


@dataclasses.dataclass(frozen=True, slots=True)
class SampledWindow:
    """The tail's verdict on a verify window (issue #20): the tokens it emits (the accepted drafts, then its own),
    on their way to the head in one message (``bus.frame.encode_window``)."""

    session_id: bytes  # 16 raw bytes (uuid)
    window: int
    """The window's id (its frame's ``step``)."""
    accepted: int
    """How many of its drafts were accepted."""
    tokens: tuple[SampledToken, ...]
    """In order; the last may carry the finish reason (then fewer than ``accepted + 1`` may follow)."""
