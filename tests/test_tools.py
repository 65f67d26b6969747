"""gateway.tools: tool calls parsed from reply text, whole and streamed, in both formats.

Streaming is checked against the whole parse by feeding the same reply in every chunking that matters (one
character at a time, and at random cut points), so a split escape, tag or key never changes the result.
"""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from gateway.tools import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedCall,
    ParsedReply,
    ReplyDelta,
    ToolCallParser,
    new_call_id,
    parse_reply,
)
from schemas.tools import ToolCallFormat


def counter() -> object:
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def stream(text: str, fmt: ToolCallFormat, cuts: list[int]) -> tuple[list[ReplyDelta], ParsedReply]:
    parser = ToolCallParser(fmt, new_id=counter())  # type: ignore[arg-type]
    deltas: list[ReplyDelta] = []
    for a, b in itertools.pairwise([0, *cuts, len(text)]):
        deltas += parser.feed(text[a:b])
    rest, reply = parser.finish()
    return deltas + rest, reply


def replay(deltas: list[ReplyDelta]) -> ParsedReply:
    """What a client accumulating the streamed deltas ends up with."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
        elif isinstance(d, CallStart):
            assert d.index == len(calls), "calls start in index order, once each"
            calls[d.index] = [d.id, d.name, ""]
        else:
            assert d.index in calls, "arguments only after their call's name"
            calls[d.index][2] += d.text
    parsed = [ParsedCall(i, n, a or "{}") for i, n, a in calls.values()]
    text = "".join(content)
    return ParsedReply(content=None if parsed and not text.strip() else text, tool_calls=parsed)


GENERIC_CASES = {
    "one call": ('{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}',
                 None, [("get_weather", {"city": "Paris", "unit": "c"})]),
    "parallel calls": ('{"tool_calls": [{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}, '
                       '{"name": "b", "arguments": {}}]}', None, [("a", {"x": [1, {"y": "}"}]}), ("b", {})]),
    "response": ('{"response": "Hi \\"there\\" \\u00e9\\ud83d\\ude00\\n ok"}', 'Hi "there" é😀\n ok', []),
    "response object": ('{"response": {"answer": 42}}', '{"answer": 42}', []),
    "arguments first": ('{"tool_call": {"arguments": {"q": "x"}, "name": "search"}}', None, [("search", {"q": "x"})]),
    "extra keys skipped": ('{"tool_calls": [{"id": "abcd", "name": "f", "arguments": {"n": -1.5e3}, "z": true}]}',
                           None, [("f", {"n": -1500.0})]),
    "not json": ("The weather is nice.", "The weather is nice.", []),
}


@pytest.mark.parametrize("name", list(GENERIC_CASES))
def test_generic_replies_parse_whole_and_streamed_alike(name: str) -> None:
    text, content, calls = GENERIC_CASES[name]
    whole = parse_reply(text, "generic", new_id=counter())  # type: ignore[arg-type]
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    assert [c.id for c in whole.tool_calls] == [f"call_{i}" for i in range(len(calls))]
    rng = random.Random(name)
    chunkings = [list(range(1, len(text))), [], *(sorted(rng.sample(range(1, len(text)), 5)) for _ in range(20))]
    for cuts in chunkings:
        deltas, reply = stream(text, "generic", cuts)
        assert reply == whole
        assert replay(deltas) == whole


HERMES_CASES = {
    "call only": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                  None, [("get_weather", {"city": "Paris"})]),
    "text then calls": ('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"s": "<tool_call>"}}\n</tool_call>'
                        '\n<tool_call>{"name": "b", "arguments": {}}</tool_call>',
                        "Let me check.", [("a", {"s": "<tool_call>"}), ("b", {})]),
    "plain text": ("No tools needed: 2 < 3 and <tool> is not a tag.", "No tools needed: 2 < 3 and <tool> is not a tag.",
                   []),
    "tag without a call": ("<tool_call> oops", "<tool_call> oops", []),
    "tag at the end": ("Hmm <tool_call>\n", "Hmm <tool_call>\n", []),
}


@pytest.mark.parametrize("name", list(HERMES_CASES))
def test_hermes_replies_parse_whole_and_streamed_alike(name: str) -> None:
    text, content, calls = HERMES_CASES[name]
    whole = parse_reply(text, "hermes", new_id=counter())  # type: ignore[arg-type]
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    rng = random.Random(name)
    for cuts in [list(range(1, len(text))), *(sorted(rng.sample(range(1, len(text)), 4)) for _ in range(20))]:
        deltas, reply = stream(text, "hermes", cuts)
        assert reply == whole
        assert replay(deltas) == whole
        # A prefix of the tag is never shown as text, nor the whitespace before a call.
        if calls:
            assert not any(isinstance(d, ContentDelta) and "<tool_c" in d.text for d in deltas)


def test_the_name_streams_before_the_arguments_and_arguments_stream_as_they_come() -> None:
    parser = ToolCallParser("generic", new_id=lambda: "call_x")
    assert parser.feed('{"tool_call": {"name": "get_wea') == []
    assert parser.feed('ther", "argu') == [CallStart(0, "call_x", "get_weather")]
    assert parser.feed('ments": {"city": "Pa') == [ArgumentsDelta(0, '{"city": "Pa')]
    assert parser.feed('ris"}}}') == [ArgumentsDelta(0, 'ris"}')]
    rest, reply = parser.finish()
    assert rest == [] and reply.tool_calls == [ParsedCall("call_x", "get_weather", '{"city": "Paris"}')]


def test_a_response_streams_decoded_text_holding_split_escapes() -> None:
    parser = ToolCallParser("generic")
    assert parser.feed('{"response": "caf') == [ContentDelta("caf")]
    assert parser.feed("\\u00") == []  # half an escape waits
    assert parser.feed("e9 \\ud83d") == [ContentDelta("é ")]  # half a surrogate pair waits
    assert parser.feed("\\ude00!\"}") == [ContentDelta("😀!")]
    assert parser.finish()[1] == ParsedReply(content="café 😀!", tool_calls=[])


def test_a_reply_cut_short_keeps_what_was_written() -> None:
    reply = parse_reply('{"tool_call": {"name": "f", "arguments": {"a": "unfinish', "generic")
    assert reply.content is None and len(reply.tool_calls) == 1
    assert reply.tool_calls[0].name == "f" and reply.tool_calls[0].arguments == '{"a": "unfinish'
    assert parse_reply('{"tool_call": {"na', "generic") == ParsedReply(content="", tool_calls=[])


def test_call_ids_look_like_openai_ids() -> None:
    made = {new_call_id() for _ in range(100)}
    assert len(made) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in made)


def test_streamed_deltas_and_whole_replies_in_chat_shapes_parse_with_the_sdk() -> None:
    from openai.types.chat import ChatCompletionChunk as SDKChunk
    from openai.types.chat import ChatCompletionMessage

    from gateway.tools import chat_delta, chat_message, finish_reason
    from schemas.openai import ChatChunkChoice, ChatCompletionChunk

    text = '{"tool_calls": [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]}'
    parser = ToolCallParser("generic")
    accumulated: dict[int, dict[str, str]] = {}
    for i in range(0, len(text), 5):
        delta = chat_delta(parser.feed(text[i:i + 5]))
        if delta is None:
            continue
        chunk = ChatCompletionChunk(id="c", model="m", choices=[ChatChunkChoice(delta=delta)])
        sdk = SDKChunk.model_validate(chunk.model_dump(mode="json", exclude_none=True))
        for call in sdk.choices[0].delta.tool_calls or []:  # how clients accumulate streamed calls
            slot = accumulated.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += call.id or ""
            slot["name"] += (call.function.name or "") if call.function else ""
            slot["arguments"] += (call.function.arguments or "") if call.function else ""
    rest, reply = parser.finish()
    assert chat_delta(rest) is None
    message = ChatCompletionMessage.model_validate(chat_message(reply).model_dump(mode="json"))
    assert message.content is None and message.tool_calls is not None
    assert [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
            for c in message.tool_calls] == [accumulated[0], accumulated[1]]
    assert finish_reason(True, "stop") == "tool_calls" and finish_reason(True, "length") == "length"
    assert finish_reason(False, "stop") == "stop"
    assert chat_message(parse_reply("plain", "generic")).tool_calls is None
