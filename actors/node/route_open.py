"""The head opens the rest of its route (issue #20: route setup off the first token's path).

The gateway sends only the head a ``SessionOpen``, with ``downstream`` (each later hop's grant and standby grant) and,
for a prompt without tools, the prompt instead of its tokens. The head tokenizes it, checks it against the route's
context, and opens every hop after it at once, in parallel, while its own first prefill chunk computes: the first
frame leaves when they have all answered, and so does the head's answer to the gateway. Each hop's open carries
only that hop's own grants, as when the gateway sent it.

A hop that cannot be opened fails the whole open: the head frees what it opened (its own session included, which has
published nothing yet) and answers with a ``HopOpenError`` naming the hop and carrying that hop's own answer, which
the gateway turns back into the ``HopError`` it would have seen opening the hop itself: a dead node is routed
around, a 4xx (a full node, a refused grant) reaches the client as before.

Prefix reuse keeps its rule: the head reuses no more than the least any later hop reuses. When the head itself has
something to reuse it waits for those answers before it starts; a prompt it holds no prefix of has nothing to wait
for.
"""

from __future__ import annotations

import asyncio
import contextlib

from bus.nodeclient import NodeClient
from schemas.errors import HopError, HopOpenError
from schemas.route import Hop
from schemas.session import HopGrant, SessionOpen, SessionOpened


def downstream_open(head: SessionOpen, index: int, grant: HopGrant) -> SessionOpen:
    """Hop ``index``'s open, from the head's (tokens and budget settled): the route without any grant but this hop's
    standby grant, and its own session grant."""
    def bare(i: int, hop: Hop) -> Hop:
        standby = hop.standby
        if standby is not None:
            standby = standby.model_copy(update={"capability": grant.standby if i == index else ""})
        return hop.model_copy(update={"capability": "", "standby": standby})

    route = head.route.model_copy(update={"hops": [bare(i, h) for i, h in enumerate(head.route.hops)]})
    return head.model_copy(update={"route": route, "hop_index": index, "capability": grant.capability,
                                   "prompt": None, "fit_max_tokens": False, "downstream": None, "reuse_limit": None})


async def open_downstream(client: NodeClient, head: SessionOpen, session_token: str | None) -> list[SessionOpened]:
    """Open hops 1.. of ``head.route`` in parallel; a ``HopOpenError`` for the first that failed (in route order),
    once every one that opened was freed again."""
    assert head.downstream is not None
    hops = head.route.hops[1:]
    results = await asyncio.gather(*(client.open_session(hop.node_id, hop.endpoint, downstream_open(head, i, grant))
                                     for i, (hop, grant) in enumerate(zip(hops, head.downstream, strict=True), 1)),
                                   return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is None:
        return [r for r in results if isinstance(r, SessionOpened)]
    await asyncio.gather(*(client.close_session(hop.node_id, hop.endpoint, head.session_id, timeout=1.0,
                                                session_token=session_token)
                           for hop, r in zip(hops, results, strict=True) if isinstance(r, SessionOpened)),
                         return_exceptions=True)
    if isinstance(failed, HopError):
        raise HopOpenError.of(failed) from failed
    raise failed


class RouteOpening:
    """The later hops' opens, under way: ``done`` for a session's first frame (False: they failed, and the head's
    open answers why), ``result`` for the open's answer. Started by ``actors.node.opener`` before the head's own
    backend session opens (a reusing head needs their answers before it is built), then the head's alone
    (``SessionStart.opening``): it awaits them for its first frame and for its open's answer."""

    def __init__(self, client: NodeClient, head: SessionOpen, session_token: str | None) -> None:
        self._client, self._head, self._token = client, head, session_token
        self._task = asyncio.ensure_future(open_downstream(client, head, session_token))

    async def done(self) -> bool:
        try:
            await asyncio.shield(self._task)
        except Exception:  # noqa: BLE001 - the open's answer reports it
            return False
        return True

    async def result(self) -> list[SessionOpened]:
        return await asyncio.shield(self._task)

    async def cancel(self) -> None:
        """The head's own open failed after these started: stop them, and free the session on every later hop
        (idempotent there: a hop that never opened it counts as freed)."""
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task
        await asyncio.gather(*(self._client.close_session(hop.node_id, hop.endpoint, self._head.session_id,
                                                          timeout=1.0, session_token=self._token)
                               for hop in self._head.route.hops[1:]), return_exceptions=True)
