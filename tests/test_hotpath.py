"""The fast lane (bus/hotpath.py) in front of a real uvicorn server, on loopback, under asyncio's loop and uvloop.

The routes behind it are a recording double (a collaborator); what is tested is the lane itself: which requests
it answers, that everything else reaches the Starlette app behind it on the same connection, ordering, partial
reads, failures and shutdown. Real frames through real nodes go through it in tests/test_route_protocol.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import pytest
import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from bus import hotpath
from bus.hoplink import HttpLink
from bus.hotpath import MAX_HEAD, Answer, HotPathProtocol, close_idle
from bus.httpserver import HttpServer

LIMIT = 64


class Recorder:
    """Claims POST /hot/...; /hot/slow answers after the test releases it; /hot/boom raises."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[bytes, bytes], bytes]] = []
        self.release = asyncio.Event()

    def claims(self, method: str, path: str) -> int | None:
        return LIMIT if method == "POST" and path.startswith("/hot/") else None

    def handle(self, path: str, headers: Mapping[bytes, bytes], body: bytes) -> Answer | Awaitable[Answer]:
        self.seen.append((path, dict(headers), body))
        if path == "/hot/boom":
            raise RuntimeError("handler bug")
        if path == "/hot/slow":
            return self._later(body)
        return 200, json.dumps({"path": path, "body": body.decode()}).encode(), [(b"x-lane", b"hot")]

    async def _later(self, body: bytes) -> Answer:
        await self.release.wait()
        return 201, json.dumps({"later": body.decode()}).encode(), []


async def behind(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"starlette {request.method} {request.url.path} {len(await request.body())}")


Scenario = Callable[[HttpServer, Recorder], Coroutine[Any, Any, None]]


def serve(scenario: Scenario, runner: str) -> None:
    async def main() -> None:
        recorder = Recorder()
        app = Starlette(routes=[Route("/{rest:path}", behind, methods=["GET", "POST"])])
        server = HttpServer(app, hot=recorder)
        await server.start()
        try:
            await asyncio.wait_for(scenario(server, recorder), 20)
        finally:
            await server.stop()

    if runner == "uvloop":
        uvloop.run(main())
    else:
        asyncio.run(main())


RUNNERS = pytest.mark.parametrize("runner", ["asyncio", "uvloop"])


def on_both_loops(scenario: Scenario) -> Callable[[str], None]:
    """A test of ``scenario`` against a fresh server, under asyncio's loop and under uvloop."""

    @RUNNERS
    def test(runner: str) -> None:
        serve(scenario, runner)

    test.__doc__ = scenario.__doc__
    return test


async def raw(server: HttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.port)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ")[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


