"""Issue #30 item 4, no input gives a 500: the bad inputs measured on the default ``up`` are each a 400 naming the
field, in OpenAI's error shape, on every endpoint they reach; what OpenAI accepts (the official client's and
swarmroute's documented fields) still passes; a client that leaves is a cancellation (logged once, at info, counted
as 499 apart from the 5xx); a real internal error is one 500 with one traceback.

Against the real gateway app (``build_app`` over the gateway of a real stub swarm: real NATS, stub nodes on
loopback) through httpx's ASGI transport, and, for the client that leaves, through raw ASGI calls that disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from starlette.applications import Starlette
from starlette.types import Message

from bus.http_edge import MAX_JSON_DEPTH, check_json, parse_json
from bus.server import EmbeddedNats
from gateway.app import build_app
from schemas.errors import BadRequestError
from tests.support.gateway import MODEL, stub_swarm
from tests.support.prometheus import Scrape
from tests.support.swarm import Swarm
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
RESPONSES: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
BODIES = {"/chat/completions": CHAT, "/completions": COMPLETION, "/responses": RESPONSES}
TEXT_FIELD = {"/chat/completions": ("messages", "messages.0.content"), "/completions": ("prompt", "prompt"),
              "/responses": ("input", "input")}
"""Per endpoint: the parameter that carries the prompt's text, and the path of that text in the body."""
ENDPOINTS = list(BODIES)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async with stub_swarm(module_nats, tmp_path_factory.mktemp("swarm")) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def slow_swarm(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    """20 ms per step: a generation lasts long enough to walk away from."""
    async with stub_swarm(module_nats, tmp_path_factory.mktemp("slow"), delay_s=0.02) as s:
        yield s


def app_of(swarm: Swarm) -> Starlette:
    assert swarm.gateway.serving is not None
    return build_app(swarm.gateway.serving, swarm.settings)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(swarm: Swarm) -> AsyncIterator[httpx.AsyncClient]:
    # raise_app_exceptions (the default): an exception escaping the app, which the server would log as a second
    # traceback, fails the test.
    transport = httpx.ASGITransport(app=app_of(swarm))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway/v1", timeout=30) as client:
        yield client


async def post(http: httpx.AsyncClient, path: str, body: dict[str, Any] | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await http.post(path, content=content, headers={"content-type": "application/json"})


def assert_400(r: httpx.Response, param: str | None, *fragments: str) -> dict[str, Any]:
    """OpenAI's error shape, naming ``param``, with ``fragments`` in its message."""
    assert r.status_code == 400, r.text
    error: dict[str, Any] = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


def with_text(path: str, text_json: bytes) -> bytes:
    """The endpoint's body with its prompt text replaced by ``text_json`` (a JSON string literal, raw bytes)."""
    if path == "/chat/completions":
        body = {**CHAT, "messages": [{"role": "user", "content": "@@"}]}
    else:
        body = {**BODIES[path], "prompt" if path == "/completions" else "input": "@@"}
    return json.dumps(body).encode().replace(b'"@@"', text_json)


# ---- text that is not Unicode -------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ENDPOINTS)
async def test_a_lone_surrogate_is_a_400_naming_the_field(http: httpx.AsyncClient, path: str) -> None:
    param, where = TEXT_FIELD[path]
    for raw in (b'"a\\ud800b"', b'"a\\udc00b"', b'"a\xed\xa0\x80b"'):  # escaped high, low; as (CESU) bytes
        assert_400(await post(http, path, with_text(path, raw)), param, where, "surrogate")
    # A pair is one character (U+1F600), and is served.
    r = await post(http, path, with_text(path, b'"a\\ud83d\\ude00b"'))
    assert r.status_code == 200, r.text


async def test_a_lone_surrogate_in_a_key_or_nested_field_is_named(http: httpx.AsyncClient) -> None:
    body = json.dumps({**CHAT, "metadata": {"k": "v"}}).replace('"k"', '"k\\udfff"').encode()
    assert_400(await post(http, "/chat/completions", body), "metadata", "surrogate")
    tools = [{"type": "function", "function": {"name": "f", "description": "@@"}}]
    body = json.dumps({**CHAT, "tools": tools}).replace('"@@"', '"\\ud800"').encode()
    assert_400(await post(http, "/chat/completions", body), "tools", "tools.0.function.description")


async def test_bytes_that_are_not_utf8_are_still_invalid_json() -> None:
    # surrogatepass lets only surrogates through to be named; other bytes stay a parse error.
    with pytest.raises(BadRequestError, match="not UTF-8"):
        parse_json(b'{"a": "\xff"}')
    assert parse_json('{"a": "é😀"}'.encode()) == {"a": "é😀"}


# ---- nesting and numbers JSON cannot carry -------------------------------------------------------------------------

@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 990, 100_000])
async def test_deep_nesting_is_a_400(http: httpx.AsyncClient, path: str, depth: int) -> None:
    for open_, close in (("[", "]"), ('{"a":', "}")):
        nested = open_ * (depth - 1) + "1" + close * (depth - 1)
        body = json.dumps({**BODIES[path], "metadata": "@@"}).replace('"@@"', nested).encode()
        error = assert_400(await post(http, path, body), "metadata" if depth < 900 else None, "nested")
        assert str(MAX_JSON_DEPTH) in error["message"]


