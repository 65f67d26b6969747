"""One way for a test to wait for something that happens eventually: poll a condition until it holds or a deadline
passes, and then fail with a message saying what never happened (and the last value seen)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(condition: Callable[[], T | Awaitable[T]], *, timeout: float = 10.0, interval: float = 0.05,
                     what: str = "the condition") -> T:
    """Poll ``condition`` (sync or async) until it returns something truthy, which is returned. After ``timeout``
    seconds an ``AssertionError`` names ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout:g}s (last: {value!r})")
        await asyncio.sleep(interval)


def eventually_sync(condition: Callable[[], T], *, timeout: float = 10.0, interval: float = 0.05,
                    what: str = "the condition") -> T:
    """``eventually`` for code without an event loop (process trees, files)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not happen within {timeout:g}s (last: {value!r})")
        time.sleep(interval)
