"""Prefix keys: names for what a request starts with, computed the same way by any gateway and any node, so that
trackers can route a request to nodes that kept the KV of a request it extends (issue #18, reuse; issue #26).

A chat's keys chain over its messages (key ``i`` names messages ``0..i``); a completion's over its text in blocks
of ``TEXT_BLOCK`` characters (key ``i`` names the first ``(i + 1) * TEXT_BLOCK``). The next turn of a chat or of a
tool loop resends the conversation, the last reply included, so its keys extend those of the session that produced
the reply; a prompt that diverges in its last words shares every key but the last few; users of one system prompt
share its key. Keys are coarse on purpose: they route (the tracker picks the route whose every hop advertises the
longest of a request's keys), and the node then reuses down to the token by comparing token ids
(``actors.node.prefix_cache``), so a key that matches wrongly costs a cold prefill, never a wrong answer, and the
tokens after the last whole key are reused all the same. A finished session advertises its longest few keys and,
spaced geometrically below them, shorter ones down to its first (a shared system prompt), so a heartbeat stays
small and a request that parts early still finds the route.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

TEXT_BLOCK = 64
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
    longest four, shorter ones spaced geometrically below them, and the first; shortest first (the nodes
    advertise them)."""
    if messages is not None:
        keys = message_keys([*messages, {"role": "assistant", "content": reply}])
    else:
        keys = text_keys((text or "") + reply)
    return [keys[i] for i in _advertised(len(keys))]


def _advertised(n: int) -> list[int]:
    """Indices of ``n`` keys worth advertising: the last four, ``n - 1 - 2**k`` below them, and 0."""
    picks = set(range(max(0, n - 4), n)) | {n - 1 - 2**k for k in range(2, 12) if n - 1 - 2**k >= 0}
    return sorted(picks | ({0} if n else set()))
