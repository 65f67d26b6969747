"""schemas.openai: the issue #19 request fields validate with errors naming the field, unsupported parameters are
named, features not wired yet stay refused, and every response and chunk shape parses with the official SDK's
own types (``openai.types.chat``, ``openai.types.completion``).
"""

from __future__ import annotations

from typing import Any

import openai.types as oai
import pytest
from openai.types.chat import ChatCompletion as SDKChatCompletion
from openai.types.chat import ChatCompletionChunk as SDKChatCompletionChunk
from pydantic import ValidationError

from schemas.errors import validation_error
from schemas.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolCallFunction,
    ToolCallFunctionDelta,
    TopLogprob,
    Usage,
    unsupported_param,
)

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def bad(fields: dict[str, Any], model: type = ChatCompletionRequest) -> tuple[str | None, str]:
    """The 400 a body gets: its ``param`` and message."""
    body = {"model": "m", **({"messages": MESSAGES} if model is ChatCompletionRequest else {"prompt": "x"}), **fields}
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    error = validation_error(info.value)
    assert error.status == 400 and error.to_body()["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    return error.param, error.message


def test_issue_19_fields_parse() -> None:
    req = chat(logprobs=True, top_logprobs=20, n=3, tools=[TOOL], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, parallel_tool_calls=False, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True}})
    assert req.top_logprobs == 20 and req.n == 3 and req.tools and req.tools[0].function.name == "get_weather"
    assert req.response_format is not None and req.response_format.type == "json_schema"
    assert req.response_format.json_schema.schema_ == {"type": "object"}
    assert req.model_extra == {}
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 5}).logprobs == 5


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "requires tools"),
    ({"tools": [TOOL, TOOL]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
    ({"n": 129}, "n", "less than or equal to 128"),
    ({"response_format": {"type": "xml"}}, "response_format", "does not match any of the expected tags"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "a", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages", "only assistant messages"),
])
def test_bad_fields_are_400s_naming_the_field(fields: dict[str, Any], param: str, message: str) -> None:
    got_param, got_message = bad(fields)
    assert got_param == param and message in got_message


def test_completions_logprobs_over_the_limit_name_the_field() -> None:
    assert bad({"logprobs": 21}, CompletionRequest)[0] == "logprobs"


@pytest.mark.parametrize("logprobs", [0, 5])
def test_completions_echo_with_logprobs_is_a_400_naming_both(logprobs: int) -> None:
    # OpenAI would add the prompt tokens' logprobs, which the route does not compute: refused, not half-served.
    param, message = bad({"echo": True, "logprobs": logprobs}, CompletionRequest)
    assert param == "logprobs" and "echo" in message and "prompt tokens' logprobs" in message
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True}).echo
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": False, "logprobs": 5}).logprobs == 5


def test_issue_19_fields_are_served_and_neutral_values_pass() -> None:
    # Served since part 2 (gateway/serving.py): a request using them validates, and so do their neutral values.
    req = chat(logprobs=True, top_logprobs=3, tools=[TOOL], tool_choice="required",
               response_format={"type": "json_object"})
    assert req.top_logprobs == 3 and req.tools is not None and req.tool_choice == "required"
    assert unsupported_param(req) is None
    chat(response_format={"type": "text"}, logprobs=False)


@pytest.mark.parametrize(("fields", "name"), [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"), ({"modalities": ["text", "audio"]}, "modalities"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"functions": [{"name": "f"}]}, "functions"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"), ({"best_of": 2}, "best_of"),
])
def test_unsupported_parameters_are_named(fields: dict[str, Any], name: str) -> None:
    found = unsupported_param(chat(**fields))
    assert found is not None and found[0] == name


@pytest.mark.parametrize("fields", [{"modalities": ["text"]}, {"best_of": 1}, {"audio": None}, {"store": True},
                                    {"metadata": {"a": "b"}}, {"service_tier": "auto"}, {"logit_bias": {}}])
