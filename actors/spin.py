"""Keeping a node's event loop polling between a session's decode steps, until its next frame or token comes.

Between two decode steps a node idles while the rest of the ring computes, and its event loop sleeps in the
kernel. Waking it when the next frame (or, on the head, the token) arrives costs a scheduler wake-up (on a VM often
a halted virtual CPU woken by an interrupt), the sender pays for that wake-up inside its write, and the handler then
runs on cold caches. Measured on this project's 2-core VMs that was a fifth of each hop's overhead.

So a decoding node busy-polls instead: from the moment it has sent a session's step on until that session's next
message arrives, or until ``grace_s`` after it was due (the arrival interval of a decoding session is steady: the
ring's compute). The poll is a chain of ``call_soon`` callbacks, so the loop keeps checking its sockets without a
timeout and everything else on it runs as usual; each turn yields the CPU (``sched_yield``) so that any other
runnable thread on that CPU (another node's forward pass on a shared machine, the gateway) goes first. The price
is a CPU that looks busy while the node waits, during decoding only; ``grace_s = 0`` turns polling off.

Measured (tests/bench/bench_gguf_route.py, paired runs on the 2-core VM): per-link overhead 0.50 -> 0.39 ms on a
2-node route and 0.53 -> 0.42 ms on a 3-node route, decode tok/s unchanged or slightly up. Polling without the
yield cost a 3-node route on 2 cores a third of its speed (45 -> 31 tok/s): two polling nodes took turns with
the one computing.
"""

from __future__ import annotations

import asyncio
import os
import time

_ALPHA = 0.3
"""Weight of the newest interval in the moving average."""
_MAX_PERIOD_S = 1.0
"""Intervals longer than this (a stall, a slow prefill) teach nothing about the next one and are not averaged."""


class ArrivalSpinner:
    """One session's decode messages on one node: call ``arrived`` when one comes in and ``idle`` once the node
    has sent the step on; the loop then polls until the next arrival (or gives up ``grace_s`` after it was due)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.period_s: float | None = None
        """Moving average of the interval between arrivals."""
        self.spun_s = 0.0
        """Total time spent polling (the node exports it as a metric)."""
        self.arrivals = 0
        self.caught = 0
        """Arrivals that found the loop polling."""
        self._spinning = False
        self._spin_started = 0.0
        self._last: float | None = None
        self._epoch = 0

    def arrived(self, now: float | None = None) -> None:
        """A message came in: stop polling for it and learn the interval."""
        now = time.perf_counter() if now is None else now
        self.arrivals += 1
        self.caught += self._spinning
        self._stop(now)
        if self._last is not None:
            interval = now - self._last
            if interval <= _MAX_PERIOD_S:
                self.period_s = interval if self.period_s is None else (
                    _ALPHA * interval + (1 - _ALPHA) * self.period_s)
        self._last = now

    def idle(self) -> None:
        """The node has nothing more to do for this session until its next message: poll until it comes."""
        if self.grace_s <= 0 or self.period_s is None or self._last is None:
            return  # off, or no steady interval yet (the first decode steps)
        until = self._last + self.period_s + self.grace_s
        if until <= time.perf_counter():
            return  # already overdue: the normal wake-up will do
        self._epoch += 1
        asyncio.get_running_loop().call_soon(self._spin, self._epoch, until)

    def reset(self) -> None:
        """The session ends or stops decoding: stop polling and forget the interval."""
        self._stop(time.perf_counter())
        self._last = self.period_s = None

    def _stop(self, now: float) -> None:
        self._epoch += 1  # a pending or running poll ends at its next callback
        if self._spinning:
            self.spun_s += now - self._spin_started
            self._spinning = False

    def _spin(self, epoch: int, until: float) -> None:
        if epoch != self._epoch:
            return  # stopped (and counted), or re-armed
        now = time.perf_counter()
        if not self._spinning:
            self._spinning, self._spin_started = True, now
        if now < until:
            os.sched_yield()  # releases the GIL too: a batch on the engine's thread is not held up either
            asyncio.get_running_loop().call_soon(self._spin, epoch, until)
        else:
            self._spinning = False
            self.spun_s += now - self._spin_started
