"""gateway.constraints: schemas are checked at the edge (a 400 naming the field), and a request's format and tools
become the head's ToolSet and the tail's constraint."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.constraints import chat_logprobs, chat_tools, check_choices, check_schema, constraint_for, tool_set
from schemas.constraint import JsonObjectConstraint, JsonSchemaConstraint, ToolCallConstraint
from schemas.errors import BadRequestError
from schemas.openai import ChatCompletionRequest
from schemas.tools import FunctionSpec

CITY = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
WEATHER = FunctionSpec(name="get_weather", parameters=CITY)
TIME = FunctionSpec(name="get_time", parameters={"type": "object", "properties": {"tz": {"type": "string"}}})


@pytest.mark.parametrize(("schema", "why"), [
    ({"type": "objekt"}, "invalid JSON Schema at type"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": -1}}}, "properties/a/maxLength"),
    ({"type": "object", "required": "a"}, "invalid JSON Schema at required"),
    ([{"type": "object"}], "must be an object"),
    ({"type": "integer", "minimum": 0}, "'minimum' cannot be enforced"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 2}}}, "'multipleOf'"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}, "'not'"),
    ({"$defs": {"x": {"type": "number", "exclusiveMaximum": 3}}, "$ref": "#/$defs/x"}, "'exclusiveMaximum'"),
])
def test_schemas_that_cannot_be_served_are_400s_naming_the_field(schema: Any, why: str) -> None:
    with pytest.raises(BadRequestError, match=why) as info:
        check_schema(schema, "response_format")
    assert info.value.param == "response_format" and info.value.status == 400


def test_keyword_names_as_property_names_are_fine() -> None:
    schema = {"type": "object", "properties": {"minimum": {"type": "integer"}, "not": {"type": "string"}},
              "required": ["minimum"]}
    assert check_schema(schema, "response_format") is schema


def test_a_tool_with_a_bad_schema_names_tools() -> None:
    with pytest.raises(BadRequestError) as info:
        tool_set([FunctionSpec(name="f", parameters={"type": 3})], "auto")
    assert info.value.param == "tools"


def test_tool_sets_follow_the_choice() -> None:
    assert tool_set([WEATHER], "none") is None and tool_set([], "auto") is None and tool_set(None, None) is None
    auto = tool_set([WEATHER, TIME], None)
    assert auto is not None and auto.mode == "auto" and auto.parallel
    named = tool_set([WEATHER, TIME], "function", function="get_time", parallel=False)
    assert named is not None and [t.name for t in named.callable_tools()] == ["get_time"] and not named.parallel
    with pytest.raises(BadRequestError) as info:
        tool_set([WEATHER], "function", function="nope")
    assert info.value.param == "tool_choice"


def test_chat_requests_give_tools_and_logprobs() -> None:
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4,
        "tools": [{"type": "function", "function": WEATHER.model_dump()}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    tools = chat_tools(req)
    assert tools is not None and tools.mode == "function" and tools.function == "get_weather"
    assert chat_logprobs(req) == 4
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                  "logprobs": True})
    assert chat_logprobs(plain) == 0 and chat_tools(plain) is None
    assert chat_logprobs(ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "x"}]})) is None


def test_constraints_for_formats_and_tools() -> None:
    assert constraint_for("text", None, None, None) is None
    assert constraint_for("json_object", None, None, None) == JsonObjectConstraint()
    assert constraint_for("json_schema", CITY, None, None) == JsonSchemaConstraint(json_schema=CITY)
    auto = tool_set([WEATHER], "auto")
    combined = constraint_for("json_schema", CITY, auto, "generic")
    assert isinstance(combined, ToolCallConstraint) and combined.response_schema == CITY
    assert combined.format == "generic" and combined.mode == "auto" and combined.tools == [WEATHER]
    hermes = constraint_for("text", None, tool_set([WEATHER], "required"), "hermes")
    assert isinstance(hermes, ToolCallConstraint) and hermes.format == "hermes" and hermes.response_schema is None
    for tools, fmt in ((tool_set([WEATHER], "required"), "generic"), (auto, "hermes")):
        with pytest.raises(BadRequestError) as info:
            constraint_for("json_object", None, tools, fmt)  # type: ignore[arg-type]
        assert info.value.param == "response_format"
    with pytest.raises(BadRequestError):
        constraint_for("json_schema", {"type": "integer", "maximum": 3}, None, None)


def test_n_over_what_a_route_holds_is_a_400_naming_n() -> None:
    check_choices(4, 4)
    check_choices(3, None)
    with pytest.raises(BadRequestError, match="n=5") as info:
        check_choices(5, 4)
    assert info.value.param == "n"
