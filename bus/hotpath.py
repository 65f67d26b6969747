"""A fast lane for the per-token requests, in front of uvicorn on the same socket.

A decode step crosses every hop of a route once, as one small POST (a frame, or the tail's token to the head).
Through uvicorn each of them costs a parser callback per header, an ASGI scope, a task and a loop turn before the
handler runs (~0.1 ms in Python on a busy 2-core node, a fifth of what a hop may add). ``HotPathProtocol`` parses
such requests itself in ``data_received`` and calls the handler there and then: a frame's forward pass can start in
the same loop turn its last byte arrived in.

It only takes what it can answer without doubt: ``POST`` to a path the handler claims (no query, no
percent-escape), HTTP/1.1, a ``Content-Length`` within the handler's limit, no transfer coding, no ``Expect`` or
``Upgrade``, kept alive. At the first request that is anything else, the connection from that request on is handed
to uvicorn's own protocol (the bytes already read go with it), so every other route, every malformed request and
every error answer of HTTP itself stay uvicorn's. Hop links (``bus.hoplink``) only ever send the plain shape, so
their connections stay here.

Requests on one connection are answered in order: while an answer is pending (the handler returned an awaitable)
the connection stops reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, cast

log = logging.getLogger(__name__)

Answer = tuple[int, bytes, Sequence[tuple[bytes, bytes]]]
"""Status, JSON body (empty for none), extra headers."""

MAX_HEAD = 16 * 1024
"""A head longer than this goes to uvicorn, whose own limits then apply."""

STALL_S = 60.0
"""A request begun but not complete for this long closes the connection: a peer trickling a large declared body
would otherwise hold its buffer (the idle sweep spares connections with bytes buffered)."""

_INTERNAL = (500, b'{"error":{"message":"internal error on the hop endpoint","type":"server_error",'
                  b'"code":"internal"}}', ())


class HotRoutes(Protocol):
    """What the fast lane serves."""

    def claims(self, method: str, path: str) -> int | None:
        """The largest body accepted for this request, or ``None`` when it is not a hot-path request."""

    def handle(self, path: str, headers: Mapping[bytes, bytes], body: bytes) -> Answer | Awaitable[Answer]:
        """Answer a claimed request (header names are lower-case). An awaitable answer holds the connection's
        later requests back until it is written; errors must come back as answers (an exception is a 500)."""


class HotPathProtocol(asyncio.Protocol):
    """One connection. Built by uvicorn with its own protocol's arguments (``Config(http=...)``); ``bind`` makes
    the class for one server."""

    routes: HotRoutes
    fallback: Callable[..., asyncio.Protocol]
    registry: set[HotPathProtocol]

    @classmethod
    def bind(cls, routes: HotRoutes, fallback: Callable[..., asyncio.Protocol],
             registry: set[HotPathProtocol]) -> type[HotPathProtocol]:
        return type("BoundHotPathProtocol", (cls,), {"routes": routes, "fallback": fallback, "registry": registry})

    def __init__(self, **uvicorn_args: Any) -> None:
        self._uvicorn_args = uvicorn_args
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._pending: asyncio.Task[None] | None = None
        self._delegated = False
        self._stall: asyncio.TimerHandle | None = None
        self.last_active = time.monotonic()

    # ---- asyncio.Protocol -------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.registry.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._unwatch()
        self.registry.discard(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._pending is None:
            self._serve()

    # ---- requests -----------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        """Answer every complete request in the buffer, until one is pending or the connection is handed on."""
        while self._transport is not None and not self._delegated and self._pending is None:
            end = self._buffer.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
            if end < 0:
                if len(self._buffer) > MAX_HEAD:
                    self._delegate()
                elif self._buffer:
                    self._watch()
                return
            request = _parse_head(bytes(self._buffer[:end]))
            limit = self.routes.claims(request[0], request[1]) if request is not None else None
            length = _plain_length(request[2], limit) if request is not None and limit is not None else None
            if request is None or length is None:
                self._delegate()
                return
            total = end + 4 + length
            if len(self._buffer) < total:
                self._watch()
                return
            if self._stall is not None:
                self._unwatch()
            body = bytes(self._buffer[end + 4:total])
            del self._buffer[:total]
            self.last_active = time.monotonic()
            self._answer(request[1], request[2], body)

    def _watch(self) -> None:
        if self._stall is None:
            self._stall = asyncio.get_running_loop().call_later(STALL_S, self._stalled)

    def _unwatch(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        log.warning("closing a connection whose request stayed incomplete for %.0f s", STALL_S)
        self.close()

    def _answer(self, path: str, headers: Mapping[bytes, bytes], body: bytes) -> None:
        try:
            answer = self.routes.handle(path, headers, body)
        except Exception:
            log.exception("hot path handler failed on %s", path)
            answer = _INTERNAL
        if isinstance(answer, tuple):
            self._write(answer)
            return
        assert self._transport is not None
        self._transport.pause_reading()
        self._pending = asyncio.ensure_future(self._answer_later(answer))

    async def _answer_later(self, answer: Awaitable[Answer]) -> None:
        try:
            result = await answer
        except asyncio.CancelledError:
            self.close()  # the server is stopping: the request stays unanswered and the peer sees the close
            raise
        except Exception:
            log.exception("hot path handler failed")
            result = _INTERNAL
        self._pending = None
        self._write(result)
        if self._transport is not None:
            self._transport.resume_reading()
            self._serve()

    def _write(self, answer: Answer) -> None:
        if self._transport is None or self._transport.is_closing():
            return
        status, body, extra = answer
        head = [b"HTTP/1.1 %d %s\r\ncontent-length: %d\r\n" % (status, _PHRASES.get(status, b"Unknown"), len(body))]
        if body:
            head.append(b"content-type: application/json\r\n")
        head.extend(b"%s: %s\r\n" % pair for pair in extra)
        head.append(b"\r\n")
        self._transport.write(b"".join(head) + body)

    def _delegate(self) -> None:
        """From the request at the start of the buffer on, this connection is uvicorn's."""
        transport = self._transport
        assert transport is not None
        self._delegated = True
        self._unwatch()
        self.registry.discard(self)
        protocol = self.fallback(**self._uvicorn_args)
        protocol.connection_made(transport)
        transport.set_protocol(protocol)
        buffered, self._buffer = bytes(self._buffer), bytearray()
        if buffered:
            protocol.data_received(buffered)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def idle(self) -> bool:
        return self._pending is None and not self._buffer


