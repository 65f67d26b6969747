"""Tools in the prompt: what the head renders so a model knows its tools and how to call them (issue #19).

Two ways, chosen by the chat template (``ChatTemplate.tool_format``):

* **hermes** (native): the template renders ``tools`` itself and knows ``<tool_call>`` blocks (Hermes, Qwen 2.5 and
  their fine-tunes). The messages go in as Transformers expects them: ``tools`` as ``[{"type": "function",
  "function": {...}}]``, an assistant's ``tool_calls`` with ``arguments`` as an object (templates ``tojson`` them),
  ``role: tool`` messages as they are.
* **generic** (fallback): for every other template, including none at all (the bundled Gemma 3 270M carries none
  and renders with Google's Gemma turns). The tools and the reply format are described in the system turn; earlier
  tool calls become the assistant's JSON reply in that format and tool results become user turns, and consecutive
  turns of one role are merged, because templates without tool support often accept only alternating user and
  assistant turns. llama.cpp's server has the same fallback (its "Generic" format); the reply format is in
  ``schemas.tools``, where the gateway's parser reads it too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from schemas.errors import BadRequestError
from schemas.tools import GENERIC_CALL_KEY, GENERIC_CALLS_KEY, GENERIC_RESPONSE_KEY, ToolSet


def tool_dicts(tools: ToolSet) -> list[dict[str, Any]]:
    """OpenAI's ``tools`` list, as templates iterate it."""
    return [{"type": "function", "function": t.model_dump(exclude_none=True)} for t in tools.tools]


def _arguments(raw: object) -> object:
    """A call's arguments as an object: OpenAI sends a JSON string, templates want the object."""
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise BadRequestError(f"tool call arguments are not JSON: {raw[:80]!r}", param="messages") from None
    return raw if raw is not None else {}


def _calls(message: Mapping[str, object]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as ``{"id", "name", "arguments": object}``."""
    raw = message.get("tool_calls")
    if not raw:
        return []
    if not isinstance(raw, list):
        raise BadRequestError("tool_calls must be a list", param="messages")
    calls = []
    for call in raw:
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise BadRequestError("every tool call needs function.name", param="messages")
        calls.append({"id": call.get("id", ""), "name": fn["name"], "arguments": _arguments(fn.get("arguments"))})
    return calls


def native_messages(messages: Sequence[Mapping[str, object]]) -> list[dict[str, object]]:
    """Messages for a template that renders tool calls itself: arguments as objects, nothing else changed."""
    out = []
    for message in messages:
        m = dict(message)
        calls = _calls(message)
        if calls:
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        out.append(m)
    return out


def instructions(tools: ToolSet) -> str:
    """The system text of the generic format: the functions, then the one JSON reply the model may write."""
    specs = json.dumps([t.model_dump(exclude_none=True, exclude={"strict"}) for t in tools.callable_tools()],
                       ensure_ascii=False)
    one = f'{{"{GENERIC_CALL_KEY}": {{"name": "<function name>", "arguments": {{<arguments>}}}}}}'
    many = f'{{"{GENERIC_CALLS_KEY}": [{{"name": "<function name>", "arguments": {{<arguments>}}}}, ...]}}'
    call = many if tools.parallel else one
    lines = [f"You can call these functions (JSON Schema of each one's arguments):\n{specs}", "",
             "Reply with one JSON object and nothing else."]
    if tools.mode == "function":
        lines.append(f"Call the function {tools.function}: {call}")
    elif tools.mode == "required":
        lines.append(f"Call one of the functions: {call}")
    else:
        lines.append(f"To call functions: {call}")
        lines.append(f'To answer the user directly instead: {{"{GENERIC_RESPONSE_KEY}": "<your answer>"}}')
    return "\n".join(lines)


def generic_messages(messages: Sequence[Mapping[str, object]], tools: ToolSet | None,
                     *, parallel: bool = True) -> list[dict[str, object]]:
    """Messages for a template without tool support: the instructions in the system turn (when there are tools),
    tool calls and results as ordinary turns, consecutive turns of one role merged. ``content`` must already be
    text (``chat_template`` normalizes it)."""
    names: dict[str, str] = {}
    turns: list[tuple[dict[str, object], bool]] = []  # (turn, made here from a tool call or result)
    for message in messages:
        role = message.get("role")
        calls = _calls(message) if role == "assistant" else []
        if calls:
            names.update({str(c["id"]): str(c["name"]) for c in calls})
            body = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
            envelope = ({GENERIC_CALLS_KEY: body} if parallel or len(body) > 1 else {GENERIC_CALL_KEY: body[0]})
            turns.append(({"role": "assistant", "content": json.dumps(envelope, ensure_ascii=False)}, True))
        elif role == "tool":
            call_id = str(message.get("tool_call_id") or "")
            name = str(message.get("name") or names.get(call_id, "a function"))
            label = f"{name} ({call_id})" if call_id else name
            turns.append(({"role": "user", "content": f"Result of {label}:\n{message.get('content') or ''}"}, True))
        else:
            turns.append(({k: v for k, v in message.items() if k != "tool_calls"}, False))
    if tools is not None:
        text = instructions(tools)
        if turns and turns[0][0].get("role") == "system":
            first = turns[0][0]
            turns[0] = ({**first, "content": f"{first.get('content') or ''}\n\n{text}".lstrip()}, False)
        else:
            turns.insert(0, ({"role": "system", "content": text}, False))
    # Only turns made here are merged with a neighbour of the same role: two user messages the caller sent stay
    # two (and a template that refuses them still says so).
    merged: list[tuple[dict[str, object], bool]] = []
    for turn, made in turns:
        if merged and merged[-1][0]["role"] == turn["role"] and (made or merged[-1][1]):
            last = merged[-1][0]
            merged[-1] = ({**last, "content": f"{last.get('content') or ''}\n\n{turn.get('content') or ''}"}, True)
        else:
            merged.append((turn, made))
    return [turn for turn, _ in merged]
