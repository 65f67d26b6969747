"""The choices of one chat or text completion as they arrive token by token: streamed chunks and whole replies.

One ``ChoiceReply`` per choice (n > 1 interleaves them; ``TokenEvent.index`` says whose a token is) holds what that
choice needs and nothing more: a tool-call parser when the request had tools (the reply's text becomes
``delta.tool_calls``), the logprobs of tokens whose text has not been sent yet when logprobs were asked for (text
can be held back by a stop string or an incomplete call; its logprobs ride the next chunk that goes out), and, for a
whole reply, the text and logprobs so far. For a model whose template marks reasoning, a reasoning parser in front
of all that splits the think block off (``gateway.reasoning``: it becomes ``reasoning_content``). A plain request's
tokens skip all of it (``Replies.plain``: the serving loop splices the text into a pre-rendered chunk).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Literal

from gateway.logprobs import chat_logprobs, completion_logprobs
from gateway.reasoning import ReasoningParser, split_reply
from gateway.tools import ToolCallParser, chat_delta, chat_message, finish_reason, parse_reply
from schemas.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
)
from schemas.reasoning import ReasoningStart
from schemas.session import FinishReason, SessionEnd, TokenEvent, TokenLogprobs
from schemas.tools import ToolCallFormat

Kind = Literal["chat", "completion"]


@dataclasses.dataclass(slots=True, eq=False)
class ChoiceReply:
    index: int
    parser: ToolCallParser | None = None
    thinker: ReasoningParser | None = None
    """Splits the think block off the reply's text, ahead of ``parser``."""
    pending: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    """Logprobs of tokens whose text has not gone out yet."""
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    offset: int = 0
    """Completions: where the next token's text starts in this choice's text (``text_offset``)."""
    has_calls: bool = False


