"""Reasoning apart from the answer (issue #27): a think block becomes ``reasoning_content`` and Responses
``reasoning`` items, under llama-server's ``reasoning_format`` choices; a template without think markers is unchanged.

The parser and the replies are checked on their own (every way of cutting a reply into tokens, tool calls after the
block, the formats), the head's detection on templates alone, and the whole path on the bundled Gemma served by
llama.cpp with a synthetic template that marks reasoning (a few-shot history makes the greedy model write a block
and close it; ``</think>`` is three tokens of its vocabulary), through the official ``openai`` client: chat and
Responses replies, a background response replayed and resumed, and a ``response_format`` enforced after the block
(on one node, and by the tail of a two-node route). The torch head's side is in tests/test_torch_route.py, the
grammar's on its own in tests/test_grammar.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, get_args

import jsonschema
import openai
import pytest
import pytest_asyncio
from openai import omit
from openai._streaming import SSEDecoder
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import ValidationError

from actors.backends.llamacpp.chat_template import GEMMA_TEMPLATE, ChatTemplate
from gateway.reasoning import ReasoningDelta, ReasoningParser, split_reply, splits
from gateway.replies import Replies
from gateway.responses import ResponseBuilder, chat_messages, sse_event
from gateway.tools import ContentDelta
from schemas.openai import ChatCompletionRequest
from schemas.openai_responses import ResponseEvent, ResponsesRequest
from schemas.reasoning import ReasoningStart, reasoning_start
from schemas.session import ChoiceEnd, SessionEnd, SessionPhase, TokenEvent

SDK_EVENTS: dict[str, type[Any]] = {get_args(m.model_fields["type"].annotation)[0]: m
                                    for m in get_args(get_args(ResponseStreamEvent)[0])}

# ---- the head: where a reply starts, from the template and the prompt's end ---------------------------------------

R1_TEMPLATE = (  # DeepSeek-R1-distill style: the generation prompt opens the block; history drops earlier blocks
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}{% set c = m['content'] %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<｜Assistant｜>{{ c }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
QWEN3_TEMPLATE = (  # Qwen 3 style: earlier reasoning shown from reasoning_content; the model opens its block itself
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize(("source", "expected"), [(R1_TEMPLATE, "open"), (QWEN3_TEMPLATE, "closed"),
                                                  (GEMMA_TEMPLATE, None)])
def test_the_head_reads_where_a_reply_starts_from_the_template_and_the_prompt(source: str,
                                                                              expected: ReasoningStart | None) -> None:
    template = ChatTemplate(source, "test", bos_token="<bos>")
    prompt = template.render([{"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello"},
                              {"role": "user", "content": "Bye"}])
    assert reasoning_start(source, prompt[-64:]) == expected
    # A prompt that ends with a block already closed (a prefilled answer) starts outside one.
    if expected is not None:
        assert reasoning_start(source, prompt + "done\n</think>\n\n") == "closed"


# ---- the parser: every cut of a reply into tokens streams what the whole reply holds -----------------------------

REPLIES: list[tuple[ReasoningStart, str, str | None, str]] = [
    ("open", "I add 3 and 4.\n</think>\n\n7", "I add 3 and 4.", "7"),
    ("closed", "\n<think>\n  I add.  \n</think>\n\nSeven.\n", "I add.", "Seven.\n"),
    ("closed", "Seven. <think>not a block</think>", None, "Seven. <think>not a block</think>"),  # later tags: text
    ("open", "cut off by max_tokens </thi", "cut off by max_tokens </thi", ""),  # unterminated, a partial tag
    ("closed", "  <thi", None, "  <thi"),  # a tag's beginning that never completed is text
    ("open", "\n</think>\n\nNo thoughts.", None, "No thoughts."),  # an empty block is no reasoning
    ("closed", "<think>a < b </ c </think> d", "a < b </ c", "d"),  # pieces of tags inside the block
]


def streamed(start: ReasoningStart, pieces: list[str]) -> tuple[str | None, str]:
    parser = ReasoningParser(start)
    thought: list[str] = []
    answer: list[str] = []
    for piece in pieces:
        r, a = parser.feed(piece)
        thought.append(r)
        answer.append(a)
    r, a = parser.finish()
    joined = "".join(thought) + r
    return (joined if parser.opened and joined else None), "".join(answer) + a


@pytest.mark.parametrize(("start", "text", "reasoning", "answer"), REPLIES)
def test_every_cut_into_tokens_streams_the_whole_replys_reasoning_and_answer(
        start: ReasoningStart, text: str, reasoning: str | None, answer: str) -> None:
    assert split_reply(text, start) == (reasoning, answer)
    for a, b in itertools.combinations(range(1, len(text)), 2):  # every cut into three tokens
        assert streamed(start, [text[:a], text[a:b], text[b:]]) == (reasoning, answer), (a, b)
    assert streamed(start, list(text)) == (reasoning, answer)  # a character per token


def test_a_stream_releases_reasoning_before_the_block_closes() -> None:
    parser = ReasoningParser("open")
    assert parser.feed("Let me see") == ("Let me see", "")
    assert parser.feed(" now </th") == (" now", "")  # the partial tag and the whitespace before it wait
    assert parser.feed("ink>\n\nIt is") == ("", "It is")
    assert parser.finish() == ("", "")


def test_formats_choose_whether_a_reply_is_split() -> None:
    assert splits("auto", "open", streamed=True) and splits("deepseek", "closed", streamed=False)
    assert not splits("none", "open", streamed=False)
    assert splits("deepseek-legacy", "open", streamed=False) and not splits("deepseek-legacy", "open", streamed=True)
    assert not splits("auto", None, streamed=True)  # a template without think markers: plain text


# ---- chat replies: deltas and messages -----------------------------------------------------------------------------

def _events(pieces: list[str], finish: str = "stop") -> list[TokenEvent]:
    return [TokenEvent(session_id="s", seq=i, token=i, text=p,
                       finish_reason=finish if i == len(pieces) - 1 else None)  # type: ignore[arg-type]
            for i, p in enumerate(pieces)]


def _end(n: int, finish: str = "stop") -> SessionEnd:
    return SessionEnd(session_id="s", phase=SessionPhase.COMPLETE, finish_reason=finish,  # type: ignore[arg-type]
                      completion_tokens=n, choices=[ChoiceEnd(index=0, finish_reason=finish,  # type: ignore[arg-type]
                                                              completion_tokens=n)])


def _stream(replies: Replies, pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    deltas = [body["delta"] for body in (replies.token(e) for e in _events(pieces, finish)) if body is not None]
    return deltas + [b["delta"] for b in replies.closing(_end(len(pieces), finish))]


def _whole(replies: Replies, pieces: list[str], finish: str = "stop") -> dict[str, Any]:
    for event in _events(pieces, finish):
        replies.collect(event)
    return replies.chat_choices(_end(len(pieces), finish))[0].model_dump(mode="json")


def _replies(start: ReasoningStart | None, **kw: Any) -> Replies:
    return Replies("chat", n=1, logprobs=False, tool_format=kw.pop("tool_format", None), cid="c", model="m",
                   reasoning=start, **kw)


HERMES_REPLY = ["Weather", " is asked.", "\n</", "think", ">\n\n", "<tool_call>", '{"name": "get_weather", ',
                '"arguments": {"city": "Paris"}}', "</tool_call>"]


def test_tool_calls_after_reasoning_stream_as_calls_and_the_reasoning_as_reasoning_content() -> None:
    deltas = _stream(_replies("open", tool_format="hermes"), HERMES_REPLY)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather is asked."
    assert not any(d.get("content") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert all("reasoning_content" not in d for d in deltas[first_call:])  # the block came first
    whole = _whole(_replies("open", tool_format="hermes"), HERMES_REPLY)
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["reasoning_content"] == "Weather is asked." and whole["message"]["content"] is None
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_deepseek_legacy_keeps_the_block_inline_in_a_whole_reply_and_adds_reasoning_content() -> None:
    pieces = ["Four", ".\n</", "think>", "\n\n4"]
    whole = _whole(_replies("open", inline_reasoning=True), pieces)
    assert whole["message"]["content"] == "Four.\n</think>\n\n4" and whole["message"]["reasoning_content"] == "Four."
    plain = _whole(_replies("open"), pieces)
    assert plain["message"]["content"] == "4" and plain["message"]["reasoning_content"] == "Four."


def test_a_template_without_markers_leaves_replies_as_they_were() -> None:
    pieces = ["<think>", "x</think>", " y"]
    assert _replies(None).plain  # the fast path stays
    whole = _whole(_replies(None), pieces)
    assert whole["message"] == {"role": "assistant", "content": "<think>x</think> y", "tool_calls": None}
    assert "".join(d.get("content", "") for d in _stream(_replies(None), pieces)) == "<think>x</think> y"


def test_an_unterminated_block_at_max_tokens_is_all_reasoning() -> None:
    pieces = ["Hmm, ", "let me", " think </", "thi"]
    deltas = _stream(_replies("open"), pieces, finish="length")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Hmm, let me think </thi"
    assert not any(d.get("content") for d in deltas)
    whole = _whole(_replies("open"), pieces, finish="length")
    assert whole["finish_reason"] == "length" and whole["message"]["reasoning_content"] == "Hmm, let me think </thi"


def test_requests_take_llama_servers_fields_and_refuse_other_values() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": "ok", "reasoning_content": "hm"},
                                       {"role": "user", "content": "more"}]}
    req = ChatCompletionRequest.model_validate({**base, "reasoning_format": "deepseek-legacy"})
    assert req.reasoning_format == "deepseek-legacy" and req.messages[1].reasoning_content == "hm"
    for bad in ({"reasoning_format": "deepseek2"}, {"reasoning_format": True}):
        with pytest.raises(ValidationError) as err:
            ChatCompletionRequest.model_validate({**base, **bad})
        assert err.value.errors()[0]["loc"][0] == "reasoning_format"


# ---- Responses: a reasoning item first, as the SDK reads it ---------------------------------------------------------

def through_the_sdk(events: list[ResponseEvent]) -> tuple[list[Any], SDKResponse | None]:
    wire = b"".join(sse_event(e) for e in events)
    decoded = [SDK_EVENTS[sse.event or ""].model_validate(sse.json()) for sse in SSEDecoder().iter_bytes(iter([wire]))]
    assert [e.sequence_number for e in decoded] == list(range(len(events)))
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[], text_format=omit)
    for event in decoded:
        state.handle_event(event)
    return decoded, state._completed_response  # noqa: SLF001 - what the SDK's stream helper returns at the end


def test_a_responses_reply_streams_its_block_as_a_reasoning_item_before_the_message() -> None:
    builder = ResponseBuilder(ResponsesRequest.model_validate({"model": "m", "input": "hi"}))
    parser = ReasoningParser("open")
    events = builder.start()
    for piece in ["Seven", " it is.", "\n</think", ">\n\nIt is ", "7."]:
        thought, text = parser.feed(piece)
        events += builder.feed(([ReasoningDelta(thought)] if thought else []) + ([ContentDelta(text)] if text else []))
    events += builder.finish("stop", input_tokens=3, output_tokens=5)
    decoded, final = through_the_sdk(events)
    assert final is not None and final.status == "completed"
    assert [o.type for o in final.output] == ["reasoning", "message"]
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [c.text for c in reasoning.content] == ["Seven it is."] and reasoning.status == "completed"
    assert final.output_text == "It is 7."
    kinds = [e.type for e in decoded]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.content_part.added")
    assert "".join(e.delta for e in decoded if e.type == "response.reasoning_text.delta") == "Seven it is."


def test_a_reasoning_item_sent_back_is_the_next_assistant_turns_reasoning_content() -> None:
    req = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}],
         "status": "completed"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        {"role": "user", "content": "more"}]})
    assert chat_messages(req) == [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "Hello", "reasoning_content": "hm"},
                                  {"role": "user", "content": "more"}]


# ---- the real route: the bundled Gemma, llama.cpp, a synthetic template, the official client -----------------------

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backends import load_backend  # noqa: E402
from actors.backends.llamacpp.backend import LlamaCppBackend  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from tests.support.swarm import Swarm, make_settings, start_swarm  # noqa: E402

MODEL = "gemma-think"


def think_template(generation_opens_block: bool) -> str:
    """Gemma's turns, with an assistant turn's ``reasoning_content`` shown as a think block (as Qwen 3's template
    does); the generation prompt opens a block (as DeepSeek-R1 distills' does) or leaves it to the model."""
    opening = "<think>{{ '\\n' }}" if generation_opens_block else ""
    return ("{{ bos_token }}{% for m in messages %}"
            "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}{{ '\\n' }}"
            "{% if m.get('reasoning_content') %}<think>{{ '\\n' + m['reasoning_content'] + '\\n' }}</think>"
            "{{ '\\n\\n' }}{% endif %}{{ m['content'] }}<end_of_turn>{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model{{ '\\n' }}" + opening + "{% endif %}")


SHOTS: list[Any] = [
    {"role": "user", "content": "Q: What is 1 + 1?"},
    {"role": "assistant", "content": "2", "reasoning_content": "1 plus 1 makes 2."},
    {"role": "user", "content": "Q: What is 2 + 3?"},
    {"role": "assistant", "content": "5", "reasoning_content": "2 plus 3 makes 5."},
    {"role": "user", "content": "Q: What is 3 + 4?"}]
N = 24



@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def think_swarm(module_nats: EmbeddedNats, gemma_path: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    # One thread: on a 2-core machine under a load of ~20, two llama.cpp threads were seen to stall a session for
    # minutes (the node then frees it as idle), on main as well.
    backend = load_backend("llamacpp", model_path=gemma_path, n_ctx=1024, max_sessions=2, threads=1)
    settings = make_settings(module_nats.url, tmp_path_factory.mktemp("think") / "home", namespace="think",
                             token_timeout_s=60.0, first_token_timeout_s=120.0, hop_timeout_s=60.0)
    swarm = await start_swarm(settings, [backend], model_id=MODEL)
    yield swarm
    await swarm.stop()
    backend.close()


def use_template(swarm: Swarm, source: str | None) -> None:
    """The head's template for the next requests: a synthetic one, or (``None``) Gemma's own fallback."""
    backend = swarm.nodes[0].backend
    assert isinstance(backend, LlamaCppBackend)
    text = backend._text  # noqa: SLF001 - the head's template is the collaborator this test swaps
    assert text.template is not None
    text.template = dataclasses.replace(text.template, source=source or GEMMA_TEMPLATE, origin="test")


def client(swarm: Swarm) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=300)


def extra(obj: Any, key: str) -> Any:
    return (obj.model_extra or {}).get(key)


async def chat(swarm: Swarm, fmt: str | None = None, *, max_tokens: int = N) -> tuple[str | None, str | None, str]:
    body = {"reasoning_format": fmt} if fmt else {}
    reply = await client(swarm).chat.completions.create(model=MODEL, messages=SHOTS, max_tokens=max_tokens,
                                                        temperature=0, extra_body=body)
    choice = reply.choices[0]
    return extra(choice.message, "reasoning_content"), choice.message.content, choice.finish_reason


async def chat_stream(swarm: Swarm, fmt: str | None = None, *, max_tokens: int = N) -> tuple[str, str, list[Any]]:
    body = {"reasoning_format": fmt} if fmt else {}
    stream = await client(swarm).chat.completions.create(model=MODEL, messages=SHOTS, max_tokens=max_tokens,
                                                         temperature=0, stream=True, extra_body=body)
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    return ("".join(extra(d, "reasoning_content") or "" for d in deltas),
            "".join(d.content or "" for d in deltas), deltas)


def split_at_close(raw: str) -> tuple[str, str]:
    """The reasoning and answer of an unparsed reply, by the tag: what the parser must have made of it."""
    before, tag, after = raw.partition("</think>")
    assert tag, f"the model closed no block: {raw!r}"
    return before.strip().removeprefix("<think>").strip(), after.lstrip()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("opens", [True, False], ids=["prompt-opens-the-block", "model-opens-the-block"])
async def test_a_think_block_comes_back_as_reasoning_content_streamed_and_not(think_swarm: Swarm,
                                                                              opens: bool) -> None:
    use_template(think_swarm, think_template(opens))
    _, raw, finish = await chat(think_swarm, "none")  # llama-server's none: the reply as the model wrote it
    assert raw is not None and raw.lstrip().startswith("<think>") != opens
    reasoning, answer = split_at_close(raw)
    assert reasoning and answer
    assert await chat(think_swarm) == (reasoning, answer, finish)  # the server's default: auto
    assert await chat(think_swarm, "deepseek") == (reasoning, answer, finish)
    streamed_reasoning, streamed_answer, deltas = await chat_stream(think_swarm)
    assert (streamed_reasoning, streamed_answer) == (reasoning, answer)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not extra(d, "reasoning_content") for d in deltas[first_content:])
    # deepseek-legacy: the block inline, and beside it in a whole reply; a stream leaves it inline.
    assert await chat(think_swarm, "deepseek-legacy") == (reasoning, raw, finish)
    legacy_reasoning, legacy_content, _ = await chat_stream(think_swarm, "deepseek-legacy")
    assert (legacy_reasoning, legacy_content) == ("", raw)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_block_cut_by_max_tokens_is_all_reasoning(think_swarm: Swarm) -> None:
    use_template(think_swarm, think_template(True))
    _, raw, _ = await chat(think_swarm, "none", max_tokens=4)
    assert raw is not None and "</think>" not in raw
    assert await chat(think_swarm, max_tokens=4) == (raw.strip(), "", "length")
    reasoning, content, _ = await chat_stream(think_swarm, max_tokens=4)
    assert (reasoning, content) == (raw.strip(), "")


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_template_without_think_markers_is_unchanged(think_swarm: Swarm) -> None:
    use_template(think_swarm, None)
    question: list[Any] = [{"role": "user", "content": "Write <think> and </think> twice."}]
    whole = await client(think_swarm).chat.completions.create(model=MODEL, messages=question, max_tokens=N,
                                                              temperature=0)
    raw = await client(think_swarm).chat.completions.create(model=MODEL, messages=question, max_tokens=N,
                                                            temperature=0, extra_body={"reasoning_format": "none"})
    assert whole.choices[0].message.content == raw.choices[0].message.content
    assert "reasoning_content" not in whole.choices[0].message.to_dict()
    stream = await client(think_swarm).chat.completions.create(model=MODEL, messages=question, max_tokens=N,
                                                               temperature=0, stream=True)
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert not any("reasoning_content" in d.to_dict() for d in deltas)