async def test_the_depth_limit_is_exact() -> None:
    def nested(levels: int) -> object:
        value: object = 1
        for _ in range(levels):
            value = [value]
        return value

    check_json(nested(MAX_JSON_DEPTH))
    with pytest.raises(BadRequestError, match=f"more than {MAX_JSON_DEPTH} levels"):
        check_json(nested(MAX_JSON_DEPTH + 1))


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
async def test_a_number_that_is_not_finite_is_a_400_naming_the_field(http: httpx.AsyncClient, path: str,
                                                                     literal: str) -> None:
    body = json.dumps({**BODIES[path], "temperature": "@@"}).replace('"@@"', literal).encode()
    error = assert_400(await post(http, path, body), "temperature", "temperature", "not a JSON number")
    assert "less than" not in error["message"]  # issue #30: NaN was refused as "should be less than or equal to 2"
    r = await post(http, path, json.dumps({**BODIES[path], "temperature": 0.5}).encode())
    assert r.status_code == 200, r.text


async def test_a_huge_integer_is_a_400(http: httpx.AsyncClient) -> None:
    body = json.dumps({**CHAT, "seed": "@@"}).replace('"@@"', "9" * 5000).encode()
    assert_400(await post(http, "/chat/completions", body), None, "not valid JSON")


# ---- fields OpenAI refuses ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ENDPOINTS)
async def test_an_unknown_field_is_a_400_naming_it(http: httpx.AsyncClient, path: str) -> None:
    assert_400(await post(http, path, {**BODIES[path], "frobnicate": 1}), "frobnicate", "frobnicate",
               "unrecognized")
    assert_400(await post(http, path, {**BODIES[path], "stream_options": {"include_usage": True, "colour": "red"}}),
               "stream_options", "stream_options.colour", "unrecognized")


@pytest.mark.parametrize(("patch", "param", "where"), [
    ({"messages": [{"role": "user", "content": "hi", "mood": "good"}]}, "messages", "messages.0.mood"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]}, "messages",
     "messages.0.content.0"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}, "colour": 1}}]}, "tools",
     "tools.0.function.colour"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "mode": 1}}},
     "response_format", "json_schema.mode"),
])
async def test_an_unknown_nested_field_is_a_400_naming_it(http: httpx.AsyncClient, patch: dict[str, Any],
                                                          param: str, where: str) -> None:
    assert_400(await post(http, "/chat/completions", {**CHAT, **patch}), param, where)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("value", ["10", True, 10.5, [10]])
async def test_a_mistyped_token_limit_is_a_400_naming_it(http: httpx.AsyncClient, path: str, value: object) -> None:
    field = "max_output_tokens" if path == "/responses" else "max_tokens"
    assert_400(await post(http, path, {**BODIES[path], field: value}), field, field)
    r = await post(http, path, {**BODIES[path], field: 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", "1"), ("temperature", True), ("stream", "true"), ("stream", 1), ("n", True), ("n", 1.0),
    ("seed", "7"), ("top_k", 2.5), ("ignore_eos", "yes"), ("logprobs", 1), ("stop", 5), ("user", 5),
])
async def test_mistyped_numbers_and_booleans_are_400s(http: httpx.AsyncClient, field: str, value: object) -> None:
    assert_400(await post(http, "/chat/completions", {**CHAT, field: value}), field, field)


