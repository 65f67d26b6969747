"""The gateway's set of Route Sessions: the live ones, and the last telemetry snapshot of those that finished.

``start`` makes a ``LiveSession``, subscribes it to its events, and has it routed and opened
(``gateway.session_opener``); the session then runs on its own and tells the manager when it is freed
(``SessionLinks.closed``), which moves it from the live sessions to the finished ones.
"""

from __future__ import annotations

import contextlib
import uuid

from nats.aio.client import Client as NATS

from bus import codec
from bus.connection import keep_cancellation
from bus.nodeclient import NodeClient
from bus.subjects import Subjects
from bus.tracker_client import TrackerClient
from gateway.live_session import LiveSession, SessionLinks
from gateway.route_nodes import RouteNodes
from gateway.session_opener import GenerationRequest, SessionOpener
from schemas.errors import HopError, HopOpenError, SwarmrouteError
from schemas.session import FailureReason, SessionPhase
from schemas.settings import Settings
from schemas.telemetry import GenerationTelemetry

FINISHED_KEPT = 1000
"""Finished sessions whose last telemetry snapshot the gateway keeps (GET /v1/sessions/{id}/telemetry)."""


class SessionManager:
    """Creates Route Sessions; injected with the NATS connection, the tracker client and the node client."""

    def __init__(self, nc: NATS, tracker: TrackerClient, nodes: NodeClient, settings: Settings) -> None:
        self.nc = nc
        self.tracker = tracker
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self.live: dict[str, LiveSession] = {}
        self.finished: dict[str, GenerationTelemetry] = {}
        self.finished_limit = FINISHED_KEPT
        route_nodes = RouteNodes(nodes, tracker)
        self._opener = SessionOpener(tracker, route_nodes, settings)
        self._links = SessionLinks(settings=settings, nodes=route_nodes, publish=self._publish, closed=self._closed)

    async def start(self, request: GenerationRequest) -> LiveSession:
        """Route and open a session; raises a SwarmrouteError (with its HTTP status) before any token flows."""
        session = LiveSession(self._links, request.session_id or uuid.uuid4().hex, request.prompt)
        self.live[session.id] = session
        try:
            await session.subscribe(self.nc, self.subjects)
            await self._publish(session.snapshot(SessionPhase.ROUTING, seq=0))
            await self._opener.open(session, request)
        except BaseException as exc:
            if isinstance(exc, SwarmrouteError) and session.route is not None:
                node = exc.node if isinstance(exc, HopError | HopOpenError) else None
                reason = FailureReason(node_id=node, phase=SessionPhase.ROUTING, kind="http_error",
                                       message=exc.message)
                await self._publish(session.snapshot(SessionPhase.FAILED, failure=reason))
            await session.close()
            raise
        return session

    async def _publish(self, snap: GenerationTelemetry) -> None:
        """A snapshot the gateway made itself, on the session's telemetry subject; an end is also remembered."""
        if snap.phase.terminal:
            self._remember(snap.session_id, snap)
        with contextlib.suppress(Exception):
            await self.nc.publish(self.subjects.telemetry(snap.session_id), codec.encode(snap))
            keep_cancellation()

    def _closed(self, session_id: str, last: GenerationTelemetry | None) -> None:
        self.live.pop(session_id, None)
        if last is not None and session_id not in self.finished:
            self._remember(session_id, last)

    def _remember(self, session_id: str, snap: GenerationTelemetry) -> None:
        """Keep a finished session's last snapshot for late telemetry readers, oldest dropped beyond the limit
        (every ending goes through here: an unbounded table grew by ~5 KiB per session, tests/test_load.py)."""
        self.finished[session_id] = snap
        while len(self.finished) > self.finished_limit:
            self.finished.pop(next(iter(self.finished)))
