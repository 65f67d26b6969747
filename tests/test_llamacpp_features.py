"""Issue #19 end to end on the real 2-node llama.cpp route: official ``openai`` client -> gateway -> real NATS and
tracker -> two shard nodes ([0, 12) + [12, 18) of the bundled Gemma 3 270M) -> llama.cpp, streamed and not.

What is proven here:
* logprobs equal llama-cpp-python's own for the same greedy tokens (within 1e-4): chat (``top_logprobs``) against
  the log-softmax of ``Llama.eval``'s logits, completions (``logprobs: 5``) against ``create_completion``'s;
* structured output: replies validate with ``jsonschema`` against several schemas (nested objects, enums, arrays),
  and ``json_object`` replies parse as objects, whatever this small pretrained model would write on its own;
* tools: a required call and a named one parse into ``tool_calls`` whose arguments validate against the function's
  schema, streamed (``delta.tool_calls``) and not; a tool result round-trips into the next turn;
* n = 3: at temperature 0 the three choices equal each other and the n = 1 reply (the gateway decodes one greedy
  sequence for all of them, gateway/fanout.py), logprobs included, streamed and not; at temperature 1 with a seed
  the choices (forked on every hop) are reproducible; usage counts every choice;
* the Responses API stream parses with the SDK's own event types (text and a function call), with telemetry on its
  events;
* bad input is a 400 in OpenAI's error shape naming the field: an invalid JSON Schema, an unknown tool in
  ``tool_choice``, ``top_logprobs`` over the limit, ``n`` over the session capacity.

Why one module of ~450 lines: one module-scoped route of two llama.cpp nodes and one reference ``Llama`` serve every
feature's tests; a module per feature would load the model three more times.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import pytest_asyncio
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseIncompleteEvent,
    ResponseOutputItemAddedEvent,
    ResponseTextDeltaEvent,
)

llama_cpp = pytest.importorskip("llama_cpp")

from bus.server import EmbeddedNats  # noqa: E402
from schemas.session import Prompt  # noqa: E402
from tests.support.swarm import Swarm, gemma_route  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

MODEL = "gemma"
THREADS = 2
MAX_SESSIONS = 4
QUESTION = "What is the capital of France?"
_namespaces = itertools.count()

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer"},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                 "country": {"type": "string", "enum": ["France", "Italy", "Spain"]}},
                "required": ["city", "country"], "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}
COLOUR = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "bright": {"type": "boolean"}},
          "required": ["colour", "bright"], "additionalProperties": False}
SHOPPING = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "count": {"type": "integer"}},
        "required": ["name", "count"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "colour": COLOUR, "shopping": SHOPPING}

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, gemma_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async with gemma_route(module_nats.url, gemma_path, tmp_path_factory.mktemp("route"),
                           namespace=f"feat{next(_namespaces)}", max_sessions=MAX_SESSIONS, threads=THREADS,
                           model_id=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def reference(gemma_path: Path) -> Iterator[Any]:
    llm = llama_cpp.Llama(str(gemma_path), n_ctx=1024, n_threads=THREADS, n_threads_batch=THREADS, verbose=False,
                          logits_all=True)
    yield llm
    llm.close()


def client(swarm: Swarm) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=300)


def messages(question: str = QUESTION) -> list[Any]:
    return [{"role": "user", "content": question}]


async def all_freed(swarm: Swarm) -> None:
    """No session, and no KV cell of any sequence (every choice's fork included), left on any node."""
    await swarm.freed()
    for node in swarm.nodes:
        backend: Any = node.backend
        assert not node.sessions and not backend.open_sessions
        assert all(backend.seq_cells(s) == (-1, -1) for s in range(backend.max_sessions))


# ---- logprobs ----------------------------------------------------------------------------------------------------


def reference_greedy(llm: Any, tokens: list[int], n: int) -> list[tuple[int, np.ndarray]]:
    """llama-cpp-python's greedy run of ``tokens``: each pick with the log-softmax of the logits it was picked from."""
    llm.reset()
    llm.eval(tokens)
    out = []
    for _ in range(n):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        lp = logits - logits.max()
        lp -= np.log(np.exp(lp).sum())
        token = int(np.argmax(logits))
        out.append((token, lp))
        if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), token):
            break
        llm.eval([token])
    return out


