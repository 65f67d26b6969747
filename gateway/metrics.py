"""Prometheus metrics of a gateway, served at ``GET /metrics`` (behind the API keys when keys are set).

Each ``GatewayMetrics`` has its own registry, so several gateways in one process (tests) keep separate series.
Times are as the client sees them: TTFT counts from the moment the request was accepted (routing, opening the
session on every hop and prefill included).

Series (all names prefixed ``swarmroute_gateway_``)::

    requests_total{endpoint,status}       HTTP requests by route template and status (499: the client went away
                                          before its answer, a cancellation, apart from the 5xx)
    sessions_total{outcome}               generation requests by outcome: complete | failed | cancelled
    live_sessions                         generation requests in flight
    ttft_seconds                          request accepted -> first token
    setup_seconds{step}                   what the first token waited for, per session: route (the tracker's
                                          answer), tokenize (the head's, when it is a round trip of its own), open
                                          (every hop opened), first_token (opened -> the first token arrived)
    time_per_output_token_seconds         gap between consecutive tokens
    session_seconds                       request accepted -> session end
    hop_compute_seconds{node}             each hop's mean compute per decode step, per finished session
    hop_overhead_seconds                  per-link network/serialization cost per decode step, per finished session
    prompt_tokens_total / completion_tokens_total
    queue_waiting                         requests waiting in the admission queue (issue #30)
    queue_wait_seconds                    joined the queue -> admitted, or dropped
    queue_admitted_total                  requests admitted after waiting
    queue_dropped_total{reason}           requests the queue refused: full | displaced | timeout | left
    queue_retries_total                   turns that found no capacity yet (the head of the queue asks again)
    service_rate                          sessions ending per second, recent (what a place in the queue is worth)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas.session import SessionEnd, SessionPhase
from schemas.telemetry import GenerationTelemetry

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLOW = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/responses")


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("swarmroute_gateway_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.sessions = Counter("swarmroute_gateway_sessions", "Generation requests by outcome", ["outcome"],
                                registry=r)
        self.live_sessions = Gauge("swarmroute_gateway_live_sessions", "Generation requests in flight", registry=r)
        self.ttft = Histogram("swarmroute_gateway_ttft_seconds", "Request accepted to first token", buckets=_SLOW,
                              registry=r)
        self.setup = Histogram("swarmroute_gateway_setup_seconds", "Opening a session, by step: route, tokenize, "
                               "open, first_token", ["step"], buckets=_FAST, registry=r)
        self.tpot = Histogram("swarmroute_gateway_time_per_output_token_seconds", "Gap between consecutive tokens",
                              buckets=_FAST, registry=r)
        self.session_seconds = Histogram("swarmroute_gateway_session_seconds", "Request accepted to session end",
                                         buckets=_SLOW, registry=r)
        self.hop_compute = Histogram("swarmroute_gateway_hop_compute_seconds", "A hop's mean compute per decode "
                                     "step, per finished session", ["node"], buckets=_FAST, registry=r)
        self.hop_overhead = Histogram("swarmroute_gateway_hop_overhead_seconds", "Per-link overhead per decode "
                                      "step, per finished session", buckets=_FAST, registry=r)
        self.prompt_tokens = Counter("swarmroute_gateway_prompt_tokens", "Prompt tokens of finished sessions",
                                     registry=r)
        self.completion_tokens = Counter("swarmroute_gateway_completion_tokens", "Tokens generated", registry=r)
        self.queue_waiting = Gauge("swarmroute_gateway_queue_waiting", "Requests waiting in the admission queue",
                                   registry=r)
        self.queue_wait = Histogram("swarmroute_gateway_queue_wait_seconds", "Joined the admission queue to admitted "
                                    "or dropped", buckets=_SLOW, registry=r)
        self.queue_admitted = Counter("swarmroute_gateway_queue_admitted", "Requests admitted after waiting",
                                      registry=r)
        self.queue_dropped = Counter("swarmroute_gateway_queue_dropped", "Requests the admission queue refused, by "
                                     "reason: full, displaced, timeout, left", ["reason"], registry=r)
        self.queue_retries = Counter("swarmroute_gateway_queue_retries", "Turns of the admission queue that found no "
                                     "capacity yet", registry=r)
        self.service_rate = Gauge("swarmroute_gateway_service_rate", "Sessions ending per second, recent (0 until "
                                  "measured)", registry=r)

    def bind(self, *, live_sessions: Callable[[], int]) -> None:
        self.live_sessions.set_function(lambda: float(live_sessions()))

    def bind_queue(self, *, waiting: Callable[[], int], service_rate: Callable[[], float | None]) -> None:
        self.queue_waiting.set_function(lambda: float(waiting()))
        self.service_rate.set_function(lambda: float(service_rate() or 0.0))

    def clock(self, accepted_at: float, setup: Mapping[str, float] | None = None) -> RequestClock:
        """One per generation request; ``accepted_at`` is a ``time.monotonic()`` stamp; ``setup`` the session's
        seconds per setup step, observed with its first token."""
        return RequestClock(self, accepted_at, setup)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestClock:
    """Observes TTFT and inter-token gaps as tokens arrive, and the outcome once; ``finish`` is idempotent."""

    def __init__(self, metrics: GatewayMetrics, accepted_at: float,
                 setup: Mapping[str, float] | None = None) -> None:
        self._m = metrics
        self._accepted = accepted_at
        self._setup = setup
        self._last: float | None = None
        self._finished = False

    def token(self) -> None:
        now = time.monotonic()
        if self._last is None:
            self._m.ttft.observe(now - self._accepted)
            for step, seconds in (self._setup or {}).items():
                self._m.setup.labels(step=step).observe(seconds)
        else:
            self._m.tpot.observe(now - self._last)
        self._last = now
        self._m.completion_tokens.inc()

    def finish(self, end: SessionEnd | None, telemetry: GenerationTelemetry | None, prompt_tokens: int) -> None:
        if self._finished:
            return
        self._finished = True
        outcome = end.phase.value if end is not None and end.phase.terminal else SessionPhase.CANCELLED.value
        self._m.sessions.labels(outcome=outcome).inc()
        self._m.session_seconds.observe(time.monotonic() - self._accepted)
        self._m.prompt_tokens.inc(prompt_tokens)
        if telemetry is None:
            return
        for hop in telemetry.route:
            if hop.mean_compute_ms is not None:
                self._m.hop_compute.labels(node=hop.node_id).observe(hop.mean_compute_ms / 1e3)
        if telemetry.hop_overhead_ms is not None:
            self._m.hop_overhead.observe(telemetry.hop_overhead_ms / 1e3)


def _endpoint(path: str) -> str:
    if path in _ENDPOINTS:
        return path
    if path.startswith("/v1/sessions/") and path.endswith("/telemetry"):
        return "/v1/sessions/{id}/telemetry"
    return "other"  # unknown paths stay one series, whatever a scanner tries


class RequestCounter:
    """ASGI middleware counting every request by route template and final status; add it last (outermost) so
    requests refused by the auth and concurrency layers count too."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self._app = app
        self._m = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self._app(scope, receive, send_status)
        finally:
            self._m.requests.labels(endpoint=_endpoint(scope["path"]), status=str(status)).inc()
