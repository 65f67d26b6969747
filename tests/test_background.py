"""gateway.background's pure parts: response ids, retrieve queries, and rendering a response from its stored record
and messages (the same events on every gateway). The endpoints on real gateways: tests/test_responses_background.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.background import ResponseView, parse_query, session_of
from schemas.errors import BadRequestError, NotFoundError
from schemas.node import LayerRange
from schemas.openai_responses import ResponseRecord
from schemas.route import Hop, Route
from schemas.session import SessionEnd, SessionPhase, TokenEvent

SID = "0123456789abcdef0123456789abcdef"


def record(**request: Any) -> ResponseRecord:
    route = Route(session_id=SID, model_id="m", n_layers=8, hidden_shape=[4], context_length=64,
                  hops=[Hop(node_id="h", endpoint="http://127.0.0.1:1", layers=LayerRange(start=0, end=8))])
    return ResponseRecord(response_id=f"resp_{SID}", session_id=SID, created_at=1700000000.0,
                          request={"model": "m", "input": "hi", "background": True, **request}, prompt_tokens=3,
                          tool_format=None, route=route)


def token(seq: int, text: str) -> TokenEvent:
    return TokenEvent(session_id=SID, seq=seq, token=seq, text=text)


def complete(n: int) -> SessionEnd:
    return SessionEnd(session_id=SID, phase=SessionPhase.COMPLETE, finish_reason="stop", completion_tokens=n)


def render(view: ResponseView, messages: list[Any]) -> list[dict[str, Any]]:
    events = view.start()
    for message in messages:
        events += view.feed(message)
    return [e.model_dump(mode="json") for e in events]


def test_ids_name_a_session_or_are_404s() -> None:
    assert session_of(f"resp_{SID}") == SID
    for bad in ("", "resp_", f"resp_{SID}x", f"msg_{SID}", f"resp_{SID.upper()}", "resp_../x"):
        with pytest.raises(NotFoundError):
            session_of(bad)


def test_queries() -> None:
    assert parse_query({}) == parse_query({"stream": "false"})
    q = parse_query({"stream": "true", "starting_after": "7", "include[]": "message.output_text.logprobs"})
    assert q.stream and q.starting_after == 7
    assert parse_query({"stream": "true"}).starting_after == -1
    for bad, param in [({"stream": "true", "starting_after": "x"}, "starting_after"),
                       ({"stream": "true", "starting_after": ""}, "starting_after"),
                       ({"stream": "true", "starting_after": "1e3"}, "starting_after"),
                       ({"starting_after": "1"}, "starting_after"), ({"stream": "yes"}, "stream"),
                       ({"after": "1"}, "after")]:
        with pytest.raises(BadRequestError) as raised:
            parse_query(bad)
        assert raised.value.param == param


def test_every_gateway_renders_the_same_events_from_the_same_messages() -> None:
    messages = [token(0, "Hel"), token(1, "lo"), token(2, "!"), complete(3)]
    first, second = render(ResponseView(record()), messages), render(ResponseView(record()), messages)
    assert first == second  # item ids and created_at included
    assert [e["sequence_number"] for e in first] == list(range(len(first)))
    assert first[-1]["type"] == "response.completed"
    assert first[-1]["response"]["output"][0]["content"][0]["text"] == "Hello!"
    assert first[-1]["response"]["created_at"] == 1700000000.0 and first[-1]["response"]["background"] is True


def test_a_repeated_token_is_rendered_once_a_missing_one_fails_and_the_first_end_wins() -> None:
    clean = render(ResponseView(record()), [token(0, "a"), token(1, "b"), complete(2)])
    again = render(ResponseView(record()), [token(0, "a"), token(0, "a"), token(1, "b"), complete(2), complete(9)])
    assert again == clean
    view = ResponseView(record())
    gap = render(view, [token(0, "a"), token(2, "c"), token(3, "d")])
    assert gap[-1]["type"] == "response.failed" and "token 1 is missing" in gap[-1]["response"]["error"]["message"]
    assert view.ended and view.response.output_text == "a"


def test_the_response_as_it_stands_shows_the_text_so_far_then_cancelled() -> None:
    view = ResponseView(record())
    render(view, [token(0, "par"), token(1, "tial")])
    assert view.response.status == "in_progress" and view.response.output_text == "partial"
    assert view.feed(SessionEnd(session_id=SID, phase=SessionPhase.CANCELLED)) == []
    assert view.response.status == "cancelled" and view.response.output_text == "partial"
