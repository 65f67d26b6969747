"""Every limit answers with a 4xx/429 and a reason — never a crash, a hang or unbounded growth.

Real swarms on loopback: real nats-server, tracker, stub nodes and gateway, the official openai client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from bus import frame as frames
from bus.nodeclient import FRAME_CONTENT_TYPE
from schemas.frame import FrameHeader, FrameKind, WireDType
from schemas.route import RouteRequest
from schemas.session import SessionOpen
from schemas.settings import Settings
from tests.support import figures
from tests.support.swarm import Swarm, Swarms, make_settings, stub
from tests.support.waiting import eventually

MODEL = "stub-model"
KEYS = ["key-one-0123456789", "key-two-0123456789"]


async def _swarm(swarms: Swarms, settings: Settings, **stub_kw: object) -> Swarm:
    return await swarms.start(settings, [stub(0, 4, **stub_kw), stub(4, 8, **stub_kw)], model_id=MODEL)


def _reason(r: httpx.Response) -> str:
    return str(r.json()["error"]["message"])


def _drained(swarm: Swarm) -> bool:
    """Every node and the gateway hold no session (closing happens just after the response)."""
    assert swarm.gateway.serving is not None
    return not any(n.sessions for n in swarm.nodes) and not swarm.gateway.serving.sessions.live


@pytest.fixture
async def small(nats_server: object, tmp_path: Path, swarms: Swarms) -> Swarm:
    """A swarm with small limits: 2 KiB bodies, 64-token context, 64 KiB frames."""
    settings = make_settings(nats_server.url, tmp_path / "home", max_body_bytes=2048,  # type: ignore[attr-defined]
                             max_frame_bytes=64 * 1024)
    return await _swarm(swarms, settings, context_length=64)


async def test_body_size_limits_on_gateway_and_node(small: Swarm) -> None:
    big = {"model": MODEL, "prompt": "x" * 4096, "max_tokens": 1}
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{small.base_url}/completions", json=big)
        assert r.status_code == 413 and "2048" in _reason(r)

        async def chunked() -> AsyncIterator[bytes]:  # no content-length: the limit must still hold while reading
            for _ in range(64):
                yield b" " * 256

        r = await http.post(f"{small.base_url}/completions", content=chunked(),
                            headers={"content-type": "application/json"})
        assert r.status_code == 413
        node = small.nodes[1].endpoint
        r = await http.post(f"{node}/v1/sessions", content=b"{" + b" " * 4096 + b"}",
                            headers={"content-type": "application/json"})
        assert r.status_code == 413
        header = FrameHeader(session_id=b"\0" * 16, kind=FrameKind.PREFILL, dtype=WireDType.F32, start_position=0,
                             n_positions=512, position_shape=(64,))
        r = await http.post(f"{node}/v1/sessions/{'0' * 32}/frames",
                            content=frames.encode(header, np.zeros((512, 64), np.float32)),
                            headers={"content-type": FRAME_CONTENT_TYPE})
        assert r.status_code in (404, 413)  # no such session is checked first: never 5xx
    figures.add("limits", "checks_body_size", 4)


async def test_prompt_context_and_max_tokens_limits(small: Swarm) -> None:
    client = openai.AsyncOpenAI(base_url=small.base_url, api_key="unused", max_retries=0)
    cases: list[tuple[dict[str, object], int, str]] = [
        ({"prompt": "p" * 100, "max_tokens": 1}, 400, "context"),  # 101 tokens > 64
        ({"prompt": "p" * 10, "max_tokens": 60}, 400, "exceeds the context"),  # 11 + 60 > 64
        ({"prompt": "p", "max_tokens": 10**15}, 400, "exceeds the context"),
        ({"prompt": "p", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": [1, 2, 999_999], "max_tokens": 1}, 400, "token ids"),
        ({"prompt": [-5], "max_tokens": 1}, 400, "token ids"),
        ({"prompt": [], "max_tokens": 1}, 400, "empty"),
    ]
    for body, status, reason in cases:
        with pytest.raises(openai.APIStatusError) as err:
            await client.completions.create(model=MODEL, **body)  # type: ignore[arg-type]
        assert err.value.status_code == status and reason in err.value.message, (body, err.value.message)
    ok = await client.completions.create(model=MODEL, prompt="p" * 10, max_tokens=53, temperature=0,
                                         extra_body={"ignore_eos": True})  # exactly the context: allowed
    assert ok.usage is not None and ok.usage.total_tokens == 64
    await eventually(lambda: _drained(small), timeout=5.0, interval=0.02,
                     what="every node and the gateway dropping their sessions")
    figures.add("limits", "checks_context_and_tokens", len(cases) + 1)


async def _slow_stream(client: openai.AsyncOpenAI, started: asyncio.Event, n: int = 30) -> int:
    stream = await client.completions.create(model=MODEL, prompt="hi", max_tokens=n, stream=True, temperature=0,
                                             extra_body={"ignore_eos": True})
    got = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            got += 1
            started.set()
    return got


async def test_node_capacity_gives_429_with_retry_after_then_recovers(nats_server: object, tmp_path: Path,
                                                                       swarms: Swarms) -> None:
    settings = make_settings(nats_server.url, tmp_path / "home", route_retry_s=0.5,  # type: ignore[attr-defined]
                             queue_max=0)  # no admission queue (issue #30): the refusal itself is under test
    swarm = await _swarm(swarms, settings, max_sessions=1, delay_s=0.01)
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    started = asyncio.Event()
    running = asyncio.create_task(_slow_stream(client, started, n=300))  # seconds: outlasts the retry window
    await asyncio.wait_for(started.wait(), 20)
    async with httpx.AsyncClient(timeout=10) as http:
        asked = time.monotonic()
        r = await http.post(f"{swarm.base_url}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        waited = time.monotonic() - asked
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert "capacity" in _reason(r) or "full" in _reason(r)
    assert 0.25 <= waited < 5  # the gateway asked again for up to route_retry_s, then gave up cleanly
    assert await running == 300
    # Until heartbeats report the freed slot (a refusal takes route_retry_s: 50 tries were ~30 s).
    done = await eventually(lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=2),
                            timeout=30.0, interval=0.1, ignoring=(openai.RateLimitError,),
                            what="a request served once the slot is free again")
    assert done.usage is not None
    figures.add("limits", "checks_node_capacity", 2)


async def test_per_api_key_and_gateway_concurrency_limits(nats_server: object, tmp_path: Path,
                                                           swarms: Swarms) -> None:
    settings = make_settings(nats_server.url, tmp_path / "home", api_keys=KEYS,  # type: ignore[attr-defined]
                             api_key_max_sessions=1, gateway_max_sessions=2)
    swarm = await _swarm(swarms, settings, max_sessions=8, delay_s=0.01)
    one, two = (openai.AsyncOpenAI(base_url=swarm.base_url, api_key=k, max_retries=0) for k in KEYS)
    started = asyncio.Event()
    running = asyncio.create_task(_slow_stream(one, started, n=40))
    await asyncio.wait_for(started.wait(), 20)
    with pytest.raises(openai.RateLimitError) as err:
        await one.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert "API key" in err.value.message and err.value.response.headers["retry-after"] == "1"
    second = asyncio.Event()
    other = asyncio.create_task(_slow_stream(two, second, n=40))  # another key is not held back
    await asyncio.wait_for(second.wait(), 20)
    with pytest.raises(openai.RateLimitError) as err:  # both keys below their limit, the gateway is full
        await two.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert "gateway" in err.value.message
    async with httpx.AsyncClient(timeout=10) as http:  # a bad key is refused before it can hold a slot
        r = await http.post(f"{swarm.base_url}/completions", json={"model": MODEL, "prompt": "x"},
                            headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert await running == 40 and await other == 40
    again = await one.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert again.usage is not None and again.usage.completion_tokens >= 1
    figures.add("limits", "checks_concurrency", 4)


async def test_idle_session_is_freed_after_the_ttl(nats_server: object, tmp_path: Path, swarms: Swarms) -> None:
    settings = make_settings(nats_server.url, tmp_path / "home", session_idle_ttl_s=0.4)  # type: ignore[attr-defined]
    tail = stub(4, 8)
    swarm = await swarms.start(settings, [stub(0, 4), tail], model_id=MODEL)
    reply = swarm.tracker.route(RouteRequest(model=MODEL, session_id="a" * 32))
    assert reply.route is not None
    request = SessionOpen(session_id="a" * 32, route=reply.route, hop_index=1, prompt_tokens=[1, 2, 3],
                          max_tokens=4)
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{swarm.nodes[1].endpoint}/v1/sessions", json=request.model_dump(mode="json"))
        assert r.status_code == 201
        assert tail.open_sessions == ["a" * 32]
        started = time.monotonic()
        await eventually(lambda: not tail.open_sessions, timeout=5, what="the idle session being freed")
        freed_after = time.monotonic() - started
        health = (await http.get(f"{swarm.nodes[1].endpoint}/health")).json()
    assert tail.open_sessions == [] and health["sessions"] == 0 and tail.kv_bytes_in_use() == 0
    assert freed_after < 2.0  # TTL 0.4 s, swept every TTL/4
    figures.add("limits", "checks_idle_ttl", 1)
