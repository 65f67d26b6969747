"""The node's per-token endpoints as a bare ASGI app in front of its Starlette app.

``POST /v1/sessions/{sid}/frames`` (activations from the previous hop) and ``POST /v1/sessions/{sid}/tokens``
(the tail's sampled token, to the head) are crossed once per hop per decode step. Starlette's routing, Request
object, exception middleware and Response rendering cost ~0.1-0.2 ms per request in Python, a sizeable share of
the 0.5 ms a hop may add; these two are handled here on the raw ASGI messages. Every other request (and any
method or path this does not own) goes on to the Starlette app. Errors keep the node API's shape: the
``SwarmrouteError`` mapped to its status and OpenAI-style body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from actors.route_session import RouteSession
from bus import frame as frames
from bus.capability import HEADER_SESSION_TOKEN
from bus.nodeclient import FRAME_CONTENT_TYPE
from schemas.errors import BadRequestError, CapacityError, FrameError, PayloadTooLargeError, SwarmrouteError
from schemas.session import TokenEvent

Lookup = Callable[[str, str | None], RouteSession]
"""(session id, session token header) -> the open session; raises SessionNotFoundError / CapabilityError."""

_PREFIX = "/v1/sessions/"
_TOKEN_HEADER = HEADER_SESSION_TOKEN.lower().encode("latin-1")
_JSON = [(b"content-type", b"application/json")]


class HopApi:
    def __init__(self, app: ASGIApp, lookup: Lookup, *, max_frame_bytes: int, max_body_bytes: int) -> None:
        self.app = app
        self._lookup = lookup
        self._max_frame_bytes = max_frame_bytes
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._route(scope)
        if handler is None:
            await self.app(scope, receive, send)
            return
        sid, handle = handler
        try:
            status, body = await handle(sid, scope, receive)
        except SwarmrouteError as exc:
            await _respond(send, exc.status, json.dumps(exc.to_body()).encode(), _retry_after(exc))
            return
        await _respond(send, status, body)

    def _route(self, scope: Scope) -> tuple[str, Callable[[str, Scope, Receive], Awaitable[tuple[int, bytes]]]] | None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path: str = scope["path"]
        if not path.startswith(_PREFIX):
            return None
        sid, _, leaf = path[len(_PREFIX):].partition("/")
        if not sid or "/" in leaf:
            return None
        if leaf == "frames":
            return sid, self._frame
        if leaf == "tokens":
            return sid, self._token
        return None

    async def _frame(self, sid: str, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        headers = _headers(scope)
        session = self._lookup(sid, _text(headers.get(_TOKEN_HEADER)))
        content_type = _text(headers.get(b"content-type")) or FRAME_CONTENT_TYPE
        if content_type != FRAME_CONTENT_TYPE:
            raise FrameError(f"frames must be sent as {FRAME_CONTENT_TYPE}")
        body = await _read_body(receive, headers, self._max_frame_bytes)
        try:
            header, hidden = frames.decode(body)
        except frames.FrameDecodeError as exc:
            raise FrameError(str(exc)) from None
        position = await session.on_frame(header, hidden, len(body))
        # One loop turn before answering: the session's outbox, woken by on_frame, then writes the forwarded frame
        # (or the token) first. The forward is on the per-token path; this answer is not (the upstream hop sends
        # this session's next frame only after the ring comes round).
        await asyncio.sleep(0)
        return 200, b'{"position":%d}' % position

    async def _token(self, sid: str, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        headers = _headers(scope)
        session = self._lookup(sid, _text(headers.get(_TOKEN_HEADER)))
        body = await _read_body(receive, headers, self._max_body_bytes)
        try:
            event = TokenEvent.model_validate_json(body)
        except ValidationError as exc:
            raise BadRequestError(f"invalid TokenEvent: {summarize(exc)}") from None
        if not session.is_head:
            raise BadRequestError("tokens go to the session's head")
        session.on_token(event)
        return 204, b""


def _headers(scope: Scope) -> dict[bytes, bytes]:
    # ASGI header names are lower-case bytes; the last of a repeated header wins, as in Starlette.
    return dict(scope["headers"])


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


async def _read_body(receive: Receive, headers: dict[bytes, bytes], limit: int) -> bytes:
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body of {declared.decode()} bytes exceeds the limit of {limit}")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequestError("the client went away before sending the whole body")
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return parts[0] if len(parts) == 1 else b"".join(parts)


def _retry_after(exc: SwarmrouteError) -> list[tuple[bytes, bytes]]:
    if isinstance(exc, CapacityError):
        return [(b"retry-after", str(max(1, round(exc.retry_after))).encode())]
    return []


async def _respond(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers: list[Any] = [(b"content-length", str(len(body)).encode()), *(_JSON if body else []), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def summarize(exc: ValidationError) -> str:
    """The first few problems of a validation error, on one line."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
