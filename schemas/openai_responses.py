"""OpenAI's Responses API (``POST /v1/responses``): the text and function-calling subset swarmroute serves.

Shapes follow openai-python's ``openai.types.responses`` (checked with openai 3.57): requests as its
``ResponseCreateParams``, the response object as ``Response``, stream events as the members of
``ResponseStreamEvent`` named here. Conversion to and from chat turns, and the order of stream events, are the
gateway's (``gateway/responses.py``). Parameters outside the subset are refused with a 400 naming them
(``unsupported_param``); only background responses are kept (``ResponseRecord``, for the window
``responses_retention_s``: issue #31), so ``previous_response_id`` is refused. Requests are as strict as
chat requests (``schemas.openai.RequestBody``: unknown fields and mistyped values are 400s naming them); input items
take the keys the SDK's own item types have, so that a reply's ``output`` items can be sent back as ``input``; a
``function_call_output`` answers a ``function_call`` before it, and every call is answered, as OpenAI requires.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from schemas.base import WireModel
from schemas.openai import RequestBody, RequestPart, field_error
from schemas.reasoning import ReasoningStart
from schemas.route import Route
from schemas.session import MAX_TOP_LOGPROBS
from schemas.tools import FUNCTION_NAME_PATTERN, ToolCallFormat


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class _Part(RequestPart):
    model_config = ConfigDict(populate_by_name=True)


# ---- request ----------------------------------------------------------------------------------------------------

class InputText(_Part):
    type: Literal["input_text"]
    text: str


class OutputTextIn(_Part):
    """An earlier assistant reply's text, sent back as input."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalIn(_Part):
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | OutputTextIn | RefusalIn, Field(discriminator="type")]


class MessageItem(_Part):
    """A turn: ``{"role", "content"}`` (``type: "message"`` optional, as in the SDK's ``EasyInputMessageParam``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, RefusalIn) else p.text for p in self.content)


class FunctionCallItem(_Part):
    """An earlier reply's call, sent back as input."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Part):
    """The caller's result of a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningTextIn(_Part):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItemIn(_Part):
    """An earlier reply's reasoning, sent back as input (as the SDK's docs ask): accepted, and not rendered (chat
    templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningTextIn] = Field(default_factory=list)
    content: list[ReasoningTextIn] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItemIn,
                      Field(discriminator="type")]


class FunctionToolParam(_Part):
    """A Responses tool: flat, ``{"type": "function", "name", "description", "parameters", "strict"}``."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Part):
    type: Literal["function"]
    name: str


class TextFormatText(_Part):
    type: Literal["text"]


class TextFormatJsonObject(_Part):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Part):
    """Flat, unlike chat's: ``{"type": "json_schema", "name", "schema", "strict", "description"}``."""

    type: Literal["json_schema"]
    name: str = Field(default="response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")]


class TextConfig(_Part):
    format: TextFormat | None = None


UNSUPPORTED_PARAMS: dict[str, str] = {
    "previous_response_id": "this server stores no responses: send the conversation in 'input'",
    "conversation": "this server stores no conversations: send the conversation in 'input'",
    "prompt": "prompt templates are not supported",
    "reasoning": "this server serves no reasoning models",
    "max_tool_calls": "max_tool_calls is not supported",
}
"""Responses parameters outside the subset; set to anything but null/false/empty they are a 400 naming them.
``store``, ``metadata``, ``service_tier``, ``user``, ``truncation`` and ``safety_identifier`` are accepted; nothing
is stored whatever ``store`` says (the response reports ``store: false``) but a background response, for a while."""

INCLUDABLE = frozenset({"message.output_text.logprobs"})
"""``include`` values served (the only one that changes a text reply)."""


class StreamOptions(_Part):
    include_obfuscation: bool | None = Field(default=None, description="accepted and ignored: no obfuscation "
                                             "padding is sent")


class ResponsesRequest(RequestBody):
    KNOWN_EXTRA = frozenset(UNSUPPORTED_PARAMS)
    model_config = ConfigDict(populate_by_name=True)

    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    stream: bool = False
    text: TextConfig | None = None
    # Field order matters: tool_choice's validator sees tools (ValidationInfo.data).
    tools: list[FunctionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    seed: int | None = Field(default=None, description="swarmroute extension, as in chat completions")
    stream_options: StreamOptions | None = None
    background: bool | None = Field(default=None, description="run on without the client: returned at once, then "
                                    "retrieved, resumed or cancelled by id on any gateway (issue #31)")
    # Parameters that change nothing about the reply: accepted, checked, ignored.
    store: bool | None = None
    service_tier: str | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_messages(cls, data: Any) -> Any:
        # The SDK's easy input messages may omit "type": give them the discriminator.
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [{**i, "type": "message"} if isinstance(i, dict) and "type" not in i and "role"
                                      in i else i for i in data["input"]]}
        return data

    @field_validator("input")
    @classmethod
    def _some_input(cls, v: str | list[InputItem]) -> str | list[InputItem]:
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        if isinstance(v, list):
            _check_calls_answered(v)
        return v

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, v: list[FunctionToolParam] | None) -> list[FunctionToolParam] | None:
        names = [t.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, v: object, info: ValidationInfo) -> object:
        if v is None or v in ("none", "auto"):
            return v
        names = [t.name for t in info.data.get("tools") or []]
        if not names:
            raise ValueError("tool_choice requires tools")
        if isinstance(v, FunctionChoice) and v.name not in names:
            raise ValueError(f"tool_choice names {v.name!r}, which is not among the tools {names}")
        return v

    @field_validator("include")
    @classmethod
    def _includable(cls, v: list[str] | None) -> list[str] | None:
        unknown = sorted(set(v or []) - INCLUDABLE)
        if unknown:
            raise ValueError(f"include values {unknown} are not supported (only {sorted(INCLUDABLE)})")
        return v

    def unsupported_param(self) -> tuple[str, str] | None:
        """The first parameter outside the subset that is set: ``(name, why)``."""
        extra = self.model_extra or {}
        for name, why in UNSUPPORTED_PARAMS.items():
            if extra.get(name) not in (None, False, "", [], {}):
                return name, why
        return None


