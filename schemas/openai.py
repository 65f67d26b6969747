"""OpenAI-compatible request, response and stream-chunk types (the subset swarmroute serves).

Requests tolerate unknown fields, as OpenAI's own API does, but a field whose meaning we cannot honour
(``n > 1``, ``tools``, ``logprobs``) is rejected by the gateway rather than silently ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TELEMETRY_KEY = "swarmroute"
"""The one namespaced extra key under which chunks and responses carry Generation Telemetry."""


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool = False
    include_telemetry: bool = Field(
        default=False, description="swarmroute extension: also send choice-less chunks carrying only telemetry"
    )


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Content as plain text; list content must be text parts only."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts: list[str] = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class _GenerationRequest(_Lenient):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)
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
    user: str | None = None

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


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] = Field(description="text, or a list of token ids")
    echo: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(_Lenient):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


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
    logprobs: None = None


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