def post(path: str, body: bytes, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: test", f"content-length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@on_both_loops
async def test_a_claimed_request_is_answered_by_the_lane(server: HttpServer, recorder: Recorder) -> None:
    link = HttpLink(server.url)
    status, body = await link.post("/hot/a", b"hello", "application/octet-stream", 5.0, {"x-token": "t1"})
    assert status == 200 and json.loads(body) == {"path": "/hot/a", "body": "hello"}
    path, headers, seen_body = recorder.seen[0]
    assert path == "/hot/a" and seen_body == b"hello" and headers[b"x-token"] == b"t1"
    assert headers[b"content-type"] == b"application/octet-stream"
    await link.aclose()


@on_both_loops
async def test_other_requests_reach_the_app_on_the_same_connection(server: HttpServer, recorder: Recorder) -> None:
    reader, writer = await raw(server)
    writer.write(post("/hot/1", b"x"))
    status, headers, body = await read_response(reader)
    assert status == 200 and headers["x-lane"] == "hot"
    writer.write(post("/v1/other", b"abc"))  # from here on the connection is uvicorn's
    status, _, body = await read_response(reader)
    assert status == 200 and body == b"starlette POST /v1/other 3"
    writer.write(post("/hot/2", b"y"))  # still served, now through the app behind
    status, _, body = await read_response(reader)
    assert body == b"starlette POST /hot/2 1"
    assert [p for p, _, _ in recorder.seen] == ["/hot/1"]
    writer.close()


@RUNNERS
@pytest.mark.parametrize("shape", [
    post("/hot/x", b"abc", "transfer-encoding: chunked").replace(b"content-length: 3\r\n", b"")
    .replace(b"abc", b"3\r\nabc\r\n0\r\n\r\n"),
    post("/hot/x", b"abc", "connection: close"),
    post("/hot/x", b"abc", "expect: 100-continue"),
    post("/hot/x", b"a" * (LIMIT + 1)),
    post("/hot/x", b"abc").replace(b"HTTP/1.1", b"HTTP/1.0"),
    post("/hot/x?q=1", b"abc"),
    post("/hot/%78", b"abc"),
    b"GET /hot/x HTTP/1.1\r\nhost: test\r\n\r\n",
], ids=["chunked", "connection-close", "expect", "over-limit", "http-1.0", "query", "escaped", "get"])
def test_anything_but_the_plain_shape_goes_to_uvicorn(runner: str, shape: bytes) -> None:
    async def scenario(server: HttpServer, recorder: Recorder) -> None:
        reader, writer = await raw(server)
        writer.write(shape)
        status, _, body = await read_response(reader)
        if status == 100:  # uvicorn's interim answer to "expect: 100-continue"
            status, _, body = await read_response(reader)
        assert status == 200 and body.startswith(b"starlette "), body
        assert recorder.seen == []
        writer.close()

    serve(scenario, runner)


@on_both_loops
async def test_pipelined_requests_are_answered_in_order_even_when_one_waits(
        server: HttpServer, recorder: Recorder) -> None:
    reader, writer = await raw(server)
    writer.write(post("/hot/slow", b"first") + post("/hot/fast", b"second"))
    await asyncio.sleep(0.1)
    assert [p for p, _, _ in recorder.seen] == ["/hot/slow"]  # the second waits for the first's answer
    recorder.release.set()
    first, second = await read_response(reader), await read_response(reader)
    assert (first[0], json.loads(first[2])) == (201, {"later": "first"})
    assert (second[0], json.loads(second[2])["body"]) == (200, "second")
    writer.close()


@on_both_loops
async def test_a_request_arriving_in_pieces_is_handled_once_whole(server: HttpServer, recorder: Recorder) -> None:
    reader, writer = await raw(server)
    data = post("/hot/pieces", b"0123456789")
    for i in range(0, len(data), 7):
        writer.write(data[i:i + 7])
        await writer.drain()
        await asyncio.sleep(0.01)
    status, _, body = await read_response(reader)
    assert status == 200 and json.loads(body)["body"] == "0123456789"
    assert len(recorder.seen) == 1
    writer.close()


@on_both_loops
async def test_a_failing_handler_gives_a_500_and_the_connection_lives_on(
        server: HttpServer, recorder: Recorder) -> None:
    link = HttpLink(server.url)
    status, body = await link.post("/hot/boom", b"", "application/json", 5.0)
    assert status == 500 and json.loads(body)["error"]["code"] == "internal"
    status, _ = await link.post("/hot/after", b"", "application/json", 5.0)
    assert status == 200
    await link.aclose()


@on_both_loops
async def test_an_oversized_head_is_left_to_uvicorn(server: HttpServer, recorder: Recorder) -> None:
    reader, writer = await raw(server)
    writer.write(post("/hot/x", b"", "x-big: " + "a" * (MAX_HEAD + 10)))
    try:
        status, _, body = await read_response(reader)
        assert status >= 400 or body.startswith(b"starlette "), (status, body)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass  # uvicorn's own limit may also just drop the connection
    assert recorder.seen == []
    writer.close()


@RUNNERS
def test_a_request_left_incomplete_closes_the_connection(runner: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hotpath, "STALL_S", 0.2)

    async def scenario(server: HttpServer, recorder: Recorder) -> None:
        reader, writer = await raw(server)
        writer.write(post("/hot/1", b"abc"))
        await read_response(reader)
        await asyncio.sleep(0.4)  # a connection between requests is not watched: it stays open
        writer.write(post("/hot/2", b"def"))
        await read_response(reader)
        writer.write(post("/hot/trickle", b"0123456789")[:-4])  # the body stops 4 bytes short
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert [p for p, _, _ in recorder.seen] == ["/hot/1", "/hot/2"]
        writer.close()

    serve(scenario, runner)


@on_both_loops
async def test_stop_closes_the_lanes_connections_and_idle_ones_are_swept(
        server: HttpServer, recorder: Recorder) -> None:
    reader, writer = await raw(server)
    writer.write(post("/hot/1", b""))
    await read_response(reader)
    connections: set[HotPathProtocol] = server._hot_connections  # noqa: SLF001 - the lane's registry
    assert len(connections) == 1
    close_idle(connections, older_than_s=60)
    assert len(connections) == 1  # recent: kept
    close_idle(connections, older_than_s=0)
    assert await reader.read() == b""  # closed by the sweep
    reader2, writer2 = await raw(server)
    writer2.write(post("/hot/2", b""))
    await read_response(reader2)
    await server.stop()
    assert await reader2.read() == b""
    writer.close()
    writer2.close()
