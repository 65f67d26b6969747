"""The Responses API on top of chat turns: requests become the head's messages and tools, and a reply (parsed by
``gateway.tools``) becomes Responses output items and stream events, in the order the official SDK accumulates:

``response.created``, ``response.in_progress``; per output item ``response.output_item.added``, then for a message
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, or for a call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; then ``response.output_item.done``; and last ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut it, ``response.failed`` when the route failed). A reply's
think block (``gateway.reasoning``, issue #27) comes first, as a ``reasoning`` item: ``response.output_item.added``,
``response.reasoning_text.delta``..., ``response.reasoning_text.done``, ``response.output_item.done``.

Pure conversion: the serving loop feeds it the parser's deltas and the tokens' logprobs as they arrive.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Sequence
from typing import Any

from gateway.constraints import FormatKind, check_schema, tool_set
from gateway.logprobs import responses_logprobs
from gateway.reasoning import ReasoningDelta, ReasoningParser
from gateway.tools import ArgumentsDelta, CallStart, ContentDelta, ReplyDelta, ToolCallParser
from schemas.openai_responses import (
    ContentPartAddedEvent,
    ContentPartDoneEvent,
    FunctionCall,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputItemAddedEvent,
    OutputItemDoneEvent,
    OutputMessage,
    OutputText,
    OutputTextDeltaEvent,
    OutputTextDoneEvent,
    ReasoningItem,
    ReasoningItemIn,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseError,
    ResponseEvent,
    ResponseFailedEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from schemas.reasoning import ReasoningStart
from schemas.session import FinishReason, SessionEnd, SessionPhase, TokenEvent, TokenLogprobs
from schemas.tools import FunctionSpec, ToolCallFormat, ToolSet

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _derived_id(prefix: str, response_id: str, n: int) -> str:
    """The ``n``-th item id of a response, the same on every gateway that renders it (issue #31: a stream resumed
    on another gateway names the items the first one named)."""
    return f"{prefix}_{hashlib.sha256(f'{response_id}/{prefix}/{n}'.encode()).hexdigest()[:24]}"


# ---- request -> chat turns, tools, format, logprobs ----------------------------------------------------------

def chat_messages(req: ResponsesRequest) -> list[dict[str, object]]:
    """The conversation as chat messages (what the head renders): ``instructions`` as the system turn, function
    calls grouped into the assistant turn that made them, their outputs as ``role: tool`` turns, and a reasoning
    item as the ``reasoning_content`` of the assistant turn after it (templates that show reasoning read it)."""
    messages: list[dict[str, object]] = []
    thought: str | None = None
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, ReasoningItemIn):
            thought = "".join(p.text for p in item.content or item.summary)
            continue
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # type: ignore[attr-defined]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            assert isinstance(item, FunctionCallOutputItem)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        if thought is not None and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("reasoning_content", thought)
        thought = None
    return messages


def request_tools(req: ResponsesRequest) -> ToolSet | None:
    specs = [FunctionSpec(name=t.name, description=t.description,
                          parameters=t.parameters if t.parameters is not None else {"type": "object",
                                                                                    "properties": {}},
                          strict=t.strict) for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        return tool_set(specs, "function", function=choice.name, parallel=req.parallel_tool_calls)
    return tool_set(specs, choice, parallel=req.parallel_tool_calls)


def text_format(req: ResponsesRequest) -> tuple[FormatKind, dict[str, Any] | None]:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJsonSchema):
        return "json_schema", check_schema(fmt.schema_, "text")
    if isinstance(fmt, TextFormatJsonObject):
        return "json_object", None
    return "text", None


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether the output text carries logprobs: ``include: ["message.output_text.logprobs"]`` asks for them
    (OpenAI's switch; ``top_logprobs`` then says how many alternatives), and so does ``top_logprobs`` >= 1 alone.
    OpenAI sends logprobs only with the include, but a count of alternatives is a request for them, and dropping it
    silently would leave the client wondering; 0 (what every OpenAI response echoes) asks for nothing."""
    return LOGPROBS_INCLUDE in (req.include or []) or bool(req.top_logprobs)