def test_neutral_and_harmless_parameters_pass(fields: dict[str, Any]) -> None:
    assert unsupported_param(chat(**fields)) is None


# ---- response shapes, read back by the official SDK -------------------------------------------------------------

LOGPROB = TokenLogprob(token=" Paris", logprob=-0.25, bytes=list(b" Paris"),
                       top_logprobs=[TopLogprob(token=" Paris", logprob=-0.25, bytes=list(b" Paris")),
                                     TopLogprob(token="bytes:\\xe2\\x80", logprob=-3.5, bytes=[0xE2, 0x80])])


def test_chat_completion_with_logprobs_tool_calls_and_choices_parses_with_the_sdk() -> None:
    body = ChatCompletion(id="chatcmpl-1", model="m", usage=Usage(prompt_tokens=3, completion_tokens=4,
                                                                 total_tokens=7), choices=[
        ChatChoice(index=0, finish_reason="stop", message=ChatMessageOut(content="Paris"),
                   logprobs=ChoiceLogprobs(content=[LOGPROB])),
        ChatChoice(index=1, finish_reason="tool_calls", message=ChatMessageOut(content=None, tool_calls=[
            ToolCall(id="call_" + "0" * 24, function=ToolCallFunction(name="get_weather",
                                                                      arguments='{"city": "Paris"}'))]))])
    sdk = SDKChatCompletion.model_validate(body.model_dump(mode="json"))
    assert [c.index for c in sdk.choices] == [0, 1]
    assert sdk.choices[0].logprobs is not None and sdk.choices[0].logprobs.content is not None
    entry = sdk.choices[0].logprobs.content[0]
    assert (entry.token, entry.logprob, entry.bytes) == (" Paris", -0.25, list(b" Paris"))
    assert entry.top_logprobs[1].bytes == [0xE2, 0x80]
    call = sdk.choices[1].message.tool_calls[0]  # type: ignore[index]
    assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
    assert sdk.choices[1].message.content is None and sdk.choices[1].finish_reason == "tool_calls"


def test_stream_chunks_with_tool_call_deltas_and_logprobs_parse_with_the_sdk() -> None:
    start = ToolCallDelta(index=0, id="call_x", type="function", function=ToolCallFunctionDelta(name="f", arguments=""))
    first = ChatCompletionChunk(id="c", model="m", choices=[ChatChunkChoice(index=2, delta=ChatDelta(
        tool_calls=[start]))])
    more = ChatCompletionChunk(id="c", model="m", choices=[ChatChunkChoice(index=2, delta=ChatDelta(tool_calls=[
        ToolCallDelta(index=0, function=ToolCallFunctionDelta(arguments='{"a"'))]), logprobs=ChoiceLogprobs(
        content=[LOGPROB]))])
    for chunk in (first, more):
        sdk = SDKChatCompletionChunk.model_validate(chunk.model_dump(mode="json", exclude_none=True))
        assert sdk.choices[0].index == 2 and sdk.choices[0].delta.tool_calls is not None
    sdk = SDKChatCompletionChunk.model_validate(more.model_dump(mode="json", exclude_none=True))
    assert sdk.choices[0].delta.tool_calls[0].function.arguments == '{"a"'  # type: ignore[index,union-attr]
    assert sdk.choices[0].logprobs.content[0].token == " Paris"  # type: ignore[union-attr,index]


def test_completion_logprobs_parse_with_the_sdk() -> None:
    body = Completion(id="cmpl-1", model="m", choices=[CompletionChoice(text=" Paris", finish_reason="length",
                                                                        logprobs=CompletionLogprobs(
        tokens=[" Paris"], token_logprobs=[-0.25], top_logprobs=[{" Paris": -0.25, " Rome": -2.0}], text_offset=[0]))])
    sdk = oai.Completion.model_validate(body.model_dump(mode="json"))
    assert sdk.choices[0].logprobs is not None and sdk.choices[0].logprobs.top_logprobs == [
        {" Paris": -0.25, " Rome": -2.0}]
