"""The choices of one Route Session on a node (n > 1): each is a backend session of its own, with its own position,
its own queued step and, on the tail, its own ``Generation``.

Choice 0 is the session itself (its backend session has the session's id). Every hop forks it after the last
prefill chunk (``StepInput.forks``): choice ``i`` is then the backend session ``<session id>/<i>`` at the same
position, decoding from the shared prompt. A plain session (n = 1) has choice 0 only, and its per-token path is
what it was: one attribute lookup for the choice.
"""

from __future__ import annotations

import asyncio
import dataclasses

from actors.backend import StepInput, StepOutput
from actors.node.engine import StepTiming
from actors.node.generation import Generation
from schemas.errors import FrameError
from schemas.session import ChoiceEnd, FinishReason

StepFuture = asyncio.Future[tuple[StepOutput, StepTiming]]


def fork_ids(session_id: str, n: int) -> tuple[str, ...]:
    """The backend session ids of choices 1..n-1 (choice 0 keeps the session's own id)."""
    return tuple(f"{session_id}/{i}" for i in range(1, n))


@dataclasses.dataclass(slots=True, eq=False)
class Choice:
    index: int
    backend_id: str
    """The backend session this choice's KV lives in."""
    position: int = 0
    generation: Generation | None = None
    """Tail: this choice's stop rules and text assembly."""
    frame_step: StepFuture | None = None
    """Hops: a frame's step queued for the backend's worker; this choice's later frames wait for it."""
    prefetched: tuple[int, StepFuture, bool] | None = None
    """Head, multi-node: the step ``on_token`` queued for token ``seq`` (its future, and whether its frame has
    already been forwarded), for the driver to pick up."""
    arrivals: dict[int, float] = dataclasses.field(default_factory=dict)
    """Head: when each token (by seq) reached ``on_token``, for the step wall time in telemetry."""
    step_started: float | None = None
    """Head: when this choice's current step started (wall time per token in telemetry)."""
    finish_reason: FinishReason | None = None
    tokens: int = 0
    """Head: tokens generated (announced) so far."""
    ended: bool = False

    def decode_step(self, token: int, *, sample: bool = False) -> StepInput:
        """Head: the step that feeds ``token`` to this choice's KV at its position."""
        return StepInput(self.backend_id, self.position, tokens=[token], sample=sample)

    def end(self, finish_reason: FinishReason, tokens: int) -> None:
        self.ended, self.finish_reason, self.tokens = True, finish_reason, tokens

    def report(self) -> ChoiceEnd:
        return ChoiceEnd(index=self.index, finish_reason=self.finish_reason, completion_tokens=self.tokens)


class Choices:
    """A session's choices, choice 0 first. Forks are added once, after the last prefill chunk."""

    def __init__(self, session_id: str, n: int, generation: Generation | None) -> None:
        self.n = n
        self.session_id = session_id
        self.all = [Choice(0, session_id, generation=generation)]

    @property
    def first(self) -> Choice:
        return self.all[0]

    def fork_ids(self) -> tuple[str, ...]:
        return fork_ids(self.session_id, self.n) if self.n > 1 and len(self.all) == 1 else ()

    def add_forks(self, position: int, generations: list[Generation | None]) -> list[Choice]:
        """Choices 1..n-1, at ``position`` (the forked session's), one generation each on the tail."""
        forks = [Choice(i, backend_id, position=position, generation=g)
                 for i, (backend_id, g) in enumerate(zip(fork_ids(self.session_id, self.n), generations,
                                                         strict=True), start=1)]
        self.all.extend(forks)
        return forks

    def get(self, index: int) -> Choice:
        """The choice a frame or token names; a ``FrameError`` for one this session does not have (yet)."""
        if 0 <= index < len(self.all):
            return self.all[index]
        raise FrameError(f"session {self.session_id} has no choice {index} (n={self.n}, {len(self.all)} forked)")

    def backend_ids(self) -> list[str]:
        return [c.backend_id for c in self.all]

    def all_ended(self) -> bool:
        return all(c.ended for c in self.all) and len(self.all) == self.n

    def tail_done(self) -> bool:
        """Tail: every choice's generation has finished."""
        return len(self.all) == self.n and all(c.generation is not None and c.generation.done for c in self.all)

    def reports(self) -> list[ChoiceEnd]:
        return [c.report() for c in self.all] if self.n > 1 else []

    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.all)