def check_chat_logprobs(content: list[Any], ref: list[tuple[int, np.ndarray]], piece: Any, top: int) -> None:
    """The reply's logprobs are the reference run's, token for token, and as many: the whole reference (up to
    max_tokens or the end of generation), not just a prefix of it as long as the reply."""
    assert len(content) == len(ref), (len(content), len(ref))
    for entry, (token, lp) in zip(content, ref, strict=True):
        assert bytes(entry.bytes) == piece(token)
        assert abs(entry.logprob - lp[token]) < 1e-4
        best = np.argsort(-lp, kind="stable")[:top]
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [piece(int(t)) for t in best]
        assert np.allclose([t.logprob for t in entry.top_logprobs], lp[best], atol=1e-4)


async def test_chat_logprobs_equal_llama_cpp_python(swarm: Swarm, reference: Any) -> None:
    n = 12
    head: Any = swarm.nodes[0].backend
    tokens = head.tokenize(Prompt(messages=messages()))
    # Off the event loop, which runs the nodes (their heartbeats must go on meanwhile).
    ref = await asyncio.to_thread(reference_greedy, reference, tokens, n)
    body: dict[str, Any] = {"model": MODEL, "messages": messages(), "max_tokens": n, "temperature": 0,
                            "logprobs": True, "top_logprobs": 5}
    whole = await client(swarm).chat.completions.create(**body)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    check_chat_logprobs(choice.logprobs.content, ref, head.token_bytes, 5)
    assert "".join(e.token for e in choice.logprobs.content) == choice.message.content
    streamed: list[Any] = []
    text = ""
    async for chunk in await client(swarm).chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                streamed += c.logprobs.content
    assert text == choice.message.content
    check_chat_logprobs(streamed, ref, head.token_bytes, 5)


async def test_completion_logprobs_equal_llama_cpp_python(swarm: Swarm, reference: Any) -> None:
    prompt = "The capital of France is"
    reference.reset()
    expected = (await asyncio.to_thread(reference.create_completion, prompt, max_tokens=10, temperature=0.0,
                                        logprobs=5))["choices"][0]
    whole = await client(swarm).completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                   logprobs=5)
    got = whole.choices[0]
    assert got.text == expected["text"]
    lp = got.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens == expected["logprobs"]["tokens"]
    assert np.allclose(lp.token_logprobs, expected["logprobs"]["token_logprobs"], atol=1e-4)
    assert lp.text_offset == [o - len(prompt) for o in expected["logprobs"]["text_offset"]]
    for ours, theirs in zip(lp.top_logprobs, expected["logprobs"]["top_logprobs"], strict=True):
        assert set(ours) == set(theirs)
        assert all(abs(ours[k] - theirs[k]) < 1e-4 for k in theirs)
    stream = await client(swarm).completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                                    logprobs=5, stream=True)
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    text = ""
    async for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                values += c.logprobs.token_logprobs or []
                tops += c.logprobs.top_logprobs or []
                offsets += c.logprobs.text_offset or []
    assert text == got.text
    assert tokens == lp.tokens
    assert len(values) == len(lp.token_logprobs) and None not in values
    assert np.allclose(values, lp.token_logprobs, atol=1e-6)
    assert offsets == lp.text_offset
    assert len(tops) == len(lp.top_logprobs)
    for ours, whole_top in zip(tops, lp.top_logprobs, strict=True):
        assert set(ours) == set(whole_top)
        assert all(abs(ours[k] - whole_top[k]) < 1e-6 for k in whole_top)


# ---- structured output -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
async def test_json_schema_replies_validate(swarm: Swarm, name: str) -> None:
    schema = SCHEMAS[name]
    fmt: Any = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    ask = messages(f"Describe a {name} as JSON.")
    whole = await client(swarm).chat.completions.create(model=MODEL, messages=ask, max_tokens=200, temperature=0,
                                                        response_format=fmt)
    assert whole.choices[0].finish_reason == "stop"
    text = whole.choices[0].message.content
    assert text is not None
    jsonschema.validate(json.loads(text), schema)
    # Sampled, not greedy: the grammar holds whatever the draw.
    streamed = ""
    async for chunk in await client(swarm).chat.completions.create(
            model=MODEL, messages=ask, max_tokens=200, temperature=1.0, seed=3, response_format=fmt, stream=True):
        for c in chunk.choices:
            streamed += c.delta.content or ""
    jsonschema.validate(json.loads(streamed), schema)


async def test_json_object_replies_parse(swarm: Swarm) -> None:
    whole = await client(swarm).chat.completions.create(model=MODEL, messages=messages("List two fruits."),
                                                        max_tokens=120, temperature=0,
                                                        response_format={"type": "json_object"})
    assert isinstance(json.loads(whole.choices[0].message.content or ""), dict)