class Replies:
    """Every choice of one request. ``kind`` picks the shapes (chat chunks and messages, or completion choices)."""

    def __init__(self, kind: Kind, *, n: int, logprobs: bool, tool_format: ToolCallFormat | None,
                 cid: str, model: str, prefix: str = "", reasoning: ReasoningStart | None = None,
                 inline_reasoning: bool = False) -> None:
        """``reasoning``: where the reply starts relative to a think block when it is to be split off (chat only);
        ``inline_reasoning``: a whole reply keeps the block in its content too (``deepseek-legacy``)."""
        self.kind = kind
        self.want_logprobs = logprobs
        self.tool_format = tool_format
        self.reasoning = reasoning if kind == "chat" else None
        self.inline_reasoning = inline_reasoning
        self.cid, self.model, self.prefix = cid, model, prefix
        self.created = int(time.time())
        """One timestamp for every chunk of the reply, as OpenAI sends them."""
        self.choices = [ChoiceReply(i, parser=ToolCallParser(tool_format) if tool_format else None,
                                    thinker=ReasoningParser(self.reasoning) if self.reasoning else None,
                                    offset=len(prefix)) for i in range(n)]
        self.plain = n == 1 and not logprobs and tool_format is None and self.reasoning is None
        """Nothing per token but the text: the serving loop's fast path."""

    # ---- streamed ------------------------------------------------------------------------------------------------

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A chunk of this request with these choices (``[]`` for a telemetry- or usage-only chunk)."""
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.cid, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def opening(self) -> dict[str, Any]:
        """The first chunk: each choice's role (chat) or echoed prompt (completions)."""
        if self.kind == "chat":
            return self.chunk([_dump(ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content="")))
                               for c in self.choices])
        return self.chunk([_dump(CompletionChoice(index=c.index, text=self.prefix)) for c in self.choices])

    def plain_choice(self, text: str | None, finish: str | None) -> dict[str, Any]:
        """Choice 0 of a plain request with this text (the serving loop renders it once as a template)."""
        if self.kind == "chat":
            return _dump(ChatChunkChoice(delta=ChatDelta(content=text), finish_reason=finish))
        return _dump(CompletionChoice(text=text or "", finish_reason=finish))

    def token(self, event: TokenEvent) -> dict[str, Any] | None:
        """The chunk choice a token releases, or ``None`` when it releases nothing yet."""
        choice = self.choices[event.index]
        if self.want_logprobs and event.logprobs is not None:
            choice.pending.append(event.logprobs)
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason
        return self._released(choice, event.text, None)

    def closing(self, end: SessionEnd) -> list[dict[str, Any]]:
        """Each choice's last chunk at a complete end: what it still held, and its finish reason."""
        finishes = {c.index: c.finish_reason for c in end.choices}
        out = []
        for choice in self.choices:
            finish = choice.finish_reason or finishes.get(choice.index) or end.finish_reason or "stop"
            body = self._released(choice, "", finish, final=True)
            assert body is not None
            out.append(body)
        return out

    def _released(self, choice: ChoiceReply, text: str, finish: str | None, *,
                  final: bool = False) -> dict[str, Any] | None:
        if self.kind == "completion":
            if not text and not final:
                return None
            return _dump(CompletionChoice(index=choice.index, text=text, finish_reason=finish,
                                          logprobs=self._completion_lps(choice)))
        thought = ""
        if choice.thinker is not None:
            thought, text = choice.thinker.feed(text) if text else ("", "")
            if final:
                more_thought, more_text = choice.thinker.finish()
                thought, text = thought + more_thought, text + more_text
        delta: ChatDelta | None
        if choice.parser is not None:
            deltas = choice.parser.feed(text) if text else []
            if final:
                held, reply = choice.parser.finish()
                deltas += held
                choice.has_calls = bool(reply.tool_calls)
            delta = chat_delta(deltas)
        else:
            delta = ChatDelta(content=text) if text else None
        if thought:
            delta = (delta or ChatDelta()).model_copy(update={"reasoning_content": thought})
        if delta is None and not final:
            return None
        if final:
            finish = finish_reason(choice.has_calls, finish)  # type: ignore[arg-type]
        lps = None
        if self.want_logprobs and (choice.pending or final):
            lps, choice.pending = chat_logprobs(choice.pending), []
        return _dump(ChatChunkChoice(index=choice.index, delta=delta or ChatDelta(), finish_reason=finish,
                                     logprobs=lps))

    def _completion_lps(self, choice: ChoiceReply) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        entries, choice.pending = choice.pending, []
        out = completion_logprobs(entries, text_offset=choice.offset)
        choice.offset += sum(len(bytes(lp.bytes or []).decode("utf-8", errors="ignore")) for lp in entries)
        return out

    # ---- whole -------------------------------------------------------------------------------------------------

    def collect(self, event: TokenEvent) -> None:
        choice = self.choices[event.index]
        choice.text.append(event.text)
        if self.want_logprobs and event.logprobs is not None:
            choice.logprobs.append(event.logprobs)
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason

    def chat_choices(self, end: SessionEnd) -> list[ChatChoice]:
        finishes = {c.index: c.finish_reason for c in end.choices}
        out = []
        for choice in self.choices:
            raw = "".join(choice.text)
            thought, text = split_reply(raw, self.reasoning) if self.reasoning else (None, raw)
            finish = choice.finish_reason or finishes.get(choice.index) or end.finish_reason
            if self.tool_format is not None:
                reply = parse_reply(text, self.tool_format)
                message = chat_message(reply)
                reason = finish_reason(bool(reply.tool_calls), finish)
            else:
                message, reason = ChatMessageOut(content=text), finish
            if self.reasoning is not None:
                inline = raw[:len(raw) - len(text)] if self.inline_reasoning else ""  # the block, as written
                content = inline + (message.content or "") if inline else message.content
                message = message.model_copy(update={"content": content, "reasoning_content": thought})
            out.append(ChatChoice(index=choice.index, message=message, finish_reason=reason,
                                  logprobs=chat_logprobs(choice.logprobs) if self.want_logprobs else None))
        return out

    def completion_choices(self, end: SessionEnd) -> list[CompletionChoice]:
        finishes = {c.index: c.finish_reason for c in end.choices}
        return [CompletionChoice(index=c.index, text=self.prefix + "".join(c.text),
                                 finish_reason=c.finish_reason or finishes.get(c.index) or end.finish_reason,
                                 logprobs=completion_logprobs(c.logprobs, text_offset=len(self.prefix))
                                 if self.want_logprobs else None)
                for c in self.choices]


def _dump(model: ChatChunkChoice | CompletionChoice) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)
