"""The node's control endpoints: every HTTP route but the two per-token ones (``hop_api`` serves those in front of
this app). docs/protocol.md has the full contract::

    GET    /health                          liveness
    GET    /metrics                         Prometheus series (``metrics``)
    GET    /v1/info                         this node's advertisement
    POST   /v1/tokenize                     head: Prompt -> token ids
    POST   /v1/sessions                     open (SessionOpen, ``opener``); the head starts prefill at once
    GET    /v1/sessions/{id}                position and counters of one session
    POST   /v1/sessions/{id}/frames         binary activation frame (every hop but the head; ``hop_api``)
    POST   /v1/sessions/{id}/tokens         head: the tail's sampled token (token frame or TokenEvent; ``hop_api``)
    POST   /v1/sessions/{id}/failure        head: a downstream hop reports a failure (FailureReason)
    POST   /v1/sessions/{id}/route          a repaired route: go on as its hop (RouteUpdate -> HopPosition)
    POST   /v1/sessions/{id}/replay         resend the journal to the new successor (ReplayRequest)
    DELETE /v1/sessions/{id}                free the session (idempotent; ``keep``, ``keys``: prefix reuse)
    POST   /v1/snapshots                    standby: keep one snapshot segment (bus.snapshot body)
    GET    /v1/snapshots/{id}?layers=A:B    standby: the chain held for a session's hop (SnapshotList)
    GET    /v1/snapshots/{id}/{digest}      standby: one segment's body
    DELETE /v1/snapshots/{id}               standby: forget a session's chains
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute
from starlette.routing import Route as HttpRoute

from actors.backend import Backend
from actors.node.admission import Admission
from actors.node.endings import Endings
from actors.node.engine import StepEngine
from actors.node.head_session import HeadSession
from actors.node.hop_session import HopSession
from actors.node.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from actors.node.metrics import NodeMetrics
from actors.node.prefix_offers import PrefixOffers
from actors.node.recovery.standby import StandbyApi
from actors.node.reuse import Reuse
from actors.node.session import NodeSession
from bus.capability import HEADER_CAPABILITY, HEADER_SESSION_TOKEN
from bus.http_edge import edge_app, read_model
from schemas.errors import BadRequestError, SessionNotFoundError
from schemas.node import NodeAdvertisement
from schemas.route import ReplayRequest, RouteUpdate
from schemas.session import FailureReason, Prompt, SessionOpen, SessionOpened, TokenizeReply

M = TypeVar("M", bound=BaseModel)


class ControlApi:
    """The Starlette app of a node's control endpoints, over the node's parts (``app()`` builds it)."""

    def __init__(self, *, node_id: str, backend: Backend, engine: StepEngine, admission: Admission, reuse: Reuse,
                 metrics: NodeMetrics, standby: StandbyApi, sessions: dict[str, NodeSession],
                 open_session: Callable[[SessionOpen], Awaitable[SessionOpened]],
                 advertisement: Callable[[], NodeAdvertisement], beat_soon: Callable[[], None],
                 max_body_bytes: int, endings: Endings | None = None,
                 prefix_offers: PrefixOffers | None = None, extra_routes: Sequence[BaseRoute] = ()) -> None:
        self.node_id = node_id
        self.backend = backend
        self.engine = engine
        self.admission = admission
        self.reuse = reuse
        self.metrics = metrics
        self.standby = standby
        self.sessions = sessions
        self.open_session = open_session
        self.advertisement = advertisement
        self.beat_soon = beat_soon
        """Heartbeat now: what the trackers route by changed (a kept prefix, a reservation that ended)."""
        """Kept prefixes gained keys: the node heartbeats at once, so trackers learn where the next turn's is."""
        self.max_body_bytes = max_body_bytes
        self.endings = endings or Endings()
        """Sessions this node headed that ended: a probe of one hears "ended", not "not open"."""
        self.extra_routes = list(extra_routes)
        """Routes of other parts of the node (spot checks, issue #28)."""
        self.prefix_offers = prefix_offers
        """Its kept prefixes offered to other routes (issue #26)."""

    def app(self) -> Starlette:
        routes = [
            HttpRoute("/health", self._health, methods=["GET"]),
            HttpRoute("/metrics", self._metrics, methods=["GET"]),
            HttpRoute("/v1/info", self._info, methods=["GET"]),
            HttpRoute("/v1/tokenize", self._tokenize, methods=["POST"]),
            HttpRoute("/v1/sessions", self._open, methods=["POST"]),
            HttpRoute("/v1/sessions/{sid}", self._status, methods=["GET"]),
            HttpRoute("/v1/sessions/{sid}", self._close, methods=["DELETE"]),
            # POST .../frames and .../tokens, the per-token path, are served by HopApi in front of this app.
            HttpRoute("/v1/sessions/{sid}/failure", self._failure, methods=["POST"]),
            HttpRoute("/v1/sessions/{sid}/route", self._route_update, methods=["POST"]),
            HttpRoute("/v1/sessions/{sid}/replay", self._replay, methods=["POST"]),
            *self.standby.routes(),
            *(self.prefix_offers.routes() if self.prefix_offers is not None else []),
            *self.extra_routes,
        ]
        return edge_app(routes)

    def session_for(self, session_id: str, session_token: str | None) -> NodeSession:
        """The session a request is about, if the request proves membership (session token, when admission is on)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"session {session_id} is not open on node {self.node_id}")
        Admission.check_session_token(session.session_token, session_token)
        return session

    def _member(self, request: Request) -> NodeSession:
        return self.session_for(request.path_params["sid"], request.headers.get(HEADER_SESSION_TOKEN))

    async def _json(self, request: Request, model: type[M]) -> M:
        return await read_model(request, model, self.max_body_bytes)

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "node_id": self.node_id, "sessions": len(self.sessions)})

    async def _info(self, request: Request) -> Response:
        return JSONResponse(self.advertisement().model_dump(mode="json"))

    async def _tokenize(self, request: Request) -> Response:
        prompt = await self._json(request, Prompt)
        self.admission.check_capability(request.headers.get(HEADER_CAPABILITY))
        if not self.backend.is_head:
            raise BadRequestError(f"node {self.node_id} is not a head: it has no tokenizer input")
        tokens = await self.engine.call(self.backend.tokenize, prompt)
        # With tools the head tells the gateway how it asked the model to write calls (the tail constrains, the
        # gateway parses that format); a backend that renders no tools refused them in ``tokenize`` already.
        tool_format = getattr(self.backend, "tool_format", None)
        if prompt.tools is not None and tool_format is None:
            raise BadRequestError(f"node {self.node_id}'s backend does not render tools", param="tools")
        reply = TokenizeReply(tokens=tokens,
                              tool_format=tool_format() if prompt.tools is not None and tool_format else None)
        return JSONResponse(reply.model_dump(mode="json"))

    async def _open(self, request: Request) -> Response:
        open_request = await self._json(request, SessionOpen)
        try:
            opened = await self.open_session(open_request)
        except BaseException:
            if self.admission.settled.refused_open(open_request.session_id):
                self.beat_soon()  # the trackers release the route's reservation here now, not in 1.5 beats
            raise
        return JSONResponse(opened.model_dump(mode="json"), status_code=201)

    async def _status(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        if sid not in self.sessions:
            self.endings.check(sid, self.node_id)
        s = self._member(request)
        return JSONResponse({"session_id": s.id, "position": s.position, "phase": s.phase.value,
                             "frames_received": s.frames_received, "bytes_received": s.bytes_received,
                             "positions_received": s.positions_received})

    async def _close(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        session = self.sessions.get(sid)
        token = request.headers.get(HEADER_SESSION_TOKEN)
        if session is not None:
            Admission.check_session_token(session.session_token, token)
            if isinstance(session, HeadSession) and request.query_params.get("cancel") == "1":
                await session.cancel("its client went away")
            else:
                session.keep = _positions(request.query_params.get("keep"), session.position)
                await session.close()
        elif self.admission.settled.closed_unopened(sid):
            self.beat_soon()  # a route refused before it reached this hop: its reservation ends now
        keys = [k for k in request.query_params.get("keys", "").split(",") if k]
        kept = self.reuse.cache.get(sid)
        if keys and kept is not None:
            Admission.check_session_token(kept.token, token)
            self.reuse.cache.attach_keys(sid, keys)
            self.beat_soon()  # trackers learn at once where the next turn's prefix is
        return JSONResponse({"closed": session is not None})

    async def _failure(self, request: Request) -> Response:
        session = self._member(request)
        reason = await self._json(request, FailureReason)
        session.on_failure_report(reason)
        return Response(status_code=204)

    # ---- repair (issue #18) --------------------------------------------------------------------------------------

    async def _route_update(self, request: Request) -> Response:
        session = self._member(request)
        update = await self._json(request, RouteUpdate)
        if update.session_id != session.id or not isinstance(session, HopSession):
            raise BadRequestError(f"a route update for session {update.session_id} reaches the heads of none")
        hops = update.route.hops
        if update.hop_index >= len(hops) or hops[update.hop_index].node_id != self.node_id:
            raise BadRequestError(f"hop {update.hop_index} of the repaired route is not node {self.node_id}")
        self.admission.check_update(update, session.session_token)
        position = await session.update_route(update)
        return JSONResponse(position.model_dump(mode="json"))

    async def _replay(self, request: Request) -> Response:
        session = self._member(request)
        replay = await self._json(request, ReplayRequest)
        return JSONResponse({"positions": session.replay(replay)})


def _positions(keep: str | None, held: int) -> int:
    """``keep`` of a DELETE: ``1`` (before issue #20) or how many positions are confirmed; 0 when absent."""
    if not keep or not keep.isdigit():
        return 0
    return held if keep == "1" else min(int(keep), held)
