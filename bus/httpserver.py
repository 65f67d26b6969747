"""Running a Starlette app under uvicorn inside an actor's event loop, on a socket the actor binds itself, with an
optional fast lane (``bus.hotpath``) for the per-token requests on the same socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Iterator

import uvicorn
import uvicorn.config
import uvicorn.importer
from starlette.types import ASGIApp

from bus.hotpath import HotPathProtocol, HotRoutes, close_idle
from bus.tls import ServerTrust, pin_endpoint

log = logging.getLogger(__name__)

IDLE_S = 75.0
"""Keep-alive connections quiet for this long are closed (uvicorn's own ``timeout_keep_alive`` for the rest)."""


class _EmbeddedServer(uvicorn.Server):
    """uvicorn that leaves signals alone: the actor owning the loop decides when to stop (and cleans up first)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Binds ``host:port`` (port 0 picks a free one) and serves ``app`` until ``stop()``, which is idempotent.
    With ``hot``, the requests it claims are answered by the fast lane instead of going through ``app``. With
    ``tls`` a ``ServerTrust`` (a node), it speaks only TLS 1.3, requires a client certificate and closes every
    connection ``tls`` does not admit before reading a byte of it; its ``url`` then carries its key's pin
    (``bus.tls``). With ``tls`` a plain context (the gateway's HTTPS), it serves TLS to any client."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0, *, hot: HotRoutes | None = None,
                 tls: ServerTrust | ssl.SSLContext | None = None) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this on Linux; without it a response written as headers + body waits
        # for a delayed ACK (~40 ms per hop).
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._hot_connections: set[HotPathProtocol] = set()
        protocol: type[asyncio.Protocol] | str = "httptools" if _has_httptools() else "h11"
        if hot is not None:
            fallback = uvicorn.importer.import_from_string(uvicorn.config.HTTP_PROTOCOLS[str(protocol)])
            protocol = HotPathProtocol.bind(hot, fallback, self._hot_connections)
        self._tls = tls
        extra: dict[str, object] = {}
        if isinstance(tls, ServerTrust):
            plain: type[asyncio.Protocol] = (uvicorn.importer.import_from_string(
                uvicorn.config.HTTP_PROTOCOLS[protocol]) if isinstance(protocol, str) else protocol)
            protocol = _admitting(plain, tls)
        if tls is not None:
            context = tls.context if isinstance(tls, ServerTrust) else tls
            extra["ssl_context_factory"] = lambda _config, _default: context
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=int(IDLE_S), proxy_headers=False, http=protocol,
                                **extra)  # type: ignore[arg-type]
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if isinstance(self._tls, ServerTrust):
            return pin_endpoint(f"https://{host}:{self.port}", self._tls.identity.fingerprint)
        return f"{'https' if self._tls is not None else 'http'}://{host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name=f"http-{self.port}")
        while not self._server.started:
            if self._task.done():
                await self._task
                raise RuntimeError(f"HTTP server on {self.url} exited during start-up")
            await asyncio.sleep(0.01)
        self._sweeper = asyncio.create_task(self._sweep(), name=f"http-idle-{self.port}")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(IDLE_S / 5)
            close_idle(self._hot_connections, IDLE_S)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), 5.0)
        except TimeoutError:
            self._server.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 2.0)
        for conn in list(self._hot_connections):  # after uvicorn stopped accepting: none can come in behind
            conn.close()
        with contextlib.suppress(OSError):
            self._sock.close()


def _admitting(protocol: type[asyncio.Protocol], trust: ServerTrust) -> type[asyncio.Protocol]:
    """``protocol``, closing a connection whose peer ``trust`` does not admit as soon as its handshake is done
    (asyncio hands a TLS connection to the protocol only then), before any request on it is read."""
    def connection_made(self: asyncio.Protocol, transport: asyncio.BaseTransport) -> None:
        protocol.connection_made(self, transport)
        if not trust.admits(transport.get_extra_info("ssl_object")):
            log.warning("refused a TLS connection from %s: its key is not registered",
                        transport.get_extra_info("peername"))
            transport.abort()  # type: ignore[attr-defined]
    return type(f"Admitting{protocol.__name__}", (protocol,), {"connection_made": connection_made})


def _has_httptools() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True
