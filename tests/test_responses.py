"""The Responses API subset: requests (schemas.openai_responses) become chat turns and tools (gateway.responses),
and replies become the event stream, checked with the official SDK itself: every event is decoded by its SSE
decoder and validated as its own ``ResponseStreamEvent`` type, and the whole stream is accumulated by its own
``ResponseStreamState`` (what ``client.responses.stream()`` runs) into the final response.
"""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest
from openai import omit
from openai._streaming import SSEDecoder
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import ValidationError

from actors.backends.llamacpp.chat_template import select_template
from gateway.responses import ResponseBuilder, chat_messages, request_logprobs, request_tools, sse_event, text_format
from gateway.tools import ContentDelta, ToolCallParser
from schemas.errors import validation_error
from schemas.openai_responses import ResponseEvent, ResponsesRequest
from schemas.session import LogprobCandidate, TokenLogprobs

# The SDK's event union, by its "type" (its discriminator is the SDK's own annotation, which pydantic cannot use).
SDK_EVENTS: dict[str, type[Any]] = {get_args(m.model_fields["type"].annotation)[0]: m
                                    for m in get_args(get_args(ResponseStreamEvent)[0])}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


# ---- requests -----------------------------------------------------------------------------------------------------

def test_a_conversation_with_calls_and_outputs_becomes_chat_turns_that_render() -> None:
    req = request(instructions="Be brief.", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},  # an easy message: no "type"
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "24 C"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Mild."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}])
    messages = chat_messages(req)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]  # type: ignore[index,union-attr]
    assert messages[4] == {"role": "tool", "tool_call_id": "call_2", "content": "24 C"}
    tools = request_tools(req)
    assert tools is not None and tools.mode == "auto" and tools.tools[0].name == "get_weather"
    # The head can render it (the bundled model's Gemma fallback, generic tool format).
    template = select_template(None, "gemma3", bos_token="<bos>")
    assert template is not None
    text = template.render(messages, tools=tools)
    assert "Result of get_weather (call_2):\n24 C" in text and text.endswith("<start_of_turn>model\n")


def test_formats_logprobs_and_choices() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert text_format(request(text={"format": {"type": "json_schema", "name": "x", "schema": schema}})) == (
        "json_schema", schema)
    assert text_format(request(text={"format": {"type": "json_object"}})) == ("json_object", None)
    assert text_format(request()) == ("text", None)
    assert request_logprobs(request(top_logprobs=3, include=["message.output_text.logprobs"])) == 3
    assert request_logprobs(request(include=["message.output_text.logprobs"])) == 0  # the sampled token's only
    # A count of alternatives asks for logprobs even without the include (honoured, not silently dropped); 0, what
    # OpenAI echoes in every response, asks for nothing.
    assert request_logprobs(request(top_logprobs=3)) == 3
    assert request_logprobs(request(top_logprobs=0)) is None
    assert request_logprobs(request()) is None
    named = request_tools(request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                  parallel_tool_calls=False))
    assert named is not None and named.mode == "function" and not named.parallel
    assert request_tools(request(tools=[WEATHER], tool_choice="none")) is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"input": []}, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
])
def test_bad_requests_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ValidationError) as info:
        request(**fields)
    assert validation_error(info.value).param == param


def test_parameters_outside_the_subset_are_named() -> None:
    assert request(previous_response_id="resp_1").unsupported_param()[0] == "previous_response_id"  # type: ignore[index]
    assert request(reasoning={"effort": "low"}).unsupported_param()[0] == "reasoning"  # type: ignore[index]
    assert request(store=True, metadata={"a": "b"}, reasoning=None).unsupported_param() is None


# ---- replies -> events, read by the SDK ---------------------------------------------------------------------------

def through_the_sdk(events: list[ResponseEvent]) -> tuple[list[Any], SDKResponse | None]:
    """Our events as bytes on the wire, decoded and validated by the SDK, and accumulated by its stream state."""
    wire = b"".join(sse_event(e, {"swarmroute": {"seq": i}}) for i, e in enumerate(events))
    decoded = [SDK_EVENTS[sse.event or ""].model_validate(sse.json()) for sse in SSEDecoder().iter_bytes(iter([wire]))]
    assert [e.type for e in decoded] == [e.type for e in events]
    assert [e.sequence_number for e in decoded] == list(range(len(events)))
    assert all(e.model_extra and "swarmroute" in e.model_extra for e in decoded)  # telemetry rides every event
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[], text_format=omit)
    for event in decoded:
        state.handle_event(event)
    return decoded, state._completed_response  # noqa: SLF001 - what the SDK's stream helper returns at the end


