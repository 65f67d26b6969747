"""Issue #30: no request body gives a 5xx, on any of the three generation endpoints (hypothesis, bounded).

Bodies are mostly well formed, so that many reach generation, with one or more of the ways a stranger's body goes
wrong: a field set to any JSON at all, an unknown field, a mistyped number or boolean, a null, a lone surrogate in
some text, a non-finite number, deep nesting, a tool message or call output that answers nothing, a random JSON
Schema (often unsatisfiable), raw bytes. Each answer must be a 4xx in OpenAI's error shape, or a success whose
stream ends properly; afterwards no session is left open anywhere.

Against the real gateway app (``build_app`` over a real stub swarm: real NATS, stub nodes on loopback) through
httpx's ASGI transport: the stub route is cheap, and a protocol test double is what a "never 5xx" property needs.
Hypothesis runs in a worker thread; each request runs on the swarm's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus.http_edge import MAX_JSON_DEPTH
from bus.server import EmbeddedNats
from gateway.app import build_app
from tests.support import figures
from tests.support.gateway import MODEL, fresh_settings, stubs
from tests.support.swarm import Swarm, start_swarm

pytestmark = pytest.mark.asyncio(loop_scope="module")

EXAMPLES = 200
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    s = fresh_settings(module_nats, tmp_path_factory.mktemp("fuzz"), default_max_tokens=4, max_body_bytes=64 * 1024)
    started = await start_swarm(s, stubs(max_sessions=64), model_id=MODEL)
    try:
        yield started
    finally:
        await started.stop()


# ---- values ------------------------------------------------------------------------------------------------------

texts = st.text(max_size=12)
wild_texts = st.text(st.characters(max_codepoint=0x7F) | st.characters(categories=("Cs",))
                     | st.characters(min_codepoint=0x80), min_size=1, max_size=8)
"""Text that may hold lone surrogates (category Cs): json.dumps writes them as ``\\udXXX`` escapes."""
leaves = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | texts
json_values = st.recursive(leaves, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(texts, kids, max_size=3),
                           max_leaves=8)
mistyped = st.sampled_from(["10", "true", "1.5", "", True, False, 1.5, [], {}, [1], {"a": 1}])

schemas = st.recursive(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])},
                          optional={"minLength": st.integers(0, 6), "maxLength": st.integers(0, 6),
                                    "enum": st.lists(st.sampled_from(["a", "b", 1, None]), max_size=3),
                                    "const": st.sampled_from(["a", 1, True])}),
    lambda kids: st.fixed_dictionaries(
        {"type": st.just("object")},
        optional={"properties": st.dictionaries(st.sampled_from(["a", "b", "c"]), kids | st.booleans(), max_size=3),
                  "required": st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=3, unique=True),
                  "additionalProperties": st.booleans(), "minProperties": st.integers(0, 3),
                  "maxProperties": st.integers(0, 3)})
    | st.fixed_dictionaries({"type": st.just("array")},
                            optional={"items": kids | st.booleans(), "minItems": st.integers(0, 3),
                                      "maxItems": st.integers(0, 3), "prefixItems": st.lists(kids, max_size=2)})
    | st.fixed_dictionaries({"anyOf": st.lists(kids | st.booleans(), min_size=1, max_size=3)}),
    max_leaves=6)
"""Small JSON Schemas, many of them unsatisfiable (bounds crossed, empty enums, required names not allowed)."""


def _mostly(valid: st.SearchStrategy[Any], edge: st.SearchStrategy[Any], one_in: int = 4) -> st.SearchStrategy[Any]:
    """``edge`` once in ``one_in`` draws, else ``valid`` (``st.one_of`` would weigh them alike, however often one
    is repeated)."""
    return st.sampled_from([valid] * (one_in - 1) + [edge]).flatmap(lambda chosen: chosen)


COMMON: dict[str, st.SearchStrategy[Any]] = {
    "temperature": _mostly(st.floats(0, 2), st.floats(-1, 3) | mistyped),
    "top_p": _mostly(st.floats(0.01, 1), st.floats(-0.5, 1.5) | mistyped),
    "stream": _mostly(st.booleans(), mistyped),
    "seed": _mostly(st.integers(0, 2**31), st.integers(-(2**70), 2**70) | mistyped),
    "metadata": _mostly(st.dictionaries(texts, texts, max_size=2), json_values),
    "user": _mostly(texts, json_values),
    "store": _mostly(st.booleans(), mistyped),
}
GENERATION: dict[str, st.SearchStrategy[Any]] = {
    **COMMON,
    "max_tokens": _mostly(st.integers(1, 4), st.integers(-2, 0) | st.just(10**20) | mistyped),
    "n": _mostly(st.just(1), st.integers(-1, 3) | mistyped),
    "stream_options": _mostly(st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "include_telemetry": st.booleans()}), json_values),
    "stop": _mostly(st.text(min_size=1, max_size=4), st.lists(texts, max_size=20) | json_values),
    "presence_penalty": _mostly(st.floats(-2, 2), st.floats(-3, 3) | mistyped),
    "top_k": _mostly(st.integers(0, 300), st.integers(-5, -1) | mistyped),
    "min_p": _mostly(st.floats(0, 1), st.floats(-0.5, 1.5)),
    "repeat_penalty": _mostly(st.floats(0.1, 10), st.floats(-1, 12)),
    "ignore_eos": _mostly(st.booleans(), mistyped),
    "response_format": _mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                               st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
                                         schemas) | json_values),
    "logit_bias": _mostly(st.just({}), json_values),
    "best_of": _mostly(st.just(1), json_values),
}

CALL_IDS = st.sampled_from(["call_1", "call_2"])
tool_calls = st.lists(st.fixed_dictionaries({
    "id": CALL_IDS, "type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g"]), "arguments": st.sampled_from(["{}", '{"a": 1}', "nope"])})}),
    min_size=1, max_size=2)
chat_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                           "content": _mostly(texts, wild_texts | st.none() | json_values)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "tool_calls": tool_calls},
                          optional={"content": st.none() | texts}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": CALL_IDS, "content": texts}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": texts | json_values}), max_size=2)}),
)
text_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                                     "content": texts})


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Valid chat histories: text turns, sometimes with a tool round trip (calls, one answer each, a user turn)."""
    messages = draw(st.lists(text_message, min_size=1, max_size=3))
    if draw(st.booleans()):
        ids = draw(st.lists(CALL_IDS, min_size=1, max_size=2, unique=True))
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ids]})
        messages += [{"role": "tool", "tool_call_id": i, "content": draw(texts)} for i in ids]
        messages.append({"role": "user", "content": draw(texts)})
    return messages


