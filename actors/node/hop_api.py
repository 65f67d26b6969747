"""The node's per-token endpoints, served by the fast lane (``bus.hotpath``) and, behind it, as bare ASGI.

``POST /v1/sessions/{sid}/frames`` (activations from the previous hop) and ``POST /v1/sessions/{sid}/tokens``
(the tail's sampled token, to the head) are crossed once per hop per decode step. A hop link's requests are
answered by ``handle`` straight from the fast lane's ``data_received``: a decode frame that can run inline is
computed, and its forward written, before that call returns. Requests the fast lane hands to uvicorn (another
client's shape) reach the same ``handle`` through ``__call__``, an ASGI app in front of the node's Starlette app
that skips Starlette's routing, Request and Response machinery for these two paths. Every other request goes on to
the Starlette app. A frame or token whose body names another session than its URL is refused here, for both
token encodings. Errors keep the node API's shape: the ``SwarmrouteError`` mapped to its status and
OpenAI-style body.

``POST /v1/batch`` (issue #26, ``bus.frame_batch``) carries several sessions' decode frames or token frames in one
request: each entry is handed to its session as if it had come alone, in order, and the batch is answered once every
entry is (a frame once computed and forwarded), with one result per entry, so that one session's refusal fails only
that session's request upstream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from actors.backend import Hidden
from bus import frame as frames
from bus.capability import HEADER_SESSION_TOKEN
from bus.frame_batch import BATCH_CONTENT_TYPE, BATCH_PATH
from bus.hotpath import Answer
from bus.http_edge import answer, read_body
from bus.nodeclient import FRAME_CONTENT_TYPE, TOKEN_CONTENT_TYPE, WINDOW_CONTENT_TYPE
from schemas.errors import BadRequestError, FrameError, SwarmrouteError, validation_message
from schemas.frame import MAGIC, TOKEN_MAGIC, FrameHeader, SampledToken, SampledWindow
from schemas.session import TokenEvent

log = logging.getLogger(__name__)


class HopTarget(Protocol):
    """What the per-token endpoints need of an open session (``actors.node.session.NodeSession``)."""

    raw_id: bytes

    def on_frame(self, header: FrameHeader, hidden: Hidden, nbytes: int) -> int | Awaitable[int]: ...

    def on_token(self, event: TokenEvent | SampledToken) -> None: ...

    def on_window(self, window: SampledWindow) -> None: ...


Lookup = Callable[[str, str | None], HopTarget]
"""(session id, session token header) -> the open session; raises SessionNotFoundError / CapabilityError."""

_PREFIX = "/v1/sessions/"
_TOKEN_HEADER = HEADER_SESSION_TOKEN.lower().encode("latin-1")
_JSON = [(b"content-type", b"application/json")]
_NO_CONTENT: Answer = (204, b"", ())


class HopApi:
    def __init__(self, app: ASGIApp, lookup: Lookup, *, max_frame_bytes: int, max_body_bytes: int) -> None:
        self.app = app
        self._lookup = lookup
        self._max_frame_bytes = max_frame_bytes
        self._max_body_bytes = max_body_bytes

    # ---- the fast lane's interface (bus.hotpath.HotRoutes) -------------------------------------------------------

    def claims(self, method: str, path: str) -> int | None:
        if method == "POST" and path == BATCH_PATH:
            return self._max_frame_bytes
        if method != "POST" or not path.startswith(_PREFIX):
            return None
        sid, _, leaf = path[len(_PREFIX):].partition("/")
        if not sid:
            return None
        return self._max_frame_bytes if leaf == "frames" else self._max_body_bytes if leaf == "tokens" else None

    def handle(self, path: str, headers: Mapping[bytes, bytes], body: bytes) -> Answer | Awaitable[Answer]:
        """Answer a claimed request; awaitable only when a frame's step had to queue for the backend's worker."""
        if path == BATCH_PATH:
            return self._batch(headers, body)
        sid, _, leaf = path[len(_PREFIX):].partition("/")
        try:
            if leaf == "tokens":
                self._token(sid, headers, body)
                return _NO_CONTENT
            position = self._frame(sid, headers, body)
        except SwarmrouteError as exc:
            return answer(exc)
        if isinstance(position, int):
            return _position(position)
        return _answer_later(position)

    def _frame(self, sid: str, headers: Mapping[bytes, bytes], body: bytes) -> int | Awaitable[int]:
        session = self._lookup(sid, _text(headers.get(_TOKEN_HEADER)))
        content_type = _text(headers.get(b"content-type")) or FRAME_CONTENT_TYPE
        if content_type != FRAME_CONTENT_TYPE:
            raise FrameError(f"frames must be sent as {FRAME_CONTENT_TYPE}")
        try:
            header, hidden = frames.decode(body)
        except frames.FrameDecodeError as exc:
            raise FrameError(str(exc)) from None
        if header.session_id != session.raw_id:
            raise FrameError(f"frame is for session {frames.session_str(header.session_id)}, not {sid}")
        return session.on_frame(header, hidden, len(body))

    def _token(self, sid: str, headers: Mapping[bytes, bytes], body: bytes) -> None:
        session = self._lookup(sid, _text(headers.get(_TOKEN_HEADER)))
        content_type = _text(headers.get(b"content-type")) or "application/json"
        event: TokenEvent | SampledToken
        if content_type == WINDOW_CONTENT_TYPE:  # a verify window's verdict (issue #20)
            try:
                window = frames.decode_window(body)
            except frames.FrameDecodeError as exc:
                raise FrameError(str(exc)) from None
            if window.session_id != session.raw_id:
                raise FrameError(f"window frame is for session {frames.session_str(window.session_id)}, not {sid}")
            session.on_window(window)
            return
        if content_type == TOKEN_CONTENT_TYPE:
            try:
                event = frames.decode_token(body)
            except frames.FrameDecodeError as exc:
                raise FrameError(str(exc)) from None
            if event.session_id != session.raw_id:
                raise FrameError(f"token frame is for session {frames.session_str(event.session_id)}, not {sid}")
        elif content_type.split(";")[0].strip() == "application/json":
            try:
                event = TokenEvent.model_validate_json(body)
            except ValidationError as exc:
                raise BadRequestError(f"invalid TokenEvent: {validation_message(exc)}") from None
            if event.session_id != sid:
                raise BadRequestError(f"token event is for session {event.session_id}, not {sid}")
        else:
            raise BadRequestError(f"tokens are sent as {TOKEN_CONTENT_TYPE} or application/json")
        session.on_token(event)

    def _batch(self, headers: Mapping[bytes, bytes], body: bytes) -> Answer | Awaitable[Answer]:
        """Every entry to its session, in order; answered with one result per entry once all are."""
        if (_text(headers.get(b"content-type")) or BATCH_CONTENT_TYPE) != BATCH_CONTENT_TYPE:
            return answer(FrameError(f"batches must be sent as {BATCH_CONTENT_TYPE}"))
        try:
            entries = frames.decode_batch(body)
        except frames.FrameDecodeError as exc:
            return answer(FrameError(str(exc)))
        results = [self._entry(frame, token) for frame, token in entries]
        ready = [r for r in results if not isinstance(r, Awaitable)]
        if len(ready) == len(results):
            return _results(ready)
        # Every entry under way at once (a coroutine does nothing until awaited): an entry waiting for its session's
        # previous step must not hold the others' steps back.
        return _results_later([asyncio.ensure_future(r) if isinstance(r, Awaitable) else r for r in results])

    def _entry(self, frame: bytes, token: str) -> int | None | SwarmrouteError | Awaitable[int]:
        """One batch entry, handed on as a request of its own would be: a frame's position (or its awaitable),
        ``None`` for a token, or the error this entry alone is refused with."""
        try:
            magic = frame[:4]
            if magic not in (MAGIC, TOKEN_MAGIC) or len(frame) < 24:
                raise FrameError(f"a batch carries activation or token frames, not {magic!r}")
            sid = frames.session_str(frame[8:24])  # both kinds carry the session at bytes 8..24
            if magic == TOKEN_MAGIC:
                self._token(sid, {b"content-type": TOKEN_CONTENT_TYPE.encode(),
                                  **({_TOKEN_HEADER: token.encode("latin-1")} if token else {})}, frame)
                return None
            session = self._lookup(sid, token or None)
            try:
                header, hidden = frames.decode(frame)
            except frames.FrameDecodeError as exc:
                raise FrameError(str(exc)) from None
            return session.on_frame(header, hidden, len(frame))
        except SwarmrouteError as exc:
            return exc

    # ---- ASGI, for requests the fast lane left to uvicorn ---------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.claims(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        try:
            body = await read_body(receive, headers, limit)
        except SwarmrouteError as exc:
            answered = answer(exc)
        else:
            handled = self.handle(scope["path"], headers, body)
            answered = handled if isinstance(handled, tuple) else await handled
        status, payload, extra = answered
        await _respond(send, status, payload, list(extra))


async def _answer_later(position: Awaitable[int]) -> Answer:
    try:
        at = await position
    except SwarmrouteError as exc:
        return answer(exc)
    # One loop turn before answering: a forward the outbox could not write at once goes out first. The forward is
    # on the per-token path; this answer is not (the upstream hop sends this session's next frame only after the
    # ring comes round).
    await asyncio.sleep(0)
    return _position(at)


async def _results_later(results: list[int | None | SwarmrouteError | Awaitable[int]]) -> Answer:
    settled: list[int | None | SwarmrouteError] = []
    for r in results:
        if not isinstance(r, Awaitable):
            settled.append(r)
            continue
        try:
            settled.append(await r)
        except SwarmrouteError as exc:
            settled.append(exc)
        except Exception as exc:  # noqa: BLE001 - one entry's fault is that entry's answer, as a lone request's
            log.exception("batch entry failed")
            settled.append(SwarmrouteError(f"internal error on the hop endpoint: {exc!r}"))
    await asyncio.sleep(0)  # as ``_answer_later``: the forwards go out first
    return _results(settled)


def _results(results: list[int | None | SwarmrouteError]) -> Answer:
    parts = []
    for r in results:
        if r is None:
            parts.append(b'{"status":204}')
        elif isinstance(r, int):
            parts.append(b'{"status":200,"position":%d}' % r)
        else:
            parts.append(b'{"status":%d,"error":%s}' % (r.status, json.dumps(r.to_body()["error"]).encode()))
    return 200, b'{"results":[' + b",".join(parts) + b"]}", ()


def _position(position: int) -> Answer:
    return 200, b'{"position":%d}' % position, ()


def _headers(scope: Scope) -> dict[bytes, bytes]:
    # ASGI header names are lower-case bytes; the last of a repeated header wins, as in Starlette.
    return dict(scope["headers"])


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


async def _respond(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers: list[Any] = [(b"content-length", str(len(body)).encode()), *(_JSON if body else []), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
