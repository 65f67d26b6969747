"""The gateway's calls to one session's route: tokenize on the head and open there, probe the head, free every hop.

The gateway talks to the head alone while a session runs: it sends the head the one ``SessionOpen`` (the head opens
every later hop itself, ``actors/node/route_open.py``), and it probes only the head (the head finds and reports
every other hop's death). Only freeing the session goes to every hop, so that a session nobody else can end (its
head gone) still leaves no KV behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from bus import capability
from bus.liveness import first_lost
from bus.nodeclient import NodeClient
from schemas.errors import HopError, HopOpenError, RouteFailedError
from schemas.route import Route
from schemas.session import Prompt, SessionOpen, SessionOpened, TokenizeReply

T = TypeVar("T")


async def passthrough(awaitable: Awaitable[T]) -> T:
    """A node refusing with a 4xx/429 is the client's problem or a busy node: pass its error through as is. A hop
    the head could not open (``HopOpenError``) counts as that hop's own answer."""
    try:
        return await awaitable
    except HopError as raised:
        exc = raised.peer_error.as_hop_error() if isinstance(raised.peer_error, HopOpenError) else raised
        if exc.peer_status in (401, 403):  # the swarm's own grant was refused: not the API client's fault
            raise RouteFailedError(f"node {exc.node} refused the session capability: {exc.message}",
                                   code="capability_refused") from exc
        if exc.peer_error is not None and exc.peer_status is not None and exc.peer_status < 500:
            raise exc.peer_error from None
        raise RouteFailedError(f"could not open the session: {exc.message}") from exc


class RouteNodes:
    """Injected with the node client; holds no state of its own (every call names its route and session)."""

    def __init__(self, nodes: NodeClient) -> None:
        self._nodes = nodes

    async def tokenize(self, route: Route, prompt: Prompt) -> TokenizeReply:
        """The head's tokens of a prompt, and how it rendered its tools; its refusals pass through (``passthrough``)."""
        head = route.head
        return await passthrough(self._nodes.tokenize_reply(head.node_id, head.endpoint, prompt,
                                                            capability=head.capability))

    async def open(self, route: Route, request: SessionOpen) -> SessionOpened:
        """Open the session on the head, which opens the later hops; refusals pass through (``passthrough``)."""
        head = route.head
        return await passthrough(self._nodes.open_session(head.node_id, head.endpoint, request))

    async def find_unresponsive(self, route: Route) -> str | None:
        """The head, if it does not answer its health check: a live head would have reported the route's
        silence itself."""
        head = route.head
        return None if await self._nodes.probe(head.node_id, head.endpoint) else head.node_id

    async def find_lost(self, route: Route, session_id: str) -> tuple[str, str] | None:
        """The head, if its process is gone or it lost the session, and why. Only the head: every other hop's
        death is the head's to find and report (it owns the session's fate)."""
        token = capability.session_token_of(route)
        return await first_lost(self._nodes, route.hops[:1], session_id, session_token=token)

    async def free(self, route: Route, session_id: str, *, cancel: bool = False,
                   keys: list[str] | None = None) -> None:
        """Free the session on every hop (idempotent there); ``cancel`` asks the head to end it as cancelled."""
        token = capability.session_token_of(route)
        await asyncio.gather(*(self._nodes.close_session(h.node_id, h.endpoint, session_id, session_token=token,
                                                         cancel=cancel and i == 0, keys=keys or ())
                               for i, h in enumerate(route.hops)))
