"""LoopPoller and ArrivalSpinner (actors/node/spin.py) on a real event loop: when the loop polls, what stops it, and
that everything else on the loop goes on meanwhile.

The poller and its spinners read the time from the poller's clock. These tests hand them a fake one and move it
themselves, so every window (due time, grace, overdue) is exact and nothing depends on how fast this machine runs
the loop; one test keeps the real clock to show that a real loop stops polling by itself.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.node.spin import ArrivalSpinner, LoopPoller
from tests.support.waiting import eventually


class FakeClock:
    """A clock that stands still until the test moves it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def turns(n: int = 5) -> None:
    """Let the event loop run ``n`` turns: the poller looks at its deadlines once a turn."""
    for _ in range(n):
        await asyncio.sleep(0)


def steady(spinner: ArrivalSpinner, period_s: float) -> None:
    """Two arrivals ``period_s`` apart, the last one now: the next is due ``period_s`` from now."""
    now = spinner.poller.clock()
    spinner.arrived(now - period_s)
    spinner.arrived(now)


async def waiting(poller: LoopPoller, clock: FakeClock, grace_s: float, period_s: float) -> ArrivalSpinner:
    """A spinner whose session has a steady interval and has just gone idle, 5 ms ago."""
    spinner = ArrivalSpinner(poller, grace_s)
    steady(spinner, period_s)
    spinner.idle()
    clock.advance(0.005)
    await turns()
    return spinner


async def test_the_interval_is_learned_from_arrivals() -> None:
    spinner = ArrivalSpinner(LoopPoller(), 0.001)
    spinner.arrived(10.0)
    assert spinner.period_s is None
    spinner.arrived(10.020)
    assert abs((spinner.period_s or 0) - 0.020) < 1e-9
    spinner.arrived(10.050)  # moves towards 30 ms, weighted
    assert 0.020 < (spinner.period_s or 0) < 0.030
    spinner.arrived(15.0)  # a stall teaches nothing
    assert 0.020 < (spinner.period_s or 0) < 0.030


async def test_without_a_steady_interval_it_never_polls() -> None:
    clock = FakeClock()
    poller = LoopPoller(clock=clock)
    spinner = ArrivalSpinner(poller, 0.005)
    spinner.arrived()
    spinner.idle()
    clock.advance(0.03)
    await turns()
    assert poller.polled_s == 0.0 and not poller.polling


async def test_it_polls_until_the_grace_after_the_due_time_while_the_loop_goes_on() -> None:
    clock = FakeClock()
    stretches: list[float] = []
    poller = LoopPoller(on_polled=stretches.append, clock=clock)
    spinner = ArrivalSpinner(poller, 0.005)
    steady(spinner, 0.010)  # the next arrival is due in 10 ms: it polls until 15 ms from now
    spinner.idle()
    assert poller.polling
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    worker = asyncio.create_task(other_work())
    await turns(20)
    clock.advance(0.015 - 1e-6)  # just before the grace ends, with no arrival
    await turns(20)
    assert poller.polling and stretches == []
    assert ticks > 10  # the rest of the loop kept running while it polled
    clock.advance(2e-6)  # the grace is over: it gives up
    await turns()
    worker.cancel()
    assert not poller.polling and 0.0 < poller.polled_s < 0.1
    assert poller.polled_s == pytest.approx(0.015, abs=1e-5)  # from going idle to the end of the grace
    assert stretches == [poller.polled_s]
    clock.advance(0.02)
    await turns()
    assert stretches == [poller.polled_s]  # given up for good


async def test_on_the_real_clock_a_real_loop_polls_then_stops_by_itself() -> None:
    stretches: list[float] = []
    poller = LoopPoller(on_polled=stretches.append)
    spinner = ArrivalSpinner(poller, 0.005)
    began = time.perf_counter()
    steady(spinner, 0.010)
    spinner.idle()
    assert poller.polling
    await eventually(lambda: not poller.polling, interval=0.005, what="the poller giving up after the grace")
    elapsed = time.perf_counter() - began
    assert stretches == [poller.polled_s] and 0.0 < poller.polled_s <= elapsed  # one stretch, within the wait
    await asyncio.sleep(0.02)
    assert stretches == [poller.polled_s]  # given up for good


async def test_an_arrival_stops_the_polling_and_counts_as_caught() -> None:
    clock = FakeClock()
    poller = LoopPoller(clock=clock)
    spinner = await waiting(poller, clock, 0.05, 0.05)
    assert poller.polling
    spinner.arrived()
    assert spinner.caught == 1
    await turns()
    assert not poller.polling and poller.polled_s > 0
    assert poller.polled_s == pytest.approx(0.005)  # from going idle to the arrival
    polled = poller.polled_s
    clock.advance(0.03)
    await turns()
    assert poller.polled_s == polled


async def test_an_overdue_message_is_not_polled_for() -> None:
    clock = FakeClock()
    poller = LoopPoller(clock=clock)
    spinner = ArrivalSpinner(poller, 0.001)
    now = clock()
    spinner.arrived(now - 0.3)
    spinner.arrived(now - 0.2)  # the next was due 0.1 s ago, its grace long past
    spinner.idle()
    clock.advance(0.01)
    await turns()
    assert poller.polled_s == 0.0 and not poller.polling


async def test_sessions_share_one_stretch_of_polling() -> None:
    clock = FakeClock()
    stretches: list[float] = []
    poller = LoopPoller(on_polled=stretches.append, clock=clock)
    short, long = ArrivalSpinner(poller, 0.01), ArrivalSpinner(poller, 0.01)
    steady(short, 0.01)  # polled for until 20 ms from now
    steady(long, 0.05)  # and until 60 ms from now
    short.idle()
    long.idle()
    clock.advance(0.03)
    await turns()  # the short one's deadline passed; the long one still waits
    assert poller.polling and stretches == []
    assert not poller.holds(short) and poller.holds(long)
    long.arrived()
    await turns()
    assert not poller.polling and len(stretches) == 1 and long.caught == 1
    assert stretches == [pytest.approx(0.03)]  # one stretch, from the first going idle to the last arrival


async def test_reset_and_a_zero_grace_stop_it() -> None:
    clock = FakeClock()
    poller = LoopPoller(clock=clock)
    spinner = await waiting(poller, clock, 0.05, 0.05)
    spinner.reset()
    await turns()
    assert not poller.polling and spinner.period_s is None

    off = ArrivalSpinner(LoopPoller(clock=clock), 0.0)
    steady(off, 0.05)
    off.idle()
    clock.advance(0.01)
    await turns()
    assert off.poller.polled_s == 0.0
