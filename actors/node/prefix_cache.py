"""Finished sessions' KV a node keeps so that a later request starting with the same tokens prefills only what is
new (issue #18, reuse): the next turn of a chat resends the whole conversation, and requests share system prompts.

An entry is a finished session's KV, exported from the backend in pieces of ``chunk`` positions (the session's
prefill chunk) and kept in host memory, with the token ids of its positions; the backend's cells are freed at once,
so kept entries never change where a running session's cells land. A new session takes the longest common prefix
of its prompt with an entry, rounded down to whole chunks and leaving its last prompt token to compute: its prefill
then continues in exactly the chunks a cold prefill would use, so a prompt that repeats a kept one (a shared system
prompt, a retried request) computes exactly what a cold run computes; positions the kept session decoded one at a
time (a chat's previous reply) differ from a cold prefill's only as two batch shapes of llama.cpp do.

Entries go least recently used first, within a number of entries and of bytes; an entry whose tokens another,
newer one extends is dropped. Routing keys (``schemas.prefix``) name what an entry holds so that trackers can send
the next turn to nodes that kept the last one. Pure bookkeeping: the node runs the backend calls.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

MAX_KEYS = 32
"""Routing keys a node advertises (the most recent entries')."""


@dataclasses.dataclass
class Kept:
    tokens: list[int]
    """The token id of every position the KV holds."""
    pieces: list[bytes]
    """The KV of positions ``[i * chunk, (i + 1) * chunk)``, in order (the last may be shorter)."""
    chunk: int
    token: str | None = None
    """The session token of the session it came from: only a member may name it with keys later."""
    keys: list[str] = dataclasses.field(default_factory=list)
    used: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.pieces)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable(shared: int, prompt: int, chunk: int) -> int:
    """Of ``shared`` positions a new prompt of ``prompt`` tokens has in common with kept KV, how many it reuses:
    whole chunks only, and never its last token (the tail samples the first token after it)."""
    return min(shared, prompt - 1) // chunk * chunk if chunk > 0 else 0


class PrefixCache:
    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self.evicted = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return sum(e.size for e in self._entries.values())

    def keep(self, name: str, entry: Kept) -> None:
        """Keep ``entry`` under ``name`` (its session's id), dropping what it supersedes and what no longer fits."""
        if not self.enabled or entry.size > self.max_bytes:
            return
        for other, kept in list(self._entries.items()):
            if len(kept.tokens) <= len(entry.tokens) and entry.tokens[:len(kept.tokens)] == kept.tokens:
                del self._entries[other]  # the new entry holds all this one did
        self._entries[name] = entry
        while len(self._entries) > self.max_entries or self.bytes_used > self.max_bytes:
            self._entries.popitem(last=False)
            self.evicted += 1

    def match(self, prompt: Sequence[int], chunk: int) -> tuple[Kept, int] | None:
        """The entry ``prompt`` reuses most of (``reusable`` positions of it, at least one chunk), if any."""
        best: tuple[str, Kept, int] | None = None
        for name, entry in self._entries.items():
            if entry.chunk != chunk:
                continue
            n = reusable(common_prefix(entry.tokens, prompt), len(prompt), chunk)
            if n > 0 and (best is None or n > best[2]):
                best = (name, entry, n)
        if best is None:
            return None
        name, entry, n = best
        entry.used = time.monotonic()
        self._entries.move_to_end(name)
        return entry, n

    def get(self, name: str) -> Kept | None:
        return self._entries.get(name)

    def attach_keys(self, name: str, keys: Sequence[str]) -> bool:
        entry = self._entries.get(name)
        if entry is None:
            return False
        entry.keys = list(keys)[-MAX_KEYS:]
        return True

    def keys(self) -> list[str]:
        """Routing keys of the entries, the most recent entry's first (at most ``MAX_KEYS``)."""
        out: list[str] = []
        for entry in reversed(self._entries.values()):
            out.extend(k for k in reversed(entry.keys) if k not in out)
            if len(out) >= MAX_KEYS:
                break
        return out[:MAX_KEYS]
