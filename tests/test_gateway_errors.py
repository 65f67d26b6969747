"""The gateway's errors with the official client against a real swarm (real NATS, stub nodes on loopback): every
bad request is an OpenAI-shaped error naming what is wrong (malformed JSON, missing or mistyped fields, parameters
swarmroute cannot honour, an unknown model or endpoint, a prompt past the context, a body past its limit), and API
keys guard everything but the health probe. What it serves is tests/test_gateway.py's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from pydantic import SecretStr

from bus.server import EmbeddedNats
from tests.support.gateway import GREEDY, MESSAGES, MODEL, client, fresh_settings, prompt_tokens, stub_swarm, stubs
from tests.support.swarm import Swarm, Swarms

# One NATS server and one swarm serve the module; tests that need other settings start their own swarm in a fresh
# namespace.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async with stub_swarm(module_nats, tmp_path_factory.mktemp("swarm")) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module")
async def swarms() -> AsyncIterator[Swarms]:
    """The shared ``swarms`` fixture (tests/conftest.py) on this module's event loop and NATS server."""
    async with Swarms() as started:
        yield started


# ---- bad input ----------------------------------------------------------------------------------------------------

def assert_openai_error(r: httpx.Response, status: int, *fragments: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


async def post(swarm: Swarm, path: str, body: Any, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await http.post(f"{swarm.base_url}{path}", content=content,
                               headers={"content-type": "application/json", **kw.pop("headers", {})}, **kw)


async def test_malformed_json_is_400(swarm: Swarm) -> None:
    error = assert_openai_error(await post(swarm, "/chat/completions", b'{"model": "stub-model", "messages": ['),
                                400, "not valid JSON")
    assert error["type"] == "invalid_request_error"
    assert_openai_error(await post(swarm, "/completions", b"\xff\xfe"), 400, "not valid JSON")
    assert_openai_error(await post(swarm, "/completions", [1, 2]), 400, "JSON object")


@pytest.mark.parametrize("path, body, field", [
    ("/chat/completions", {"model": MODEL}, "messages"),
    ("/chat/completions", {"messages": MESSAGES}, "model"),
    ("/completions", {"model": MODEL}, "prompt"),
])
async def test_missing_field_is_400_naming_it(swarm: Swarm, path: str, body: dict[str, Any], field: str) -> None:
    assert_openai_error(await post(swarm, path, body), 400, field, "required")


@pytest.mark.parametrize("patch, field", [
    ({"max_tokens": "many"}, "max_tokens"),
    ({"messages": "hello"}, "messages"),
    ({"temperature": 7}, "temperature"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"stream": "sometimes"}, "stream"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": [""]}, "stop"),
])
async def test_wrong_types_are_400(swarm: Swarm, patch: dict[str, Any], field: str) -> None:
    body = {"model": MODEL, "messages": MESSAGES, **patch}
    assert_openai_error(await post(swarm, "/chat/completions", body), 400, field)


@pytest.mark.parametrize(("patch", "field"), [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    # The stub renders no tools: refused by the head, passed through naming the field.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
])
async def test_unsupported_parameters_are_rejected(swarm: Swarm, patch: dict[str, Any], field: str) -> None:
    error = assert_openai_error(await post(swarm, "/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                                        **patch}), 400)
    assert error["param"] == field, error
    assert not swarm.gateway.serving.sessions.live  # type: ignore[union-attr]


async def test_unknown_model_is_404(swarm: Swarm) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client(swarm).chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert "no-such-model" in info.value.message
    assert info.value.code == "model_not_found"  # the tracker's class survives its RouteReply
    assert not swarm.gateway.serving.sessions.live  # type: ignore[union-attr]


async def test_prompt_plus_max_tokens_over_context_is_400_naming_the_numbers(swarm: Swarm) -> None:
    ctx = swarm.nodes[0].backend.info.context_length
    prompt = "y" * 100
    n_prompt = prompt_tokens(swarm, text=prompt)
    too_many = ctx - n_prompt + 1
    with pytest.raises(openai.BadRequestError) as info:
        await client(swarm).completions.create(model=MODEL, prompt=prompt, max_tokens=too_many)
    for number in (n_prompt, too_many, n_prompt + too_many, ctx):
        assert str(number) in info.value.message
    assert info.value.code == "context_length_exceeded"
    ok = await client(swarm).completions.create(model=MODEL, prompt=prompt, max_tokens=1)  # the boundary is real
    assert ok.choices[0].finish_reason in ("length", "stop")


async def test_prompt_alone_over_context_is_400(module_nats: EmbeddedNats, tmp_path: Path, swarms: Swarms) -> None:
    swarm = await swarms.start(fresh_settings(module_nats, tmp_path), stubs(context_length=64), model_id=MODEL)
    prompt = "z" * 80
    with pytest.raises(openai.BadRequestError) as info:
        await client(swarm).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert str(prompt_tokens(swarm, text=prompt)) in info.value.message and "64" in info.value.message


async def test_oversized_body_is_413(module_nats: EmbeddedNats, tmp_path: Path, swarms: Swarms) -> None:
    limit = 2048
    s = fresh_settings(module_nats, tmp_path, max_body_bytes=limit)
    swarm = await swarms.start(s, stubs(), model_id=MODEL)
    with pytest.raises(openai.APIStatusError) as info:
        await client(swarm).completions.create(model=MODEL, prompt="w" * (2 * limit), max_tokens=1)
    assert info.value.status_code == 413 and str(limit) in info.value.message

    async def chunked() -> AsyncIterator[bytes]:  # no content-length: the limit is enforced while reading
        yield b'{"model": "stub-model", "prompt": "'
        for _ in range(10):
            yield b"w" * 512
        yield b'"}'

    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{swarm.base_url}/completions", content=chunked(),
                            headers={"content-type": "application/json"})
    assert_openai_error(r, 413, str(limit))
    small = await client(swarm).completions.create(model=MODEL, prompt="w" * 100, max_tokens=1)
    assert small.choices


async def test_unknown_endpoint_is_404_json(swarm: Swarm) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        r = await http.get(f"{swarm.base_url}/embeddings")
        error = assert_openai_error(r, 404, "/v1/embeddings")
        assert error["code"] == "not_found"
        r = await http.get(f"{swarm.url}/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"


async def test_unknown_session_telemetry_is_404(swarm: Swarm) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        r = await http.get(f"{swarm.base_url}/sessions/{'0' * 32}/telemetry")
    error = assert_openai_error(r, 404, "0" * 32)
    assert error["code"] == "session_not_found"


# ---- API keys -----------------------------------------------------------------------------------------------------

async def test_api_keys(module_nats: EmbeddedNats, tmp_path: Path, swarms: Swarms) -> None:
    s = fresh_settings(module_nats, tmp_path, api_keys=[SecretStr("key-one"), SecretStr("key-two")])
    swarm = await swarms.start(s, stubs(), model_id=MODEL)
    with pytest.raises(openai.AuthenticationError) as info:
        await client(swarm, api_key="wrong").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 401
    async with httpx.AsyncClient(timeout=5) as http:
        for headers in ({}, {"authorization": "key-one"}, {"authorization": "Bearer"},
                        {"authorization": "Bearer key-one-and-more"}, {"authorization": "Basic key-one"}):
            r = await http.post(f"{swarm.base_url}/chat/completions", headers=headers,
                                json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
            error = assert_openai_error(r, 401)
            assert error["type"] == "authentication_error"
            assert "key-one" not in r.text
        r = await http.get(f"{swarm.base_url}/models")
        assert r.status_code == 401
        assert (await http.get(f"{swarm.url}/health")).status_code == 200  # probes need no key
    for key in ("key-one", "key-two"):
        ok = await client(swarm, api_key=key).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                                      max_tokens=2, **GREEDY)
        assert ok.choices[0].finish_reason == "length"
    stream = await client(swarm, api_key="key-two").chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True, **GREEDY)
    assert sum(1 for ch in [c async for c in stream] if ch.choices and ch.choices[0].delta.content) == 4
