"""What every backend keeps about its open sessions (issue #24): the table of them, and the refusals that come with
opening, forking, exporting and truncating one.

A backend composes one ``SessionTable`` and keeps only what differs: what a session holds (KV, sampler), how one
is made, forked and freed, and the wording of a refusal where its own differs (``Wording``: clients and tests read
the messages). The table takes no lock: every backend already serialises these calls under its own, which on
llama.cpp also guards the C state a session's cells live in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence, ValuesView
from typing import Generic, Protocol, TypeVar

from actors.backend import StepOutput
from schemas.errors import BadRequestError, CapacityError, SessionNotFoundError
from schemas.session import SamplingParams


class Positioned(Protocol):
    position: int
    """Positions the session's KV holds so far."""


S = TypeVar("S", bound=Positioned)


@dataclasses.dataclass(frozen=True, slots=True)
class Wording:
    """A backend's refusals, as ``str.format`` templates. They may name ``name`` (the table's), ``open``, ``free``
    and ``max`` (sessions open, room left, the most), ``forks`` (how many asked for), and in the range refusals
    ``session``, ``position`` (the session's), ``start``, ``end`` and ``to`` (what was asked)."""

    full: str = "{name} node holds {open} sessions (max {max})"
    forks_full: str = "{forks} forks do not fit: the {name} node holds {open} sessions (max {max})"
    step_forks_full: str = "this step forks {forks} sessions; the {name} node holds {open} (max {max})"
    unsampled: str = "a session forks on the tail after the step that sampled its first token"
    export_range: str = "session {session} holds positions [0, {position}); cannot export [{start}, {end})"
    truncate_range: str = "session {session} is at position {position}; cannot truncate to {to}"


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed choice ``choice`` of an n > 1 session samples with (``actors.backend.ForkingBackend``)."""
    return None if seed is None else seed + choice


class SessionTable(Generic[S]):
    """The open sessions of one backend, by id, at most ``max_sessions`` of them.

    ``tail``: the backend samples (the last layers are its). ``constraints``: it enforces output constraints (has a
    grammar sampler: llama.cpp's is the only one); a tail that does not refuses a session that asks for one."""

    def __init__(self, name: str, max_sessions: int, *, tail: bool, constraints: bool = True,
                 wording: Wording | None = None) -> None:
        self.name = name
        self.max_sessions = max_sessions
        self.tail = tail
        self.constraints = constraints
        self.wording = wording or Wording()
        self._open: dict[str, S] = {}

    def __getitem__(self, session_id: str) -> S:
        """``SessionNotFoundError`` (not ``KeyError``) for an id not open: the node answers it as a 404."""
        try:
            return self._open[session_id]
        except KeyError:
            raise SessionNotFoundError(f"session {session_id} is not open on this node") from None

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._open

    def __len__(self) -> int:
        return len(self._open)

    def ids(self) -> list[str]:
        """The open ids, in the order they opened: a copy, safe to take without the backend's lock."""
        return list(self._open)

    def values(self) -> ValuesView[S]:
        return self._open.values()

    # --- opening and closing --------------------------------------------------------------------------------------

    def admit(self, session_id: str, sampling: SamplingParams) -> None:
        """Refuse to open ``session_id``: a constraint the backend cannot honour, an id already open, no room."""
        if self.tail and not self.constraints and sampling.constraint is not None:
            field = "tools" if sampling.constraint.type == "tool_call" else "response_format"
            raise BadRequestError(f"the {self.name} backend does not enforce output constraints (response_format, "
                                  "tools); serve a llamacpp model for them", param=field)
        self.check_new(session_id)
        self.check_room()

    def check_new(self, session_id: str) -> None:
        if session_id in self._open:
            raise BadRequestError(f"session {session_id} is already open on this node")

    def check_room(self) -> None:
        if len(self._open) >= self.max_sessions:
            raise CapacityError(self._say(self.wording.full))

    def add(self, session_id: str, session: S) -> None:
        """Register a session ``admit`` (or ``check_new`` and ``check_room``) let in."""
        self._open[session_id] = session

    def pop(self, session_id: str) -> S | None:
        """Forget a session (``None`` if it is not open: closing is idempotent); freeing it is the backend's."""
        return self._open.pop(session_id, None)

    def clear(self) -> None:
        self._open.clear()

    # --- n > 1 forks ------------------------------------------------------------------------------------------------

    def check_step_forks(self, fork_ids: Sequence[str]) -> None:
        """Refuse a step's forks before its forward pass, so that a failed fork never leaves a step half applied."""
        if len(self._open) + len(fork_ids) > self.max_sessions:
            raise CapacityError(self._say(self.wording.step_forks_full, forks=len(fork_ids)))
        self._check_fork_ids(fork_ids)

    def fork(self, fork_ids: Sequence[str], make: Callable[[int], S], first: Callable[[S], StepOutput], *,
             sampled: bool, discard: Callable[[S], None] | None = None) -> list[StepOutput]:
        """Open ``fork_ids``, all or nothing (``actors.backend.ForkingBackend.fork_session``): ``make(i)`` builds
        choice ``i`` (1, 2, ...) and must leave nothing behind when it raises; ``discard`` frees the ones already
        made when a later one fails. On the tail ``first(fork)`` samples each fork's first token from the logits
        the session sampled last, which ``sampled`` says are there; elsewhere a fork's output is empty."""
        self._check_fork_ids(fork_ids)
        if len(self._open) + len(fork_ids) > self.max_sessions:
            raise CapacityError(self._say(self.wording.forks_full, forks=len(fork_ids)))
        if self.tail and not sampled:
            raise BadRequestError(self.wording.unsampled)
        made: list[S] = []
        try:
            for choice in range(1, len(fork_ids) + 1):
                made.append(make(choice))
        except BaseException:
            if discard is not None:
                for session in made:
                    discard(session)
            raise
        self._open.update(zip(fork_ids, made, strict=True))
        return [first(fork) if self.tail else StepOutput() for fork in made]

    def _check_fork_ids(self, fork_ids: Sequence[str]) -> None:
        if len(set(fork_ids)) != len(fork_ids) or any(f in self._open for f in fork_ids):
            raise BadRequestError(f"fork ids must be new and distinct, got {list(fork_ids)}")

    # --- positions --------------------------------------------------------------------------------------------------

    def exporting(self, session_id: str, start: int, end: int) -> S:
        """The session, once ``[start, end)`` is a non-empty range of the positions it holds."""
        session = self[session_id]
        if not 0 <= start < end <= session.position:
            raise BadRequestError(self.wording.export_range.format(session=session_id, position=session.position,
                                                                   start=start, end=end))
        return session

    def truncating(self, session_id: str, position: int) -> S:
        """The session, once it may be cut back to ``position`` (at most where it is)."""
        session = self[session_id]
        if not 0 <= position <= session.position:
            raise BadRequestError(self.wording.truncate_range.format(session=session_id, position=session.position,
                                                                     to=position))
        return session

    def _say(self, template: str, **asked: int) -> str:
        n = len(self._open)
        return template.format(name=self.name, open=n, free=self.max_sessions - n, max=self.max_sessions, **asked)


class HoldsSessions(Generic[S]):
    """The ``Backend`` members a backend answers from its ``SessionTable``, which it keeps as ``_sessions``."""

    _sessions: SessionTable[S]

    @property
    def max_sessions(self) -> int:
        """How many sessions may hold KV at once."""
        return self._sessions.max_sessions

    @property
    def open_sessions(self) -> list[str]:
        """The open ids: a snapshot taken without the backend's lock, so that a caller on the event loop never
        waits for a step."""
        return self._sessions.ids()
