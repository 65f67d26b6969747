"""Reasoning apart from the answer (issue #27): a reply's think block split off its text as the text arrives.

For a model whose template marks reasoning (the head reports where the reply starts: ``schemas.reasoning``), the
text before ``</think>`` is reasoning (``delta.reasoning_content``, ``message.reasoning_content``, Responses
``reasoning`` items) and the rest is the answer, which then goes on to the tool-call parser as any reply's text
does. A reply that starts outside a block is reasoning only if it opens one first (``<think>`` after nothing but
whitespace); later tags are text, as llama.cpp reads them.

A tag split across tokens is held until it is complete or cannot be one; reasoning loses its leading and trailing
whitespace, and the answer its leading whitespace after the block (llama.cpp strips both), so what streams
concatenates to exactly what a whole reply holds. A block that never closes (a reply cut by ``max_tokens``) is all
reasoning, a partial closing tag included. It never fails.
"""

from __future__ import annotations

import dataclasses

from schemas.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningFormat, ReasoningStart

_WS = " \t\r\n"


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Reasoning text, beside ``gateway.tools``' deltas of the answer (the Responses builder takes both)."""

    text: str


def splits(fmt: ReasoningFormat, start: ReasoningStart | None, *, streamed: bool) -> bool:
    """Whether a chat reply is split at all: a template that marks reasoning, a format that extracts it, and for a
    stream not ``deepseek-legacy`` (which leaves a stream's block inline)."""
    return start is not None and fmt != "none" and not (streamed and fmt == "deepseek-legacy")


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (it may complete with the next token)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Feed reply text as it arrives, ``finish`` at the end; each returns ``(reasoning, answer)`` released by it.
    One per choice of a request."""

    def __init__(self, start: ReasoningStart) -> None:
        self._state = "thinking" if start == "open" else "before"
        self._held = ""
        self._reasoning_started = False
        self.opened = start == "open"
        """Whether the reply has a think block (opened by the prompt or by the reply)."""

    def feed(self, text: str) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        reasoning: list[str] = []
        answer: list[str] = []
        while buf:
            if self._state == "before":
                lead = buf.lstrip(_WS)
                if lead.startswith(THINK_OPEN):
                    self._state, self.opened, buf = "thinking", True, lead[len(THINK_OPEN):]
                elif not lead or THINK_OPEN.startswith(lead):
                    self._held, buf = buf, ""  # whitespace, or maybe the start of the tag
                else:
                    self._state = "answer"
            elif self._state == "thinking":
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(self._reasoning(buf[:end].rstrip(_WS)))
                    self._state, buf = "after", buf[end + len(THINK_CLOSE):]
                    continue
                keep = _partial_suffix(buf, THINK_CLOSE)
                body = buf[:len(buf) - keep]
                shown = body.rstrip(_WS)  # trailing whitespace waits: the block may close right after it
                reasoning.append(self._reasoning(shown))
                self._held, buf = body[len(shown):] + buf[len(buf) - keep:], ""
            elif self._state == "after":
                buf = buf.lstrip(_WS)
                if buf:
                    self._state = "answer"
            else:
                answer.append(buf)
                buf = ""
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "before":
            return "", held  # whitespace or a tag's beginning that never completed: text
        if self._state == "thinking":
            return self._reasoning(held.rstrip(_WS)), ""
        return "", ""

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip(_WS)
            self._reasoning_started = bool(text)
        return text


def split_reply(text: str, start: ReasoningStart) -> tuple[str | None, str]:
    """A whole reply's reasoning (``None`` when it has no think block, or an empty one) and answer."""
    parser = ReasoningParser(start)
    reasoning, answer = parser.feed(text)
    more_reasoning, more_answer = parser.finish()
    thought = reasoning + more_reasoning
    return (thought if parser.opened and thought else None), answer + more_answer