async def test_completions_take_response_format_too(swarm: Swarm) -> None:
    got = await client(swarm).completions.create(model=MODEL, prompt="A colour as JSON:", max_tokens=120,
                                                 temperature=0, extra_body={"response_format": {
                                                     "type": "json_schema",
                                                     "json_schema": {"name": "colour", "schema": COLOUR}}})
    jsonschema.validate(json.loads(got.choices[0].text), COLOUR)


# ---- tools ---------------------------------------------------------------------------------------------------------


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])


@pytest.mark.parametrize(("tool_choice", "parallel", "max_tokens"), [
    ("required", False, 120),
    # Parallel calls allowed: this small model repeats its call up to the grammar's limit of 8, then must stop.
    ({"type": "function", "function": {"name": "get_time"}}, None, 320),
])
async def test_required_and_named_tool_calls_parse_and_validate(swarm: Swarm, tool_choice: Any, parallel: bool | None,
                                                                max_tokens: int) -> None:
    names = {"get_time"} if isinstance(tool_choice, dict) else {"get_weather", "get_time"}
    ask = messages("What is the weather in Paris right now?")
    options: dict[str, Any] = {"model": MODEL, "messages": ask, "tools": [WEATHER, TIME], "tool_choice": tool_choice,
                               "max_tokens": max_tokens, "temperature": 0}
    if parallel is not None:
        options["parallel_tool_calls"] = parallel
    whole = await client(swarm).chat.completions.create(**options)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    check_calls(choice.message.tool_calls or [], names)
    if parallel is False:
        assert len(choice.message.tool_calls or []) == 1
    calls: dict[int, dict[str, Any]] = {}
    finishes = []
    async for chunk in await client(swarm).chat.completions.create(stream=True, **options):
        for c in chunk.choices:
            finishes.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                assert d.function is not None
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    assert [f for f in finishes if f] == ["tool_calls"]
    whole_calls = choice.message.tool_calls or []
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                                     for c in whole_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


async def test_auto_tool_choice_gives_a_valid_call_or_text(swarm: Swarm) -> None:
    tools: Any = [WEATHER, TIME]
    for question in ("What is the weather in Paris?", "Say hello."):
        got = await client(swarm).chat.completions.create(model=MODEL, messages=messages(question), tools=tools,
                                                          parallel_tool_calls=False, max_tokens=120, temperature=0)
        choice = got.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
        else:
            # The generic format's text reply ({"response": ...}) comes out as plain content (this small model may
            # go on writing it up to max_tokens).
            assert choice.finish_reason in ("stop", "length") and choice.message.content
            assert not choice.message.content.lstrip().startswith('{"response"')


async def test_tool_choice_none_gives_plain_text(swarm: Swarm) -> None:
    """Tools given with ``tool_choice: none``: neither rendered nor constrained, so the reply is the same text as
    with no tools at all (the same prompt tokens, greedy), never parsed into calls, streamed and not."""
    ask = messages("What is the weather in Paris right now?")
    body: dict[str, Any] = {"model": MODEL, "messages": ask, "max_tokens": 40, "temperature": 0}
    bare = await client(swarm).chat.completions.create(**body)
    none = await client(swarm).chat.completions.create(tools=[WEATHER, TIME], tool_choice="none", **body)
    choice = none.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content and choice.message.content == bare.choices[0].message.content
    assert none.usage is not None and bare.usage is not None
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens  # the tools were not rendered into the prompt
    text = ""
    finishes = []
    async for chunk in await client(swarm).chat.completions.create(tools=[WEATHER, TIME], tool_choice="none",
                                                                   stream=True, **body):
        for c in chunk.choices:
            assert c.delta.tool_calls is None
            text += c.delta.content or ""
            finishes.append(c.finish_reason)
    assert text == choice.message.content
    assert [f for f in finishes if f] == [choice.finish_reason]
    await all_freed(swarm)


