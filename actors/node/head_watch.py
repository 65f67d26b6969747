"""What a head checks besides its route's messages: whether the session's client still listens (``watch_client``),
while the route is silent whether a hop died or lost the session (``lost_downstream``), and once it stayed silent
past the token timeout, which hop stopped answering (``stalled``). The head (``actors.node.head_session``) runs
them and decides what they mean for the session.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from actors.node.session import SessionFailed
from bus.liveness import first_lost
from bus.nodeclient import NodeClient
from schemas.route import Hop
from schemas.session import FailureReason, SessionPhase

M = TypeVar("M")

ClientPresent = Callable[[str], Awaitable[bool | None]]
CLIENT_MISSES = 3
"""Probes in a row that must find no subscriber before a head cancels a session (``watch_client``)."""
LOST_GRACE_S = 0.5
"""After a hop is found lost, how long the head still waits for word already on its way before failing."""


async def watch_client(present: ClientPresent, session_id: str, *, every_s: float, closed: Callable[[], bool],
                       cancel: Callable[[str], Awaitable[None]]) -> None:
    """Cancel the session once its client is gone: NATS reports no subscriber for ``CLIENT_MISSES`` probes in a
    row. A killed gateway tells nobody; without this its sessions would generate to ``max_tokens`` and hold a KV
    slot on every hop meanwhile. A probe without an answer (a NATS outage, a slow gateway) proves nothing and
    resets nothing: only "no responders" counts, several times, so a gateway reconnecting is not taken for a dead
    one.

    The loop checks ``closed`` itself: a cancellation can be lost inside nats.py's request (see
    ``bus.connection.keep_cancellation``), and a watcher that went on probing after ``close()`` had cancelled it
    kept ``close()`` waiting for it for good."""
    misses = 0
    while not closed():
        await asyncio.sleep(every_s)
        answer = await present(session_id)
        if closed():
            return
        misses = misses + 1 if answer is False else 0 if answer else misses
        if misses >= CLIENT_MISSES:
            await cancel(f"its client stopped listening (no subscriber for {CLIENT_MISSES} probes {every_s:g}s apart)")
            return


async def stalled(client: NodeClient, hops: Sequence[Hop], phase: SessionPhase, waited: float) -> FailureReason:
    """No token in time: name the first of ``hops`` that does not answer, else the route as a whole."""
    for hop in hops:
        if not await client.probe(hop.node_id, hop.endpoint):
            return FailureReason(node_id=hop.node_id, phase=phase, kind="timeout",
                                 message=f"node {hop.node_id} stopped answering; no token for {waited:g}s")
    return FailureReason(node_id=None, phase=phase, kind="timeout",
                         message=f"no token from the route for {waited:g}s although every hop answers")


async def lost_downstream(client: NodeClient, hops: Sequence[Hop], session_id: str, phase: SessionPhase,
                          arrivals: asyncio.Queue[M], *, session_token: str | None) -> M | None:
    """Fail at once (``SessionFailed``) if one of ``hops`` is dead or lost the session, unless word (a failure
    report, a token) arrives in ``arrivals`` within the grace that messages already on their way need: that word is
    returned. None: every hop holds the session."""
    lost = await first_lost(client, hops, session_id, session_token=session_token)
    if lost is None:
        return None
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LOST_GRACE_S):
            return await arrivals.get()
    node, why = lost
    raise SessionFailed(FailureReason(node_id=node, phase=phase, kind="unreachable", message=why))
