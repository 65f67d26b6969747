"""The alpha failure model with real processes: a route node dies or hangs -> a structured failure, nothing hangs,
the surviving nodes free the session."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx
import openai
import pytest

from actors.tracker import Tracker
from bus import codec
from bus.subjects import Subjects
from gateway.app import Gateway
from schemas.settings import Settings
from schemas.telemetry import GenerationTelemetry
from tests.support.swarm import Swarms, make_settings, wait_model
from tests.support.waiting import eventually

MODEL = "stub-model"


def stub_args(layers: str, delay: float) -> list[str]:
    return ["--backend", "stub", "--model", MODEL, "--layers", layers, "--n-layers", "8", "--stub-delay", str(delay)]


async def _holds_no_session(endpoint: str) -> bool:
    async with httpx.AsyncClient() as client:
        return int((await client.get(f"{endpoint}/health")).json()["sessions"]) == 0


async def _stream_until_failure(base_url: str, kill: object, *, after_tokens: int, prompt: str = "hello") -> tuple[
        openai.APIError, int, float]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=400, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
    seen = 0
    killed_at = 0.0
    with pytest.raises(openai.APIError) as failure:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                seen += 1
            if seen == after_tokens and not killed_at:
                killed_at = time.monotonic()
                kill()  # type: ignore[operator]
    return failure.value, seen, time.monotonic() - killed_at


@pytest.fixture
def fast_settings(nats_server: object, tmp_path: object) -> Settings:
    # repair off: alpha's fail-stop, unchanged (tests/test_repair.py has the sessions that survive)
    return make_settings(nats_server.url, tmp_path / "home", token_timeout_s=3.0,  # type: ignore[attr-defined,operator]
                         first_token_timeout_s=3.0, hop_timeout_s=2.0, prefill_chunk=4, repair=False)


@pytest.mark.parametrize("victim", ["tail", "head"])
async def test_node_killed_mid_decode_fails_session_and_survivor_frees_it(fast_settings: Settings, swarms: Swarms,
                                                                          victim: str) -> None:
    head = await swarms.node_process(fast_settings, "head", stub_args("0:4", 0.01))
    tail = await swarms.node_process(fast_settings, "tail", stub_args("4:8", 0.01))
    tracker = await swarms.actor(Tracker(fast_settings))
    gateway = await swarms.actor(Gateway(fast_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=2)
    dead, alive = (tail, head) if victim == "tail" else (head, tail)
    error, seen, waited = await _stream_until_failure(gateway.url + "/v1", dead.kill, after_tokens=5)
    assert seen >= 5
    assert dead.node_id in error.message and "decode" in error.message
    body = error.body if isinstance(error.body, dict) else {}
    failure = body.get("failure") or {}
    assert failure.get("node_id") == dead.node_id and failure.get("phase") == "decode"
    assert waited < fast_settings.token_timeout_s + fast_settings.hop_timeout_s + 5
    assert alive.endpoint.startswith("http://127.0.0.1:")  # where it said it serves
    await eventually(lambda: _holds_no_session(alive.endpoint),
                     what=f"the surviving node at {alive.endpoint} freeing the session")


@pytest.mark.parametrize("victim", ["head", "tail"])
async def test_node_killed_during_a_non_streaming_request_is_a_5xx_naming_it(fast_settings: Settings, swarms: Swarms,
                                                                            nc: Any, victim: str) -> None:
    """No stream to end with an error chunk: the one response the client waits for is a 5xx in the OpenAI error
    shape, naming the node that died and the phase it died in."""
    head = await swarms.node_process(fast_settings, "head", stub_args("0:4", 0.05))
    tail = await swarms.node_process(fast_settings, "tail", stub_args("4:8", 0.05))
    tracker = await swarms.actor(Tracker(fast_settings))
    gateway = await swarms.actor(Gateway(fast_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=2)
    decoding = asyncio.Event()

    async def on_telemetry(msg: Any) -> None:  # what the head publishes for every session, streamed or not
        snap = codec.decode(msg.data, GenerationTelemetry)
        if snap.phase == "decode" and snap.generated_tokens >= 3:
            decoding.set()

    await nc.subscribe(Subjects(fast_settings.namespace).telemetry_all, cb=on_telemetry)
    await nc.flush()
    dead = head if victim == "head" else tail
    async with httpx.AsyncClient(base_url=gateway.url, timeout=60) as http:
        request = asyncio.create_task(http.post("/v1/completions", json={
            "model": MODEL, "prompt": "hello", "max_tokens": 400, "temperature": 0, "ignore_eos": True}))
        await asyncio.wait_for(decoding.wait(), 30)  # a few tokens in: the response is still being built
        assert not request.done()
        dead.kill()
        response = await request
    assert 500 <= response.status_code < 600, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]  # OpenAI's shape: {"error": {"message", "type", "code", ...}}
    assert {"message", "type", "code"} <= set(error), error
    assert isinstance(error["message"], str) and dead.node_id in error["message"], error
    assert error["failure"]["node_id"] == dead.node_id and error["failure"]["phase"] == "decode", error
    # and the official client raises it as an APIStatusError carrying the same error object
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:  # the dead node's layers: no route now
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert refused.value.status_code == 503, refused.value
    assert ("[0, 4)" if victim == "head" else "[4, 8)") in refused.value.message, refused.value.message
    survivor = tail if victim == "head" else head
    await eventually(lambda: _holds_no_session(survivor.endpoint),
                     what=f"the surviving node at {survivor.endpoint} freeing the session")


async def test_node_killed_mid_prefill_fails_in_prefill(fast_settings: Settings, swarms: Swarms) -> None:
    head = await swarms.node_process(fast_settings, "head", stub_args("0:4", 0.05))
    tail = await swarms.node_process(fast_settings, "tail", stub_args("4:8", 0.05))
    tracker = await swarms.actor(Tracker(fast_settings))
    gateway = await swarms.actor(Gateway(fast_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=2)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    # 200 prompt tokens in chunks of 4 at 50 ms per chunk per node: prefill lasts seconds.
    stream = await client.completions.create(model=MODEL, prompt="p" * 200, max_tokens=5, stream=True,
                                             extra_body={"stream_options": {"include_telemetry": True}})
    killed = False
    with pytest.raises(openai.APIError) as failure:
        async for chunk in stream:
            snap = (chunk.model_extra or {}).get("swarmroute") or {}
            if not killed and snap.get("phase") == "prefill" and snap["prefill"]["done"] >= 40:
                tail.kill()
                killed = True
    assert killed
    assert "tail" in failure.value.message and "prefill" in failure.value.message
    assert head.endpoint.startswith("http://127.0.0.1:")  # where it said it serves
    await eventually(lambda: _holds_no_session(head.endpoint),
                     what=f"the surviving node at {head.endpoint} freeing the session")


async def test_hung_node_is_named_after_the_timeout(fast_settings: Settings, swarms: Swarms) -> None:
    """SIGSTOP: the process exists and its socket accepts, but it never answers."""
    head = await swarms.node_process(fast_settings, "head", stub_args("0:4", 0.01))
    tail = await swarms.node_process(fast_settings, "tail", stub_args("4:8", 0.01))
    tracker = await swarms.actor(Tracker(fast_settings))
    gateway = await swarms.actor(Gateway(fast_settings, port=0))
    swarms.on_teardown(lambda: os.kill(tail.proc.pid, signal.SIGCONT))  # first thing: a stopped process stops slowly
    await wait_model(tracker, MODEL, n_nodes=2)
    started = time.monotonic()
    error, _, waited = await _stream_until_failure(
        gateway.url + "/v1", lambda: os.kill(tail.proc.pid, signal.SIGSTOP), after_tokens=3)
    assert "tail" in error.message
    assert waited < fast_settings.hop_timeout_s + fast_settings.token_timeout_s + 5
    assert time.monotonic() - started < 30
    assert head.endpoint.startswith("http://127.0.0.1:")  # where it said it serves
    await eventually(lambda: _holds_no_session(head.endpoint),
                     what=f"the surviving node at {head.endpoint} freeing the session")


async def test_retry_after_failure_is_a_new_session_on_a_new_route(fast_settings: Settings, swarms: Swarms) -> None:
    await swarms.node_process(fast_settings, "head", stub_args("0:4", 0.01))
    tail = await swarms.node_process(fast_settings, "tail", stub_args("4:8", 0.01))
    spare = await swarms.node_process(fast_settings, "spare", stub_args("4:8", 0.01))
    tracker = await swarms.actor(Tracker(fast_settings))
    gateway = await swarms.actor(Gateway(fast_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=3)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    first = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                                 max_tokens=3)
    route = [h["node_id"] for h in first.model_extra["swarmroute"]["route"]]  # type: ignore[index]
    victim = tail if route[-1] == "tail" else spare
    victim.kill()
    registry = tracker.registry
    assert registry is not None
    await eventually(lambda: victim.node_id not in {a.node_id for a in registry.live()},
                     timeout=fast_settings.registry_ttl_s + 1.0, what=f"the registry forgetting {victim.node_id}")
    second = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                                  max_tokens=3)
    assert second.id != first.id
    assert victim.node_id not in [h["node_id"] for h in second.model_extra["swarmroute"]["route"]]  # type: ignore[index]


@pytest.fixture
def patient_settings(nats_server: object, tmp_path: object) -> Settings:
    """Timeouts far beyond what the tests wait: only the gateway's liveness probes can end these sessions in time,
    and the registry keeps a dead node's entry for the whole test."""
    return make_settings(nats_server.url, tmp_path / "home", token_timeout_s=60.0,  # type: ignore[attr-defined,operator]
                         first_token_timeout_s=60.0, hop_timeout_s=30.0, prefill_chunk=4, liveness_probe_s=0.3,
                         registry_ttl_s=60.0, heartbeat_s=0.5, repair=False)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_a_dead_head_fails_the_stream_at_once_not_after_the_token_timeout(patient_settings: Settings,
                                                                                swarms: Swarms, phase: str) -> None:
    """The head dies. In prefill nobody on the route can report it (the tail only waits for frames), so the
    gateway's probes of the silent session must; in decode the tail finds it when its token bounces. Either way the
    stream ends with an error naming the head and the phase, long before any timeout could have fired."""
    head = await swarms.node_process(patient_settings, "head", stub_args("0:4", 0.05))
    await swarms.node_process(patient_settings, "tail", stub_args("4:8", 0.05))
    tracker = await swarms.actor(Tracker(patient_settings))
    gateway = await swarms.actor(Gateway(patient_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=2)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt="p" * 200, max_tokens=200, stream=True,
                                             extra_body={"stream_options": {"include_telemetry": True},
                                                         "ignore_eos": True})
    killed_at = 0.0
    with pytest.raises(openai.APIError) as failure:
        async for chunk in stream:
            snap = (chunk.model_extra or {}).get("swarmroute") or {}
            if not killed_at and snap.get("phase") == phase and (phase == "decode" or
                                                                 snap["prefill"]["done"] >= 40):
                head.kill()
                killed_at = time.monotonic()
    assert killed_at
    waited = time.monotonic() - killed_at
    body = failure.value.body if isinstance(failure.value.body, dict) else {}
    assert body.get("failure", {}).get("node_id") == "head", body
    assert body["failure"]["phase"] == phase and body["failure"]["kind"] == "unreachable", body
    if phase == "prefill":  # nobody on the route talks to the head: the gateway's probe found it
        assert "its process died" in failure.value.message
    assert waited < patient_settings.token_timeout_s / 4, waited


