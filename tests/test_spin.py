"""ArrivalSpinner (actors/spin.py) on a real event loop: when it polls, what stops it, and that the loop goes on.

No timing is asserted beyond "it polled" / "it stopped": the windows are wide so that a busy machine passes too.
"""

from __future__ import annotations

import asyncio
import time

from actors.spin import ArrivalSpinner


def steady(spinner: ArrivalSpinner, period_s: float) -> None:
    """Two arrivals ``period_s`` apart, the last one now: the next is due ``period_s`` from now."""
    now = time.perf_counter()
    spinner.arrived(now - period_s)
    spinner.arrived(now)


async def test_the_interval_is_learned_from_arrivals() -> None:
    spinner = ArrivalSpinner(0.001)
    spinner.arrived(10.0)
    assert spinner.period_s is None
    spinner.arrived(10.020)
    assert abs((spinner.period_s or 0) - 0.020) < 1e-9
    spinner.arrived(10.050)  # moves towards 30 ms, weighted
    assert 0.020 < (spinner.period_s or 0) < 0.030
    spinner.arrived(15.0)  # a stall teaches nothing
    assert 0.020 < (spinner.period_s or 0) < 0.030


async def test_without_a_steady_interval_it_never_polls() -> None:
    spinner = ArrivalSpinner(0.005)
    spinner.arrived()
    spinner.idle()
    await asyncio.sleep(0.03)
    assert spinner.spun_s == 0.0


async def test_it_polls_until_the_grace_after_the_due_time_while_the_loop_goes_on() -> None:
    spinner = ArrivalSpinner(0.005)
    steady(spinner, 0.010)
    spinner.idle()
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    worker = asyncio.create_task(other_work())
    await asyncio.sleep(0.1)  # no arrival: it polls until 5 ms after the due time, then gives up
    worker.cancel()
    assert 0.0 < spinner.spun_s < 0.1
    assert ticks > 10  # the rest of the loop kept running while it polled
    spun = spinner.spun_s
    await asyncio.sleep(0.02)
    assert spinner.spun_s == spun  # given up


async def test_an_arrival_stops_the_polling_and_counts_as_caught() -> None:
    spinner = ArrivalSpinner(0.05)
    steady(spinner, 0.05)
    spinner.idle()
    await asyncio.sleep(0.005)
    spinner.arrived()
    assert spinner.caught == 1 and spinner.spun_s > 0
    spun = spinner.spun_s
    await asyncio.sleep(0.03)
    assert spinner.spun_s == spun


async def test_an_overdue_message_is_not_polled_for() -> None:
    spinner = ArrivalSpinner(0.001)
    now = time.perf_counter()
    spinner.arrived(now - 0.3)
    spinner.arrived(now - 0.2)  # the next was due 0.1 s ago, its grace long past
    spinner.idle()
    await asyncio.sleep(0.01)
    assert spinner.spun_s == 0.0


async def test_reset_and_a_zero_grace_stop_it() -> None:
    spinner = ArrivalSpinner(0.05)
    steady(spinner, 0.05)
    spinner.idle()
    await asyncio.sleep(0.005)
    spinner.reset()
    spun = spinner.spun_s
    assert spun > 0
    await asyncio.sleep(0.03)
    assert spinner.spun_s == spun and spinner.period_s is None

    off = ArrivalSpinner(0.0)
    steady(off, 0.05)
    off.idle()
    await asyncio.sleep(0.01)
    assert off.spun_s == 0.0
