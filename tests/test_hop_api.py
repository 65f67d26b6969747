"""HopApi: the per-token endpoints served in front of the node's Starlette app, over a real uvicorn server.

The sessions behind it are a recording double (a collaborator); what is tested is the endpoint itself: routing,
pass-through, body limits, content types and the error shapes. Full frames through real nodes are covered by
tests/test_route_protocol.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from actors.node.hop_api import HopApi
from bus import frame as frames
from bus.httpserver import HttpServer
from bus.nodeclient import FRAME_CONTENT_TYPE, TOKEN_CONTENT_TYPE
from schemas.errors import BadRequestError, CapabilityError, SessionNotFoundError
from schemas.frame import FrameHeader, FrameKind, HopStamp, SampledToken, WireDType
from schemas.session import TokenEvent

SID = "0123456789abcdef0123456789abcdef"


class RecordingSession:
    def __init__(self, *, is_head: bool) -> None:
        self.is_head = is_head
        self.frames: list[tuple[FrameHeader, Any, int]] = []
        self.tokens: list[TokenEvent | SampledToken] = []
        self.raw_id = frames.session_bytes(SID)

    async def on_frame(self, header: FrameHeader, hidden: Any, nbytes: int) -> int:
        self.frames.append((header, hidden, nbytes))
        return header.start_position + header.n_positions

    def on_token(self, event: TokenEvent | SampledToken) -> None:
        if not self.is_head:  # as a HopSession answers (tests/test_hop_session.py): the error shape is tested here
            raise BadRequestError("tokens go to the session's head")
        self.tokens.append(event)


class Sessions:
    def __init__(self) -> None:
        self.by_id: dict[str, RecordingSession] = {SID: RecordingSession(is_head=True),
                                                   "tail": RecordingSession(is_head=False)}
        self.token = "secret"

    def __call__(self, sid: str, token: str | None) -> RecordingSession:
        if sid not in self.by_id:
            raise SessionNotFoundError(f"session {sid} is not open")
        if token != self.token:
            raise CapabilityError("missing or wrong session token")
        return self.by_id[sid]


async def behind(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"starlette {request.method} {request.url.path}")


@pytest.fixture
async def served():  # type: ignore[no-untyped-def]
    sessions = Sessions()
    inner = Starlette(routes=[Route("/{rest:path}", behind, methods=["GET", "POST", "DELETE"])])
    api = HopApi(inner, sessions, max_frame_bytes=4096, max_body_bytes=1024)  # type: ignore[arg-type]
    server = HttpServer(api, hot=api)
    await server.start()
    async with httpx.AsyncClient(base_url=server.url, headers={"x-swarmroute-session-token": "secret"}) as client:
        yield client, sessions
    await server.stop()


def frame(n: int = 2, dim: int = 8, sid: str = SID) -> bytes:
    header = FrameHeader(session_id=frames.session_bytes(sid), kind=FrameKind.DECODE, dtype=WireDType.F32,
                         start_position=5, n_positions=n, position_shape=(dim,), step=0, sample=True, stamps=())
    return frames.encode(header, np.arange(n * dim, dtype=np.float32).reshape(n, dim))


async def test_a_frame_reaches_its_session_decoded(served) -> None:  # type: ignore[no-untyped-def]
    client, sessions = served
    body = frame()
    r = await client.post(f"/v1/sessions/{SID}/frames", content=body, headers={"content-type": FRAME_CONTENT_TYPE})
    assert r.status_code == 200 and r.json() == {"position": 7}
    header, hidden, nbytes = sessions.by_id[SID].frames[0]
    assert header.start_position == 5 and nbytes == len(body)
    assert np.array_equal(hidden, np.arange(16, dtype=np.float32).reshape(2, 8))


async def test_a_token_reaches_the_head(served) -> None:  # type: ignore[no-untyped-def]
    client, sessions = served
    event = TokenEvent(session_id=SID, seq=0, token=42, text="hi")
    r = await client.post(f"/v1/sessions/{SID}/tokens", content=event.model_dump_json(),
                          headers={"content-type": "application/json"})
    assert r.status_code == 204 and r.content == b""
    assert sessions.by_id[SID].tokens == [event]


async def test_a_token_frame_reaches_the_head(served) -> None:  # type: ignore[no-untyped-def]
    client, sessions = served
    token = SampledToken(session_id=frames.session_bytes(SID), seq=3, token=42, text="hi", finish_reason="stop",
                         stamps=(HopStamp(0, 1500, 0), HopStamp(1, 9000, 20)))
    r = await client.post(f"/v1/sessions/{SID}/tokens", content=frames.encode_token(token),
                          headers={"content-type": TOKEN_CONTENT_TYPE})
    assert r.status_code == 204
    assert sessions.by_id[SID].tokens == [token]


async def test_other_requests_pass_through_to_starlette(served) -> None:  # type: ignore[no-untyped-def]
    client, _ = served
    for method, path in [("GET", f"/v1/sessions/{SID}/frames"), ("POST", f"/v1/sessions/{SID}/failure"),
                         ("POST", "/v1/sessions"), ("POST", f"/v1/sessions/{SID}/frames/extra"),
                         ("DELETE", f"/v1/sessions/{SID}"), ("GET", "/health")]:
        r = await client.request(method, path)
        assert r.text == f"starlette {method} {path}", (method, path)


@pytest.mark.parametrize(("path", "kwargs", "status", "code"), [
    ("/v1/sessions/nope/frames", {"content": b"x"}, 404, "session_not_found"),
    (f"/v1/sessions/{SID}/frames", {"content": b"not a frame", "headers": {"content-type": FRAME_CONTENT_TYPE}},
     400, "invalid_frame"),
    (f"/v1/sessions/{SID}/frames", {"content": frame(), "headers": {"content-type": "application/json"}},
     400, "invalid_frame"),
    (f"/v1/sessions/{SID}/frames", {"content": frame(n=200), "headers": {"content-type": FRAME_CONTENT_TYPE}},
     413, None),
    (f"/v1/sessions/{SID}/tokens", {"content": b'{"seq": "x"}'}, 400, "invalid_request"),
    (f"/v1/sessions/{SID}/tokens", {"content": b"{" * 2000}, 413, None),
    ("/v1/sessions/tail/tokens", {"content": TokenEvent(session_id="tail", seq=0, token=1, text="").model_dump_json()},
     400, "invalid_request"),
    (f"/v1/sessions/{SID}/tokens", {"content": TokenEvent(session_id="f" * 32, seq=0, token=1).model_dump_json()},
     400, "invalid_request"),
    (f"/v1/sessions/{SID}/frames", {"content": frame(sid="f" * 32), "headers": {"content-type": FRAME_CONTENT_TYPE}},
     400, "invalid_frame"),
    (f"/v1/sessions/{SID}/tokens", {"content": b"SRT1", "headers": {"content-type": TOKEN_CONTENT_TYPE}},
     400, "invalid_frame"),
    (f"/v1/sessions/{SID}/tokens", {"content": frames.encode_token(SampledToken(session_id=bytes(16), seq=0, token=1)),
                                    "headers": {"content-type": TOKEN_CONTENT_TYPE}}, 400, "invalid_frame"),
    (f"/v1/sessions/{SID}/tokens", {"content": b"1", "headers": {"content-type": "text/plain"}},
     400, "invalid_request"),
])
async def test_bad_requests_get_the_node_error_shape(served, path, kwargs, status, code) -> None:  # type: ignore[no-untyped-def]
    client, _ = served
    r = await client.post(path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"]
    if code is not None:
        assert error["code"] == code


async def test_a_missing_session_token_is_refused(served) -> None:  # type: ignore[no-untyped-def]
    client, sessions = served
    r = await client.post(f"/v1/sessions/{SID}/frames", content=frame(),
                          headers={"content-type": FRAME_CONTENT_TYPE, "x-swarmroute-session-token": ""})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_capability"
    assert sessions.by_id[SID].frames == []
