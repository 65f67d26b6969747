"""What route requests read of the registry, derived once and kept while it is current (issue #28).

Words: a *view* is the live nodes as of one moment and what is derived from them (one ``RouteIndex`` per model
and exclusion, one ``StandbyPool`` per exclusion). It is *current* for at most ``window_s`` and only while the
registry's membership is unchanged (no node joined, left, or changed its model, range, state or verification):
a heartbeat that only renews a node's load leaves the view current, because requests read each node's capacity
from the registry itself (``RegistryView.current``), never from the view. So the cost of a pass over every node is
paid once per window or membership change, not once per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from actors.registry import RegistryView
from actors.tracker.routes import RouteIndex, StandbyPool
from schemas.node import NodeAdvertisement


class RouteViews:
    def __init__(self, registry: RegistryView, window_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._window = window_s
        self._clock = clock
        self._at = float("-inf")
        self._membership = -1
        self._live: list[NodeAdvertisement] = []
        self._indexes: dict[tuple[str, frozenset[str]], RouteIndex] = {}
        self._pools: dict[frozenset[str], StandbyPool] = {}
        self.builds = 0
        """Views derived so far (a figure for the benchmark and its test)."""

    def _current(self) -> None:
        now = self._clock()
        if now - self._at < self._window and self._registry.membership == self._membership:
            return
        self._at, self._membership = now, self._registry.membership
        self._live = self._registry.live()
        self._indexes.clear()
        self._pools.clear()
        self.builds += 1

    def live(self) -> list[NodeAdvertisement]:
        self._current()
        return self._live

    def index(self, model: str, exclude: frozenset[str]) -> RouteIndex:
        """``model``'s route index without the nodes ``exclude``; raises ``ModelNotFoundError`` as
        ``RouteIndex.build`` does (not kept: the next request looks again)."""
        self._current()
        key = (model, exclude)
        index = self._indexes.get(key)
        if index is None:
            index = self._indexes[key] = RouteIndex.build(self._live, model, exclude)
        return index

    def standbys(self, exclude: frozenset[str]) -> StandbyPool:
        self._current()
        pool = self._pools.get(exclude)
        if pool is None:
            pool = self._pools[exclude] = StandbyPool.build(self._live, exclude)
        return pool
