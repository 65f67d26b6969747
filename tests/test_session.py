"""schemas.session: the issue #19 wire contract. Unused, the new fields leave every message byte for byte as it
was, so an old node reads a new gateway's messages and the other way round; used, they survive the NATS codec."""

from __future__ import annotations

from typing import Any

import msgpack

from bus import codec
from schemas.constraint import JsonSchemaConstraint, ToolCallConstraint
from schemas.node import LayerRange
from schemas.route import Hop, Route
from schemas.session import (
    ChoiceEnd,
    LogprobCandidate,
    Prompt,
    SamplingParams,
    SessionEnd,
    SessionOpen,
    SessionPhase,
    TokenEvent,
    TokenizeReply,
    TokenLogprobs,
)
from schemas.tools import FunctionSpec, ToolSet

ROUTE = Route(session_id="s", model_id="m", n_layers=2, hidden_shape=[4], context_length=64, hops=[
    Hop(node_id="a", endpoint="http://a", layers=LayerRange(start=0, end=2))])

# The keys each message had before issue #19 (git show bb5b02c:schemas/session.py), plus the ``type`` tag that
# issue #15 added to the two messages sharing the token subject (a deliberate protocol change: docs/protocol.md).
BEFORE: dict[str, set[str]] = {
    "SamplingParams": {"schema_version", "temperature", "top_p", "top_k", "min_p", "seed", "repeat_penalty",
                       "presence_penalty", "frequency_penalty", "penalty_last_n"},
    "Prompt": {"schema_version", "text", "messages", "add_generation_prompt"},
    "TokenizeReply": {"schema_version", "tokens"},
    "SessionOpen": {"schema_version", "session_id", "route", "hop_index", "prompt_tokens", "max_tokens", "sampling",
                    "stop", "ignore_eos", "prefill_chunk", "capability"},
    "TokenEvent": {"schema_version", "type", "session_id", "seq", "token", "text", "finish_reason", "hop_timings"},
    "SessionEnd": {"schema_version", "type", "session_id", "phase", "finish_reason", "failure", "prompt_tokens",
                   "completion_tokens"},
    "Route": {"schema_version", "session_id", "model_id", "n_layers", "hidden_shape", "context_length", "hops"},
}


def plain_messages() -> dict[str, Any]:
    return {"SamplingParams": SamplingParams(), "Prompt": Prompt(text="hi"), "TokenizeReply": TokenizeReply(tokens=[1]),
            "SessionOpen": SessionOpen(session_id="s", route=ROUTE, hop_index=0, prompt_tokens=[1], max_tokens=4),
            "TokenEvent": TokenEvent(session_id="s", seq=0, token=5, text="a"),
            "SessionEnd": SessionEnd(session_id="s", phase=SessionPhase.COMPLETE), "Route": ROUTE}


def test_unused_new_fields_leave_the_wire_as_it_was() -> None:
    for name, message in plain_messages().items():
        assert set(message.model_dump(mode="json")) == BEFORE[name], name
        # and so is what the NATS codec sends (it dumps with exclude_none=False)
        assert set(msgpack.unpackb(codec.encode(message))) == BEFORE[name], name
    dumped = plain_messages()["SessionOpen"].model_dump(mode="json")
    assert set(dumped["sampling"]) == BEFORE["SamplingParams"] and set(dumped["route"]) == BEFORE["Route"]


def test_old_messages_still_decode() -> None:
    old = {name: message.model_dump(mode="json") for name, message in plain_messages().items()}
    assert SessionOpen.model_validate(old["SessionOpen"]).n == 1
    event = TokenEvent.model_validate(old["TokenEvent"])
    assert event.index == 0 and event.logprobs is None
    assert SamplingParams.model_validate(old["SamplingParams"]).constraint is None
    assert SessionEnd.model_validate(old["SessionEnd"]).choices == []
    assert TokenizeReply.model_validate(old["TokenizeReply"]).tool_format is None


def test_new_fields_survive_the_nats_codec() -> None:
    lp = TokenLogprobs(token=5, logprob=-0.5, top=[LogprobCandidate(token=5, logprob=-0.5),
                                                   LogprobCandidate(token=9, logprob=-2.0)])
    event = TokenEvent(session_id="s", seq=3, token=5, text="a", index=2, logprobs=lp.with_bytes(lambda t: bytes([t])))
    back = codec.decode(codec.encode(event), TokenEvent)
    assert back == event and back.logprobs is not None and back.logprobs.top[1].bytes == [9]
    tools = ToolSet(tools=[FunctionSpec(name="f")], mode="required")
    sampling = SamplingParams(logprobs=5, constraint=ToolCallConstraint(**tools.model_dump(), format="hermes"))
    opened = SessionOpen(session_id="s", route=ROUTE.model_copy(update={"max_sessions": 4}), hop_index=0,
                         prompt_tokens=[1], max_tokens=4, sampling=sampling, n=3)
    back_open = SessionOpen.model_validate_json(opened.model_dump_json())
    assert back_open == opened and isinstance(back_open.sampling.constraint, ToolCallConstraint)
    assert back_open.route.max_sessions == 4
    schema = SamplingParams(constraint=JsonSchemaConstraint(json_schema={"type": "object"}))
    assert SamplingParams.model_validate(schema.model_dump(mode="json")).constraint == schema.constraint
    end = SessionEnd(session_id="s", phase=SessionPhase.COMPLETE, completion_tokens=7,
                     choices=[ChoiceEnd(index=0, finish_reason="stop", completion_tokens=3),
                              ChoiceEnd(index=1, finish_reason="length", completion_tokens=4)])
    assert codec.decode(codec.encode(end), SessionEnd) == end
    assert Prompt.model_validate(Prompt(messages=[], tools=tools).model_dump(mode="json")).tools == tools
