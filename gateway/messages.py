"""Chat request messages as the head renders them (``Prompt.messages``): text content, plus, since issue #19, an
assistant's ``tool_calls`` and a tool result's ``tool_call_id`` and ``name``, so a tool result round-trips into
the next turn (the head's chat template, or its generic fallback, renders them)."""

from __future__ import annotations

from schemas.errors import BadRequestError
from schemas.openai import ChatMessage


def head_messages(messages: list[ChatMessage]) -> list[dict[str, object]]:
    """``Prompt.messages``; a 400 naming ``messages`` for content the head cannot render (non-text parts)."""
    out: list[dict[str, object]] = []
    for m in messages:
        try:
            turn: dict[str, object] = {"role": m.role, "content": m.text()}
        except ValueError as exc:
            raise BadRequestError(str(exc), param="messages") from None
        if m.tool_calls:
            turn["tool_calls"] = [c.model_dump(mode="json") for c in m.tool_calls]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            turn["name"] = m.name
        if m.reasoning_content is not None:  # a reasoning model's earlier turn: templates that show it read it
            turn["reasoning_content"] = m.reasoning_content
        out.append(turn)
    return out