def request_logprobs(req: ResponsesRequest) -> int | None:
    """``SamplingParams.logprobs``: the number of alternatives when logprobs are wanted, else off."""
    return (req.top_logprobs or 0) if wants_logprobs(req) else None


# ---- reply -> output items and events ------------------------------------------------------------------------

class ResponseBuilder:
    """One response, built from a reply as it streams. ``start`` once, ``feed`` per token event, then ``finish``
    or ``fail``; each returns the stream events to send (a non-streamed request ignores them and takes
    ``response``)."""

    def __init__(self, req: ResponsesRequest, *, response_id: str | None = None, created_at: float | None = None,
                 ) -> None:
        self.req = req
        self._seq = 0
        self._items = 0
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        self.response = ResponseObject(
            id=response_id or _id("resp"), status="in_progress", model=req.model, instructions=req.instructions,
            background=bool(req.background),
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            temperature=req.temperature, top_p=req.top_p, top_logprobs=req.top_logprobs,
            tool_choice=req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice)
            else (req.tool_choice or "auto"),
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            metadata=req.metadata or {})
        if created_at is not None:
            self.response.created_at = created_at
        self._message: OutputMessage | None = None
        self._message_index = -1
        self._text: list[str] = []
        self._logprobs: list[TokenLogprobs] = []
        self._pending_logprobs: list[TokenLogprobs] = []
        self._calls: dict[int, tuple[int, FunctionCall]] = {}
        self._reasoning: ReasoningItem | None = None
        self._reasoning_index = -1
        self._reasoning_text: list[str] = []
        self._want_logprobs = wants_logprobs(req)

    def _next(self) -> int:
        self._seq += 1
        return self._seq - 1

    def _item_id(self, prefix: str) -> str:
        self._items += 1
        return _derived_id(prefix, self.response.id, self._items - 1)

    def _snapshot(self) -> ResponseObject:
        return self.response.model_copy(deep=True)

    def start(self) -> list[ResponseEvent]:
        return [ResponseCreatedEvent(sequence_number=self._next(), response=self._snapshot()),
                ResponseInProgressEvent(sequence_number=self._next(), response=self._snapshot())]

    def feed(self, deltas: Sequence[ReplyDelta | ReasoningDelta],
             logprobs: Sequence[TokenLogprobs] = ()) -> list[ResponseEvent]:
        """The parsers' deltas for one or more tokens, and those tokens' logprobs (when asked for)."""
        events: list[ResponseEvent] = []
        if self._want_logprobs:
            self._pending_logprobs.extend(logprobs)
        for delta in deltas:
            if isinstance(delta, ReasoningDelta):
                events += self._reasoning_delta(delta.text)
                continue
            events += self._close_reasoning(cut=False)
            if isinstance(delta, ContentDelta):
                events += self._text_delta(delta.text)
            elif isinstance(delta, CallStart):
                events += self._close_message()
                item = FunctionCall(id=self._item_id("fc"), call_id=delta.id, name=delta.name, arguments="",
                                    status="in_progress")
                index = len(self.response.output)
                self.response.output.append(item)
                self._calls[delta.index] = (index, item)
                events.append(OutputItemAddedEvent(sequence_number=self._next(), output_index=index,
                                                   item=item.model_copy()))
            else:
                assert isinstance(delta, ArgumentsDelta)
                index, item = self._calls[delta.index]
                item.arguments += delta.text
                events.append(FunctionCallArgumentsDeltaEvent(sequence_number=self._next(), item_id=item.id,
                                                              output_index=index, delta=delta.text))
        return events

    def _reasoning_delta(self, text: str) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        if self._reasoning is None:
            self._reasoning = ReasoningItem(id=self._item_id("rs"), status="in_progress")
            self._reasoning_index = len(self.response.output)
            self.response.output.append(self._reasoning)
            events.append(OutputItemAddedEvent(sequence_number=self._next(), output_index=self._reasoning_index,
                                               item=self._reasoning.model_copy(deep=True)))
        self._reasoning_text.append(text)
        events.append(ReasoningTextDeltaEvent(sequence_number=self._next(), item_id=self._reasoning.id,
                                              output_index=self._reasoning_index, delta=text))
        return events

    def _close_reasoning(self, *, cut: bool) -> list[ResponseEvent]:
        """The think block ended (the answer began, or the reply ended: ``cut`` by the token limit)."""
        item = self._reasoning
        if item is None or item.status != "in_progress":
            return []
        text = "".join(self._reasoning_text)
        item.content = [ReasoningText(text=text)]
        item.status = "incomplete" if cut else "completed"
        return [ReasoningTextDoneEvent(sequence_number=self._next(), item_id=item.id,
                                       output_index=self._reasoning_index, text=text),
                OutputItemDoneEvent(sequence_number=self._next(), output_index=self._reasoning_index,
                                    item=item.model_copy(deep=True))]

    def _text_delta(self, text: str) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        if self._message is None:
            self._message = OutputMessage(id=self._item_id("msg"), status="in_progress", content=[])
            self._message_index = len(self.response.output)
            self.response.output.append(self._message)
            events.append(OutputItemAddedEvent(sequence_number=self._next(), output_index=self._message_index,
                                               item=self._message.model_copy(deep=True)))
            events.append(ContentPartAddedEvent(sequence_number=self._next(), item_id=self._message.id,
                                                output_index=self._message_index, content_index=0,
                                                part=OutputText(text="", logprobs=[] if self._want_logprobs
                                                                else None)))
        lps, self._pending_logprobs = self._pending_logprobs, []
        self._text.append(text)
        self._logprobs.extend(lps)
        events.append(OutputTextDeltaEvent(sequence_number=self._next(), item_id=self._message.id,
                                           output_index=self._message_index, content_index=0, delta=text,
                                           logprobs=responses_logprobs(lps)))
        return events

    def _close_message(self) -> list[ResponseEvent]:
        message = self._message
        if message is None or message.status != "in_progress":
            return []
        part = OutputText(text="".join(self._text),
                          logprobs=responses_logprobs(self._logprobs) if self._want_logprobs else None)
        message.content = [part]
        message.status = "completed"
        return [OutputTextDoneEvent(sequence_number=self._next(), item_id=message.id, output_index=self._message_index,
                                    content_index=0, text=part.text, logprobs=part.logprobs or []),
                ContentPartDoneEvent(sequence_number=self._next(), item_id=message.id,
                                     output_index=self._message_index, content_index=0, part=part),
                OutputItemDoneEvent(sequence_number=self._next(), output_index=self._message_index,
                                    item=message.model_copy(deep=True))]

    def finish(self, finish_reason: FinishReason | None, *, input_tokens: int, output_tokens: int,
               ) -> list[ResponseEvent]:
        """Close every open item and the response: ``completed``, or ``incomplete`` when cut by the token limit."""
        cut = finish_reason == "length"
        events = self._close_reasoning(cut=cut) + self._close_message()
        for index, item in sorted(self._calls.values(), key=lambda c: c[0]):
            if item.status == "in_progress":
                item.status = "incomplete" if cut else "completed"
                events.append(FunctionCallArgumentsDoneEvent(sequence_number=self._next(), item_id=item.id,
                                                             output_index=index, name=item.name,
                                                             arguments=item.arguments))
                events.append(OutputItemDoneEvent(sequence_number=self._next(), output_index=index,
                                                  item=item.model_copy()))
        if cut and self._message is not None:
            self._message.status = "incomplete"
        self.response.usage = ResponseUsage(input_tokens=input_tokens, output_tokens=output_tokens,
                                            total_tokens=input_tokens + output_tokens)
        if cut:
            self.response.status = "incomplete"
            self.response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            events.append(ResponseIncompleteEvent(sequence_number=self._next(), response=self._snapshot()))
        else:
            self.response.status = "completed"
            events.append(ResponseCompletedEvent(sequence_number=self._next(), response=self._snapshot()))
        return events

    def fail(self, kind: str, message: str) -> list[ResponseEvent]:
        """The route failed: ``response.failed`` with the error (the partial output stays). OpenAI's error codes
        are a closed list, so the code is ``server_error`` and the failure kind (``FailureReason.kind``) leads the
        message."""
        self.response.status = "failed"
        self.response.error = ResponseError(code="server_error", message=f"route failed ({kind}): {message}")
        return [ResponseFailedEvent(sequence_number=self._next(), response=self._snapshot())]

    def current(self) -> ResponseObject:
        """The response as it stands: an open message shows the text so far (``GET /v1/responses/{id}`` of a
        background response still running)."""
        snap = self._snapshot()
        message = self._message
        if message is not None and message.status == "in_progress":
            index = self._message_index
            snap.output[index] = message.model_copy(update={"content": [OutputText(
                text="".join(self._text),
                logprobs=responses_logprobs(self._logprobs) if self._want_logprobs else None)]})
        return snap

    def cancel(self) -> list[ResponseEvent]:
        """Cancelled (``POST /v1/responses/{id}/cancel``): the partial output stays. The SDK's stream events have
        no cancelled event, so the stream just ends; the response says ``cancelled``."""
        self.response.status = "cancelled"
        return []

    @property
    def output(self) -> list[OutputItem]:
        return self.response.output


