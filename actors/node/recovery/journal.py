"""What a hop computed for its successor since the successor's latest snapshots (issue #18), so that a replacement
for the successor can be rebuilt exactly: its snapshot chain up to a boundary, then these frames replayed one by
one, as originally computed (same chunks, same positions, same bytes).

Invariant: the entries are consecutive frames, in order, with no gap: ``start`` is the first entry's first position
and each entry begins where the previous ended. Entries are kept back to the second most recent snapshot boundary
(a successor may have died before its newest snapshot reached its standby), so the journal holds at most two
snapshot intervals of frames, or everything from position 0 when snapshots are off. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses

from actors.backend import Hidden
from schemas.frame import FrameKind


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotSchedule:
    """When every hop of a session snapshots: at the end of prefill (``prompt`` positions), then every ``every``
    decoded positions, skipping boundaries below ``every`` (a short session's journal alone rebuilds it cheaply).
    The same for every hop (it comes with the session's open), so their boundaries agree."""

    prompt: int
    every: int
    """0: no snapshots."""

    def due(self, position: int) -> bool:
        if self.every <= 0 or position < max(self.prompt, self.every):
            return False
        return (position - self.prompt) % self.every == 0

    def boundary(self, position: int, back: int = 1) -> int:
        """The ``back``-th most recent boundary at or below ``position`` (1: the latest); 0 when there is none."""
        if self.every <= 0 or position < self.prompt:
            return 0
        latest = self.prompt + (position - self.prompt) // self.every * self.every
        earlier = latest - (back - 1) * self.every
        return earlier if earlier >= max(self.prompt, self.every) else 0


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One frame as it was (or would have been) sent: replaying it recomputes exactly what it did."""

    kind: FrameKind
    start: int
    hidden: Hidden
    sample: bool
    step: int
    tokens: tuple[int, ...] | None = None

    @property
    def end(self) -> int:
        return self.start + int(self.hidden.shape[0])


class Journal:
    def __init__(self, schedule: SnapshotSchedule) -> None:
        self.schedule = schedule
        self._entries: list[Entry] = []
        self.end = 0
        """One past the last position recorded."""

    @property
    def start(self) -> int:
        """The first position this journal can replay from."""
        return self._entries[0].start if self._entries else self.end

    def record(self, entry: Entry) -> None:
        if entry.start != self.end:
            raise ValueError(f"journal entry at position {entry.start} does not continue at {self.end}")
        self._entries.append(entry)
        self.end = entry.end
        keep_from = self.schedule.boundary(self.end, back=2)
        while self._entries and self._entries[0].end <= keep_from:
            self._entries.pop(0)

    def since(self, position: int) -> list[Entry] | None:
        """The entries from ``position`` on, or None when the journal cannot replay from there (already trimmed,
        or ``position`` falls inside a frame)."""
        if position == self.end:
            return []
        for i, entry in enumerate(self._entries):
            if entry.start == position:
                return self._entries[i:]
        return None

    def truncate(self, position: int) -> None:
        """Forget what lies at or after ``position`` (the session's KV was cut back there)."""
        self._entries = [e for e in self._entries if e.end <= position]
        self.end = min(self.end, position)
        if self._entries and self._entries[-1].end != self.end:
            self._entries.clear()
