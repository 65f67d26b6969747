"""Verify windows of one session taken in their number order (issue #20), whatever order HTTP delivers them in: a
hop's link to the next may carry two windows on two connections, and a window computed before the one ahead of it
would be computed on the wrong KV."""

from __future__ import annotations

import asyncio


class WindowOrder:
    """Not thread-safe: the node's event loop only."""

    def __init__(self) -> None:
        self.next = 1
        """The number of the window whose turn it is (windows are numbered from 1)."""
        self._waiting: dict[int, asyncio.Future[None]] = {}

    def seen(self, window: int) -> bool:
        return window < self.next

    async def turn(self, window: int) -> None:
        """Until every window before ``window`` has been taken."""
        if window <= self.next:
            return
        future = self._waiting.setdefault(window, asyncio.get_running_loop().create_future())
        await future

    def taken(self, window: int) -> None:
        """``window`` was taken (its step queued, or it was found stale): the next one's turn."""
        self.next = max(self.next, window + 1)
        future = self._waiting.pop(self.next, None)
        if future is not None and not future.done():
            future.set_result(None)

    def close(self) -> None:
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()
