"""Routes a tracker handed out that their nodes have not reported yet.

Invariant: a route handed out counts against each of its nodes until that node reports the session settled (its
``sessions_settled`` passed the value seen at hand-out: a refused or abandoned route is released by the node's
next, immediate, heartbeat), and at the latest for ``horizon_s`` (a gateway that died while opening). Counting an
arrived session as pending too would count it twice, and under fast churn a swarm with free slots refuses routes
(tests/test_load.py).

A count is computed for one node when asked (``get``), from that node's own hand-outs: a request prices a few
nodes, so its cost does not grow with every route handed out across the swarm (issue #28: summing them all for
every request took 14 ms at 100 routes a second).
"""

from __future__ import annotations

import time
from collections.abc import Callable

SettledOf = Callable[[str], int | None]
"""A node's ``sessions_settled`` now, by id; None once it left."""


class PendingRoutes:
    def __init__(self, settled_of: SettledOf, horizon_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._settled_of = settled_of
        self._horizon = horizon_s
        self._clock = clock
        self._stamps: dict[str, list[tuple[float, int]]] = {}
        """node id -> (when a route was handed out, the node's sessions_settled then), oldest first."""
        self._pruned_at = clock()

    def add(self, node_id: str) -> None:
        """A route through ``node_id`` was handed out now."""
        now = self._clock()
        self._stamps.setdefault(node_id, []).append((now, self._settled_of(node_id) or 0))
        if now - self._pruned_at > self._horizon:
            self._prune(now)

    def get(self, node_id: str, default: int = 0, /) -> int:
        """How many routes through ``node_id`` are still pending (``default`` when none)."""
        stamps = self._stamps.get(node_id)
        if not stamps:
            return default
        cutoff = self._clock() - self._horizon
        if stamps[0][0] <= cutoff:
            stamps[:] = [s for s in stamps if s[0] > cutoff]
            if not stamps:
                del self._stamps[node_id]
                return default
        arrived = max(0, (self._settled_of(node_id) or 0) - stamps[0][1])
        return len(stamps) - arrived if len(stamps) > arrived else default

    def nodes(self) -> list[str]:
        return list(self._stamps)

    def counts(self) -> dict[str, int]:
        """Every node with routes pending, and how many."""
        counts = {n: self.get(n, 0) for n in self.nodes()}
        return {n: c for n, c in counts.items() if c}

    def _prune(self, now: float) -> None:
        # Nodes no request asked about again would keep their stamps: drop every expired one now and then.
        self._pruned_at = now
        cutoff = now - self._horizon
        for node_id in list(self._stamps):
            stamps = [s for s in self._stamps[node_id] if s[0] > cutoff]
            if stamps:
                self._stamps[node_id] = stamps
            else:
                del self._stamps[node_id]
