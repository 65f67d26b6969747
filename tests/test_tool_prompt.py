"""Tools in the prompt: the generic fallback (through Google's Gemma template, which the bundled model uses) and
native hermes rendering (through a template in the style of Qwen 2.5's), with tool calls and results in the history.
"""

from __future__ import annotations

import json

import pytest

from actors.backends.llamacpp.chat_template import select_template
from actors.backends.llamacpp.tool_prompt import generic_messages, instructions
from gateway.tools import parse_reply
from schemas.errors import BadRequestError
from schemas.tools import FunctionSpec, ToolSet

WEATHER = FunctionSpec(name="get_weather", description="Weather in a city", parameters={
    "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}})
TIME = FunctionSpec(name="get_time", parameters={"type": "object", "properties": {"tz": {"type": "string"}}})

HISTORY: list[dict[str, object]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24 C, cloudy"},
]

# A Hermes-style template written for this test, in the manner of Qwen 2.5's: tools in the system turn,
# <tool_call> blocks with the arguments object, tool results as <tool_response> in a user turn.
HERMES = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def gemma() -> object:
    template = select_template(None, "gemma3", bos_token="<bos>")
    assert template is not None
    return template


def test_templates_choose_their_tool_format() -> None:
    gemma_template = select_template(None, "gemma3")
    hermes = select_template(HERMES, "qwen2")
    plain = select_template("{% for m in messages %}{{ m.content }}{% endfor %}", "llama")
    assert gemma_template is not None and hermes is not None and plain is not None
    assert (gemma_template.tool_format, hermes.tool_format, plain.tool_format) == ("generic", "hermes", "generic")


@pytest.mark.parametrize(("mode", "function", "parallel", "expect", "absent"), [
    ("auto", None, False, ['{"tool_call": {"name"', '{"response": '], ['"tool_calls"']),
    ("required", None, True, ['{"tool_calls": [', "Call one of the functions"], ['"response"']),
    ("function", "get_time", False, ["Call the function get_time"], ['"response"', "get_weather"]),
])
def test_generic_instructions_follow_the_choice(mode: str, function: str | None, parallel: bool,
                                                expect: list[str], absent: list[str]) -> None:
    text = instructions(ToolSet(tools=[WEATHER, TIME], mode=mode, function=function, parallel=parallel))  # type: ignore[arg-type]
    assert all(e in text for e in expect) and not any(a in text for a in absent)
    specs = json.loads(text.splitlines()[1])  # the functions, as JSON, on the line after the heading
    assert {s["name"] for s in specs} == ({"get_time"} if function else {"get_weather", "get_time"})


def test_generic_history_renders_through_a_strictly_alternating_template() -> None:
    # Gemma's template refuses anything but user/model turns in alternation: tool calls become the model's JSON
    # reply and the two results one user turn, and the tool instructions join the system text in the first turn.
    template = select_template(None, "gemma3", bos_token="<bos>")
    assert template is not None
    text = template.render(HISTORY, tools=ToolSet(tools=[WEATHER]))
    turns = text.split("<start_of_turn>")[1:]
    assert [t.split("\n", 1)[0] for t in turns] == ["user", "model", "user", "model"]
    assert turns[0].startswith("user\nYou are terse.\n\nYou can call these functions")
    assert "Weather in Paris" in turns[0]
    call_turn = turns[1].split("\n", 1)[1].removesuffix("<end_of_turn>\n")
    # The earlier calls are written the way the model is asked to write them, and parse back into the same calls.
    calls = parse_reply(call_turn, "generic").tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                 ("get_weather", {"city": "Rome"})]
    assert "Result of get_weather (call_1):\n18 C, sunny" in turns[2] and "24 C, cloudy" in turns[2]
    assert turns[3] == "model\n"


def test_tool_results_alone_render_without_tools() -> None:
    # The next turn of a conversation may come without tools (tool_choice none): the history still renders.
    template = select_template(None, "gemma3", bos_token="<bos>")
    assert template is not None
    text = template.render(HISTORY)
    assert "You can call these functions" not in text and "Result of get_weather (call_2)" in text


def test_hermes_templates_render_tools_and_history_natively() -> None:
    template = select_template(HERMES, "qwen2")
    assert template is not None
    text = template.render(HISTORY, tools=ToolSet(tools=[WEATHER]))
    assert '<tools>{"type": "function", "function": {"name": "get_weather"' in text  # trim_blocks ate the \n
    # Arguments go to the template as an object, so tojson writes JSON once, not a JSON string of JSON.
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert text.count("<tool_response>") == 2 and text.endswith("<|im_start|>assistant")
    assert "You can call these functions" not in text  # no generic fallback text


@pytest.mark.parametrize(("message", "why"), [
    ({"role": "assistant", "tool_calls": [{"id": "x", "function": {"arguments": "{}"}}]}, "function.name"),
    ({"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "{oops"}}]}, "not JSON"),
    ({"role": "assistant", "tool_calls": "f"}, "must be a list"),
])
def test_malformed_tool_calls_in_the_history_are_400s_naming_messages(message: dict[str, object], why: str) -> None:
    with pytest.raises(BadRequestError, match=why) as info:
        generic_messages([{"role": "user", "content": "hi"}, message], None)
    assert info.value.param == "messages"
