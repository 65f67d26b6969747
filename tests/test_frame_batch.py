"""One data-plane request per pass per hop (issue #26, item 6; ``bus/frame_batch.py``, ``POST /v1/batch``).

The container round-trips and refuses what is malformed; a ``FrameBatcher`` sends what one loop turn queued for a
peer as one request to a real ``HopApi`` served over HTTP (its sessions a recording double: the endpoint is the unit
here), each entry answered on its own: one session's refusal fails that session's request only, a lone frame goes
out as a plain request. Then real stub nodes, tracker and gateway on loopback with ``frame_batch`` on: concurrent
sessions decode in batch requests and every session's text is what the same route without batching gives.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from actors.node.hop_api import HopApi
from bus import frame as frames
from bus.frame_batch import BATCH_CONTENT_TYPE, BATCH_PATH, FrameBatcher, batchable
from bus.hoplink import HttpLink
from bus.httpserver import HttpServer
from bus.nodeclient import FRAME_CONTENT_TYPE, TOKEN_CONTENT_TYPE, NodeClient
from bus.server import EmbeddedNats
from schemas.errors import HopError
from schemas.frame import FrameKind, SampledToken
from tests.support.swarm import Swarm, Swarms, make_settings, stub
from tests.test_hop_api import SID, RecordingSession, Sessions, frame

OTHER = "fedcba9876543210fedcba9876543210"


def token_frame(sid: str = SID) -> bytes:
    return frames.encode_token(SampledToken(session_id=frames.session_bytes(sid), seq=0, token=42, text="hi"))


def test_a_batch_round_trips_its_frames_and_tokens() -> None:
    entries = [(frame(), "t1"), (frame(sid=OTHER), ""), (token_frame(), "t3")]
    assert frames.decode_batch(frames.encode_batch(entries)) == entries


@pytest.mark.parametrize(("mutate", "says"), [
    (lambda b: b[:3], "shorter than"),
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:-1], "needs"),
    (lambda b: b + b"\0", "after the batch"),
    (lambda b: b[:4] + b"\0\0" + b[6:], "0 entries"),
])
def test_a_malformed_batch_says_what_is_wrong(mutate: Any, says: str) -> None:
    body = frames.encode_batch([(frame(), "t"), (frame(sid=OTHER), "t")])
    with pytest.raises(frames.FrameDecodeError, match=says):
        frames.decode_batch(mutate(body))


def test_only_causal_frames_ride_batches() -> None:
    assert batchable(frame()) and batchable(token_frame())
    prefill = bytearray(frame())
    prefill[4] = FrameKind.PREFILL
    assert not batchable(bytes(prefill))
    assert not batchable(b"SRW1" + bytes(24))  # verify windows' verdicts go alone


@pytest.fixture
async def hop() -> AsyncIterator[tuple[str, Sessions]]:
    sessions = Sessions()
    sessions.by_id[OTHER] = RecordingSession(is_head=False)  # takes frames, refuses tokens
    sessions.by_id[OTHER].raw_id = frames.session_bytes(OTHER)
    api = HopApi(Starlette(), sessions, max_frame_bytes=1 << 16, max_body_bytes=1024)  # type: ignore[arg-type]
    server = HttpServer(api, hot=api)
    await server.start()
    yield server.url, sessions
    await server.stop()


def batcher() -> tuple[FrameBatcher, NodeClient]:
    client = NodeClient(timeout_s=5.0, batch_frames=True)
    assert client.batcher is not None
    return client.batcher, client


async def test_one_turns_frames_go_as_one_request_each_answered(hop: tuple[str, Sessions]) -> None:
    url, sessions = hop
    b, client = batcher()
    try:
        sends = [b.send("n2", url, f"/v1/sessions/{SID}/frames", frame(), FRAME_CONTENT_TYPE, 5.0, "secret"),
                 b.send("n2", url, f"/v1/sessions/{OTHER}/frames", frame(sid=OTHER), FRAME_CONTENT_TYPE, 5.0,
                        "secret"),
                 b.send("n2", url, f"/v1/sessions/{SID}/tokens", token_frame(), TOKEN_CONTENT_TYPE, 5.0, "secret")]
        await asyncio.gather(*sends)
        assert (b.requests, b.frames) == (1, 3)
        assert len(sessions.by_id[SID].frames) == 1 and len(sessions.by_id[OTHER].frames) == 1
        assert len(sessions.by_id[SID].tokens) == 1
    finally:
        await client.aclose()


async def test_one_sessions_refusal_fails_that_session_only(hop: tuple[str, Sessions]) -> None:
    url, sessions = hop
    b, client = batcher()
    unknown = "00000000000000000000000000000001"
    try:
        good = b.send("n2", url, f"/v1/sessions/{SID}/frames", frame(), FRAME_CONTENT_TYPE, 5.0, "secret")
        lost = b.send("n2", url, f"/v1/sessions/{unknown}/frames", frame(sid=unknown), FRAME_CONTENT_TYPE, 5.0,
                      "secret")
        forged = b.send("n2", url, f"/v1/sessions/{SID}/frames", frame(), FRAME_CONTENT_TYPE, 5.0, "forged")
        wrong_role = b.send("n2", url, f"/v1/sessions/{OTHER}/tokens", token_frame(OTHER), TOKEN_CONTENT_TYPE, 5.0,
                            "secret")
        results = await asyncio.gather(good, lost, forged, wrong_role, return_exceptions=True)
        assert results[0] is None
        assert [r.peer_status if isinstance(r, HopError) else r for r in results[1:]] == [404, 401, 400]
        assert all(isinstance(r, HopError) and r.node == "n2" and r.kind == "http_error" for r in results[1:])
        assert len(sessions.by_id[SID].frames) == 1  # the forged entry never reached the session
        assert b.requests == 1
    finally:
        await client.aclose()


async def test_a_lone_frame_is_a_plain_request(hop: tuple[str, Sessions]) -> None:
    url, sessions = hop
    b, client = batcher()
    try:
        await b.send("n2", url, f"/v1/sessions/{SID}/frames", frame(), FRAME_CONTENT_TYPE, 5.0, "secret")
        await b.send("n2", url, f"/v1/sessions/{SID}/frames", frame(), FRAME_CONTENT_TYPE, 5.0, "secret")
        assert (b.requests, b.frames) == (2, 2) and len(sessions.by_id[SID].frames) == 2
    finally:
        await client.aclose()


async def test_a_bad_batch_is_a_400_and_an_unreachable_peer_fails_every_entry(hop: tuple[str, Sessions]) -> None:
    url, _ = hop
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.post(BATCH_PATH, content=b"SRB1\x00\x00\x00\x00", headers={"content-type": BATCH_CONTENT_TYPE})
        assert r.status_code == 400 and "entries" in r.json()["error"]["message"]
        garbage = frames.encode_batch([(b"JUNK" + bytes(40), ""), (frame(), "secret")])
        r = await http.post(BATCH_PATH, content=garbage, headers={"content-type": BATCH_CONTENT_TYPE})
        assert [e["status"] for e in r.json()["results"]] == [400, 200]
    dead = HttpLink("http://127.0.0.1:1")
    b = FrameBatcher(lambda _: dead, lambda *a: HopError("n2", "http_error", "refused"))
    sends = [b.send("n2", "http://127.0.0.1:1", f"/v1/sessions/{SID}/frames", frame(), FRAME_CONTENT_TYPE, 2.0, "")
             for _ in range(2)]
    results = await asyncio.gather(*sends, return_exceptions=True)
    assert all(isinstance(r, HopError) and r.kind == "unreachable" for r in results)


async def test_a_peer_without_batches_gets_each_frame_alone_from_then_on() -> None:
    """A node that predates batches (no ``/v1/batch``: a plain 404) still gets every frame, one per request."""
    got: list[tuple[str, bytes]] = []

    async def take(request: Request) -> Response:
        got.append((request.url.path, await request.body()))
        return JSONResponse({"position": 1})

    old = HttpServer(Starlette(routes=[Route("/v1/sessions/{sid}/frames", take, methods=["POST"]),
                                       Route("/v1/sessions/{sid}/tokens", take, methods=["POST"])]))
    await old.start()
    client = NodeClient(timeout_s=5.0, batch_frames=True)
    b = client.batcher
    assert b is not None
    try:
        first = [b.send("old", old.url, f"/v1/sessions/{sid}/frames", frame(sid=sid), FRAME_CONTENT_TYPE, 5.0, "")
                 for sid in (SID, OTHER)]
        await asyncio.gather(*first)
        assert sorted(path for path, _ in got) == sorted(f"/v1/sessions/{sid}/frames" for sid in (SID, OTHER))
        assert b.lone == {old.url} and (b.requests, b.frames) == (3, 2)  # the refused batch, then one each
        later = [b.send("old", old.url, f"/v1/sessions/{SID}/frames", frame(), FRAME_CONTENT_TYPE, 5.0, ""),
                 b.send("old", old.url, f"/v1/sessions/{SID}/tokens", token_frame(), TOKEN_CONTENT_TYPE, 5.0, "")]
        await asyncio.gather(*later)
        assert len(got) == 4 and (b.requests, b.frames) == (5, 4)  # no second batch tried
    finally:
        await client.aclose()
        await old.stop()


# ---- real stub nodes --------------------------------------------------------------------------------------------


async def texts(swarm: Swarm, prompts: list[str]) -> list[str]:
    api = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    replies = await asyncio.gather(*(api.completions.create(model="stub-model", prompt=p, max_tokens=24,
                                                            temperature=0, extra_body={"ignore_eos": True})
                                     for p in prompts))
    return [r.choices[0].text for r in replies]


async def test_concurrent_sessions_decode_in_batches_with_the_same_tokens(nats_server: EmbeddedNats, tmp_path: Path,
                                                                         swarms: Swarms) -> None:
    prompts = [f"story {i} about a harbour" for i in range(4)]
    routes = []
    for name, on in (("plain", False), ("batched", True)):
        settings = make_settings(nats_server.url, tmp_path / name, namespace=f"batch-{name}", frame_batch=on)
        routes.append(await swarms.start(settings, [stub(0, 3, n_layers=8), stub(3, 6, n_layers=8),
                                                    stub(6, 8, n_layers=8)]))
    plain, batched = routes
    expected = await texts(plain, prompts)
    got = await texts(batched, prompts)
    assert got == expected
    counts = [n.runtime.client.batcher for n in batched.nodes]  # type: ignore[union-attr]
    assert all(c is not None for c in counts)
    assert all(c.frames > c.requests for c in counts if c is not None)  # every hop sent batches, tail included
    assert all(n.runtime.client.batcher is None for n in plain.nodes)  # type: ignore[union-attr]
    # What a node's /metrics says it sent: one frame per request without batches, more with them.
    for node in plain.nodes:
        requests, frames = data_plane(node.metrics.render())
        assert requests == frames > 0
    for node in batched.nodes:
        requests, frames = data_plane(node.metrics.render())
        assert frames > requests > 0
    await batched.freed()


def data_plane(metrics: bytes) -> tuple[float, float]:
    """(requests, frames) from a node's Prometheus text."""
    found = dict(re.findall(r"^swarmroute_node_data_(requests|frames)_total (\S+)$", metrics.decode(), re.M))
    return float(found["requests"]), float(found["frames"])
