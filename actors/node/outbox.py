"""One session's requests to one peer (the next hop's frames, or the tail's tokens to the head), sent in order.

Invariant: requests reach the peer in the order they were queued, and each answer is awaited in that order; the
first request that fails stops the outbox and is reported once (``on_failure``). A request is *started* (its bytes
written) either at once or by the outbox task:

* a causal request (a decode frame, a token) exists only because the previous one was computed downstream (its
  token came back), so it can never overtake it: it is written at once unless something of this session's is still
  unwritten;
* a prefill chunk is written only after the previous request was answered: chunks follow each other without waiting
  for the ring, and must reach the next hop in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from schemas.errors import HopError

Outbound = Coroutine[Any, Any, None]
"""One request to another node, already started (written) when it is queued as a coroutine."""
Start = Callable[[], Outbound]
"""Writes a request when called; the outbox awaits what it returns."""


class Outbox:
    """Not thread-safe: used from the node's event loop."""

    def __init__(self, name: str, on_failure: Callable[[HopError], Awaitable[None]],
                 on_answered: Callable[[float], None]) -> None:
        self._name = name
        self._on_failure = on_failure
        self._on_answered = on_answered
        """Seconds from writing a request to its answer, per request (the hop metric)."""
        self._queue: asyncio.Queue[Outbound | Start | asyncio.Event] = asyncio.Queue()
        self._awaiting = False
        """The task is awaiting an answer."""
        self._unwritten = 0
        """Requests queued but not yet written."""
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"outbox-{self._name}")

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def send(self, start: Start, *, causal: bool) -> None:
        """Queue one request (see the module's docstring for when it is written)."""
        if self._task is None or self._closed or self._unwritten or (
                not causal and (self._awaiting or not self._queue.empty())):
            self._unwritten += 1
            self._queue.put_nowait(start)
            return
        self._queue.put_nowait(start())

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for the answers to what was sent: the last frame's answer comes just after the
        last token, and cancelling its read would lose its hop metric and close a pooled connection."""
        if self._task is None or self._task.done():
            return
        drained = asyncio.Event()
        self._queue.put_nowait(drained)  # the task sets it when it gets there
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await drained.wait()

    def close(self) -> None:
        """Requests never written are dropped; one already written is closed unawaited. The caller cancels (and
        awaits) ``task`` itself, with the session's other tasks."""
        self._closed = True
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if asyncio.iscoroutine(item):
                item.close()

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            if isinstance(item, asyncio.Event):
                item.set()
                continue
            self._awaiting = True
            if not asyncio.iscoroutine(item):
                self._unwritten -= 1
            try:
                started = time.perf_counter()
                await (item if asyncio.iscoroutine(item) else item())
                self._on_answered(time.perf_counter() - started)
            except HopError as exc:
                await self._on_failure(exc)
                return
            finally:
                self._awaiting = False
