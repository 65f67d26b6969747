"""OpenAI-compatible request, response and stream-chunk types (the subset swarmroute serves).

Requests are validated as strictly as OpenAI's API validates them (issue #30): an unknown field is a 400 naming it,
and so is a mistyped one, numbers and booleans included (``"10"``, ``true`` or ``10.5`` is no ``max_tokens``; an
integer is a valid float), as OpenAI answers them. OpenAI parameters whose meaning we cannot honour are known, but
refused with a 400 naming them and why rather than silently ignored: the ``UNSUPPORTED_PARAMS`` (checked by
``unsupported_param``). A ``null`` is the parameter's default, as at OpenAI. Field validation errors carry the field
in their location (``bus.http_edge`` turns it into the error's ``param``); checks across fields are attached to the
later field for the same reason. The limits of what is checked, and the few deliberate leniencies, are listed in
docs/protocol.md (Gateway: request validation).

The Responses API's models are in ``schemas.openai_responses``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from schemas.reasoning import ReasoningFormat
from schemas.session import MAX_CHOICES, MAX_TOP_LOGPROBS
from schemas.tools import FunctionSpec

UNSUPPORTED_PARAMS: dict[str, str] = {
    "audio": "audio output is not supported",
    "modalities": "only the text modality is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the deprecated 'functions' is not supported: use 'tools'",
    "function_call": "the deprecated 'function_call' is not supported: use 'tool_choice'",
    "logit_bias": "logit_bias is not supported",
    "reasoning_effort": "reasoning_effort is not supported: a model reasons as its chat template says "
                        "(reasoning_format chooses how its reasoning is returned)",
    "best_of": "best_of > 1 is not supported",
    "suffix": "suffix (insertion) is not supported",
}
"""OpenAI parameters swarmroute does not honour, and why; sent with a value other than their neutral one
(``_neutral``) they are a 400 naming the parameter. Parameters that change nothing about the reply (``store``,
``metadata``, ``service_tier``, ``user``, ``prompt_cache_key``, ``safety_identifier``) are accepted and ignored."""


def _neutral(name: str, value: object) -> bool:
    if value is None or value is False or value == [] or value == {} or value == "":
        return True
    if name == "modalities":
        return value == ["text"]
    if name == "best_of":
        return value == 1
    return False


def unsupported_param(req: BaseModel) -> tuple[str, str] | None:
    """The first ``UNSUPPORTED_PARAMS`` entry the request sets to a non-neutral value: ``(name, why)``."""
    extra = req.model_extra or {}
    for name, why in UNSUPPORTED_PARAMS.items():
        if name in extra and not _neutral(name, extra[name]):
            return name, why
    return None

TELEMETRY_KEY = "swarmroute"
"""The one namespaced extra key under which chunks and responses carry Generation Telemetry."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


def field_error(model: str, loc: tuple[str | int, ...], message: str, value: object) -> ValidationError:
    """A validation error at ``loc`` (relative to where it is raised) with ``message``: raised in a validator, it
    names the field the way pydantic's own errors do."""
    return ValidationError.from_exception_data(model, [InitErrorDetails(
        type=PydanticCustomError("invalid_value", message.replace("{", "{{").replace("}", "}}")), loc=loc,
        input=value)])


class RequestPart(BaseModel):
    """A part of a request body: unknown keys and mistyped values (strict numbers and booleans) are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RequestBody(BaseModel):
    """A request body: strict like ``RequestPart``, but it keeps, as extras, the parameters of ``KNOWN_EXTRA`` (the
    ones refused by name, with the reason, once set: ``unsupported_param``); any other unknown field is refused. A
    ``null`` for a field that takes none is the field's default, as OpenAI reads it."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    KNOWN_EXTRA: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or fields[k].is_required() or fields[k].default is None}

    @model_validator(mode="after")
    def _no_unknown_fields(self) -> Self:
        unknown = [(k, v) for k, v in (self.model_extra or {}).items() if k not in self.KNOWN_EXTRA]
        if unknown:
            raise ValidationError.from_exception_data(type(self).__name__, [
                InitErrorDetails(type="extra_forbidden", loc=(k,), input=v) for k, v in unknown])
        return self


