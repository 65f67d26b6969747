"""bus.connection.keep_cancellation: a cancellation lost inside an await comes back."""

from __future__ import annotations

import asyncio
import sys

import pytest

from bus.connection import keep_cancellation


async def test_a_cancellation_that_wait_for_dropped_is_raised_again() -> None:
    """The exact loss nats.py's request is exposed to: the reply and the cancel land in the same loop turn."""
    loop = asyncio.get_running_loop()
    reply: asyncio.Future[str] = loop.create_future()
    went_on: list[str] = []

    async def requester(keep: bool) -> None:
        got = await asyncio.wait_for(reply, 5)
        if keep:
            keep_cancellation()
        went_on.append(got)

    for keep in (False, True):
        reply = loop.create_future()
        task = asyncio.create_task(requester(keep))
        await asyncio.sleep(0)
        reply.set_result("answer")
        task.cancel()
        if keep or sys.version_info >= (3, 12):  # 3.12's wait_for keeps it by itself
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            await task  # Python 3.11: wait_for returned the reply, the cancellation is gone
    assert went_on == (["answer"] if sys.version_info < (3, 12) else [])


async def test_without_a_cancellation_nothing_is_raised() -> None:
    async def work() -> str:
        await asyncio.sleep(0)
        keep_cancellation()
        return "done"

    assert await asyncio.create_task(work()) == "done"
