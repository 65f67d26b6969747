"""actors.node.recovery.journal: the snapshot schedule every hop shares, and the journal's bounds (issue #18)."""

from __future__ import annotations

import numpy as np
import pytest

from actors.node.recovery.journal import Entry, Journal, SnapshotSchedule
from schemas.frame import FrameKind


def entry(start: int, n: int = 1, kind: FrameKind = FrameKind.DECODE) -> Entry:
    return Entry(kind, start, np.full((n, 2), start, dtype=np.float32), True, start)


def test_boundaries_are_the_end_of_prefill_then_every_k_positions() -> None:
    s = SnapshotSchedule(prompt=100, every=16)
    assert [p for p in range(0, 200) if s.due(p)] == [100, 116, 132, 148, 164, 180, 196]
    assert s.boundary(99) == 0 and s.boundary(100) == 100 and s.boundary(131) == 116
    assert s.boundary(131, back=2) == 100 and s.boundary(115, back=2) == 0


def test_a_short_prompt_skips_boundaries_below_k_and_off_means_none() -> None:
    s = SnapshotSchedule(prompt=5, every=16)
    assert [p for p in range(0, 60) if s.due(p)] == [21, 37, 53]
    assert s.boundary(20) == 0 and s.boundary(36, back=2) == 0 and s.boundary(40, back=2) == 21
    assert not any(SnapshotSchedule(prompt=5, every=0).due(p) for p in range(100))


def test_the_journal_keeps_two_intervals_back_and_replays_from_a_frame_start() -> None:
    journal = Journal(SnapshotSchedule(prompt=8, every=4))
    journal.record(entry(0, 4, FrameKind.PREFILL))
    journal.record(entry(4, 4, FrameKind.PREFILL))
    for p in range(8, 20):
        journal.record(entry(p))
    # Boundaries 8, 12, 16, 20: the newest snapshot (20) may not have reached the standby yet, so from 16 on.
    assert journal.end == 20 and journal.start == 16
    assert journal.since(12) is None and journal.since(14) is None
    assert [e.start for e in journal.since(16) or []] == [16, 17, 18, 19]
    assert journal.since(20) == []


def test_before_the_second_boundary_it_reaches_back_to_position_0() -> None:
    journal = Journal(SnapshotSchedule(prompt=8, every=4))
    journal.record(entry(0, 4, FrameKind.PREFILL))
    journal.record(entry(4, 4, FrameKind.PREFILL))
    journal.record(entry(8))
    assert journal.start == 0 and [e.start for e in journal.since(0) or []] == [0, 4, 8]
    assert journal.since(2) is None  # inside a chunk: not a frame anyone computed


def test_entries_must_follow_each_other_and_truncation_drops_what_follows() -> None:
    journal = Journal(SnapshotSchedule(prompt=4, every=0))
    journal.record(entry(0, 4, FrameKind.PREFILL))
    with pytest.raises(ValueError, match="does not continue"):
        journal.record(entry(6))
    for p in range(4, 10):
        journal.record(entry(p))
    journal.truncate(7)
    assert journal.end == 7 and [e.start for e in journal.since(4) or []] == [4, 5, 6]
    journal.truncate(2)  # inside the prefill chunk: only from 2 on could be replayed, and nothing is there
    assert journal.end == 2 and journal.since(0) is None
