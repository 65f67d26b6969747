"""gateway/replies.py: what each choice's tokens turn into, streamed and whole (the end-to-end behaviour through real
nodes is tests/test_choices.py and tests/test_llamacpp_features.py); and the per-choice gap check of
``gateway.live_session.LiveSession``, whose events they consume."""

from __future__ import annotations

import json
from typing import Any

from gateway.live_session import LiveSession
from gateway.replies import Replies
from schemas.openai import ChatCompletionChunk, Completion
from schemas.session import ChoiceEnd, LogprobCandidate, SessionEnd, SessionPhase, TokenEvent, TokenLogprobs


def lp(token: int, text: str, logprob: float = -0.5) -> TokenLogprobs:
    return TokenLogprobs(token=token, logprob=logprob, bytes=list(text.encode()),
                         top=[LogprobCandidate(token=token, logprob=logprob, bytes=list(text.encode()))])


def event(index: int, seq: int, text: str, *, finish: Any = None, logprobs: bool = True) -> TokenEvent:
    return TokenEvent(session_id="s", seq=seq, token=100 + seq, text=text, finish_reason=finish, index=index,
                      logprobs=lp(100 + seq, text or "x") if logprobs else None)


def complete(n: int, tokens: int, finish: Any = "stop") -> SessionEnd:
    return SessionEnd(session_id="s", phase=SessionPhase.COMPLETE, finish_reason=finish, completion_tokens=n * tokens,
                      choices=[ChoiceEnd(index=i, finish_reason=finish, completion_tokens=tokens)
                               for i in range(n)] if n > 1 else [])


def test_chat_choices_stream_with_their_index_and_logprobs_ride_the_next_chunk() -> None:
    replies = Replies("chat", n=2, logprobs=True, tool_format=None, cid="c", model="m")
    assert not replies.plain
    opening = ChatCompletionChunk.model_validate(replies.opening())
    assert [(c.index, c.delta.role) for c in opening.choices] == [(0, "assistant"), (1, "assistant")]
    assert replies.token(event(1, 0, "")) is None  # held back (a stop string might start here): nothing yet
    body = replies.token(event(1, 1, "Hi"))
    assert body is not None
    chunk = ChatCompletionChunk.model_validate(replies.chunk([body]))
    choice = chunk.choices[0]
    assert choice.index == 1 and choice.delta.content == "Hi"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [e.token for e in choice.logprobs.content] == ["x", "Hi"]  # the held token's logprobs came along
    body0 = replies.token(event(0, 0, "Yo", finish="stop"))
    assert body0 is not None and body0["index"] == 0 and "finish_reason" not in body0
    closing = [ChatCompletionChunk.model_validate(replies.chunk([b])).choices[0]
               for b in replies.closing(complete(2, 2))]
    assert [(c.index, c.finish_reason) for c in closing] == [(0, "stop"), (1, "stop")]


def test_a_plain_request_takes_the_fast_path() -> None:
    assert Replies("chat", n=1, logprobs=False, tool_format=None, cid="c", model="m").plain
    assert not Replies("chat", n=1, logprobs=False, tool_format="generic", cid="c", model="m").plain


def test_streamed_tool_calls_and_their_finish_reason() -> None:
    replies = Replies("chat", n=1, logprobs=False, tool_format="generic", cid="c", model="m")
    text = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
    bodies = [b for i, piece in enumerate([text[:20], text[20:40], text[40:]])
              if (b := replies.token(event(0, i, piece, logprobs=False))) is not None]
    bodies += replies.closing(complete(1, 3))
    chunks = [ChatCompletionChunk.model_validate(replies.chunk([b])).choices[0] for b in bodies]
    calls = [d for c in chunks for d in c.delta.tool_calls or []]
    assert calls[0].id is not None and calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in calls)) == {"city": "Paris"}
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"]
    assert not any(c.delta.content for c in chunks)


def test_whole_chat_reply_parses_calls_and_keeps_logprobs_per_choice() -> None:
    replies = Replies("chat", n=2, logprobs=True, tool_format="generic", cid="c", model="m")
    replies.collect(event(0, 0, '{"response": "Hello"}', finish="stop"))
    replies.collect(event(1, 0, '{"tool_call": {"name": "f", "arguments": {}}}', finish="stop"))
    first, second = replies.chat_choices(complete(2, 1))
    assert first.message.content == "Hello" and first.finish_reason == "stop" and not first.message.tool_calls
    assert second.message.tool_calls is not None and second.message.tool_calls[0].function.name == "f"
    assert second.finish_reason == "tool_calls" and second.message.content is None
    assert first.logprobs is not None and first.logprobs.content is not None and len(first.logprobs.content) == 1


def test_completion_choices_echo_and_offsets() -> None:
    replies = Replies("completion", n=1, logprobs=True, tool_format=None, cid="c", model="m", prefix="Say:")
    opening = Completion.model_validate(replies.opening())
    assert opening.choices[0].text == "Say:"
    offsets: list[int] = []
    for i, piece in enumerate([" one", " two"]):
        body = replies.token(event(0, i, piece))
        assert body is not None
        offsets += Completion.model_validate(replies.chunk([body])).choices[0].logprobs.text_offset  # type: ignore[union-attr]
    assert offsets == [4, 8]
    replies.collect(event(0, 0, " one"))
    whole = replies.completion_choices(complete(1, 1))[0]
    assert whole.text == "Say: one" and whole.logprobs is not None and whole.logprobs.text_offset == [4]


def test_a_gap_is_found_per_choice() -> None:
    session = LiveSession(None, "s")  # type: ignore[arg-type]  # the links are not used by _absorb
    session.n, session.seen = 2, [0, 0]
    assert session._absorb(event(0, 0, "a")) is not None
    assert session._absorb(event(1, 0, "b")) is not None
    assert session._absorb(event(1, 1, "c")) is not None
    assert session.seen == [1, 2] and session.end is None
    lost = session._absorb(event(0, 2, "d"))  # choice 0's token 1 never came
    assert isinstance(lost, SessionEnd) and lost.phase is SessionPhase.FAILED
    assert lost.failure is not None and "token 1 of choice 0" in lost.failure.message
    # A complete end whose per-choice count disagrees reveals a lost last token.
    session = LiveSession(None, "t")  # type: ignore[arg-type]
    session.n, session.seen = 2, [0, 0]
    session._absorb(event(0, 0, "a"))
    session._absorb(event(1, 0, "b"))
    end = SessionEnd(session_id="t", phase=SessionPhase.COMPLETE, finish_reason="stop", completion_tokens=2,
                     choices=[ChoiceEnd(index=0, completion_tokens=2), ChoiceEnd(index=1, completion_tokens=0)])
    lost_end = session._absorb(end)
    assert isinstance(lost_end, SessionEnd) and lost_end.phase is SessionPhase.FAILED
    assert lost_end.failure is not None and "choice 0" in lost_end.failure.message
