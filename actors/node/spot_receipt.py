"""What one hop of a sampled session keeps for a spot check (issue #28): every frame it computed from position 0,
its input and the hidden states it sent on (on the tail: the ``top_k`` largest logits of each row it sampled a token
from), until ``limit`` positions; then the receipt is handed to ``ready``
(once), off the session's path.

Recording costs a reference per frame (the arrays are the ones the step already made: the journal keeps the same
outputs), so a sampled session decodes as fast as any other. A session that did not start at position 0 (reused or
imported KV), or whose frames leave a gap (a repair cut it back), cannot be recomputed from its receipt and records
nothing more. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from actors.backend import Hidden, StepInput, TopLogits
from schemas.node import LayerRange
from schemas.spot_check import SpotFrame, SpotReceipt


@dataclasses.dataclass(frozen=True)
class Sealed:
    """A finished receipt and its arrays, ready to encode."""

    receipt: SpotReceipt
    inputs: list[bytes | None]
    outputs: list[bytes]

    def encode(self) -> bytes:
        return self.receipt.encode(self.inputs, self.outputs)


@dataclasses.dataclass
class _Frame:
    start: int
    n: int
    tokens: list[int] | None
    hidden: Hidden | None
    alone: bool
    output: Hidden | None = None
    top: TopLogits | None = None
    drawn: int | None = None
    done: bool = False
    """Its output went out (hidden states sent on, or on the tail its token sampled, or nothing to sample)."""


class SpotRecorder:
    def __init__(self, *, session_id: str, model_id: str, manifest_id: str, layers: LayerRange, node_id: str,
                 build_id: str, hidden_shape: tuple[int, ...], limit: int, ready: Callable[[Sealed], None],
                 top_k: int = 0, kernels_id: str = "", clearance: int | None = None, greedy: bool = False) -> None:
        self._meta = dict(session_id=session_id, model_id=model_id, manifest_id=manifest_id, layers=layers,
                          node_id=node_id, build_id=build_id, kernels_id=kernels_id, hidden_shape=list(hidden_shape),
                          top_k=top_k, clearance=clearance, greedy=greedy and top_k > 0)
        self.top_k = top_k
        """On the tail: how many of each sampled row's largest logits to keep (its steps ask for them); else 0."""
        self._limit = limit
        self._ready = ready
        self._frames: list[_Frame] = []
        self.stopped = False
        """Nothing more is recorded: sealed, or the session cannot be recomputed from position 0."""

    def top_k_for(self, sample: bool) -> int:
        """How many of a sampled row's largest logits a tail's step keeps for this receipt (0: none)."""
        return self.top_k if sample and not self.stopped else 0

    @property
    def _end(self) -> int:
        return self._frames[-1].start + self._frames[-1].n if self._frames else 0

    def computed(self, start: int, item: StepInput, batch_size: int) -> None:
        """The step of ``item`` (positions from ``start``) ran in a pass of ``batch_size`` sessions."""
        if self.stopped:
            return
        if start != self._end or (self._frames and not self._frames[-1].done):
            self.stopped = True  # a gap, or a frame that never went out: not recomputable from 0
            return
        tokens = list(item.tokens) if item.tokens is not None else None
        # A copy: a frame's input may be a view of a receive buffer the next request reuses.
        hidden = None if item.hidden is None else item.hidden.copy()
        self._frames.append(_Frame(start, item.n_positions, tokens, hidden, batch_size <= 1))

    def sent(self, start: int, hidden: Hidden) -> None:
        """The frame of positions from ``start`` went on with ``hidden``."""
        if self.stopped or not self._frames:
            return
        last = self._frames[-1]
        if self.top_k or last.start != start or last.done or int(hidden.shape[0]) != last.n:
            self.stopped = True
            return
        last.output, last.done = hidden, True
        if self._end >= self._limit:
            self.seal()

    def answered(self, start: int, sample: bool, top: TopLogits | None, drawn: int | None = None) -> None:
        """On the tail: the frame of positions from ``start`` ran, and sampled the token ``drawn`` from the logits
        ``top`` summarises (``sample``), or sampled nothing."""
        if self.stopped or not self._frames:
            return
        last = self._frames[-1]
        if not self.top_k or last.start != start or last.done or (sample and top is None):
            self.stopped = True  # e.g. a backend that returns no top logits: nothing to compare
            return
        last.top, last.drawn, last.done = (top if sample else None), (drawn if sample else None), True
        if self._end >= self._limit:
            self.seal()

    def seal(self) -> None:
        """Hand what was recorded (whole frames that went out) to ``ready``, once; at the limit or at close."""
        if self.stopped:
            return
        self.stopped = True
        done = [f for f in self._frames if f.done]
        self._frames = []
        if not any(f.output is not None or f.top is not None for f in done):
            return
        receipt = SpotReceipt.model_validate({
            **self._meta, "frames": [SpotFrame(start=f.start, n=f.n, tokens=f.tokens, alone=f.alone,
                                               sample=f.top is not None, drawn=f.drawn) for f in done]})
        inputs: list[bytes | None] = [None if f.hidden is None else _raw(f.hidden) for f in done]
        outputs = [_raw(f.output) if f.output is not None else b"" if f.top is None else raw_top(f.top)
                   for f in done]
        self._ready(Sealed(receipt, inputs, outputs))


def _raw(hidden: Hidden) -> bytes:
    return np.ascontiguousarray(hidden, dtype="<f4").tobytes()


def raw_top(top: TopLogits) -> bytes:
    """A tail frame's output on the wire: its ids (int32), then their logits (float32), little-endian."""
    return np.ascontiguousarray(top.ids, dtype="<i4").tobytes() + np.ascontiguousarray(top.values, "<f4").tobytes()


def top_of(raw: bytes, k: int) -> TopLogits:
    """``raw_top`` read back; ``ValueError`` when it does not hold ``k`` of each."""
    if len(raw) != 8 * k:
        raise ValueError(f"a tail frame's output of {len(raw)} bytes is not {k} ids and {k} logits")
    return TopLogits(ids=np.frombuffer(raw[:4 * k], dtype="<i4").astype(np.int32),
                     values=np.frombuffer(raw[4 * k:], dtype="<f4").astype(np.float32))