def close_idle(registry: set[HotPathProtocol], older_than_s: float) -> None:
    """Close connections with nothing pending that have been quiet for ``older_than_s`` (peers reconnect)."""
    cutoff = time.monotonic() - older_than_s
    for conn in [c for c in registry if c.idle() and c.last_active < cutoff]:
        with contextlib.suppress(Exception):
            conn.close()


_PHRASES = {s.value: s.phrase.encode() for s in http.HTTPStatus}


def _parse_head(head: bytes) -> tuple[str, str, dict[bytes, bytes]] | None:
    """(method, path, lower-cased headers) of an HTTP/1.1 request head, or ``None`` if it is anything else."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    target = parts[1] if len(parts) == 3 else b""
    # A query or a percent-escape: uvicorn decodes them, the fast lane only serves paths it can compare as they are.
    if parts[2:] != [b"HTTP/1.1"] or not target.startswith(b"/") or b"?" in target or b"%" in target:
        return None
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or name.lower() in headers:
            return None  # malformed, or repeated: uvicorn decides
        headers[name.lower()] = value.strip()
    try:
        return parts[0].decode("ascii"), parts[1].decode("ascii"), headers
    except UnicodeDecodeError:
        return None


def _plain_length(headers: Mapping[bytes, bytes], limit: int) -> int | None:
    """The body length when the request has the plain shape the fast lane serves, else ``None``."""
    declared = headers.get(b"content-length")
    if declared is None or not declared.isdigit() or int(declared) > limit:
        return None
    if b"transfer-encoding" in headers or b"expect" in headers or b"upgrade" in headers:
        return None
    if headers.get(b"connection", b"keep-alive").lower() != b"keep-alive":
        return None
    return int(declared)