async def test_a_tool_result_round_trips(swarm: Swarm) -> None:
    api = client(swarm)
    ask = messages("What is the weather in Paris?")
    tools: Any = [WEATHER]
    first = await api.chat.completions.create(model=MODEL, messages=ask, tools=tools, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=120, temperature=0)
    call: Any = (first.choices[0].message.tool_calls or [])[0]
    result = '{"temperature": 18, "sky": "cloudy"}'
    history: list[Any] = [*ask, first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": result}]
    second = await api.chat.completions.create(model=MODEL, messages=history, tools=tools, max_tokens=40,
                                               temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage is not None and first.usage is not None
    # The head rendered the call and its result into the second prompt.
    head: Any = swarm.nodes[0].backend
    rendered = b"".join(head.token_bytes(t) for t in head.tokenize(Prompt(messages=[
        {"role": "user", "content": ask[0]["content"]},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": result}]))).decode()
    assert result in rendered and call.function.arguments in rendered
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    await all_freed(swarm)


# ---- n > 1 ---------------------------------------------------------------------------------------------------------


def logprob_rows(content: list[Any]) -> list[tuple[bytes, float, list[tuple[bytes, float]]]]:
    return [(bytes(e.bytes), e.logprob, [(bytes(t.bytes), t.logprob) for t in e.top_logprobs]) for e in content]


async def test_n3_greedy_choices_are_the_n1_reply(swarm: Swarm) -> None:
    """Greedy choices are one sequence the gateway gives to every choice (gateway/fanout.py): the three are equal to
    each other and to the n = 1 reply (both decoded as one sequence: the same batch shapes), logprobs and finish
    reasons included, streamed and not; usage counts every choice."""
    n_tokens = 24
    body: dict[str, Any] = {"model": MODEL, "messages": messages("Write a short story about a fox."),
                            "max_tokens": n_tokens, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    single = await client(swarm).chat.completions.create(**body)
    lone = single.choices[0]
    assert lone.logprobs is not None and lone.logprobs.content and lone.message.content
    reference = logprob_rows(lone.logprobs.content)
    three = await client(swarm).chat.completions.create(n=3, **body)
    assert [c.index for c in three.choices] == [0, 1, 2]
    rows = []
    for choice in three.choices:
        assert choice.message.content == lone.message.content
        assert choice.finish_reason == lone.finish_reason
        assert choice.logprobs is not None and choice.logprobs.content is not None
        rows.append(logprob_rows(choice.logprobs.content))
    assert rows[0] == rows[1] == rows[2]  # one sequence: the very same numbers
    assert [token for token, _, _ in rows[0]] == [token for token, _, _ in reference]
    assert np.allclose([lp for _, lp, _ in rows[0]], [lp for _, lp, _ in reference], atol=1e-4)
    assert three.usage is not None and single.usage is not None
    assert three.usage.prompt_tokens == single.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * single.usage.completion_tokens == 3 * len(reference)
    texts = dict.fromkeys(range(3), "")
    streamed: dict[int, list[Any]] = {i: [] for i in range(3)}
    finishes: dict[int, str] = {}
    usage = None
    async for chunk in await client(swarm).chat.completions.create(n=3, stream=True,
                                                                   stream_options={"include_usage": True}, **body):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                streamed[c.index] += c.logprobs.content
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == dict.fromkeys(range(3), lone.message.content)
    assert finishes == dict.fromkeys(range(3), lone.finish_reason)
    got = [logprob_rows(streamed[i]) for i in range(3)]
    assert got[0] == got[1] == got[2]
    assert [token for token, _, _ in got[0]] == [token for token, _, _ in reference]
    assert np.allclose([lp for _, lp, _ in got[0]], [lp for _, lp, _ in reference], atol=1e-4)
    assert usage is not None and usage.completion_tokens == three.usage.completion_tokens
    await all_freed(swarm)


async def test_n3_seeded_choices_are_reproducible(swarm: Swarm) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": messages("Name some animals."), "max_tokens": 16,
                            "temperature": 1.0, "seed": 11, "n": 3}
    first = await client(swarm).chat.completions.create(**body)
    texts = {c.index: "" for c in first.choices}
    async for chunk in await client(swarm).chat.completions.create(stream=True, **body):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in first.choices]
    assert len({c.message.content for c in first.choices}) > 1  # seed + i: the choices draw differently
    await all_freed(swarm)


# ---- the Responses API -------------------------------------------------------------------------------------------


async def test_responses_stream_parses_with_the_sdk_event_types(swarm: Swarm) -> None:
    api = client(swarm)
    events = [e async for e in await api.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16,
                                                           temperature=0, stream=True)]
    # Cut by max_output_tokens: the SDK's own "incomplete" event ends it.
    assert isinstance(events[0], ResponseCreatedEvent) and isinstance(events[-1], ResponseIncompleteEvent)
    deltas = "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent))
    assert deltas and events[-1].response.output_text == deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    whole = await api.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    assert whole.output_text == deltas and whole.usage is not None and whole.usage.output_tokens == 16
    assert whole.status == "incomplete"  # cut by max_output_tokens
    telemetry = (whole.model_extra or {})["swarmroute"]
    assert [h["node_id"] for h in telemetry["route"]] == ["n1", "n2"]
    # Telemetry rides the stream's events under the same key (raw SSE: the SDK keeps only the event's fields).
    async with httpx.AsyncClient(timeout=120) as http, http.stream(
            "POST", f"{swarm.base_url}/responses",
            json={"model": MODEL, "input": QUESTION, "max_output_tokens": 4, "stream": True}) as r:
        data = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
    assert "swarmroute" in data[0] and data[-1]["swarmroute"]["phase"] == "complete"


async def test_responses_function_call(swarm: Swarm) -> None:
    tool: Any = {"type": "function", **WEATHER["function"]}
    events = [e async for e in await client(swarm).responses.create(
        model=MODEL, input="What is the weather in Rome?", tools=[tool], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120, temperature=0, stream=True)]
    added = [e for e in events if isinstance(e, ResponseOutputItemAddedEvent) and e.item.type == "function_call"]
    assert added
    arguments = "".join(e.delta for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent))
    final = events[-1]
    assert isinstance(final, ResponseCompletedEvent)
    calls = [o for o in final.response.output if o.type == "function_call"]
    assert calls and calls[0].arguments == arguments and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS["get_weather"])


async def test_responses_function_call_output_round_trips(swarm: Swarm) -> None:
    """A Responses function call, then its ``function_call_output`` in the next request's input: the head renders
    both into the prompt exactly as the chat turn with a ``role: tool`` message (the same prompt tokens and, greedy,
    the same reply), streamed and not."""
    api = client(swarm)
    tool: Any = {"type": "function", **WEATHER["function"]}
    question = "What is the weather in Rome?"
    first = await api.responses.create(model=MODEL, input=question, tools=[tool], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    result = '{"temperature": 24, "sky": "clear"}'
    follow_up: Any = [{"role": "user", "content": question}, call.model_dump(exclude_none=True),
                      {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    second = await api.responses.create(model=MODEL, input=follow_up, tools=[tool], max_output_tokens=40,
                                        temperature=0)
    assert second.status in ("completed", "incomplete") and second.output
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    # The same conversation as chat turns (proven to render the call and its result: test_a_tool_result_round_trips).
    history: list[Any] = [{"role": "user", "content": question},
                          {"role": "assistant", "content": None, "tool_calls": [{
                              "id": call.call_id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    chat = await api.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=40,
                                             temperature=0)
    assert chat.usage is not None and second.usage.input_tokens == chat.usage.prompt_tokens
    message = chat.choices[0].message
    assert second.output_text == (message.content or "")
    assert [(o.name, o.arguments) for o in second.output if o.type == "function_call"] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[union-attr]
    events = [e async for e in await api.responses.create(model=MODEL, input=follow_up, tools=[tool],
                                                           max_output_tokens=40, temperature=0, stream=True)]
    final = events[-1]
    assert isinstance(final, ResponseCompletedEvent | ResponseIncompleteEvent)
    assert final.response.output_text == second.output_text
    assert final.response.usage is not None and final.response.usage.input_tokens == second.usage.input_tokens
    await all_freed(swarm)


async def test_responses_top_logprobs_alone_gives_logprobs(swarm: Swarm) -> None:
    """``top_logprobs`` without ``include`` is honoured (gateway/responses.py ``wants_logprobs``): the same logprobs
    as with the include, one per output token, each with its alternatives."""
    body: dict[str, Any] = {"model": MODEL, "input": QUESTION, "max_output_tokens": 8, "temperature": 0,
                            "top_logprobs": 3}
    alone = await client(swarm).responses.create(**body)
    included = await client(swarm).responses.create(include=["message.output_text.logprobs"], **body)
    rows = []
    for response in (alone, included):
        part: Any = response.output[0].content[0]  # type: ignore[union-attr]
        assert response.usage is not None and len(part.logprobs) == response.usage.output_tokens == 8
        assert all(len(x.top_logprobs) == 3 for x in part.logprobs)
        rows.append([(x.token, x.logprob) for x in part.logprobs])
    assert [t for t, _ in rows[0]] == [t for t, _ in rows[1]]
    assert np.allclose([v for _, v in rows[0]], [v for _, v in rows[1]], atol=1e-4)


# ---- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                          "required": "name"}}}},
     "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_stock_price"}}},
     "tool_choice"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": MAX_SESSIONS + 1, "temperature": 1.0}, "n"),  # sampled: every choice is a sequence on every hop
])
async def test_bad_input_is_a_400_naming_the_field(swarm: Swarm, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client(swarm).chat.completions.create(model=MODEL, messages=messages(), max_tokens=4, **extra)
    assert info.value.status_code == 400
    assert info.value.param == param, info.value.body
    assert isinstance(info.value.body, dict) and info.value.body["message"]
    await all_freed(swarm)
