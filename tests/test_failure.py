"""The alpha failure model with real processes: a route node dies or hangs -> a structured failure, nothing hangs,
the surviving nodes free the session."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from actors.tracker import Tracker
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.swarm import NodeProcess, make_settings, wait_model

MODEL = "stub-model"


def stub_args(layers: str, delay: float) -> list[str]:
    return ["--backend", "stub", "--model", MODEL, "--layers", layers, "--n-layers", "8", "--stub-delay", str(delay)]


async def _sessions_on(endpoint: str) -> int:
    async with httpx.AsyncClient() as client:
        return int((await client.get(f"{endpoint}/health")).json()["sessions"])


async def _wait_freed(endpoint: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await _sessions_on(endpoint) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the surviving node at {endpoint} still holds the session")


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
    return make_settings(nats_server.url, tmp_path / "home", token_timeout_s=3.0,  # type: ignore[attr-defined,operator]
                         first_token_timeout_s=3.0, hop_timeout_s=2.0, prefill_chunk=4)


@pytest.mark.parametrize("victim", ["tail", "head"])
async def test_node_killed_mid_decode_fails_session_and_survivor_frees_it(fast_settings: Settings, victim: str) -> None:
    head = NodeProcess(fast_settings, "head", stub_args("0:4", 0.01))
    tail = NodeProcess(fast_settings, "tail", stub_args("4:8", 0.01))
    async with Tracker(fast_settings) as tracker, Gateway(fast_settings, port=0) as gateway:
        try:
            await wait_model(tracker, MODEL, n_nodes=2)
            dead, alive = (tail, head) if victim == "tail" else (head, tail)
            error, seen, waited = await _stream_until_failure(gateway.url + "/v1", dead.kill, after_tokens=5)
            assert seen >= 5
            assert dead.node_id in error.message and "decode" in error.message
            body = error.body if isinstance(error.body, dict) else {}
            failure = body.get("failure") or {}
            assert failure.get("node_id") == dead.node_id and failure.get("phase") == "decode"
            assert waited < fast_settings.token_timeout_s + fast_settings.hop_timeout_s + 5
            assert alive.endpoint is not None
            await _wait_freed(alive.endpoint)
        finally:
            head.stop()
            tail.stop()


async def test_node_killed_mid_prefill_fails_in_prefill(fast_settings: Settings) -> None:
    head = NodeProcess(fast_settings, "head", stub_args("0:4", 0.05))
    tail = NodeProcess(fast_settings, "tail", stub_args("4:8", 0.05))
    async with Tracker(fast_settings) as tracker, Gateway(fast_settings, port=0) as gateway:
        try:
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
            assert head.endpoint is not None
            await _wait_freed(head.endpoint)
        finally:
            head.stop()
            tail.stop()


async def test_hung_node_is_named_after_the_timeout(fast_settings: Settings) -> None:
    """SIGSTOP: the process exists and its socket accepts, but it never answers."""
    head = NodeProcess(fast_settings, "head", stub_args("0:4", 0.01))
    tail = NodeProcess(fast_settings, "tail", stub_args("4:8", 0.01))
    async with Tracker(fast_settings) as tracker, Gateway(fast_settings, port=0) as gateway:
        try:
            await wait_model(tracker, MODEL, n_nodes=2)
            started = time.monotonic()
            error, _, waited = await _stream_until_failure(
                gateway.url + "/v1", lambda: os.kill(tail.proc.pid, signal.SIGSTOP), after_tokens=3)
            assert "tail" in error.message
            assert waited < fast_settings.hop_timeout_s + fast_settings.token_timeout_s + 5
            assert time.monotonic() - started < 30
            assert head.endpoint is not None
            await _wait_freed(head.endpoint)
        finally:
            os.kill(tail.proc.pid, signal.SIGCONT)
            head.stop()
            tail.stop()


async def test_retry_after_failure_is_a_new_session_on_a_new_route(fast_settings: Settings) -> None:
    head = NodeProcess(fast_settings, "head", stub_args("0:4", 0.01))
    tail = NodeProcess(fast_settings, "tail", stub_args("4:8", 0.01))
    spare = NodeProcess(fast_settings, "spare", stub_args("4:8", 0.01))
    async with Tracker(fast_settings) as tracker, Gateway(fast_settings, port=0) as gateway:
        try:
            await wait_model(tracker, MODEL, n_nodes=3)
            client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
            first = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                                         max_tokens=3)
            route = [h["node_id"] for h in first.model_extra["swarmroute"]["route"]]  # type: ignore[index]
            victim = tail if route[-1] == "tail" else spare
            victim.kill()
            await asyncio.sleep(fast_settings.registry_ttl_s + 1.0)  # the registry forgets the dead node
            second = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                                          max_tokens=3)
            assert second.id != first.id
            assert victim.node_id not in [h["node_id"] for h in second.model_extra["swarmroute"]["route"]]  # type: ignore[index]
        finally:
            for p in (head, tail, spare):
                p.stop()