def lp(token: int, text: bytes, value: float) -> TokenLogprobs:
    return TokenLogprobs(token=token, logprob=value, bytes=list(text),
                         top=[LogprobCandidate(token=token, logprob=value, bytes=list(text))])


def test_a_text_reply_streams_and_accumulates_in_the_sdk() -> None:
    req = request(include=["message.output_text.logprobs"], top_logprobs=1)
    builder = ResponseBuilder(req)
    parser = ToolCallParser("generic")
    events = builder.start()
    for i, piece in enumerate(["Hel", "lo", " world"]):
        events += builder.feed(parser.feed(piece), [lp(i, piece.encode(), -0.5 * (i + 1))])
    events += builder.feed(parser.finish()[0])
    events += builder.finish("stop", input_tokens=5, output_tokens=3)
    decoded, final = through_the_sdk(events)
    assert final is not None and final.status == "completed" and final.output_text == "Hello world"
    deltas = [e for e in decoded if e.type == "response.output_text.delta"]
    assert [d.delta for d in deltas] == ["Hel", "lo", " world"] and deltas[1].logprobs[0].logprob == -1.0
    done = next(e for e in decoded if e.type == "response.output_text.done")
    assert done.text == "Hello world" and [x.token for x in done.logprobs] == ["Hel", "lo", " world"]
    assert final.usage is not None and final.usage.total_tokens == 8
    sdk = SDKResponse.model_validate(builder.response.model_dump(mode="json", by_alias=True))
    assert sdk.output_text == "Hello world" and sdk.top_logprobs == 1


def test_top_logprobs_alone_gives_the_output_texts_logprobs() -> None:
    builder = ResponseBuilder(request(top_logprobs=2))
    events = builder.start() + builder.feed([ContentDelta("Hi")], [lp(7, b"Hi", -0.25)])
    events += builder.finish("stop", input_tokens=1, output_tokens=1)
    decoded, final = through_the_sdk(events)
    assert final is not None
    part = final.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and [(x.token, x.logprob) for x in part.logprobs or []] == [("Hi", -0.25)]
    delta = next(e for e in decoded if e.type == "response.output_text.delta")
    assert [x.token for x in delta.logprobs] == ["Hi"]
    plain = ResponseBuilder(request(top_logprobs=0))
    events = plain.start() + plain.feed([ContentDelta("Hi")], [lp(7, b"Hi", -0.25)])
    _, final = through_the_sdk(events + plain.finish("stop", input_tokens=1, output_tokens=1))
    assert final is not None and not final.output[0].content[0].logprobs  # type: ignore[union-attr]


def test_a_function_call_streams_name_then_arguments() -> None:
    req = request(tools=[WEATHER], tool_choice="required")
    builder = ResponseBuilder(req)
    parser = ToolCallParser("generic")
    events = builder.start()
    reply = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
            '{"name": "get_weather", "arguments": {"city": "Rome"}}]}'
    for i in range(0, len(reply), 7):
        events += builder.feed(parser.feed(reply[i:i + 7]))
    events += builder.feed(parser.finish()[0])
    events += builder.finish("stop", input_tokens=20, output_tokens=30)
    decoded, final = through_the_sdk(events)
    assert final is not None and final.status == "completed"
    calls = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "Rome"})]
    assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)
    kinds = [e.type for e in decoded]
    assert kinds.index("response.function_call_arguments.delta") > kinds.index("response.output_item.added")
    assert kinds.count("response.function_call_arguments.done") == 2 and not any("output_text" in k for k in kinds)


def test_a_reply_cut_by_the_token_limit_is_incomplete() -> None:
    builder = ResponseBuilder(request(max_output_tokens=2))
    events = builder.start() + builder.feed(ToolCallParser("generic").feed("Hello"))
    events += builder.finish("length", input_tokens=5, output_tokens=2)
    decoded, final = through_the_sdk(events)
    assert decoded[-1].type == "response.incomplete"
    assert decoded[-1].response.incomplete_details.reason == "max_output_tokens"
    assert final is None  # the SDK completes only on response.completed; the incomplete response is the last event


def test_a_failed_route_is_a_failed_response() -> None:
    builder = ResponseBuilder(request())
    events = builder.start() + builder.feed(ToolCallParser("generic").feed("Hel"))
    events += builder.fail("unreachable", "node b failed during decode")
    decoded, _ = through_the_sdk(events)
    assert decoded[-1].type == "response.failed" and decoded[-1].response.error.code == "server_error"
    assert decoded[-1].response.error.message == "route failed (unreachable): node b failed during decode"
