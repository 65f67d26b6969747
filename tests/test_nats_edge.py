"""bus.nats_edge: an error raised behind a NATS endpoint comes back to the requester as the same class, with the
same body, over a real nats-server (a micro service, as the tracker serves its subjects); the replies it builds are
byte for byte the ones the tracker built by hand before it existed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from nats.aio.client import Client as NATS

from bus import codec
from bus.nats_edge import endpoint, error_reply, reply_error
from bus.service import Endpoint, Handler, register
from schemas.assignment import AssignmentReply
from schemas.errors import (
    REBUILT,
    BadRequestError,
    CapacityError,
    FrameError,
    ModelNotFoundError,
    NoRouteError,
    NotFoundError,
    PeerStatusError,
    SwarmrouteError,
)
from schemas.node import LayerRange
from schemas.route import RouteReply, RouteRequest

SUBJECT = "edge.test.route"
TREE: dict[str, type[SwarmrouteError]] = {cls.__name__: cls for cls in REBUILT}
"""Every class a status and code rebuild (schemas.errors); the request's ``model`` names the one to raise."""


class Served:
    """A micro service on the test's nats-server answering ``SUBJECT`` with a handler, and the requests it got."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.seen: list[RouteRequest] = []

    async def serve(self, handler: Handler) -> None:
        self.service = await register(self.nc, namespace="edge", role="test", member="t", description="nats edge",
                                      endpoints=[Endpoint("route", SUBJECT, handler)])

    async def ask(self, payload: bytes) -> Any:
        return await self.nc.request(SUBJECT, payload, timeout=5)


@pytest.fixture
async def served(nc: NATS) -> AsyncIterator[Served]:
    s = Served(nc)
    yield s
    await s.service.stop()


async def _refuse(served: Served) -> None:
    async def refuse(request: RouteRequest) -> RouteReply:
        served.seen.append(request)
        raise TREE[request.model](f"refused session {request.session_id}")

    await served.serve(endpoint(RouteRequest, RouteReply, refuse))


async def test_a_raised_error_comes_back_as_its_class(served: Served) -> None:
    await _refuse(served)
    for name, cls in TREE.items():
        msg = await served.ask(codec.encode(RouteRequest(model=name, session_id="s1")))
        reply = codec.decode(msg.data, RouteReply)
        assert reply.route is None and reply.status == cls.status
        back = reply_error(reply, "the tracker found no route")
        sent = cls("refused session s1")
        assert type(back) is cls, name
        assert back.to_body() == sent.to_body() and back.http_headers() == sent.http_headers()
    assert len(served.seen) == len(TREE)


async def test_a_request_that_does_not_decode_is_a_400_naming_the_field(served: Served) -> None:
    await _refuse(served)
    missing = await served.ask(msgpack.packb({"model": "NoRouteError"}))
    reply = codec.decode(missing.data, RouteReply)
    assert reply.status == 400 and "session_id" in (reply.error or "")
    assert type(reply_error(reply, "")) is BadRequestError
    garbage = codec.decode((await served.ask(b"\xc1")).data, RouteReply)
    assert garbage.status == 400 and "not a msgpack RouteRequest" in (garbage.error or "")
    assert served.seen == []  # the handler never saw either


async def test_a_reply_keeps_its_own_fields(served: Served) -> None:
    gaps = [LayerRange(start=4, end=8)]

    async def uncovered(request: RouteRequest) -> RouteReply:
        return error_reply(RouteReply, NoRouteError("layers [4, 8) of 8 are not served"), uncovered=gaps)

    await served.serve(endpoint(RouteRequest, RouteReply, uncovered))
    reply = codec.decode((await served.ask(codec.encode(RouteRequest(model="m", session_id="s")))).data, RouteReply)
    assert reply.uncovered == gaps and reply.code == "no_route"
    assert type(reply_error(reply, "")) is NoRouteError


async def test_an_error_outside_the_tree_is_left_to_the_service(served: Served) -> None:
    """A bug is not dressed up as a reply: micro answers it with its error headers (bus.service)."""
    async def broken(request: RouteRequest) -> RouteReply:
        raise KeyError("a bug")

    await served.serve(endpoint(RouteRequest, RouteReply, broken))
    msg = await served.ask(codec.encode(RouteRequest(model="m", session_id="s")))
    assert msg.headers is not None and msg.headers.get("Nats-Service-Error-Code") == "500"
    assert msg.data == b""


@pytest.mark.parametrize(("exc", "fields", "by_hand"), [
    (CapacityError("every route for model 'm' is at capacity"), {},
     RouteReply(error="every route for model 'm' is at capacity", status=429, code="capacity_exceeded")),
    (NoRouteError("no full route for model 'm': layers [4, 8)"), {"uncovered": [LayerRange(start=4, end=8)]},
     RouteReply(error="no full route for model 'm': layers [4, 8)", status=503, code="no_route",
                uncovered=[LayerRange(start=4, end=8)])),
    (ModelNotFoundError("no live node serves model 'm'"), {},
     RouteReply(error="no live node serves model 'm'", status=404, code="model_not_found")),
    (BadRequestError("the route has no hop 3"), {}, RouteReply(error="the route has no hop 3", status=400)),
    (NotFoundError("cannot assign layers: no manifest"), {},
     AssignmentReply(error="cannot assign layers: no manifest", status=404)),
    (PeerStatusError(501, "this tracker cannot assign layers"), {},
     AssignmentReply(error="this tracker cannot assign layers", status=501)),
    (SwarmrouteError("the tracker could not assign layers: TimeoutError: "), {},
     AssignmentReply(error="the tracker could not assign layers: TimeoutError: ", status=500)),
])
def test_replies_are_byte_for_byte_the_ones_built_by_hand_before(exc: SwarmrouteError, fields: dict[str, Any],
                                                                 by_hand: RouteReply | AssignmentReply) -> None:
    built = error_reply(type(by_hand), exc, **fields)
    assert codec.encode(built) == codec.encode(by_hand)


def test_a_bare_400_and_an_assignment_reply_carry_no_code() -> None:
    assert "code" not in msgpack.unpackb(codec.encode(error_reply(RouteReply, BadRequestError("bad"))))
    assert msgpack.unpackb(codec.encode(error_reply(RouteReply, FrameError("bad"))))["code"] == "invalid_frame"
    assert "code" not in msgpack.unpackb(codec.encode(error_reply(AssignmentReply, CapacityError("full"))))
