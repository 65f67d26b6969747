"""Telling a silent session from a dead one: when to ask a session's hops whether they still hold it, and what the
answers mean. Used by the head (for its downstream hops) and by the gateway (for the head, the one node whose
death nobody on the route can report).

A hop whose process died refuses the connection at once (``unreachable``); one that restarted answers 404 for the
session (``gone``). Either ends the session now, naming the node, instead of after a token timeout. A hop that does
not answer in time proves nothing (it may be busy): only the timeouts decide then.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence

from bus.nodeclient import NodeClient
from schemas.route import Hop

KEEPALIVE_S = 5.0
"""Probes back off to at most this far apart (and a streaming client gets a keep-alive this often)."""


class Silence:
    """How long a session has been quiet, and when to probe its hops meanwhile. Probes start after ``probe_s`` of
    silence and back off (doubling, at most ``KEEPALIVE_S`` apart): a long prefill chunk on a slow node is silence
    too, and must cost its hops little. ``probe_s`` 0 never probes."""

    def __init__(self, probe_s: float) -> None:
        self._probe_s = probe_s
        self.broken()

    def broken(self) -> None:
        """Something arrived: the silence starts again."""
        now = time.monotonic()
        self._since = self._said = now
        self._every = self._probe_s
        self._next_probe = now + self._probe_s if self._probe_s > 0 else math.inf

    def lasted(self) -> float:
        return time.monotonic() - self._since

    def probe_due(self) -> bool:
        return time.monotonic() >= self._next_probe

    def probed(self) -> None:
        self._every = min(self._every * 2, KEEPALIVE_S)
        self._next_probe = time.monotonic() + self._every

    def keepalive_due(self) -> bool:
        now = time.monotonic()
        if now - self._said < KEEPALIVE_S:
            return False
        self._said = now
        return True

    def wait(self, limit: float) -> float:
        """How long to wait for the next event before a probe, a keep-alive or the ``limit`` of silence is due."""
        now = time.monotonic()
        return min(self._said + KEEPALIVE_S, self._since + limit, self._next_probe) - now


async def first_lost(client: NodeClient, hops: Sequence[Hop], session_id: str, *,
                     session_token: str | None = None) -> tuple[str, str] | None:
    """The first of ``hops`` whose process is gone or that no longer holds the session, and why; ``None`` while
    each holds it, cannot say, or (a head) says the session ended there: its end is on the bus, nothing is lost."""
    states = await asyncio.gather(*(client.session_state(h.node_id, h.endpoint, session_id,
                                                         session_token=session_token) for h in hops))
    for hop, state in zip(hops, states, strict=True):
        if state == "unreachable":
            return hop.node_id, f"nothing listens at {hop.endpoint} any more (its process died)"
        if state == "gone":
            return hop.node_id, "it answers but no longer holds the session (it restarted or freed it)"
    return None
