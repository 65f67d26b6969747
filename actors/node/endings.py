"""Sessions this node headed that ended, remembered for a while: what a liveness probe of one is told.

A head frees a completed session on every hop before it publishes the ``SessionEnd`` (so that a client opening its
next session at once finds the slots free). A gateway probing the head in that window used to hear "not held" and,
its grace over before the end arrived on a loaded machine, failed a stream that had completed. The head says
"ended" instead (``schemas.errors.SessionEndedError``): the end is on its way, nothing was lost.
"""

from __future__ import annotations

import collections

from schemas.errors import SessionEndedError
from schemas.session import SessionPhase

ENDINGS_REMEMBERED = 4096
"""Ended sessions a node remembers; a probe comes within seconds of the end, so the newest few thousand do."""


class Endings:
    def __init__(self, remembered: int = ENDINGS_REMEMBERED) -> None:
        self._phases: collections.OrderedDict[str, SessionPhase] = collections.OrderedDict()
        self._remembered = remembered

    def ended(self, session_id: str, phase: SessionPhase) -> None:
        self._phases[session_id] = phase
        self._phases.move_to_end(session_id)
        if len(self._phases) > self._remembered:
            self._phases.popitem(last=False)

    def phase(self, session_id: str) -> SessionPhase | None:
        """How ``session_id`` ended here, if this node headed it and still remembers."""
        return self._phases.get(session_id)

    def check(self, session_id: str, node_id: str) -> None:
        """``SessionEndedError`` if ``session_id`` (no longer held here) ended on this node."""
        phase = self._phases.get(session_id)
        if phase is not None:
            raise SessionEndedError(f"session {session_id} ended ({phase.value}) on node {node_id}")
