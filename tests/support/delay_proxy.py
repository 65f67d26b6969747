"""A TCP proxy that adds a fixed one-way delay, run as its own process: the stand-in for netem (not available here).

``python -m tests.support.delay_proxy --target-port T --delay-ms D [--listen-port P]`` prints ``ready <port>``
once listening. Each chunk is written ``D`` ms after it was read, scheduled on the loop's clock (``call_at``), so
back-to-back chunks are delayed side by side rather than one after another, and order is kept. In its own process
(on uvloop where installed) the proxy's timers do not queue behind a benchmark client's event loop, which made
the in-process proxy (tests/support/proxy.py) add ~0.7 ms per link on top of the delay it was asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys


class DelayProxy:
    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.target = target
        self.delay_s = delay_s

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        for w in (writer, up_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while chunk := await reader.read(65536):
                loop.call_at(loop.time() + self.delay_s, _write, writer, chunk)
        except (ConnectionError, OSError):
            pass
        finally:
            # The close goes out after the last delayed chunk, not before it.
            loop.call_at(loop.time() + self.delay_s, writer.close)


def _write(writer: asyncio.StreamWriter, chunk: bytes) -> None:
    with contextlib.suppress(Exception):
        writer.write(chunk)


async def serve(args: argparse.Namespace) -> None:
    proxy = DelayProxy((args.target_host, args.target_port), args.delay_ms / 1e3)
    server = await asyncio.start_server(proxy.handle, args.listen_host, args.listen_port)
    port = server.sockets[0].getsockname()[1]
    print(f"ready {port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-port", type=int, required=True)
    parser.add_argument("--target-host", default="127.0.0.1")
    parser.add_argument("--listen-port", type=int, default=0)
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
