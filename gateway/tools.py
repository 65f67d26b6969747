"""Tool calls out of a model's reply: whole (``message.tool_calls``) and as it streams (``delta.tool_calls``).

The head told the gateway which format it asked the model to write (``TokenizeReply.tool_format``; the formats are
described in ``schemas.tools``), and with ``tool_choice`` ``required`` or a named function the tail's grammar
guarantees it. The parser reads the reply text as it arrives and emits, per call, first its id and name
(``CallStart``), then fragments of its arguments' JSON text (``ArgumentsDelta``), and any plain text as
``ContentDelta``; the streamed fragments concatenate to exactly the ``arguments`` of the final ``ParsedReply``.

It never fails: text that is not in the format (a model writing prose although tools were offered, a reply cut by
``max_tokens``) is content, or a call with the arguments written so far. Ids are ``call_`` and 24 hex digits.

Why one module of ~470 lines: the whole and the streamed parser of both formats live together so that they
stay equal (tests/test_tools.py checks them against each other).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Callable

from schemas.openai import ChatDelta, ChatMessageOut, ToolCall, ToolCallDelta, ToolCallFunction, ToolCallFunctionDelta
from schemas.session import FinishReason
from schemas.tools import (
    GENERIC_CALL_KEY,
    GENERIC_CALLS_KEY,
    GENERIC_RESPONSE_KEY,
    HERMES_CLOSE,
    HERMES_OPEN,
    ToolCallFormat,
)

_WS = " \t\r\n"


def new_call_id() -> str:
    """``call_`` + 24 hex digits, like OpenAI's."""
    return "call_" + secrets.token_hex(12)


@dataclasses.dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    index: int
    text: str


