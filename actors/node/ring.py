"""How a head groups its concurrent decode sessions of multi-hop routes (issue #20, item 4: sessions fill the pipe).

With several sessions on a route of ``h`` hops, a head can put all their decode steps in one forward pass (one
*group*: every hop computes the same batch, one hop after the other, each idle while the others work), or split them
into up to ``h`` groups that follow each other around the ring, so that different hops compute different sessions'
steps at the same time. Which is faster depends on the model and the machine: a hop whose forward pass costs about
the same for one row as for four (memory-bound weights, or a vocabulary-wide output layer on the tail) loses more to
smaller batches than the overlap wins; a compute-bound hop gains up to ``h`` times. So the head measures it: it
keeps one grouping for an epoch, counting the decode steps its engine runs per second, tries the other one now and
then, and keeps whichever went faster for that many sessions (``Settings.ring_groups`` = 0), unless the operator fixed
the number of groups.

Everything here runs on the engine's worker thread, when it takes a batch.
"""

from __future__ import annotations

import dataclasses
import math

EPOCH_S = 1.0
"""How long one grouping is kept before its rate is read."""
PROBE_EVERY = 5
"""Epochs between tries of the grouping not in use (once both were measured)."""
BETTER = 1.03
"""How much faster the other grouping must have been to be switched to."""


@dataclasses.dataclass(slots=True)
class _Epoch:
    key: tuple[int, int]
    groups: int
    started: float
    steps: int = 0


class RingGroups:
    """``fixed``: 0 measures and chooses between one group and ``min(hops, sessions)``; ``k`` >= 1 always uses up to
    ``k`` groups (1: every session in one pass)."""

    def __init__(self, fixed: int = 0, *, epoch_s: float = EPOCH_S) -> None:
        self.fixed = fixed
        self.epoch_s = epoch_s
        self._rates: dict[tuple[tuple[int, int], int], float] = {}
        """(sessions, hops), groups -> decode steps per second last measured."""
        self._age: dict[tuple[int, int], int] = {}
        """Epochs since the grouping not in use was last tried, per (sessions, hops)."""
        self._epoch: _Epoch | None = None

    def cap(self, sessions: int, hops: int, now: float) -> int:
        """The most decode steps of these sessions one pass may carry."""
        return math.ceil(sessions / self.groups(sessions, hops, now)) if sessions else 1

    def groups(self, sessions: int, hops: int, now: float) -> int:
        most = max(1, min(hops, sessions))
        if self.fixed:
            return min(self.fixed, most)
        if most == 1:
            self._epoch = None
            return 1
        key = (sessions, hops)
        epoch = self._epoch
        if epoch is None or epoch.key != key:  # the sessions changed: start measuring what was best for them
            self._epoch = _Epoch(key, self._best(key, most), now)
            return self._epoch.groups
        if now - epoch.started >= self.epoch_s:
            self._rates[(key, epoch.groups)] = epoch.steps / (now - epoch.started)
            epoch = self._epoch = _Epoch(key, self._next(key, epoch.groups, most), now)
        return epoch.groups

    def stepped(self, steps: int) -> None:
        """A pass carried ``steps`` decode steps of the sessions being grouped."""
        if self._epoch is not None:
            self._epoch.steps += steps

    def _best(self, key: tuple[int, int], most: int) -> int:
        one, split = self._rates.get((key, 1)), self._rates.get((key, most))
        if split is None:
            return most  # never measured: try the pipe first
        if one is None:
            return 1
        return 1 if one >= split else most

    def _next(self, key: tuple[int, int], current: int, most: int) -> int:
        other = 1 if current != 1 else most
        other_rate = self._rates.get((key, other))
        age = self._age.get(key, 0) + 1
        if other_rate is None or age >= PROBE_EVERY:  # not measured yet, or long ago: try it again
            self._age[key] = 0
            return other
        self._age[key] = age
        return other if other_rate > self._rates[(key, current)] * BETTER else current


MERGE_HOLD_S = 0.05
"""Longest a head holds a ring step for the route's other sessions when its group is smaller than the grouping wants
(groups that drifted apart: one such hold aligns them, and they go on together)."""
CYCLE_EMA = 0.3
"""Weight of the newest interval in a session's ring cycle estimate."""


@dataclasses.dataclass(slots=True)
class _Ringed:
    route: tuple[str, ...]
    taken: float
    cycle: float | None = None
    """Seconds between this session's ring steps (an average), once it has had two."""


class RingSessions:
    """The worker's view of a head's decode sessions on multi-hop routes: which route each is on, when its last step
    was taken, how long a turn around the ring takes it. Only the engine's worker touches it."""

    def __init__(self, groups: RingGroups, *, window_s: float) -> None:
        self.groups = groups
        self.window_s = window_s
        self._by_id: dict[str, _Ringed] = {}

    def taken(self, session_id: str, route: tuple[str, ...], now: float) -> None:
        seen = self._by_id.get(session_id)
        if seen is None or seen.route != route:
            self._by_id[session_id] = _Ringed(route, now)
            return
        interval = now - seen.taken
        seen.cycle = interval if seen.cycle is None else seen.cycle + CYCLE_EMA * (interval - seen.cycle)
        seen.taken = now

    def forget(self, session_id: str) -> None:
        self._by_id.pop(session_id, None)

    def prune(self, now: float) -> None:
        for sid in [sid for sid, r in self._by_id.items() if now - r.taken > self.window_s]:
            del self._by_id[sid]

    def on(self, route: tuple[str, ...], queued: set[str]) -> set[str]:
        """The sessions of ``route``: those seen lately and those with a step queued (``queued``: ids on it)."""
        return {sid for sid, r in self._by_id.items() if r.route == route} | queued

    def cap(self, route: tuple[str, ...], sessions: int, now: float) -> int:
        return self.groups.cap(sessions, len(route), now) if sessions > 1 else 1

    def due(self, route: tuple[str, ...], now: float, hold: float) -> set[str]:
        """Sessions of ``route`` whose next step should come within ``hold`` (not those long overdue: a session
        that finished, or whose ring stalls, is not waited for)."""
        due = set()
        for sid, r in self._by_id.items():
            if r.route == route and r.cycle is not None:
                expected = r.taken + r.cycle
                if now - 0.25 * r.cycle <= expected <= now + hold:
                    due.add(sid)
        return due