@pytest.mark.parametrize("path", ENDPOINTS)
async def test_null_is_a_default_where_openai_takes_it(http: httpx.AsyncClient, path: str) -> None:
    r = await post(http, path, {**BODIES[path], "temperature": None, "top_p": None, "stream": None})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("message", "fragment"), [
    ({"role": "user", "content": None}, "content is null"),
    ({"role": "user"}, "content is missing"),
    ({"role": "system", "content": None}, "a system message needs content"),
    ({"role": "assistant", "content": None}, "needs content or tool_calls"),
])
async def test_null_content_is_a_400(http: httpx.AsyncClient, message: dict[str, Any], fragment: str) -> None:
    body = {**CHAT, "messages": [message, {"role": "user", "content": "hi"}]}
    assert_400(await post(http, "/chat/completions", body), "messages", "messages.0.content", fragment)


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("messages", "where", "fragment"), [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}],
     "messages.1.tool_call_id", "does not follow an assistant message with tool_calls"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], "messages.0.tool_call_id", "does not follow"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_2", "content": "18 C"}], "messages.2.tool_call_id", "'call_2'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "user", "content": "well?"}], "messages.1.tool_calls", "none answers ['call_1']"),
])
async def test_a_tool_message_answers_a_call_before_it(http: httpx.AsyncClient, messages: list[dict[str, Any]],
                                                       where: str, fragment: str) -> None:
    assert_400(await post(http, "/chat/completions", {**CHAT, "messages": messages}), "messages", where, fragment)


async def test_a_tool_round_trip_passes_validation(http: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}, {"role": "user", "content": "and?"}]
    r = await post(http, "/chat/completions", {**CHAT, "messages": messages})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("items", "where", "fragment"), [
    ([{"type": "function_call_output", "call_id": "call_1", "output": "18 C"}], "input.0.call_id",
     "no function_call with call_id 'call_1'"),
    ([{"role": "user", "content": "hi"},
      {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}], "input.1.call_id",
     "no function_call_output answers"),
])
async def test_a_function_call_output_answers_a_call(http: httpx.AsyncClient, items: list[dict[str, Any]],
                                                     where: str, fragment: str) -> None:
    assert_400(await post(http, "/responses", {**RESPONSES, "input": items}), "input", where, fragment)


# ---- schemas no reply can satisfy ---------------------------------------------------------------------------------

UNSATISFIABLE = [
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength 5 is more than maxLength 2"),
    ({"type": "object", "properties": {"tags": {"type": "array", "minItems": 3, "maxItems": 1}}},
     "properties/tags"),
    ({"type": "object", "minProperties": 2, "maxProperties": 1}, "minProperties 2 is more than maxProperties 1"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum 5 is more than maximum 2"),
    ({"type": "number", "exclusiveMinimum": 2, "exclusiveMaximum": 2}, "between the bounds"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "enum is empty"),
    ({"type": "string", "enum": [1, 2]}, "no value of its enum"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"], "additionalProperties": False},
     "the required property 'b'"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "'a' is set to false"),
    ({"type": "array", "items": False, "minItems": 1}, "items is false"),
    ({"anyOf": [False, False]}, "anyOf"),
]


@pytest.mark.parametrize(("schema", "fragment"), UNSATISFIABLE)
async def test_an_unsatisfiable_schema_is_a_400_on_every_endpoint(http: httpx.AsyncClient, schema: dict[str, Any],
                                                                  fragment: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for path in ("/chat/completions", "/completions"):
        assert_400(await post(http, path, {**BODIES[path], "response_format": fmt}), "response_format",
                   "admits no value", fragment)
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    assert_400(await post(http, "/responses", {**RESPONSES, "text": text}), "text", "admits no value", fragment)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": schema}}}}
    assert_400(await post(http, "/chat/completions", {**CHAT, "tools": [tool]}), "tools", "admits no value")


async def test_a_satisfiable_schema_passes_the_gateway(http: httpx.AsyncClient) -> None:
    # Through the gateway's check to the stub's tail, which enforces no constraints: its own 400 says so.
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 5},
                                               "tags": {"type": "array", "minItems": 1, "maxItems": 3}},
              "required": ["name"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert_400(await post(http, "/chat/completions", {**CHAT, "response_format": fmt}), "response_format",
               "stub backend does not enforce")


# ---- what must stay accepted ----------------------------------------------------------------------------------------

async def test_the_official_client_and_documented_extensions_pass(swarm: Swarm) -> None:
    transport = httpx.ASGITransport(app=app_of(swarm))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway/v1") as http_client:
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", max_retries=0,
                                    http_client=http_client)
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_tokens=2, temperature=0, top_p=1, n=1, seed=3, stop=["\n\n"], presence_penalty=0,
            frequency_penalty=0, logprobs=False, user="u", store=False, metadata={"a": "b"}, service_tier="auto",
            prompt_cache_key="k", safety_identifier="s", parallel_tool_calls=None,
            extra_body={"top_k": 4, "min_p": 0.05, "repeat_penalty": 1.1, "ignore_eos": True})
        assert chat.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=2, stream=True,
            stream_options={"include_usage": True}, extra_body={"stream_options": {
                "include_usage": True, "include_telemetry": True}})
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
        text = await client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, echo=False, best_of=1,
                                               logprobs=2, suffix=None)
        assert text.choices[0].logprobs is not None
        response = await client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False,
                                                 truncation="disabled", metadata={"a": "b"}, top_logprobs=0)
        assert response.status == "incomplete"


