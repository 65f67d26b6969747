"""Finished sessions' KV a node keeps so that a later request starting with the same tokens prefills only what is
new (issue #18, reuse): the next turn of a chat resends the whole conversation, and requests share system prompts.

An entry is a finished session's backend session, kept open instead of freed, with the token ids of the positions
its KV holds. A new session takes the longest common prefix of its prompt with any entry (at most all but its last
token: the tail needs one position to sample from), which the backend shares into the new session's sequence
(``KvBackend.copy_prefix``). Entries go least recently used first, within a number of sessions and of positions.
Routing keys (``schemas.prefix``) name what an entry holds so that trackers can send the next turn to nodes that
kept the last one. Pure bookkeeping: the node runs the backend calls.
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
    backend_id: str
    """The backend session that holds the KV (the finished session's id)."""
    tokens: list[int]
    """The token id of every position its KV holds."""
    keys: list[str] = dataclasses.field(default_factory=list)
    used: float = dataclasses.field(default_factory=time.monotonic)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(self, *, max_sessions: int, max_positions: int) -> None:
        self.max_sessions = max_sessions
        self.max_positions = max_positions
        self._entries: collections.OrderedDict[str, Kept] = collections.OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_sessions > 0 and self.max_positions > 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def positions(self) -> int:
        return sum(len(e.tokens) for e in self._entries.values())

    def keep(self, backend_id: str, tokens: Sequence[int]) -> list[str]:
        """Keep a finished session's KV; returns the backend sessions to free now (evicted, or this one itself
        when it alone outgrows the budget)."""
        if not self.enabled or not tokens or len(tokens) > self.max_positions:
            return [backend_id]
        self._entries[backend_id] = Kept(backend_id, list(tokens))
        evicted = []
        while len(self._entries) > self.max_sessions or self.positions > self.max_positions:
            oldest, _ = self._entries.popitem(last=False)
            evicted.append(oldest)
        return evicted

    def match(self, prompt: Sequence[int]) -> tuple[Kept, int] | None:
        """The entry sharing the longest prefix with ``prompt`` (at most ``len(prompt) - 1`` positions)."""
        best: tuple[Kept, int] | None = None
        for entry in self._entries.values():
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if n > 0 and (best is None or n > best[1]):
                best = (entry, n)
        if best is not None:
            best[0].used = time.monotonic()
            self._entries.move_to_end(best[0].backend_id)
        return best

    def attach_keys(self, backend_id: str, keys: Sequence[str]) -> bool:
        entry = self._entries.get(backend_id)
        if entry is None:
            return False
        entry.keys = list(keys)[-MAX_KEYS:]
        return True

    def drop(self, backend_id: str) -> bool:
        return self._entries.pop(backend_id, None) is not None

    def keys(self) -> list[str]:
        """Routing keys of the entries, most recent entry first (at most ``MAX_KEYS``)."""
        out: list[str] = []
        for entry in reversed(self._entries.values()):
            out.extend(k for k in reversed(entry.keys) if k not in out)
            if len(out) >= MAX_KEYS:
                break
        return out[:MAX_KEYS]

    def backend_ids(self) -> list[str]:
        return list(self._entries)
