"""Finished sessions' KV a node keeps so that a later request starting with the same tokens prefills only what is
new (issue #18, reuse; token-exact since issue #26): the next turn of a chat or of a tool loop resends the whole
conversation, a retried request repeats one, and many users share a system prompt.

An entry holds the token ids of a finished session's positions and its KV in one of two tiers: *resident*, the
session's sequence parked in the backend's context (llama.cpp, ``actors.backends.llamacpp.resident``: nothing is
copied, a new session adopts the cells), or *host*, the KV exported in pieces of ``chunk`` positions into host
memory (any ``KvBackend``). A resident entry that the backend had to evict (memory pressure, or no slot for a newer
one) is demoted to host pieces when the node made room itself, and forgotten when the backend did.

A new session takes the longest common token prefix of its prompt with any entry, down to the token, leaving only
its last prompt token to compute at least (the tail samples the first token after it): the same prompt again
computes one position, a prompt that diverges in its last tokens computes from where it diverges. Each entry
carries a hash of its tokens and one per host piece, checked before use: an entry that fails is dropped and the
session computes the positions itself, never uses it.

Entries go least recently used first, within a number of entries and of host bytes; an entry whose tokens another,
newer one extends is dropped. Routing keys (``schemas.prefix``) name what an entry holds so that trackers can send
the next turn to nodes that kept the last one. Pure bookkeeping: the node runs the backend calls (``reuse``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import time
from collections.abc import Sequence

from schemas.snapshot import prefix_hash

MAX_KEYS = 64
"""Routing keys a node advertises (the most recent entries')."""


def piece_digest(piece: bytes) -> str:
    return hashlib.sha256(piece).hexdigest()


@dataclasses.dataclass
class Kept:
    tokens: list[int]
    """The token id of every position the KV holds."""
    pieces: list[bytes]
    """Host tier: the KV of positions ``[i * chunk, (i + 1) * chunk)``, in order (the last may be shorter); empty
    while the entry is only resident."""
    chunk: int
    token: str | None = None
    """The session token of the session it came from: only a member may name it with keys later."""
    keys: list[str] = dataclasses.field(default_factory=list)
    used: float = dataclasses.field(default_factory=time.monotonic)
    resident: bool = False
    """Resident tier: the backend holds the KV as a parked sequence named like the entry."""
    token_hash: str = ""
    digests: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_hash:
            self.token_hash = prefix_hash(self.tokens)
        if len(self.digests) != len(self.pieces):
            self.digests = [piece_digest(p) for p in self.pieces]

    @property
    def size(self) -> int:
        return sum(len(p) for p in self.pieces)

    def with_pieces(self, pieces: list[bytes]) -> None:
        """Demoted to the host tier: ``pieces`` now hold the KV."""
        self.pieces, self.digests, self.resident = pieces, [piece_digest(p) for p in pieces], False

    def intact(self, positions: int) -> bool:
        """Whether the entry still is what was kept, as far as a session reusing ``positions`` of it reads: its
        tokens against their hash, and the host pieces those positions lie in against theirs."""
        if prefix_hash(self.tokens) != self.token_hash:
            return False
        if self.resident:
            return True
        pieces = -(-positions // self.chunk) if self.chunk > 0 else 0
        if pieces > len(self.pieces):
            return False
        return all(piece_digest(p) == d for p, d in zip(self.pieces[:pieces], self.digests, strict=False))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable(shared: int, prompt: int, chunk: int = 1) -> int:
    """Of ``shared`` positions a new prompt of ``prompt`` tokens has in common with kept KV, how many it reuses:
    whole multiples of ``chunk`` (1: down to the token, issue #26), and never its last token (the tail samples the
    first token after it)."""
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

    def keep(self, name: str, entry: Kept) -> list[tuple[str, Kept]]:
        """Keep ``entry`` under ``name`` (its session's id), dropping what it supersedes and what no longer fits;
        returns the entries dropped (their resident sequences are the caller's to free), ``entry`` itself if it
        was not kept."""
        if not self.enabled or entry.size > self.max_bytes:
            return [(name, entry)]
        gone = []
        for other, kept in list(self._entries.items()):
            if len(kept.tokens) <= len(entry.tokens) and entry.tokens[:len(kept.tokens)] == kept.tokens:
                gone.append((other, self._entries.pop(other)))  # the new entry holds all this one did
        self._entries[name] = entry
        return gone + self.fit()

    def fit(self) -> list[tuple[str, Kept]]:
        """Evict the least recently used entries until the budgets hold; returns them."""
        gone = []
        while len(self._entries) > self.max_entries or self.bytes_used > self.max_bytes:
            gone.append(self._entries.popitem(last=False))
            self.evicted += 1
        return gone

    def match(self, prompt: Sequence[int]) -> tuple[str, Kept, int] | None:
        """The entry ``prompt`` reuses most of (``reusable`` positions of it, at least one; a resident entry
        before a host one that gives as many), its name, and how many positions."""
        best: tuple[str, Kept, int] | None = None
        for name, entry in self._entries.items():
            n = reusable(common_prefix(entry.tokens, prompt), len(prompt))
            if n > 0 and (best is None or (n, entry.resident) > (best[2], best[1].resident)):
                best = (name, entry, n)
        if best is None:
            return None
        name, entry, _ = best
        entry.used = time.monotonic()
        self._entries.move_to_end(name)
        return best

    def get(self, name: str) -> Kept | None:
        return self._entries.get(name)

    def discard(self, name: str) -> Kept | None:
        return self._entries.pop(name, None)

    def resident(self) -> list[str]:
        """Names of the resident entries, the least recently used first."""
        return [name for name, entry in self._entries.items() if entry.resident]

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
