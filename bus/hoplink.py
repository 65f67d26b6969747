"""A minimal keep-alive HTTP/1.1 client for the per-token path (frames and tokens), on raw asyncio streams.

A general HTTP client costs about a millisecond per request in Python; a decode step crosses every hop once, so
the hot path uses this instead: one write per request (headers and body together, TCP_NODELAY), Content-Length
framing only (what the node server sends), pooled connections per peer. Control requests keep using httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

from bus.tls import check_pin

_MAX_HEADER = 16 * 1024

_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class LinkError(Exception):
    """Transport failure; ``timeout`` tells a stall from an unreachable or vanished peer."""

    def __init__(self, message: str, *, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class HttpLink:
    """Pooled connections to one peer (``http://host:port``; ``https://host:port`` with ``tls``, a client
    context, and ``pin``, the key that must answer: checked before a request is written, ``bus.tls``)."""

    def __init__(self, base_url: str, *, max_idle: int = 8, tls: ssl.SSLContext | None = None,
                 pin: str | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != ("https" if tls is not None else "http") or not parts.hostname:
            raise ValueError(f"hop links speak plain http://host:port, or https:// with a TLS context, "
                             f"got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if tls is not None else 80)
        self._tls = tls
        self._pin = pin
        self._host_header = parts.netloc.encode()
        self._idle: list[_Conn] = []
        self._max_idle = max_idle

    async def _connect(self) -> _Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self._tls,
                                                       server_hostname="" if self._tls is not None else None)
        if self._tls is not None:
            try:
                check_pin(writer.get_extra_info("ssl_object"), self._pin, where=f"{self.host}:{self.port}")
            except OSError:
                writer.close()
                raise
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    def _checkout(self) -> _Conn | None:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer
            writer.close()
        return None

    async def post(self, path: str, body: bytes, content_type: str, timeout: float,
                   headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """POST and return (status, body). Raises LinkError on connection failure or timeout."""
        return await self.post_now(path, body, content_type, timeout, headers)()

    def post_now(self, path: str, body: bytes, content_type: str, timeout: float,
                 headers: dict[str, str] | None = None) -> Callable[[], Coroutine[Any, Any, tuple[int, bytes]]]:
        """``post``, with the request written before this returns when a pooled connection is idle (otherwise when
        the answer is awaited): whatever the caller does next is then off the per-token path. Call the result and
        await that for the answer; it raises LinkError like ``post``. (A callable rather than a coroutine, so that
        a request whose answer is never wanted leaves no coroutine behind unawaited.)"""
        request = _request_bytes(self._host_header, path, body, content_type, headers)
        conn = self._checkout()
        if conn is not None:
            try:
                conn[1].write(request)
            except (OSError, RuntimeError):  # closed under us: the answer opens a fresh connection
                conn[1].close()
                conn = None
        return functools.partial(self._answer, conn, request, timeout)

    async def _answer(self, conn: _Conn | None, request: bytes, timeout: float) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(timeout):  # no task per request, unlike wait_for
                if conn is not None:
                    try:
                        return await self._read_answer(conn)
                    except (OSError, asyncio.IncompleteReadError):
                        pass  # the pooled connection had gone stale: retry once on a fresh one
                conn = await self._connect()
                conn[1].write(request)
                return await self._read_answer(conn)
        except TimeoutError:
            raise LinkError(f"no answer within {timeout:g}s", timeout=True) from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise LinkError(f"{type(exc).__name__}: {exc}") from None

    async def _read_answer(self, conn: _Conn) -> tuple[int, bytes]:
        reader, writer = conn
        try:
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            if len(head) > _MAX_HEADER:
                raise ValueError("response header too large")
            status, length, keep_alive = _parse_head(head)
            payload = await reader.readexactly(length) if length else b""
        except BaseException:
            writer.close()
            raise
        if keep_alive and len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            writer.close()
        return status, payload

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _request_bytes(host: bytes, path: str, body: bytes, content_type: str, headers: dict[str, str] | None) -> bytes:
    extra = b"".join(b"\r\n" + f"{k}: {v}".encode("latin-1") for k, v in headers.items()) if headers else b""
    return b"".join([b"POST ", path.encode(), b" HTTP/1.1\r\nhost: ", host, b"\r\ncontent-type: ",
                     content_type.encode(), b"\r\ncontent-length: ", str(len(body)).encode(), extra, b"\r\n\r\n",
                     body])


def _parse_head(head: bytes) -> tuple[int, int, bool]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {lines[0]!r}")
    status = int(rest[:3])
    length = 0
    keep_alive = version == "HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value.strip())
        elif name == "connection":
            keep_alive = value.strip().lower() == "keep-alive"
        elif name == "transfer-encoding" and value.strip().lower() != "identity":
            raise ValueError("chunked responses are not expected on hop links")
    return status, length, keep_alive
