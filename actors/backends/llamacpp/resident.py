"""Finished sessions' KV kept resident in the llama.cpp context (issue #26, token-exact prefix reuse), as
llama-server's slots keep theirs: the first tier of prefix reuse, before the node's host-memory pieces.

A finished session's cells are *parked*: they stay where they are, tagged (``llama_memory_seq_cp``) with one of the
context's spare sequence ids (``LlamaCppConfig.resident_prefixes``, after the sessions' ids, which are all free again
once their sessions close), and a new session *adopts* any prefix of them with ``llama_memory_seq_cp``. On the
unified cache that only tags the cells with the new sequence id (nothing is copied or computed); with per-sequence
streams the whole stream is copied at the next decode and the positions past the prefix are dropped again. Either
way the adopted positions are the very cells the finished session computed.

Parked sequences hold cells of the context's one budget (``n_ctx`` per session), never cells of their own: when a
running session's step finds no room, the backend drops the least recently used parked sequence and decodes again
(``LlamaCppBackend._pass``), so memory pressure evicts kept prefixes, never a running session's KV. Pure
bookkeeping: the backend runs the llama.cpp calls, under its lock.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class Parked:
    seq_id: int
    positions: int
    """The sequence holds positions ``[0, positions)``."""


class ResidentPrefixes:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._held: collections.OrderedDict[str, Parked] = collections.OrderedDict()
        self.evicted = 0
        """Parked sequences dropped to make room (for a running session's cells or for a newer one)."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, handle: object) -> bool:
        return handle in self._held

    def positions(self) -> dict[str, int]:
        """Each parked sequence's positions, by handle (the least recently used first)."""
        return {h: p.positions for h, p in self._held.items()}

    @property
    def full(self) -> bool:
        return len(self._held) >= self.slots

    def park(self, handle: str, seq_id: int, positions: int) -> None:
        self._held[handle] = Parked(seq_id, positions)

    def get(self, handle: str) -> Parked | None:
        parked = self._held.get(handle)
        if parked is not None:
            self._held.move_to_end(handle)
        return parked

    def drop(self, handle: str) -> Parked | None:
        return self._held.pop(handle, None)

    def oldest(self) -> str | None:
        return next(iter(self._held), None)
