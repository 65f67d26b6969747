"""schemas.errors: the one mapping each way. An error sent as a response body comes back as the same class, with the
same body, whatever transport carried it (a node's HTTP answer, the tracker's ``RouteReply``)."""

from __future__ import annotations

import pytest

from schemas.errors import (
    REBUILT,
    CapacityError,
    NoRouteError,
    NotFoundError,
    PeerStatusError,
    SwarmrouteError,
    error_for_status,
    error_from_body,
)


@pytest.mark.parametrize("cls", REBUILT)
def test_a_body_comes_back_as_its_class(cls: type[SwarmrouteError]) -> None:
    sent = cls("what went wrong")
    back = error_from_body(sent.status, sent.to_body())
    assert type(back) is cls
    assert back.to_body() == sent.to_body() and back.http_headers() == sent.http_headers()


def test_a_status_alone_names_the_status_class() -> None:
    assert type(error_for_status(404, "gone")) is NotFoundError
    assert type(error_for_status(503, "none")) is NoRouteError
    capacity = error_for_status(429, "full")
    assert isinstance(capacity, CapacityError) and capacity.http_headers() == {"retry-after": "1"}
    # a code the tree does not know for that status keeps the status's class and the peer's code
    odd = error_for_status(404, "gone", code="session_not_found_elsewhere")
    assert type(odd) is NotFoundError and odd.code == "session_not_found_elsewhere"
    teapot = error_for_status(418, "tea")
    assert isinstance(teapot, PeerStatusError) and teapot.status == 418
