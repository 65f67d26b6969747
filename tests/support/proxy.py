"""A TCP proxy on loopback that counts (and can delay) what crosses it: real bytes on the wire, real latency."""

from __future__ import annotations

import asyncio
import contextlib


class CountingProxy:
    """Forwards 127.0.0.1:<port> -> target, recording client->server bytes (and server->client ones with
    ``record_downstream``); ``delay_s`` is added one-way per chunk; ``connections`` counts what it accepted."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1", delay_s: float = 0.0, *,
                 record_downstream: bool = False) -> None:
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.upstream = bytearray()
        self.downstream = bytearray()
        self.connections = 0
        self._record_downstream = record_downstream
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def start(cls, target_port: int, target_host: str = "127.0.0.1", delay_s: float = 0.0,
                    listen_host: str = "127.0.0.1") -> CountingProxy:
        proxy = cls(target_port, target_host, delay_s)
        await proxy.listen(listen_host)
        return proxy

    async def listen(self, host: str = "127.0.0.1") -> None:
        self._server = await asyncio.start_server(self._handle, host, 0)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        self.upstream.clear()

    def request_bodies(self) -> list[bytes]:
        """Split the recorded client->server stream into HTTP request bodies (Content-Length framing)."""
        data, bodies, i = bytes(self.upstream), [], 0
        while True:
            end = data.find(b"\r\n\r\n", i)
            if end < 0:
                return bodies
            head = data[i:end].decode("latin-1").lower()
            length = 0
            for line in head.split("\r\n"):
                if line.startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            bodies.append(data[end + 4:end + 4 + length])
            i = end + 4 + length

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        t1 = asyncio.create_task(self._pipe(reader, up_writer, self.upstream))
        t2 = asyncio.create_task(self._pipe(up_reader, writer, self.downstream if self._record_downstream else None))
        self._tasks.update((t1, t2))
        await asyncio.gather(t1, t2, return_exceptions=True)
        self._tasks.difference_update((t1, t2))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    into: bytearray | None) -> None:
        try:
            while chunk := await reader.read(65536):
                if into is not None:
                    into += chunk
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