ReplyDelta = ContentDelta | CallStart | ArgumentsDelta


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str
    """The JSON text of the arguments, as the model wrote it (what was streamed)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None
    """``None`` when the reply is only tool calls."""
    tool_calls: list[ParsedCall]


class _Value:
    """Where one JSON value ends, fed a character at a time (strings, escapes, nesting). Does not validate."""

    MORE, LAST, OUTSIDE = 0, 1, 2
    """``feed``: the character is in the value and more may follow / ends it / is not in it (it ends a number or
    literal and belongs to what follows)."""

    def __init__(self) -> None:
        self.kind = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, ch: str) -> int:
        if not self.kind:
            self.kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
            self.depth = 1 if self.kind == "container" else 0
            self.in_string = self.kind == "string"
            return self.MORE
        if self.kind == "scalar":
            return self.OUTSIDE if ch in ",}]" or ch in _WS else self.MORE
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.kind == "string":
                    return self.LAST
            return self.MORE
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                return self.LAST
        return self.MORE


class _JsonString:
    """The characters between a JSON string's quotes, decoded as far as they can be (an escape sequence, or a
    surrogate pair, split across tokens is held until complete)."""

    def __init__(self) -> None:
        self.raw: list[str] = []
        self.escape = ""
        self.hold_from: int | None = None
        self.high_surrogate = False
        self.emitted = 0
        self.closed = False

    def feed(self, ch: str) -> None:
        if self.escape:
            self.escape += ch
            self.raw.append(ch)
            if self.escape[1] != "u" or len(self.escape) == 6:
                code = int(self.escape[2:], 16) if self.escape[1] == "u" else -1
                self.escape = ""
                if 0xD800 <= code < 0xDC00:
                    self.high_surrogate = True  # keep holding until its low half
                else:
                    self.high_surrogate = False
                    self.hold_from = None
            return
        if ch == "\\":
            if not self.high_surrogate:
                self.hold_from = len(self.raw)
            self.escape = ch
            self.raw.append(ch)
        elif ch == '"':
            self.closed = True
            self.hold_from = None
        else:
            self.raw.append(ch)
            if self.high_surrogate:  # a lone high surrogate: let it through rather than hold forever
                self.high_surrogate, self.hold_from = False, None

    def take(self) -> str:
        """Decoded text not taken before."""
        end = len(self.raw) if self.hold_from is None else self.hold_from
        if end <= self.emitted:
            return ""
        piece = "".join(self.raw[self.emitted:end])
        self.emitted = end
        try:
            out: str = json.loads(f'"{piece}"')
        except ValueError:
            out = piece  # not valid JSON escapes: pass the text through as written
        return out

    def value(self) -> str:
        try:
            out: str = json.loads('"' + "".join(self.raw) + '"')
        except ValueError:
            out = "".join(self.raw)
        return out


class _Call:
    """One call object ``{"name": ..., "arguments": ...}`` after its ``{``; other keys are skipped."""

    def __init__(self, index: int, call_id: str, emit: Callable[[ReplyDelta], None]) -> None:
        self.index, self.id = index, call_id
        self.name: str | None = None
        self.arguments: list[str] = []
        self.done = False
        self._emit = emit
        self._state = "key"
        self._key = _JsonString()
        self._name = _JsonString()
        self._value = _Value()
        self._pending_args: list[str] = []

    def feed(self, ch: str) -> None:
        state = self._state
        if state == "key":
            if ch == '"':
                self._key, self._state = _JsonString(), "key_string"
            elif ch == "}":
                self.done = True
        elif state == "key_string":
            self._key.feed(ch)
            if self._key.closed:
                self._state = "colon"
        elif state == "colon":
            if ch == ":":
                self._state = "value"
        elif state == "value":
            if ch in _WS:
                return
            key = self._key.value()
            if key == "name" and ch == '"':
                self._name, self._state = _JsonString(), "name"
            else:
                self._value, self._state = _Value(), "arguments" if key == "arguments" else "skip"
                self._value.feed(ch)
                if self._state == "arguments":
                    self._argument(ch)
        elif state == "name":
            self._name.feed(ch)
            if self._name.closed:
                self._state = "key"
                if self.name is None:
                    self.name = self._name.value()
                    self._emit(CallStart(self.index, self.id, self.name))
                    if self._pending_args:
                        self._emit(ArgumentsDelta(self.index, "".join(self._pending_args)))
                        self._pending_args.clear()
        else:  # arguments or skip: a value of any kind
            where = self._value.feed(ch)
            if where == _Value.OUTSIDE:
                self._state = "key"
                self.feed(ch)
                return
            if state == "arguments":
                self._argument(ch)
            if where == _Value.LAST:
                self._state = "key"

    def _argument(self, ch: str) -> None:
        self.arguments.append(ch)
        if self.name is None:
            self._pending_args.append(ch)  # a model that writes arguments first: streamed once the name is known
        else:
            self._emit(ArgumentsDelta(self.index, ch))

    def parsed(self) -> ParsedCall | None:
        if self.name is None:
            return None
        # A call that closed without arguments takes none; one cut off keeps what was written (maybe nothing).
        return ParsedCall(self.id, self.name, "".join(self.arguments) or ("{}" if self.done else ""))


class ToolCallParser:
    """Feed reply text as it arrives; ``finish`` at the end. Not thread-safe (one per choice of a request)."""

    def __init__(self, fmt: ToolCallFormat, *, new_id: Callable[[], str] = new_call_id) -> None:
        self.format = fmt
        self._new_id = new_id
        self._out: list[ReplyDelta] = []
        self._calls: list[_Call] = []
        self._call: _Call | None = None
        self._content: list[str] = []
        self._state = "start" if fmt == "generic" else "text"
        self._key = _JsonString()
        self._text = _JsonString()
        self._value = _Value()
        self._held = ""
        self._before_tag = ""

    # --- public -------------------------------------------------------------------------------------------------

    def feed(self, text: str) -> list[ReplyDelta]:
        for ch in text:
            self._char(ch)
        if self._state == "response":
            self._emit_content(self._text.take())
        elif self._state == "text" and self.format == "hermes":
            self._release_text()
        return self._take()

    def finish(self) -> tuple[list[ReplyDelta], ParsedReply]:
        """The deltas still held back, and the whole reply."""
        if self._state == "text" and self._held:
            self._emit_content(self._held if self._held.strip(_WS) or not self._calls else "")
            self._held = ""
        elif self._state == "response":
            self._emit_content(self._text.take())
        elif self._state == "hermes_open":  # the reply ended right after the tag: it was text
            self._emit_content(self._before_tag + HERMES_OPEN + self._held)
            self._held = ""
        calls = [p for p in (c.parsed() for c in self._calls) if p is not None]
        content = "".join(self._content)
        if calls and not content.strip():
            return self._take(), ParsedReply(content=None, tool_calls=calls)
        return self._take(), ParsedReply(content=content, tool_calls=calls)

    # --- per character ------------------------------------------------------------------------------------------

    def _char(self, ch: str) -> None:
        state = self._state
        if self._call is not None:
            self._call.feed(ch)
            if self._call.done:
                self._call = None
            return
        if state == "text":
            if self.format == "hermes":
                self._held += ch
                if self._held.endswith(HERMES_OPEN):
                    # Whitespace before a call block (or between two) is layout, not content; it is kept aside in
                    # case no call follows.
                    before = self._held[:-len(HERMES_OPEN)]
                    text = before.rstrip(_WS)
                    self._emit_content(text)
                    self._held, self._before_tag, self._state = "", before[len(text):], "hermes_open"
            else:
                self._emit_content(ch)
        elif state == "start":  # generic: an envelope object, or else plain text
            if ch in _WS:
                return
            if ch == "{":
                self._state = "env_key"
            else:
                self._state = "text"
                self._emit_content(ch)
        elif state == "env_key":
            if ch == '"':
                self._key, self._state = _JsonString(), "env_key_string"
            elif ch == "}":
                self._state = "done"
        elif state == "env_key_string":
            self._key.feed(ch)
            if self._key.closed:
                self._state = "env_colon"
        elif state == "env_colon":
            if ch == ":":
                self._state = "env_value"
        elif state == "env_value":
            self._env_value(ch)
        elif state == "response":
            self._text.feed(ch)
            if self._text.closed:
                self._emit_content(self._text.take())
                self._state = "env_key"
        elif state in ("response_json", "skip"):
            where = self._value.feed(ch)
            if where == _Value.OUTSIDE:
                self._state = "env_key"
                self._char(ch)
                return
            if state == "response_json":
                self._emit_content(ch)
            if where == _Value.LAST:
                self._state = "env_key"
        elif state == "calls":
            if ch == "{":
                self._start_call()
            elif ch == "]":
                self._state = "env_key"
        elif state == "hermes_open":
            if ch in _WS:
                self._held += ch
            elif ch == "{":
                self._start_call()
                self._held, self._state = "", "hermes_close"
            else:  # not a call after all: the tag and what follows are text
                self._emit_content(self._before_tag + HERMES_OPEN + self._held + ch)
                self._held, self._state = "", "text"
        elif state == "hermes_close":
            self._held += ch
            if self._held.endswith(HERMES_CLOSE):
                self._held, self._state = "", "text"
        # "done": whatever follows the envelope (whitespace) is dropped

    def _env_value(self, ch: str) -> None:
        if ch in _WS:
            return
        key = self._key.value()
        if key == GENERIC_RESPONSE_KEY and ch == '"':
            self._text, self._state = _JsonString(), "response"
        elif key == GENERIC_CALL_KEY and ch == "{":
            self._state = "env_key"
            self._start_call()
        elif key == GENERIC_CALLS_KEY and ch == "[":
            self._state = "calls"
        else:
            self._value = _Value()
            self._value.feed(ch)
            self._state = "response_json" if key == GENERIC_RESPONSE_KEY else "skip"
            if self._state == "response_json":
                self._emit_content(ch)

    def _start_call(self) -> None:
        self._call = _Call(len(self._calls), self._new_id(), self._emit)
        self._calls.append(self._call)

    # --- output -------------------------------------------------------------------------------------------------

    def _release_text(self) -> None:
        """Hermes text: emit what cannot be the start of ``<tool_call>``; trailing whitespace waits too (a reply
        that turns out to be only calls has no content)."""
        keep = 0
        for n in range(min(len(HERMES_OPEN) - 1, len(self._held)), 0, -1):
            if self._held.endswith(HERMES_OPEN[:n]):
                keep = n
                break
        head = self._held[:len(self._held) - keep]
        stripped = head.rstrip(_WS)
        self._emit_content(stripped)
        self._held = head[len(stripped):] + self._held[len(self._held) - keep:]

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._emit(ContentDelta(text))

    def _emit(self, delta: ReplyDelta) -> None:
        """Queue a delta, merged into the previous one when both are text of the same kind."""
        last = self._out[-1] if self._out else None
        if isinstance(delta, ContentDelta) and isinstance(last, ContentDelta):
            self._out[-1] = ContentDelta(last.text + delta.text)
        elif isinstance(delta, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == delta.index:
            self._out[-1] = ArgumentsDelta(delta.index, last.text + delta.text)
        else:
            self._out.append(delta)

    def _take(self) -> list[ReplyDelta]:
        out, self._out = self._out, []
        return out


def parse_reply(text: str, fmt: ToolCallFormat, *, new_id: Callable[[], str] = new_call_id) -> ParsedReply:
    """The whole reply at once (non-streamed responses): the same parser, fed everything."""
    parser = ToolCallParser(fmt, new_id=new_id)
    parser.feed(text)
    return parser.finish()[1]


# ---- in OpenAI's chat shapes ------------------------------------------------------------------------------------

def chat_delta(deltas: list[ReplyDelta]) -> ChatDelta | None:
    """One chunk's ``delta`` for the deltas a token released (``None`` when it released nothing): its text, and its
    calls' pieces, the first of each carrying ``id``, ``type`` and the name."""
    text = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: list[ToolCallDelta] = []
    for d in deltas:
        if isinstance(d, CallStart):
            calls.append(ToolCallDelta(index=d.index, id=d.id, type="function",
                                       function=ToolCallFunctionDelta(name=d.name, arguments="")))
        elif isinstance(d, ArgumentsDelta):
            calls.append(ToolCallDelta(index=d.index, function=ToolCallFunctionDelta(arguments=d.text)))
    if not text and not calls:
        return None
    return ChatDelta(content=text or None, tool_calls=calls or None)


def chat_message(reply: ParsedReply) -> ChatMessageOut:
    """``choices[].message`` of a whole reply."""
    calls = [ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
             for c in reply.tool_calls]
    return ChatMessageOut(content=reply.content, tool_calls=calls or None)


def finish_reason(reply_has_calls: bool, finish: FinishReason | None) -> str | None:
    """OpenAI's ``tool_calls`` when a reply that ended by itself made calls; otherwise the session's own."""
    return "tool_calls" if reply_has_calls and finish == "stop" else finish
