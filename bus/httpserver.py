"""Running a Starlette app under uvicorn inside an actor's event loop, on a socket the actor binds itself."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp


class _EmbeddedServer(uvicorn.Server):
    """uvicorn that leaves signals alone: the actor owning the loop decides when to stop (and cleans up first)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Binds ``host:port`` (port 0 picks a free one) and serves ``app`` until ``stop()``, which is idempotent."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this on Linux; without it a response written as headers + body waits
        # for a delayed ACK (~40 ms per hop).
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=75,
                                proxy_headers=False,
                                http="h11" if not _has_httptools() else "httptools")
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name=f"http-{self.port}")
        while not self._server.started:
            if self._task.done():
                await self._task
                raise RuntimeError(f"HTTP server on {self.url} exited during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), 5.0)
        except TimeoutError:
            self._server.force_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 2.0)
        with contextlib.suppress(OSError):
            self._sock.close()


def _has_httptools() -> bool:
    try:
        import httptools  # noqa: F401
    except ImportError:
        return False
    return True