class StreamOptions(RequestPart):
    include_usage: bool = False
    include_telemetry: bool = Field(
        default=False, description="swarmroute extension: also send choice-less chunks carrying only telemetry"
    )
    include_obfuscation: bool | None = Field(default=None, description="accepted and ignored: no obfuscation "
                                             "padding is sent")


class ToolCallFunction(RequestPart):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCall(RequestPart):
    """A call in an assistant message (``message.tool_calls``, and sent back in the next request's history)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


_TEXT_PART_KEYS = frozenset({"type", "text"})


class ChatMessage(RequestPart):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    refusal: str | None = Field(default=None, description="an assistant's refusal, sent back: rendered as its text")
    reasoning_content: str | None = Field(default=None, description="an assistant's reasoning, sent back (llama-server"
                                          " and DeepSeek's field): given to the template, which may render it")
    # What the SDK's ``message.model_dump()`` holds besides, sent back with a history: annotations are ignored,
    # audio and function_call accepted when null.
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        for name in ("audio", "function_call"):
            if getattr(self, name):
                raise field_error("ChatMessage", (name,), f"{name} in a message is not supported",
                                  getattr(self, name))
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal is not None)):
            what = "null" if "content" in self.model_fields_set else "missing"
            need = "content or tool_calls" if self.role == "assistant" else "content"
            raise field_error("ChatMessage", ("content",), f"a {self.role} message needs {need} (a string or a "
                              f"list of text parts); content is {what}", self.content)
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                problem = _text_part_problem(part)
                if problem:
                    raise field_error("ChatMessage", ("content", i), problem, part)
        return self

    def text(self) -> str:
        """Content as plain text; list content must be text parts only."""
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str] = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


def _text_part_problem(part: dict[str, Any]) -> str | None:
    """What is wrong with a text part; other parts are refused as unsupported when rendered (``text``)."""
    if part.get("type") != "text":
        return None
    if not isinstance(part.get("text"), str):
        return "a text part needs its text (a string)"
    unknown = sorted(set(part) - _TEXT_PART_KEYS)
    return f"unrecognized keys {unknown} in a text part (it takes 'type' and 'text')" if unknown else None


class FunctionDefinition(RequestPart):
    """``tools[].function`` as a client sends it: checked strictly here, carried as ``FunctionSpec``."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(RequestPart):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionSpec

    @field_validator("function", mode="before")
    @classmethod
    def _strict_definition(cls, v: Any) -> Any:
        # FunctionSpec is a wire part (tolerant of unknown keys, lax types): the client's definition is held to
        # the request's rules first.
        if isinstance(v, dict):
            FunctionDefinition.model_validate(v)
            if v.get("parameters", ...) is None:
                v = {k: x for k, x in v.items() if k != "parameters"}
        return v


class NamedFunction(RequestPart):
    name: str


class NamedToolChoice(RequestPart):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(RequestPart):
    name: str = Field(default="response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", default_factory=dict)
    strict: bool | None = None


class TextFormat(RequestPart):
    type: Literal["text"]


