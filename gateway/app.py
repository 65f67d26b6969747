"""The gateway actor: a Starlette app (OpenAI endpoints, health, session telemetry SSE) on its own NATS connection.

    GET  /health
    GET  /v1/models
    POST /v1/chat/completions          stream true|false
    POST /v1/completions               stream true|false
    POST /v1/responses                 stream true|false (the Responses API: text and function calling)
                                       background true: kept in JetStream, by id on any gateway (issue #31):
    GET  /v1/responses/{id}            ?stream=true&starting_after=N (gateway.background)
    POST /v1/responses/{id}/cancel
    GET  /v1/sessions/{id}/telemetry   SSE of Generation Telemetry until the session ends
    GET  /dashboard                    the operators' live page (gateway/dashboard.py lists its paths)
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as HttpRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from bus import codec
from bus.actor import NatsActor
from bus.http_edge import EXCEPTION_HANDLERS, InternalErrors, error_response, read_model
from bus.httpserver import HttpServer
from bus.nodeclient import NodeClient
from bus.service import register
from bus.subjects import Subjects
from bus.tls import client_from_settings, gateway_context
from bus.tracker_client import TrackerClient
from gateway import sse
from gateway.admission import AdmissionMiddleware, AdmissionQueue, AdmittedSessions, QueueLimits
from gateway.background import BackgroundResponses
from gateway.limits import ConcurrencyCounter, ConcurrencyLimitMiddleware, ConcurrencyLimits
from gateway.live_session import LiveSession
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import GatewayMetrics, RequestCounter
from gateway.response_store import ResponseStore
from gateway.response_stream import ResponsesServing
from gateway.serving import OpenAIServing
from schemas.errors import AuthenticationError, NotFoundError
from schemas.openai import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from schemas.openai_responses import ResponsesRequest
from schemas.session import FailureReason, SessionPhase
from schemas.settings import Settings
from schemas.telemetry import GenerationTelemetry

log = logging.getLogger(__name__)
_OPEN_PATHS = {"/health"}
STREAM_END_GRACE_S = 2.0
"""How long a stopping gateway gives its streams to write their final error chunk."""


def build_app(serving: OpenAIServing, settings: Settings, background: BackgroundResponses | None = None) -> Starlette:
    """``background``: where background responses live (without it, ``background: true`` is a 400)."""
    sessions = serving.sessions
    keys = [k.get_secret_value().encode() for k in settings.api_keys]

    async def health(request: Request) -> Response:
        ok = sessions.nc.is_connected
        return JSONResponse({"status": "ok" if ok else "degraded", "nats": ok, "live_sessions": len(sessions.live)},
                            status_code=200 if ok else 503)

    async def models(request: Request) -> Response:
        reply = await sessions.tracker.models()
        cards = [ModelCard.model_validate({
            "id": m.id, "name": m.name, "aliases": m.aliases, "complete": m.complete, "n_layers": m.n_layers,
            "nodes": m.nodes,
            "layer_ranges": [[r.start, r.end] for r in m.layer_ranges],
            "fetching": [f.model_dump(mode="json", exclude={"schema_version"}) for f in m.fetching],
            "backend": m.backend.model_dump(mode="json") if m.backend else None}) for m in reply.models]
        return JSONResponse(ModelList(data=cards).model_dump(mode="json"))

    async def chat(request: Request) -> Response:
        req = await read_model(request, ChatCompletionRequest, settings.max_body_bytes)
        return await serving.chat(req, request)

    async def completions(request: Request) -> Response:
        req = await read_model(request, CompletionRequest, settings.max_body_bytes)
        return await serving.completion(req, request)

    responses_api = ResponsesServing(serving, background)

    async def responses(request: Request) -> Response:
        req = await read_model(request, ResponsesRequest, settings.max_body_bytes)
        return await responses_api.respond(req, request)

    def kept(rid: str) -> BackgroundResponses:
        if background is None:
            raise NotFoundError(f"No response found with id '{rid}'", param="response_id", code="response_not_found")
        return background

    async def response(request: Request) -> Response:
        rid = request.path_params["rid"]
        return await kept(rid).retrieve(rid, request.query_params)

    async def cancel_response(request: Request) -> Response:
        rid = request.path_params["rid"]
        return await kept(rid).cancel(rid)

    async def metrics(request: Request) -> Response:
        return Response(serving.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def telemetry(request: Request) -> Response:
        sid = request.path_params["sid"]
        live = sessions.live.get(sid)
        final = sessions.finished.get(sid)
        if live is None and final is None:
            raise NotFoundError(f"no session {sid} on this gateway", code="session_not_found")
        return StreamingResponse(_telemetry_events(sessions.nc, sessions.subjects, sid, live, final),
                                 media_type="text/event-stream", headers={"cache-control": "no-cache"})

    app = Starlette(routes=[
        HttpRoute("/health", health, methods=["GET"]),
        HttpRoute("/metrics", metrics, methods=["GET"]),
        HttpRoute("/v1/models", models, methods=["GET"]),
        HttpRoute("/v1/chat/completions", chat, methods=["POST"]),
        HttpRoute("/v1/completions", completions, methods=["POST"]),
        HttpRoute("/v1/responses", responses, methods=["POST"]),
        HttpRoute("/v1/responses/{rid}", response, methods=["GET"]),
        HttpRoute("/v1/responses/{rid}/cancel", cancel_response, methods=["POST"]),
        HttpRoute("/v1/sessions/{sid}/telemetry", telemetry, methods=["GET"]),
    ], exception_handlers=EXCEPTION_HANDLERS)
    from gateway.dashboard import PREFIX as DASHBOARD  # the operators' page: its own paths, its own key check
    from gateway.dashboard import dashboard_routes
    from gateway.dashboard_feed import SwarmFeed
    app.router.routes.extend(dashboard_routes(SwarmFeed(sessions.nc, sessions.subjects,
                                                        ttl_s=settings.registry_ttl_s), keys))

    app.add_middleware(InternalErrors)  # innermost: one 500 and one traceback for whatever no handler took
    # Added first = innermost: requests are counted only once their API key passed. The admission queue waits
    # inside the concurrency limits (a waiting request is in flight) and starts a waiting stream's response.
    app.add_middleware(AdmissionMiddleware)
    app.state.concurrency = ConcurrencyCounter(ConcurrencyLimits.from_settings(settings))
    app.add_middleware(ConcurrencyLimitMiddleware, counter=app.state.concurrency)
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys, self_checked=DASHBOARD)
    app.add_middleware(RequestCounter, metrics=serving.metrics)  # outermost: refused requests count too
    return app


class ApiKeyMiddleware:
    """OpenAI-style ``Authorization: Bearer <key>`` on every path but health; constant-time comparison."""

    def __init__(self, app: ASGIApp, keys: list[bytes], self_checked: str | None = None) -> None:
        """``self_checked``: a path prefix whose routes check the keys themselves (the dashboard: a browser without
        a key gets a sign-in form there, not a JSON 401)."""
        self.app = app
        self.keys = keys
        self.self_checked = self_checked

    def _own_check(self, path: str) -> bool:
        prefix = self.self_checked
        return prefix is not None and (path == prefix or path.startswith(prefix + "/"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS and not self._own_check(scope["path"]):
            given = Headers(scope=scope).get("authorization", "")
            token = given[7:].encode() if given.lower().startswith("bearer ") else b""
            if not any(hmac.compare_digest(token, k) for k in self.keys):
                response = error_response(AuthenticationError("missing or invalid API key (Authorization: Bearer)"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _telemetry_events(nc: NATS, subjects: Subjects, sid: str, live: LiveSession | None,
                            final: GenerationTelemetry | None) -> AsyncIterator[bytes]:
    if live is None and final is not None:
        yield sse.data(final)
        yield sse.DONE
        return
    queue: asyncio.Queue[GenerationTelemetry] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        with contextlib.suppress(codec.DecodeError):
            queue.put_nowait(codec.decode(msg.data, GenerationTelemetry))

    sub = await nc.subscribe(subjects.telemetry(sid), cb=on_msg)
    try:
        last = live.telemetry if live is not None else None
        sent = -1
        if last is not None:
            yield sse.data(last)
            sent = last.seq
            if last.phase.terminal:  # ended before cleanup: nothing more will be published
                yield sse.DONE
                return
        while True:
            try:
                snap = await asyncio.wait_for(queue.get(), 5.0)
            except TimeoutError:
                yield sse.KEEPALIVE
                continue
            # Skip what was already shown; a terminal snapshot always counts: the gateway numbers its own (cancelled,
            # failed) from what it has absorbed, which may lag the head's latest.
            if snap.seq <= sent and not snap.phase.terminal:
                continue
            sent = snap.seq
            yield sse.data(snap)
            if snap.phase.terminal:
                break
        yield sse.DONE
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


class Gateway(NatsActor):
    """The gateway actor: an async context manager (``bus.actor.NatsActor``); ``stop()`` is safe to call twice."""

    def __init__(self, settings: Settings, *, host: str | None = None, port: int | None = None,
                 nc: NATS | None = None) -> None:
        super().__init__(settings, nc=nc, name="gateway")
        self._host = host or settings.bind_host
        self._port = settings.gateway_port if port is None else port
        self.server: HttpServer | None = None
        self.serving: OpenAIServing | None = None
        self.background: BackgroundResponses | None = None
        self._nodes: NodeClient | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    async def _on_start(self) -> None:
        subjects = Subjects(self.settings.namespace)
        self._nodes = NodeClient(timeout_s=self.settings.hop_timeout_s,
                                 tls=client_from_settings(self.settings, self.settings.member_name or "gateway"))
        metrics = GatewayMetrics()
        queue = AdmissionQueue(QueueLimits.from_settings(self.settings), metrics)
        manager = AdmittedSessions(self.nc, TrackerClient(self.nc, subjects), self._nodes, self.settings, queue)
        self.serving = OpenAIServing(manager, metrics)
        self.background = BackgroundResponses(self.serving, ResponseStore(self.nc, self.settings), self._nodes,
                                              self.settings)
        self.background.start_sweeping()
        self.server = HttpServer(build_app(self.serving, self.settings, self.background), self._host, self._port,
                                 tls=gateway_context(self.settings, self._host))
        await self.server.start()
        self.service = await register(self.nc, namespace=subjects.namespace, role="gateway",
                                       member=self.settings.member_name or "gateway", extra={"url": self.server.url},
                                       description="swarmroute gateway: OpenAI-compatible API")
        log.info("gateway listening on %s", self.server.url)

    async def _on_stop(self) -> None:
        await self._stop_service()
        running: set[str] = set()
        if self.background is not None:
            running = await self.background.aclose()  # first: its sessions are not this gateway's to end
        if self.serving is not None:
            await self._end_streams(running)
        if self.server is not None:
            await self.server.stop()
        if self.serving is not None:
            await self.serving.aclose()
        if self._nodes is not None:
            await self._nodes.aclose()

    async def _end_streams(self, running: set[str]) -> None:
        """Every client still streaming gets an error chunk and ``[DONE]`` (not a bare ``[DONE]`` that reads like
        a complete answer); then each session is freed on its hops. Background sessions (``running``) run on."""
        assert self.serving is not None
        live = [s for s in self.serving.sessions.live.values() if s.id not in running]
        for session in live:
            session.abort(FailureReason(phase=session.telemetry.phase if session.telemetry else SessionPhase.PREFILL,
                                        kind="internal", message="the gateway is shutting down"))
        deadline = time.monotonic() + STREAM_END_GRACE_S
        while any(s.backlog for s in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for session in live:
            await session.close(cancelled=True)
