"""One way for a test to wait for something that happens eventually: poll a condition until it holds or a deadline
passes, and then fail with a message saying what never happened (and the last value seen)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

What = str | Callable[[], str]
"""What the test waits for, in words; a callable is asked only when the wait fails (to show the state by then)."""


class _Poll:
    """What both pollers share: the deadline, the last value (or exception) seen, and the failure."""

    def __init__(self, timeout: float, what: What) -> None:
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.what = what
        self.last: object = None

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def failure(self) -> AssertionError:
        what = self.what() if callable(self.what) else self.what
        error = AssertionError(f"{what} did not happen within {self.timeout:g}s (last: {self.last!r})")
        error.__cause__ = self.last if isinstance(self.last, BaseException) else None
        return error


async def eventually(condition: Callable[[], T | Awaitable[T]], *, timeout: float = 10.0, interval: float = 0.05,
                     what: What = "the condition", ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``condition`` (sync or async) until it returns something truthy, which is returned. After ``timeout``
    seconds an ``AssertionError`` names ``what`` and the last value. Exceptions of the ``ignoring`` types count as
    "not yet" (the last one is reported, and chained)."""
    poll = _Poll(timeout, what)
    while True:
        try:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
        except ignoring as exc:
            poll.last = exc
        else:
            if value:
                return value  # type: ignore[return-value]
            poll.last = value
        if poll.expired():
            raise poll.failure()
        await asyncio.sleep(interval)


def eventually_sync(condition: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.05,
                    what: What = "the condition", ignoring: tuple[type[BaseException], ...] = (),
                    sleep: Callable[[float], object] = time.sleep) -> T:
    """``eventually`` for code without an event loop (process trees, files). Between polls it calls
    ``sleep(interval)``: something that also does work while it waits (e.g. pumps a torrent session's alerts)."""
    poll = _Poll(timeout, what)
    while True:
        try:
            value = condition()
        except ignoring as exc:
            poll.last = exc
        else:
            if value:
                return value
            poll.last = value
        if poll.expired():
            raise poll.failure()
        sleep(interval)
