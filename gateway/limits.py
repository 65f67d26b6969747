"""Concurrency limits on generation requests: per gateway and per API key, answered with 429 + Retry-After.

A slot is held for the whole request, streaming included, and released when the response ends or the client goes
away (the ASGI call returns then). Waiting is never queued: a request over a limit is refused at once, so a burst
cannot pile up sessions, memory or tasks behind the limit. Keys are tracked by digest, never by their text.
"""

from __future__ import annotations

import dataclasses
import hashlib

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from bus.http_edge import error_response
from schemas.errors import CapacityError
from schemas.settings import Settings

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
RETRY_AFTER_S = 1.0


@dataclasses.dataclass(frozen=True)
class ConcurrencyLimits:
    total: int = 0
    """Generation requests in flight on this gateway; 0 means unlimited."""

    per_key: int = 0
    """Generation requests in flight per API key (only when keys are configured); 0 means unlimited."""

    @classmethod
    def from_settings(cls, settings: Settings) -> ConcurrencyLimits:
        per_key = settings.api_key_max_sessions if settings.api_keys else 0
        return cls(total=settings.gateway_max_sessions, per_key=per_key)


class ConcurrencyCounter:
    """In-flight counts; single event loop, so plain integers need no lock."""

    def __init__(self, limits: ConcurrencyLimits) -> None:
        self.limits = limits
        self.total = 0
        self.by_key: dict[str, int] = {}
        self.refused = 0

    def try_acquire(self, key: str) -> CapacityError | None:
        """Take a slot for ``key`` (a digest), or say why not."""
        limits = self.limits
        if limits.total and self.total >= limits.total:
            self.refused += 1
            return CapacityError(f"the gateway is serving its limit of {limits.total} generation requests; retry "
                                 f"shortly", retry_after=RETRY_AFTER_S, code="gateway_busy")
        held = self.by_key.get(key, 0)
        if limits.per_key and held >= limits.per_key:
            self.refused += 1
            return CapacityError(f"this API key already has {held} generation requests in flight (limit "
                                 f"{limits.per_key})", retry_after=RETRY_AFTER_S, code="api_key_concurrency")
        self.total += 1
        self.by_key[key] = held + 1
        return None

    def release(self, key: str) -> None:
        self.total -= 1
        left = self.by_key[key] - 1
        if left:
            self.by_key[key] = left
        else:
            del self.by_key[key]


def key_digest(headers: Headers) -> str:
    """Which key a request spends: a digest of its bearer token (anonymous requests share one bucket)."""
    given = headers.get("authorization", "")
    token = given[7:] if given.lower().startswith("bearer ") else ""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


class ConcurrencyLimitMiddleware:
    """Pure ASGI (no buffering of streamed bodies); sits inside the API key check, so keys are already valid."""

    def __init__(self, app: ASGIApp, counter: ConcurrencyCounter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        key = key_digest(Headers(scope=scope))
        refused = self.counter.try_acquire(key)
        if refused is not None:
            await error_response(refused)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.counter.release(key)