class JsonObjectFormat(RequestPart):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(RequestPart):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class _GenerationRequest(RequestBody):
    KNOWN_EXTRA = frozenset(UNSUPPORTED_PARAMS)

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # llama.cpp extensions, accepted as top-level fields like llama.cpp's own server does
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    timings_per_token: bool = Field(default=False, description="llama-server's: llama.cpp-style ``timings`` on "
                                    "every streamed chunk, not only the last")
    # swarmroute extension (issue #31): this request's tokens do not depend on what else the route computes.
    batch_invariant: bool = False
    # OpenAI parameters that change nothing about the reply: accepted, checked, ignored.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    # Field order matters: a validator sees the fields declared before its own (ValidationInfo.data).
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_format: ReasoningFormat | None = Field(default=None, description="llama-server's: how a reply's think "
                                                     "block is returned (None: the server's setting)")

    @field_validator("messages")
    @classmethod
    def _tool_results_answer_calls(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        """As OpenAI requires: tool messages follow the assistant message whose calls they answer, one per call."""
        calls: set[str] = set()  # the calls of the last assistant message, if tool messages may still follow
        pending: dict[str, int] = {}  # those not answered yet -> the index of the message that made them
        for i, m in enumerate(v):
            if m.role == "tool":
                if m.tool_call_id not in calls:
                    why = (f"answers the call {m.tool_call_id!r}, which the assistant message before it did not "
                           f"make (its calls: {sorted(calls)})") if calls else \
                        "does not follow an assistant message with tool_calls"
                    raise field_error("ChatCompletionRequest", (i, "tool_call_id"), f"a tool message must answer a "
                                      f"call of the assistant message before it; this one {why}", m.tool_call_id)
                pending.pop(m.tool_call_id, None)
                continue
            _all_answered(pending)
            calls = {c.id for c in m.tool_calls or []} if m.role == "assistant" else set()
            pending = dict.fromkeys(calls, i)
        _all_answered(pending)
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, v: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [t.function.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, v: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if v is None or v in ("none", "auto"):
            return v
        names = [t.function.name for t in info.data.get("tools") or []]
        if not names:
            raise ValueError("tool_choice requires tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"tool_choice names {v.function.name!r}, which is not among the tools {names}")
        return v


def _all_answered(pending: dict[str, int]) -> None:
    if pending:
        raise field_error("ChatCompletionRequest", (next(iter(pending.values())), "tool_calls"),
                          f"an assistant message with tool_calls must be followed by a tool message for each call; "
                          f"none answers {sorted(pending)}", sorted(pending))


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] = Field(description="text, or a list of token ids")
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="the N most likely tokens at each position (OpenAI allows up to 5)")
    response_format: ResponseFormat | None = Field(default=None, description="llama.cpp's server extension")

    @field_validator("logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        # OpenAI answers echo + logprobs with the prompt tokens' logprobs too. The tail computes logprobs only from
        # the rows it samples from (the prompt's last); every prompt row's logits would have to come back from it.
        # Returning the generated tokens' alone would silently drop what was asked for.
        if v is not None and info.data.get("echo"):
            raise ValueError("logprobs with echo asks for the prompt tokens' logprobs, which this server does not "
                             "compute; drop echo (and prepend the prompt yourself) or drop logprobs")
        return v


def _absent(v: object) -> bool:
    return v is None


class Timings(BaseModel):
    """llama-server's ``timings`` (tools/server/server-common.cpp, ``server_slot_stats::to_json``), from what the
    route measured: ``prompt_n`` prompt tokens computed and ``cache_n`` reused (together the prompt), the prefill's
    wall time; ``predicted_n`` tokens generated, the time from the first to the last (the first token comes with the
    prefill, so the per-token figures divide by ``predicted_n - 1`` decode steps); the speculative drafts verified
    and accepted, present only when there were any."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | None = Field(default=None, exclude_if=_absent)
    draft_n_accepted: int | None = Field(default=None, exclude_if=_absent)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt positions taken from KV the route kept from an earlier request (issue #26, prefix reuse)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Chat ``choices[].logprobs``: one entry per generated token."""

    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """Completions ``choices[].logprobs`` (the legacy shape, as llama-cpp-python and vLLM return it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = Field(default=None, exclude_if=_absent)
    """The reply's think block, for a model whose template marks reasoning (absent otherwise)."""
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Lenient):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallFunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of a call: the first carries ``id``, ``type`` and the name, later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ToolCallFunctionDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Lenient):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Lenient):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Lenient):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "swarmroute"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
