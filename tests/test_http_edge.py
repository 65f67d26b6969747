"""bus.http_edge.edge_app: an app of ours, served by a real uvicorn on loopback, answers every error in the OpenAI
shape, and a real internal error is one 500 with exactly one traceback in the log (Starlette's catch-all alone logs
it twice: once answering, once raising it again for the server)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bus.http_edge import edge_app
from bus.httpserver import HttpServer
from schemas.errors import CapacityError


async def _broken(request: Request) -> Response:
    raise RuntimeError("a bug, not the client's fault")


async def _full(request: Request) -> Response:
    raise CapacityError("every slot is taken")


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    app = edge_app([Route("/broken", _broken, methods=["GET"]), Route("/full", _full, methods=["GET"])])
    http = HttpServer(app)
    await http.start()
    try:
        yield http
    finally:
        await http.stop()


async def test_an_internal_error_is_one_500_with_one_traceback(server: HttpServer,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    server_log = logging.getLogger("uvicorn.error")  # uvicorn's own logger does not reach the root's handlers
    server_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            async with httpx.AsyncClient(base_url=server.url) as client:
                reply = await client.get("/broken")
    finally:
        server_log.removeHandler(caplog.handler)
    assert reply.status_code == 500
    assert reply.json()["error"]["message"] == "internal error: RuntimeError"
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1, caplog.text
    assert "GET /broken" in tracebacks[0].getMessage()


async def test_errors_of_the_tree_and_of_routing_keep_their_status_and_code(server: HttpServer) -> None:
    async with httpx.AsyncClient(base_url=server.url) as client:
        full = await client.get("/full")
        wrong_method = await client.post("/full")
        nowhere = await client.get("/nowhere")
    assert full.status_code == 429 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["message"] == "every slot is taken"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert nowhere.status_code == 404 and "no such endpoint: GET /nowhere" in nowhere.json()["error"]["message"]
