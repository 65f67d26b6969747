"""actors.node.outbox: one session's requests to one peer, in order (its docstring states the invariant). The peer
here is a fake that records each request when it is written and answers it when the test says; no process, no
network."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator

import pytest

from actors.node.outbox import Outbound, Outbox, Start
from schemas.errors import HopError


class Peer:
    """The other end: ``written`` in the order requests were written (their start called), ``answered`` in the
    order their answers were read; each answer comes when the test calls ``answer(name)``, or ``fail(name)``."""

    def __init__(self) -> None:
        self.written: list[str] = []
        self.answered: list[str] = []
        self._answers: dict[str, asyncio.Future[None]] = {}
        self.requests: dict[str, Outbound] = {}

    def request(self, name: str) -> Start:
        def start() -> Outbound:
            self.written.append(name)
            self._answers[name] = asyncio.get_running_loop().create_future()
            self.requests[name] = self._answer(name)
            return self.requests[name]

        return start

    async def _answer(self, name: str) -> None:
        await self._answers[name]
        self.answered.append(name)

    def answer(self, name: str) -> None:
        self._answers[name].set_result(None)

    def fail(self, name: str) -> None:
        self._answers[name].set_exception(HopError("b", "unreachable", f"{name}: connection reset"))


class Reports:
    def __init__(self) -> None:
        self.failures: list[HopError] = []
        self.seconds: list[float] = []

    async def failed(self, exc: HopError) -> None:
        self.failures.append(exc)

    def answered(self, seconds: float) -> None:
        self.seconds.append(seconds)


@pytest.fixture
async def outbox(reports: Reports) -> AsyncIterator[Outbox]:
    box = Outbox("test", reports.failed, reports.answered)
    box.start()
    yield box
    box.close()
    assert box.task is not None
    box.task.cancel()
    await asyncio.gather(box.task, return_exceptions=True)


@pytest.fixture
def reports() -> Reports:
    return Reports()


@pytest.fixture
def peer() -> Peer:
    return Peer()


async def turns(n: int = 5) -> None:
    """Let the outbox's task run for a few loop turns."""
    for _ in range(n):
        await asyncio.sleep(0)


async def test_causal_requests_are_written_at_once_and_answered_in_order(outbox: Outbox, peer: Peer,
                                                                         reports: Reports) -> None:
    for name in ("t0", "t1", "t2"):
        outbox.send(peer.request(name), causal=True)
        assert peer.written[-1] == name  # written before send returned, although nothing was answered yet
    peer.answer("t2")
    peer.answer("t1")  # the peer answers out of order: the outbox still reads t0's answer first
    await turns()
    assert peer.answered == [] and reports.seconds == []
    peer.answer("t0")
    await turns()
    assert peer.answered == ["t0", "t1", "t2"] and len(reports.seconds) == 3


async def test_a_prefill_chunk_is_written_only_after_the_previous_answer(outbox: Outbox, peer: Peer) -> None:
    outbox.send(peer.request("chunk0"), causal=False)
    assert peer.written == ["chunk0"]  # nothing before it: written at once
    outbox.send(peer.request("chunk1"), causal=False)
    outbox.send(peer.request("decode0"), causal=True)
    await turns()
    # chunk1 waits for chunk0's answer, and the causal frame may not overtake what is still unwritten
    assert peer.written == ["chunk0"]
    peer.answer("chunk0")
    await turns()
    assert peer.written == ["chunk0", "chunk1"]
    peer.answer("chunk1")
    await turns()
    assert peer.written == ["chunk0", "chunk1", "decode0"]
    peer.answer("decode0")
    await turns()
    assert peer.answered == ["chunk0", "chunk1", "decode0"]


async def test_the_hop_metric_is_the_time_from_writing_to_the_answer(outbox: Outbox, peer: Peer,
                                                                     reports: Reports) -> None:
    outbox.send(peer.request("t0"), causal=True)
    await asyncio.sleep(0.05)
    peer.answer("t0")
    await turns()
    assert len(reports.seconds) == 1 and 0.05 <= reports.seconds[0] < 5


async def test_the_first_failure_stops_the_outbox_and_is_reported_once(outbox: Outbox, peer: Peer,
                                                                       reports: Reports) -> None:
    outbox.send(peer.request("t0"), causal=True)
    outbox.send(peer.request("t1"), causal=True)
    outbox.send(peer.request("chunk"), causal=False)  # queued behind them, unwritten
    peer.fail("t0")
    peer.fail("t1")
    await turns()
    assert [str(e) for e in reports.failures] == ["t0: connection reset"]
    assert reports.failures[0].node == "b" and reports.failures[0].kind == "unreachable"
    assert outbox.task is not None and outbox.task.done()
    assert peer.written == ["t0", "t1"] and peer.answered == []  # nothing after the failure is read or written
    await turns()
    assert len(reports.failures) == 1


async def test_drain_waits_for_the_last_answer(outbox: Outbox, peer: Peer) -> None:
    outbox.send(peer.request("t0"), causal=True)
    outbox.send(peer.request("t1"), causal=True)
    drain = asyncio.ensure_future(outbox.drain(5.0))
    peer.answer("t0")
    await turns()
    assert not drain.done()
    peer.answer("t1")
    await asyncio.wait_for(drain, 1.0)
    assert peer.answered == ["t0", "t1"]


async def test_drain_gives_up_after_its_timeout(outbox: Outbox, peer: Peer) -> None:
    outbox.send(peer.request("t0"), causal=True)
    started = time.monotonic()
    await outbox.drain(0.05)
    assert 0.05 <= time.monotonic() - started < 2 and peer.answered == []
    unstarted = Outbox("idle", Reports().failed, Reports().answered)  # never started: nothing to wait for
    started = time.monotonic()
    await unstarted.drain(5.0)
    assert time.monotonic() - started < 1


async def test_close_drops_the_unwritten_and_closes_the_written_unawaited(outbox: Outbox, peer: Peer) -> None:
    """As ``NodeSession.close`` does it: the task cancelled first, then the outbox closed."""
    outbox.send(peer.request("t0"), causal=True)  # written; the task awaits its answer
    outbox.send(peer.request("t1"), causal=True)  # written; still in the queue, unawaited
    outbox.send(peer.request("chunk"), causal=False)  # unwritten
    await turns()
    assert outbox.task is not None
    outbox.task.cancel()
    await asyncio.gather(outbox.task, return_exceptions=True)
    outbox.close()
    assert inspect.getcoroutinestate(peer.requests["t1"]) == inspect.CORO_CLOSED  # no "never awaited" warning
    assert inspect.getcoroutinestate(peer.requests["t0"]) == inspect.CORO_CLOSED
    outbox.send(peer.request("late"), causal=True)
    await turns()
    assert peer.written == ["t0", "t1"] and peer.answered == []  # neither the chunk nor a late request went out
