"""actors/node/link_probe.py: which peers a node measures, and the RTTs it measures to a real HTTP server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as HttpRoute

from actors.node.link_probe import LinkProbe, route_neighbours
from bus.httpserver import HttpServer
from schemas.node import LayerRange
from schemas.route import Hop, Route
from tests.support.up import free_port


def _route(*names: str) -> Route:
    step = 12 // len(names)
    return Route(session_id="s", model_id="m", n_layers=12, hidden_shape=[4], context_length=64,
                 hops=[Hop(node_id=n, endpoint=f"http://127.0.0.1:{9000 + i}",
                           layers=LayerRange(start=i * step, end=(i + 1) * step)) for i, n in enumerate(names)])


def test_a_hop_measures_the_hops_before_and_after_it_on_the_ring() -> None:
    route = _route("a", "b", "c")
    assert sorted(route_neighbours(route, 0, "a")) == ["b", "c"]  # the head hears the tail's tokens
    assert sorted(route_neighbours(route, 1, "b")) == ["a", "c"]
    assert sorted(route_neighbours(route, 2, "c")) == ["a", "b"]  # the tail sends its tokens back to the head
    assert route_neighbours(_route("a", "b"), 0, "a") == {"b": "http://127.0.0.1:9001"}
    assert route_neighbours(_route("a"), 0, "a") == {}


@pytest.fixture
async def peer() -> AsyncIterator[str]:
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    server = HttpServer(Starlette(routes=[HttpRoute("/health", health)]), "127.0.0.1", 0)
    await server.start()
    yield server.url
    await server.stop()


async def test_a_peer_that_answers_gets_an_rtt_and_one_that_does_not_loses_it(peer: str) -> None:
    peers = {"up": peer, "down": f"http://127.0.0.1:{free_port()}"}
    now = [0.0]
    probe = LinkProbe(lambda: list(peers.items()), interval_s=5.0, clock=lambda: now[0])
    try:
        await probe.probe_due()
        assert set(probe.rtt_ms) == {"up"} and 0 < probe.rtt_ms["up"] < 2000
        first = probe.rtt_ms["up"]
        await probe.probe_due()  # not due again yet: the same figure
        assert probe.rtt_ms["up"] == first

        peers["up"] = f"http://127.0.0.1:{free_port()}"  # the peer went away
        now[0] = 6.0
        await probe.probe_due()
        assert probe.rtt_ms == {}
    finally:
        await probe.aclose()


async def test_a_peer_no_session_names_any_more_is_forgotten(peer: str) -> None:
    peers = {"up": peer}
    now = [0.0]
    probe = LinkProbe(lambda: list(peers.items()), interval_s=5.0, forget_s=60.0, clock=lambda: now[0])
    try:
        await probe.probe_due()
        assert "up" in probe.rtt_ms
        peers.clear()  # its sessions ended: kept for a while, so the operator's matrix does not blink
        now[0] = 30.0
        await probe.probe_due()
        assert "up" in probe.rtt_ms
        now[0] = 61.0
        await probe.probe_due()
        assert probe.rtt_ms == {}
    finally:
        await probe.aclose()