def responses_history() -> list[Any]:
    """The few-shot history as Responses input: reasoning items before the assistant messages."""
    history: list[Any] = []
    for m in SHOTS:
        if m.get("reasoning_content"):
            history.append({"type": "reasoning", "id": f"rs_{len(history)}", "summary": [],
                            "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
        history.append({"role": m["role"], "content": m["content"]})
    return history


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_responses_return_the_block_as_a_reasoning_item(think_swarm: Swarm) -> None:
    use_template(think_swarm, think_template(True))
    reasoning, answer, _ = await chat(think_swarm)
    history = responses_history()
    stream = await client(think_swarm).responses.create(model=MODEL, input=history, max_output_tokens=N,
                                                        temperature=0, stream=True)
    events = [event async for event in stream]
    assert events[-1].type == "response.incomplete"  # cut by max_output_tokens, as the chat reply was
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert [o.type for o in final.output] == ["reasoning", "message"]
    item = final.output[0]
    assert item.type == "reasoning" and [c.text for c in item.content or []] == [reasoning]
    assert final.output_text == answer
    whole = await client(think_swarm).responses.create(model=MODEL, input=history, max_output_tokens=N,
                                                       temperature=0)
    assert [o.type for o in whole.output] == ["reasoning", "message"] and whole.output_text == answer


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_background_response_replays_and_resumes_its_block_as_the_reasoning_item(think_swarm: Swarm) -> None:
    use_template(think_swarm, think_template(True))
    reasoning, answer, _ = await chat(think_swarm)
    sdk = client(think_swarm)
    created = await sdk.responses.create(model=MODEL, input=responses_history(), max_output_tokens=N,
                                         temperature=0, background=True)
    await think_swarm.freed(timeout=120)  # it ran to its end with nobody reading
    whole = [event async for event in await sdk.responses.retrieve(created.id, stream=True)]
    assert "".join(e.delta for e in whole if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in whole if e.type == "response.output_text.delta") == answer
    final = whole[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert [c.text for c in final.output[0].content or []] == [reasoning] and final.output_text == answer
    # Resumed inside the block: every later event once, the reasoning item's own included.
    n = next(i for i, e in enumerate(whole) if e.type == "response.reasoning_text.delta")
    rest = [event async for event in await sdk.responses.retrieve(created.id, stream=True, starting_after=n)]
    assert [e.model_dump() for e in rest] == [e.model_dump() for e in whole[n + 1:]]
    assert any(e.type == "response.reasoning_text.done" and e.text == reasoning for e in rest)
    stored = await sdk.responses.retrieve(created.id)
    assert stored.model_dump() == final.model_dump()


ANSWER_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"answer": {"type": "integer"}},
                                 "required": ["answer"], "additionalProperties": False}


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_json_schema_constrains_the_answer_after_the_block(think_swarm: Swarm) -> None:
    use_template(think_swarm, think_template(True))
    reasoning, _, _ = await chat(think_swarm)  # free: the block the greedy model writes, and closes
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
    reply = await client(think_swarm).chat.completions.create(model=MODEL, messages=SHOTS, max_tokens=64,
                                                              temperature=0, response_format=fmt)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    # The block is the same as unconstrained (greedy, and the grammar leaves it free); the answer is the schema's.
    assert extra(choice.message, "reasoning_content") == reasoning
    assert choice.message.content is not None
    jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)
    stream = await client(think_swarm).chat.completions.create(model=MODEL, messages=SHOTS, max_tokens=64,
                                                               temperature=0, response_format=fmt, stream=True)
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    assert "".join(extra(d, "reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == choice.message.content
    # json_object likewise.
    whole = await client(think_swarm).chat.completions.create(model=MODEL, messages=SHOTS, max_tokens=64,
                                                              temperature=0, response_format={"type": "json_object"})
    assert extra(whole.choices[0].message, "reasoning_content") == reasoning
    assert isinstance(json.loads(whole.choices[0].message.content or ""), dict)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_the_tail_of_a_two_node_route_constrains_after_the_block_too(
        think_swarm: Swarm, module_nats: EmbeddedNats, gemma_path: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # The head, which reads the prompt, tells the tail on another node where the reply starts.
    use_template(think_swarm, think_template(True))
    reasoning, _, _ = await chat(think_swarm)
    shard_dir = tmp_path_factory.mktemp("think-shards")
    backends = [load_backend("llamacpp", model_path=gemma_path, n_ctx=1024, max_sessions=2, threads=1,
                             layer_start=a, layer_end=b, shard_dir=shard_dir) for a, b in ((0, 9), (9, 18))]
    settings = make_settings(module_nats.url, tmp_path_factory.mktemp("think2") / "home", namespace="think2",
                             token_timeout_s=60.0, first_token_timeout_s=120.0, hop_timeout_s=60.0)
    swarm = await start_swarm(settings, backends, model_id=MODEL)
    try:
        use_template(swarm, think_template(True))
        reply = await client(swarm).chat.completions.create(
            model=MODEL, messages=SHOTS, max_tokens=64, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}})
        message = reply.choices[0].message
        assert [h["node_id"] for h in (reply.model_extra or {})["swarmroute"]["route"]] == ["n1", "n2"]
        assert extra(message, "reasoning_content") == reasoning
        jsonschema.validate(json.loads(message.content or ""), ANSWER_SCHEMA)
    finally:
        await swarm.stop()
        for b in backends:
            b.close()
