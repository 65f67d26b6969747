"""gateway.messages: a chat history with tool calls and results reaches the head intact and renders."""

from __future__ import annotations

import json

import pytest

from actors.backends.llamacpp.chat_template import select_template
from gateway.messages import head_messages
from schemas.errors import BadRequestError
from schemas.openai import ChatCompletionRequest


def test_a_tool_result_round_trips_into_the_next_turn() -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]}]})
    messages = head_messages(req.messages)
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}
    assert json.loads(json.dumps(messages)) == messages  # what Prompt carries over HTTP
    template = select_template(None, "gemma3", bos_token="<bos>")
    assert template is not None
    text = template.render(messages)
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in text
    assert "Result of get_weather (call_1):\n18 C" in text


def test_non_text_content_is_a_400_naming_messages() -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(BadRequestError) as info:
        head_messages(req.messages)
    assert info.value.param == "messages"
