"""Prefix keys: names for what a request starts with, computed the same way by any gateway and any node, so that
trackers can route a request to nodes that kept the KV of a request it extends (issue #18, reuse).

A chat's keys chain over its messages (key ``i`` names messages ``0..i``); a completion's over its text in blocks
of ``TEXT_BLOCK`` characters (key ``i`` names the first ``(i + 1) * TEXT_BLOCK``). The next turn of a chat resends
the conversation, the last reply included, so its keys extend those of the session that produced the reply. Keys
only steer routing: what a node reuses is decided on token ids (``actors.node.prefix_cache``), so a key that
matches wrongly costs a cold prefill, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

TEXT_BLOCK = 256
KEY_CHARS = 24
MAX_KEYS = 64


def _chain(previous: str, part: bytes) -> str:
    return hashlib.sha256(previous.encode() + b"\x00" + part).hexdigest()[:KEY_CHARS]


def message_keys(messages: Sequence[Mapping[str, object]]) -> list[str]:
    """One key per message prefix, shortest first."""
    keys, key = [], "chat"
    for message in messages:
        canonical = json.dumps({"role": message.get("role"), "content": message.get("content"),
                                "tool_calls": message.get("tool_calls"), "name": message.get("name")},
                               sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        key = _chain(key, canonical.encode())
        keys.append(key)
    return keys[-MAX_KEYS:]


def text_keys(text: str) -> list[str]:
    """One key per whole block of the text, shortest first."""
    keys, key = [], "text"
    for end in range(TEXT_BLOCK, len(text) + 1, TEXT_BLOCK):
        key = _chain(key, text[end - TEXT_BLOCK:end].encode())
        keys.append(key)
    return keys[-MAX_KEYS:]


def request_keys(messages: Sequence[Mapping[str, object]] | None, text: str | None) -> list[str]:
    """The keys of what a request starts with (its route request carries them)."""
    if messages is not None:
        return message_keys(messages)
    return text_keys(text or "")


def conversation_keys(messages: Sequence[Mapping[str, object]] | None, text: str | None, reply: str) -> list[str]:
    """The keys of what a completed session's KV holds, its reply included: what the next turn extends. The
    longest few only (the nodes advertise them)."""
    if messages is not None:
        return message_keys([*messages, {"role": "assistant", "content": reply}])[-4:]
    return text_keys((text or "") + reply)[-4:]