async def test_a_node_dead_but_still_registered_is_routed_around_and_a_gap_is_a_503(
        patient_settings: Settings, swarms: Swarms) -> None:
    """The registry still lists a killed node (its entry has not expired): opening a session on it finds nothing
    listening, so the gateway routes again without it; with nobody else serving its layers the client gets the
    tracker's 503 naming them, not a 502 about a node that is already gone."""
    await swarms.node_process(patient_settings, "head", stub_args("0:4", 0.0))
    tail = await swarms.node_process(patient_settings, "tail", stub_args("4:8", 0.0))
    tracker = await swarms.actor(Tracker(patient_settings))
    gateway = await swarms.actor(Gateway(patient_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=2)
    tail.kill()
    assert any(a.node_id == "tail" for a in tracker.registry.live())  # type: ignore[union-attr]
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert refused.value.status_code == 503, refused.value
    assert "[4, 8)" in refused.value.message or "4-8" in refused.value.message, refused.value.message


async def test_a_stopping_gateway_ends_its_streams_with_an_error(fast_settings: Settings, swarms: Swarms) -> None:
    """Not a bare ``[DONE]`` that reads like a complete answer: the client learns the gateway went away."""
    head = await swarms.node_process(fast_settings, "head", stub_args("0:4", 0.02))
    await swarms.node_process(fast_settings, "tail", stub_args("4:8", 0.02))
    tracker = await swarms.actor(Tracker(fast_settings))
    gateway = await swarms.actor(Gateway(fast_settings, port=0))
    await wait_model(tracker, MODEL, n_nodes=2)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt="hello", max_tokens=400, stream=True,
                                             extra_body={"ignore_eos": True})
    stopping: asyncio.Task[None] | None = None
    with pytest.raises(openai.APIError, match="the gateway is shutting down"):
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and stopping is None:
                stopping = asyncio.create_task(gateway.stop())
    assert stopping is not None
    await stopping
    assert head.endpoint.startswith("http://127.0.0.1:")  # where it said it serves
    await eventually(lambda: _holds_no_session(head.endpoint),
                     what=f"the surviving node at {head.endpoint} freeing the session")