@st.composite
def response_inputs(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Valid Responses input items: turns, sometimes with a function call and its output."""
    items: list[dict[str, Any]] = [{"role": "user", "content": draw(texts)}]
    if draw(st.booleans()):
        items += [{"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "call_1", "output": draw(texts)}]
    return items


tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "bad name"])}, optional={"parameters": schemas, "description": texts})}),
    max_size=2)

CHAT: dict[str, st.SearchStrategy[Any]] = {
    **GENERATION,
    "max_completion_tokens": _mostly(st.integers(1, 4), mistyped),
    "logprobs": _mostly(st.booleans(), mistyped),
    "top_logprobs": _mostly(st.integers(0, 3), st.integers(-1, 30) | mistyped),
    "tools": _mostly(tools, json_values),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "parallel_tool_calls": _mostly(st.booleans(), mistyped),
}
COMPLETIONS: dict[str, st.SearchStrategy[Any]] = {
    **GENERATION,
    "echo": _mostly(st.booleans(), mistyped),
    "logprobs": _mostly(st.integers(0, 3), st.integers(-1, 30) | mistyped),
    "suffix": _mostly(st.none(), texts),
}
response_item = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                           "content": _mostly(texts, wild_texts | st.none())}),
    st.fixed_dictionaries({"type": st.just("message"), "role": st.just("user"), "content": st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["input_text", "input_image"]), "text": texts}),
        max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": CALL_IDS, "name": st.just("f"),
                           "arguments": st.just("{}")}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": CALL_IDS, "output": texts}),
)
RESPONSES: dict[str, st.SearchStrategy[Any]] = {
    **COMMON,
    "instructions": _mostly(texts, wild_texts | json_values),
    "max_output_tokens": _mostly(st.integers(1, 4), st.integers(-2, 0) | mistyped),
    "top_logprobs": _mostly(st.integers(0, 3), st.integers(-1, 30) | mistyped),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]),
                        max_size=2),
    "text": _mostly(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
                    st.builds(lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}}, schemas)),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g"])},
                                            optional={"parameters": schemas}), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]),
    "truncation": st.sampled_from(["auto", "disabled", "sometimes"]),
    "previous_response_id": st.none() | texts,
}

FIELDS = {"/chat/completions": CHAT, "/completions": COMPLETIONS, "/responses": RESPONSES}


def base_body(draw: st.DrawFn, path: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(_mostly(st.just(MODEL), st.sampled_from(["nope", ""]) | json_values, 8))}
    if path == "/chat/completions":
        body["messages"] = draw(_mostly(conversations(), st.lists(chat_message, min_size=1, max_size=4)
                                        | json_values))
    elif path == "/completions":
        body["prompt"] = draw(_mostly(texts | st.lists(st.integers(0, 300), min_size=1, max_size=6),
                                      wild_texts | st.lists(st.integers(-3, 10**6), max_size=6) | json_values))
    else:
        body["input"] = draw(_mostly(texts | response_inputs(), st.lists(response_item, min_size=1, max_size=4)
                                     | wild_texts | json_values))
    fields = FIELDS[path]
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(fields[name])
    return body


NESTED = "@@nested@@"


@st.composite
def bodies(draw: st.DrawFn, path: str) -> bytes:
    """One request body: a mostly valid one, then zero or more mutations (as JSON or as raw text)."""
    if draw(st.integers(0, 19)) == 0:
        return draw(st.binary(max_size=200))
    body = base_body(draw, path)
    depth = 0
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2]))):  # half the bodies keep what base_body drew
        mutation = draw(st.sampled_from(["junk", "unknown", "null", "drop", "nested", "mistyped"]))
        keys = sorted(body) or ["model"]
        key = draw(st.sampled_from(keys))
        if mutation == "junk":
            body[key] = draw(json_values)
        elif mutation == "unknown":
            body[draw(st.sampled_from(["frobnicate", "extra", "functions", "audio", "reasoning"]))] = draw(json_values)
        elif mutation == "null":
            body[key] = None
        elif mutation == "drop":
            body.pop(key, None)
        elif mutation == "nested":
            body[key] = NESTED  # written as text below: json.dumps itself would recurse too deep
            depth = draw(st.sampled_from([40, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 990, 3000]))
        else:
            body[key] = draw(mistyped)
    text = json.dumps(body).replace(json.dumps(NESTED), "[" * (depth - 1) + "{}" + "]" * (depth - 1), 1)
    raw = draw(st.sampled_from(["", "", "", "", "", "NaN", "Infinity", "1e999"]))
    if raw and '"temperature": ' in text:
        head, _, rest = text.partition('"temperature": ')
        value_end = min((i for i in (rest.find(","), rest.find("}")) if i >= 0), default=len(rest))
        text = head + '"temperature": ' + raw + rest[value_end:]
    return text.encode("utf-8", "surrogatepass")


def check(r: httpx.Response, path: str, statuses: collections.Counter[int]) -> None:
    statuses[r.status_code] += 1
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"], r.text
        assert {"type", "param", "code"} <= set(error), r.text
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        if path == "/responses":
            last = [line for line in r.text.splitlines() if line.startswith("event: ")][-1]
            assert last in ("event: response.completed", "event: response.incomplete", "event: response.failed"), \
                r.text[-500:]
        else:
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-500:]


@pytest.mark.parametrize("path", list(FIELDS))
async def test_no_request_body_gives_a_5xx(swarm: Swarm, path: str) -> None:
    assert swarm.gateway.serving is not None
    loop = asyncio.get_running_loop()
    statuses: collections.Counter[int] = collections.Counter()
    transport = httpx.ASGITransport(app=build_app(swarm.gateway.serving, swarm.settings))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway/v1", timeout=60) as http:

        async def send(body: bytes) -> httpx.Response:
            return await http.post(path, content=body, headers={"content-type": "application/json"})

        @FUZZ
        @given(body=bodies(path))
        def run(body: bytes) -> None:
            r = asyncio.run_coroutine_threadsafe(send(body), loop).result(timeout=120)
            check(r, path, statuses)

        await asyncio.to_thread(run)
    await swarm.freed(timeout=30)
    assert sum(statuses.values()) >= EXAMPLES and statuses[400] > 0 and statuses[200] > 0, statuses
    figures.record(f"fuzz_gateway_{path.strip('/').replace('/', '_')}", cases=sum(statuses.values()),
                   statuses=dict(statuses))