# ---- methods, clients that leave, internal errors -------------------------------------------------------------------

async def test_a_wrong_method_is_a_405_with_its_own_code(http: httpx.AsyncClient) -> None:
    r = await http.get("/chat/completions")
    assert r.status_code == 405, r.text
    error = r.json()["error"]
    assert error["code"] == "method_not_allowed" and error["type"] == "invalid_request_error", error
    assert "GET" in error["message"] and "POST" in r.headers["allow"]


def _scope(path: str, body: bytes, spec: str = "2.3") -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 50000), "server": ("gateway", 80),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


async def leave_midway(app: Starlette, swarm: Swarm, path: str, body: dict[str, Any],
                       spec: str = "2.3") -> list[Message]:
    """One request by raw ASGI whose client goes away once its session has produced a token; what the app sent.
    ASGI 2.3 (uvicorn's): the server says ``http.disconnect``; 2.4: a send after that raises ``OSError``."""
    raw = json.dumps(body).encode()
    gone = asyncio.Event()
    sent: list[Message] = []
    first = True

    async def receive() -> Message:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if spec >= "2.4" and gone.is_set():
            raise OSError("the connection is closed")
        sent.append(message)

    assert swarm.gateway.serving is not None
    live = swarm.gateway.serving.sessions.live
    call = asyncio.create_task(app(_scope(path, raw, spec), receive, send))
    await eventually(lambda: any(s.tokens_seen for s in live.values()), what="a token of the request")
    gone.set()
    await asyncio.wait_for(call, 30)  # the app returns: nothing escapes it for the server to log
    await swarm.freed()
    return sent


def requests_total(swarm: Swarm, path: str, status: str) -> float:
    assert swarm.gateway.serving is not None
    scrape = Scrape(swarm.gateway.serving.metrics.render().decode())
    found = [s.value for s in scrape.samples
             if s.name == "swarmroute_gateway_requests_total" and s.labels == {"endpoint": path, "status": status}]
    return sum(found)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
async def test_a_client_that_leaves_a_whole_reply_is_a_cancellation(slow_swarm: Swarm, path: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    body = {**BODIES[path.removeprefix("/v1")], "max_tokens": 500, "max_output_tokens": 500}
    body.pop("max_output_tokens" if path != "/v1/responses" else "max_tokens")
    if path != "/v1/responses":
        body["ignore_eos"] = True
    before = {status: requests_total(slow_swarm, path, status) for status in ("499", "500")}
    with caplog.at_level(logging.INFO):
        sent = await leave_midway(app_of(slow_swarm), slow_swarm, path, body)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]  # to nobody: it is gone
    assert requests_total(slow_swarm, path, "499") == before["499"] + 1
    assert requests_total(slow_swarm, path, "500") == before["500"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    cancelled = [r for r in caplog.records if "cancelled" in r.getMessage() and r.name.startswith("gateway")]
    assert len(cancelled) == 1 and cancelled[0].levelno == logging.INFO and not cancelled[0].exc_info, caplog.text


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
async def test_a_client_that_leaves_a_stream_is_a_cancellation(slow_swarm: Swarm, spec: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    body = {**CHAT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with caplog.at_level(logging.INFO):
        sent = await leave_midway(app_of(slow_swarm), slow_swarm, "/v1/chat/completions", body, spec)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    cancelled = [r for r in caplog.records if "cancelled" in r.getMessage() and r.name.startswith("gateway")]
    assert len(cancelled) == 1 and cancelled[0].levelno == logging.INFO, caplog.text


async def test_an_internal_error_is_one_500_logged_once(swarm: Swarm, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    serving = swarm.gateway.serving
    assert serving is not None

    async def broken(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(serving, "completion", broken)
    transport = httpx.ASGITransport(app=app_of(swarm))  # raises what escapes the app: the server's second log
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway/v1") as http:
        with caplog.at_level(logging.INFO):
            r = await post(http, "/completions", COMPLETION)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
    assert "RuntimeError" in r.json()["error"]["message"]
    logged = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(logged) == 1 and logged[0].exc_info is not None, caplog.text


async def test_bad_input_leaves_no_session_open(swarm: Swarm, http: httpx.AsyncClient) -> None:
    for path in ENDPOINTS:
        assert_400(await post(http, path, {**BODIES[path], "frobnicate": True}), "frobnicate")
    await swarm.freed()