def _check_calls_answered(items: list[InputItem]) -> None:
    """A ``function_call_output`` answers a ``function_call`` before it; every call gets its output."""
    calls: dict[str, int] = {}
    answered: set[str] = set()
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            calls.setdefault(item.call_id, i)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise field_error("ResponsesRequest", (i, "call_id"), f"no function_call with call_id "
                                  f"{item.call_id!r} comes before this function_call_output", item.call_id)
            answered.add(item.call_id)
    unanswered = [call_id for call_id in calls if call_id not in answered]
    if unanswered:
        raise field_error("ResponsesRequest", (calls[unanswered[0]], "call_id"), f"no function_call_output "
                          f"answers the function_call {unanswered[0]!r}", unanswered[0])


# ---- response ---------------------------------------------------------------------------------------------------

class ResponseTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ResponseLogprob(ResponseTopLogprob):
    top_logprobs: list[ResponseTopLogprob]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ResponseLogprob] | None = None


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A reply's think block (issue #27), before its message or calls: the text in ``content``, no summary."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: ItemStatus


OutputItem = OutputMessage | FunctionCall | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class ResponseObject(_Lenient):
    """``Response``; extra keys (the ``swarmroute`` telemetry) are kept, as on chat completions."""

    id: str
    object: Literal["response"] = "response"
    created_at: float = Field(default_factory=lambda: float(int(time.time())))
    status: ResponseStatus
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    previous_response_id: None = None
    store: bool = False
    truncation: Literal["disabled"] = "disabled"
    background: bool = False

    @property
    def output_text(self) -> str:
        return "".join(p.text for item in self.output if isinstance(item, OutputMessage) for p in item.content)


# ---- stream events ----------------------------------------------------------------------------------------------

class _Event(_Lenient):
    sequence_number: int


class ResponseCreatedEvent(_Event):
    type: Literal["response.created"] = "response.created"
    response: ResponseObject


class ResponseInProgressEvent(_Event):
    type: Literal["response.in_progress"] = "response.in_progress"
    response: ResponseObject


class ResponseCompletedEvent(_Event):
    type: Literal["response.completed"] = "response.completed"
    response: ResponseObject


class ResponseIncompleteEvent(_Event):
    type: Literal["response.incomplete"] = "response.incomplete"
    response: ResponseObject


class ResponseFailedEvent(_Event):
    type: Literal["response.failed"] = "response.failed"
    response: ResponseObject


class OutputItemAddedEvent(_Event):
    type: Literal["response.output_item.added"] = "response.output_item.added"
    output_index: int
    item: OutputItem


class OutputItemDoneEvent(_Event):
    type: Literal["response.output_item.done"] = "response.output_item.done"
    output_index: int
    item: OutputItem


class ContentPartAddedEvent(_Event):
    type: Literal["response.content_part.added"] = "response.content_part.added"
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDoneEvent(_Event):
    type: Literal["response.content_part.done"] = "response.content_part.done"
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ResponseLogprob] = Field(default_factory=list)


class OutputTextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ResponseLogprob] = Field(default_factory=list)


class FunctionCallArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ReasoningTextDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str


class ReasoningTextDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


ResponseEvent = (ResponseCreatedEvent | ResponseInProgressEvent | ResponseCompletedEvent | ResponseIncompleteEvent
                 | ResponseFailedEvent | OutputItemAddedEvent | OutputItemDoneEvent | ContentPartAddedEvent
                 | ContentPartDoneEvent | OutputTextDeltaEvent | OutputTextDoneEvent | FunctionCallArgumentsDeltaEvent
                 | FunctionCallArgumentsDoneEvent | ReasoningTextDeltaEvent | ReasoningTextDoneEvent | ErrorEvent)


# ---- background responses (issue #31) ----------------------------------------------------------------------------

class ResponseRecord(WireModel):
    """What the gateway that opened a background response stores beside its session's events (JetStream,
    ``gateway.response_store``): with it, any gateway rebuilds the same stream events from the head's token events
    (``gateway.background``), and cancels the session on its route."""

    response_id: str
    session_id: str
    created_at: float
    request: dict[str, Any] = Field(description="the ResponsesRequest as the client sent it")
    prompt_tokens: int = Field(ge=0, description="as the head counted them")
    tool_format: ToolCallFormat | None = Field(default=None, description="how the head asked for tool calls")
    route: Route = Field(description="as opened, with the head's session token (to cancel it)")
    reasoning: ReasoningStart | None = Field(
        default=None, description="where the reply starts relative to a think block (the head's "
                                  "SessionOpened.reasoning), when the opening gateway's reasoning format splits it off "
                                  "into a reasoning item; None: the reply is text (issue #27)")