class ResponseReply:
    """One response as its session's token events arrive: text through the tool-call parser (with tools) into the
    builder. A pure function of the request, the session's facts and its events, so that every gateway rendering
    one session's events gives the same stream events (issue #31)."""

    def __init__(self, req: ResponsesRequest, *, response_id: str, prompt_tokens: int,
                 tool_format: ToolCallFormat | None, created_at: float | None = None,
                 reasoning: ReasoningStart | None = None) -> None:
        """``reasoning``: where the reply starts relative to a think block, when it is to be split off into a
        ``reasoning`` item (issue #27)."""
        self.builder = ResponseBuilder(req, response_id=response_id, created_at=created_at)
        self.prompt_tokens = prompt_tokens
        self.tokens = 0
        tools = request_tools(req) is not None
        self.parser = ToolCallParser(tool_format) if tools and tool_format is not None else None
        self.thinker = ReasoningParser(reasoning) if reasoning is not None else None

    def token(self, event: TokenEvent) -> list[ResponseEvent]:
        self.tokens += 1
        thought, text = self.thinker.feed(event.text) if self.thinker and event.text else ("", event.text)
        return self.builder.feed(self._deltas(thought, text), [event.logprobs] if event.logprobs is not None else [])

    def _deltas(self, thought: str, text: str) -> list[ReplyDelta | ReasoningDelta]:
        deltas: list[ReplyDelta | ReasoningDelta] = [ReasoningDelta(thought)] if thought else []
        if self.parser is not None:
            deltas += self.parser.feed(text) if text else []
        elif text:
            deltas.append(ContentDelta(text))
        return deltas

    def collect(self, event: TokenEvent) -> None:
        """A whole reply: the builder accumulates; its events are not sent."""
        self.token(event)

    def end(self, end: SessionEnd) -> list[ResponseEvent]:
        if end.phase is SessionPhase.CANCELLED:
            return self.builder.cancel()
        if end.phase is not SessionPhase.COMPLETE:
            failure = end.failure
            return self.builder.fail(failure.kind if failure else end.phase.value,
                                     failure.describe() if failure else f"session ended: {end.phase.value}")
        events = self.builder.feed(self._deltas(*self.thinker.finish())) if self.thinker is not None else []
        events += self.builder.feed(self.parser.finish()[0]) if self.parser is not None else []
        completion = end.completion_tokens or self.tokens
        return events + self.builder.finish(end.finish_reason, input_tokens=self.prompt_tokens,
                                            output_tokens=completion)


def sse_event(event: ResponseEvent, extra: dict[str, Any] | None = None) -> bytes:
    """One Responses stream event as OpenAI sends it: an ``event:`` line naming its type, then its ``data:``
    (``extra`` adds keys, the ``swarmroute`` telemetry, beside the event's own)."""
    body = {**event.model_dump(mode="json", by_alias=True), **(extra or {})}
    return f"event: {event.type}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n".encode()
