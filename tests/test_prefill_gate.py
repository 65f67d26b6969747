"""The prefill gate (issue #30): how much prefill a head's sessions have under way at once, in arrival order, by
the time this node's measured prefill rate needs for it."""

from __future__ import annotations

import asyncio

import pytest

from actors.node.prefill_gate import PrefillGate
from tests.support.waiting import eventually

WITHIN = 1.0


class Rate:
    def __init__(self, value: float | None) -> None:
        self.value = value

    def __call__(self) -> float | None:
        return self.value


async def _admitted(gate: PrefillGate, sid: str, positions: int, order: list[str]) -> None:
    await gate.admit(sid, positions, WITHIN)
    order.append(sid)


async def test_sessions_beyond_the_limit_wait_and_start_in_arrival_order_as_prefills_end() -> None:
    gate = PrefillGate(100, Rate(10.0))  # 10 positions within a second
    order: list[str] = []
    await _admitted(gate, "a", 6, order)
    await _admitted(gate, "b", 4, order)
    waiting = [asyncio.create_task(_admitted(gate, sid, n, order)) for sid, n in (("c", 8), ("d", 1))]
    await eventually(lambda: gate.waiting == 2, what="c and d waiting")
    assert gate.in_flight == 10 and order == ["a", "b"]
    gate.release("b")  # 4 free: c (8) does not fit yet, and d (1) does not overtake it
    await asyncio.sleep(0)
    assert order == ["a", "b"] and gate.waiting == 2
    gate.release("a")
    await asyncio.gather(*waiting)
    assert order == ["a", "b", "c", "d"] and gate.in_flight == 9 and gate.waited == 2


async def test_the_limit_is_the_measured_rate_over_the_time_given_at_most_the_cap() -> None:
    rate = Rate(None)
    gate = PrefillGate(50, rate)
    assert gate.limit(2.0) == 0  # nothing measured yet: one session at a time
    rate.value = 10.0
    assert gate.limit(2.0) == 20 and gate.limit(0.5) == 5
    rate.value = 1000.0
    assert gate.limit(2.0) == 50


async def test_before_a_rate_is_measured_and_for_a_chunk_over_the_limit_a_session_prefills_alone() -> None:
    rate = Rate(None)
    gate = PrefillGate(1000, rate)
    await gate.admit("first", 8, WITHIN)
    second = asyncio.create_task(gate.admit("second", 8, WITHIN))
    await eventually(lambda: gate.waiting == 1, what="the second waiting")
    rate.value = 4.0  # measured now: 4 positions within the second, less than one chunk
    gate.release("first")
    await second
    third = asyncio.create_task(gate.admit("third", 1, WITHIN))
    await eventually(lambda: gate.waiting == 1, what="the third waiting: 8 + 1 is over the limit")
    gate.release("second")
    await third
    assert gate.holds("third") and gate.in_flight == 1


async def test_release_is_idempotent_and_a_second_admit_keeps_the_ticket() -> None:
    gate = PrefillGate(4, Rate(4.0))
    await gate.admit("a", 3, WITHIN)
    await gate.admit("a", 3, WITHIN)
    assert gate.in_flight == 3 and gate.admitted == 1
    gate.release("a")
    gate.release("a")
    gate.release("never")
    assert gate.in_flight == 0


async def test_a_waiter_that_is_cancelled_leaves_the_line_and_gives_back_a_ticket_it_just_got() -> None:
    gate = PrefillGate(4, Rate(4.0))
    await gate.admit("a", 4, WITHIN)
    gone = asyncio.create_task(gate.admit("gone", 4, WITHIN))
    after = asyncio.create_task(gate.admit("after", 2, WITHIN))
    await eventually(lambda: gate.waiting == 2, what="two waiting")
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    gate.release("a")
    await after
    assert gate.holds("after") and not gate.holds("gone") and gate.in_flight == 2
    # Admitted and cancelled in the same turn: the ticket it was given goes back at once.
    raced = asyncio.create_task(gate.admit("raced", 4, WITHIN))
    await eventually(lambda: gate.waiting == 1, what="raced waiting")
    gate.release("after")
    raced.cancel()
    with pytest.raises(asyncio.CancelledError):
        await raced
    assert gate.in_flight == 0 and not gate.holds("raced")


async def test_a_waiter_keeps_its_session_alive_and_goes_after_the_longest_wait() -> None:
    gate = PrefillGate(4, Rate(4.0))
    await gate.admit("a", 4, WITHIN)
    beats: list[int] = []

    async def keepalive() -> None:
        beats.append(gate.waiting)

    await asyncio.wait_for(gate.admit("late", 4, WITHIN, keepalive=keepalive, every_s=0.01, max_wait_s=0.05), 10)
    assert beats and all(b == 1 for b in beats)  # it kept its session alive while it waited in line
    assert gate.holds("late") and gate.holds("a") and gate.overdue == 1 and gate.waiting == 0


def test_the_cap_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefillGate(0, Rate(None))
