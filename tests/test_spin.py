"""LoopPoller and ArrivalSpinner (actors/spin.py) on a real event loop: when the loop polls, what stops it, and that
everything else on the loop goes on meanwhile.

No timing is asserted beyond "it polled" / "it stopped": the windows are wide so that a busy machine passes too.
"""

from __future__ import annotations

import asyncio
import time

from actors.node.spin import ArrivalSpinner, LoopPoller


def steady(spinner: ArrivalSpinner, period_s: float) -> None:
    """Two arrivals ``period_s`` apart, the last one now: the next is due ``period_s`` from now."""
    now = time.perf_counter()
    spinner.arrived(now - period_s)
    spinner.arrived(now)


async def waiting(poller: LoopPoller, grace_s: float, period_s: float) -> ArrivalSpinner:
    """A spinner whose session has a steady interval and has just gone idle, 5 ms ago."""
    spinner = ArrivalSpinner(poller, grace_s)
    steady(spinner, period_s)
    spinner.idle()
    await asyncio.sleep(0.005)
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
    poller = LoopPoller()
    spinner = ArrivalSpinner(poller, 0.005)
    spinner.arrived()
    spinner.idle()
    await asyncio.sleep(0.03)
    assert poller.polled_s == 0.0 and not poller.polling


async def test_it_polls_until_the_grace_after_the_due_time_while_the_loop_goes_on() -> None:
    stretches: list[float] = []
    poller = LoopPoller(on_polled=stretches.append)
    spinner = ArrivalSpinner(poller, 0.005)
    steady(spinner, 0.010)
    spinner.idle()
    assert poller.polling
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    worker = asyncio.create_task(other_work())
    await asyncio.sleep(0.1)  # no arrival: it polls until 5 ms after the due time, then gives up
    worker.cancel()
    assert not poller.polling and 0.0 < poller.polled_s < 0.1
    assert stretches == [poller.polled_s]
    assert ticks > 10  # the rest of the loop kept running while it polled
    await asyncio.sleep(0.02)
    assert stretches == [poller.polled_s]  # given up for good


async def test_an_arrival_stops_the_polling_and_counts_as_caught() -> None:
    poller = LoopPoller()
    spinner = await waiting(poller, 0.05, 0.05)
    spinner.arrived()
    assert spinner.caught == 1
    await asyncio.sleep(0.005)
    assert not poller.polling and poller.polled_s > 0
    polled = poller.polled_s
    await asyncio.sleep(0.03)
    assert poller.polled_s == polled


async def test_an_overdue_message_is_not_polled_for() -> None:
    poller = LoopPoller()
    spinner = ArrivalSpinner(poller, 0.001)
    now = time.perf_counter()
    spinner.arrived(now - 0.3)
    spinner.arrived(now - 0.2)  # the next was due 0.1 s ago, its grace long past
    spinner.idle()
    await asyncio.sleep(0.01)
    assert poller.polled_s == 0.0


async def test_sessions_share_one_stretch_of_polling() -> None:
    stretches: list[float] = []
    poller = LoopPoller(on_polled=stretches.append)
    short, long = ArrivalSpinner(poller, 0.01), ArrivalSpinner(poller, 0.01)
    steady(short, 0.01)
    steady(long, 0.05)
    short.idle()
    long.idle()
    await asyncio.sleep(0.03)  # the short one's deadline passed; the long one still waits
    assert poller.polling and stretches == []
    long.arrived()
    await asyncio.sleep(0.005)
    assert not poller.polling and len(stretches) == 1 and long.caught == 1


async def test_reset_and_a_zero_grace_stop_it() -> None:
    poller = LoopPoller()
    spinner = await waiting(poller, 0.05, 0.05)
    spinner.reset()
    await asyncio.sleep(0.005)
    assert not poller.polling and spinner.period_s is None

    off = ArrivalSpinner(LoopPoller(), 0.0)
    steady(off, 0.05)
    off.idle()
    await asyncio.sleep(0.01)
    assert off.poller.polled_s == 0.0
