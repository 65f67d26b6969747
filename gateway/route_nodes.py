"""The gateway's calls to one session's route: tokenize on the head and open there, probe the head, free every hop.

The gateway talks to the head alone while a session runs: it sends the head the one ``SessionOpen`` (the head opens
every later hop itself, ``actors/node/route_open.py``), and it probes only the head (the head finds and reports
every other hop's death). Only freeing the session goes to every hop, so that a session nobody else can end (its
head gone) still leaves no KV behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from bus import capability
from bus.liveness import first_lost
from bus.nodeclient import NodeClient
from bus.tracker_client import TrackerClient
from schemas.errors import HopError, HopOpenError, RouteFailedError, SwarmrouteError
from schemas.route import RepairRequest, Route
from schemas.session import Prompt, Resume, SessionOpen, SessionOpened, TokenizeReply
from schemas.snapshot import SnapshotSegment

T = TypeVar("T")
log = logging.getLogger(__name__)
REPLACEMENT_POLL_S = 0.5
"""How often the gateway asks the trackers again while no node can take a lost head's layers over."""


class HeadLost(Exception):
    """Why a lost head could not be replaced; the session then fails naming the head, with this message."""


@dataclasses.dataclass(frozen=True)
class HeadState:
    """What only the head held, as the gateway holds it too (issue #31): the open it sent (the request), the tokens
    the client has, how far the prompt goes, the route's epoch and the last telemetry seq seen."""

    request: SessionOpen
    generated: list[int]
    n_prompt: int
    max_tokens: int
    epoch: int
    telemetry_seq: int

    @property
    def target(self) -> int:
        """Where the replacement's KV must reach before it sends a frame: the position whose frame the tail samples
        the client's next token from, or, before any token, the start of the prompt's last prefill chunk."""
        if self.generated:
            return self.n_prompt + len(self.generated) - 1
        chunk = self.request.prefill_chunk
        return (self.n_prompt - 1) // chunk * chunk


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

    def __init__(self, nodes: NodeClient, tracker: TrackerClient | None = None) -> None:
        self._nodes = nodes
        self._tracker = tracker

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

    async def replace_head(self, route: Route, state: HeadState, *, exclude: list[str], timeout_s: float) -> Route:
        """Issue #31: a node serving the lost head's layers (the trackers', asked again until ``timeout_s``), opened
        as the session's head with what the old head held (``state``) and its snapshot chain; returns the new route.
        ``HeadLost`` says why not."""
        if self._tracker is None:
            raise HeadLost("this gateway cannot ask the trackers for a replacement")
        token = capability.session_token_of(route)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                new = await self._tracker.repair(RepairRequest(route=capability.strip(route), lost=0,
                                                               exclude=exclude, session_token=token))
                break
            except SwarmrouteError as exc:
                if exc.status != 503 or time.monotonic() + REPLACEMENT_POLL_S > deadline:
                    raise HeadLost(f"no replacement for layers {route.head.layers}: {exc.message}") from None
                await asyncio.sleep(REPLACEMENT_POLL_S)
        segments = await self._head_chain(route, state.target, exclude)
        standby = route.head.standby
        resume = Resume(standby=standby if segments else None, segments=[s.digest for s in segments],
                        start=segments[-1].end if segments else 0, quiet_below=state.target, target=state.target,
                        generated=state.generated, telemetry_seq=state.telemetry_seq, lost_node=route.head.node_id)
        request = state.request.model_copy(update={
            "route": capability.strip(new, keep_standby=0), "capability": new.head.capability, "downstream": None,
            "resume": resume, "epoch": state.epoch, "max_tokens": state.max_tokens, "fit_max_tokens": False,
            "reuse_limit": None})
        try:
            await self._nodes.open_session(new.head.node_id, new.head.endpoint, request)
        except HopError as exc:
            raise HeadLost(f"the replacement {new.head.node_id} could not take the session over: "
                           f"{exc.message}") from None
        return new

    async def _head_chain(self, route: Route, target: int, exclude: list[str]) -> list[SnapshotSegment]:
        """The lost head's snapshot chain, as far as it ends at or before ``target`` (none: the replacement
        recomputes from the tokens)."""
        standby = route.head.standby
        if standby is None or standby.node_id in exclude:
            return []
        try:
            listing = await self._nodes.list_snapshots(standby.node_id, standby.endpoint, route.session_id,
                                                       route.head.layers,
                                                       session_token=capability.session_token_of(route))
        except HopError as exc:
            log.warning("session %s: the head's standby %s lists no snapshots: %s", route.session_id[:8],
                        standby.node_id, exc)
            return []
        usable: list[SnapshotSegment] = []
        for segment in listing.segments:
            if segment.end > target:
                break
            usable.append(segment)
        return usable
