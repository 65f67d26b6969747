"""Keeping a node's event loop polling between decode steps, until each waiting session's next frame or token comes.

Between two decode steps a node idles while the rest of the ring computes, and its event loop sleeps in the
kernel. Waking it when the next frame (or, on the head, the token) arrives costs a scheduler wake-up (on a VM often
a halted virtual CPU woken by an interrupt), the sender pays for that wake-up inside its write, and the handler then
runs on cold caches. Measured on this project's 2-core VMs that was a fifth of each hop's overhead.

So a decoding node busy-polls instead: from the moment it has sent a session's step on until that session's next
message arrives, or until ``grace_s`` after it was due (the arrival interval of a decoding session is steady: the
ring's compute). One ``LoopPoller`` per node keeps its loop polling while any session waits: a chain of
``call_soon`` callbacks, so the loop checks its sockets without a timeout and everything else on it runs as usual.
Each turn yields the CPU (``sched_yield``) so that any other runnable thread on that CPU (another node's forward
pass on a shared machine, the gateway) goes first. The price is a CPU that looks busy while the node decodes;
``grace_s = 0`` turns polling off.

Measured (paired runs on the 2-core VM, routes up side by side, rounds interleaved): the gain depends on how
expensive the host makes a wake-up. In a slow phase of the VM, per-link overhead 0.50 -> 0.39 ms on a 2-node route
and 0.53 -> 0.42 ms on a 3-node route; in a fast phase 0.36 -> 0.35 and 0.48 -> 0.46; decode tok/s within noise
either way. Node CPU per token on the 2-node route: 7.0 -> 21.7 ms (head), 16.8 -> 22.5 ms (tail). Polling without
the yield cost a 3-node route on 2 cores a third of its speed (45 -> 31 tok/s): two polling nodes took turns with
the one computing.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

_ALPHA = 0.3
"""Weight of the newest interval in the moving average."""
_MAX_PERIOD_S = 1.0
"""Intervals longer than this (a stall, a slow prefill) teach nothing about the next one and are not averaged."""


class LoopPoller:
    """Keeps the running event loop polling while any holder's deadline is ahead. ``on_polled`` receives the
    length of every stretch of polling (for the node's metrics). ``clock`` tells the time for the poller and its
    spinners (``time.perf_counter``; a test passes its own)."""

    def __init__(self, on_polled: Callable[[float], None] | None = None, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._deadlines: dict[object, float] = {}
        self._on_polled = on_polled
        self._started: float | None = None
        """When the current stretch of polling began; ``None`` while the loop is left to sleep."""
        self.polled_s = 0.0

    @property
    def polling(self) -> bool:
        return self._started is not None

    def hold(self, holder: object, until: float) -> None:
        """Poll until ``until`` (on ``clock``) or until ``release(holder)``."""
        self._deadlines[holder] = until
        if self._started is None:
            self._started = self.clock()
            asyncio.get_running_loop().call_soon(self._turn)

    def release(self, holder: object) -> None:
        """The holder's message came, or it stopped waiting; polling ends at the next turn if nobody else waits."""
        self._deadlines.pop(holder, None)

    def holds(self, holder: object) -> bool:
        return self._started is not None and holder in self._deadlines

    def _turn(self) -> None:
        now = self.clock()
        deadlines = self._deadlines
        for holder in [h for h, until in deadlines.items() if until <= now]:
            del deadlines[holder]
        if deadlines:
            os.sched_yield()  # releases the GIL too: a batch on the engine's thread is not held up either
            asyncio.get_running_loop().call_soon(self._turn)
            return
        assert self._started is not None
        stretch, self._started = now - self._started, None
        self.polled_s += stretch
        if self._on_polled is not None:
            self._on_polled(stretch)


class ArrivalSpinner:
    """One session's decode messages on one node: call ``arrived`` when one comes in and ``idle`` once the node
    has sent the step on; the node's poller then polls until the next arrival (or ``grace_s`` past its due time)."""

    def __init__(self, poller: LoopPoller, grace_s: float) -> None:
        self.poller = poller
        self.grace_s = grace_s
        self.period_s: float | None = None
        """Moving average of the interval between arrivals."""
        self.caught = 0
        """Arrivals that found the loop polling for them."""
        self._last: float | None = None

    def arrived(self, now: float | None = None) -> None:
        """A message came in (at ``now`` on the poller's clock, by default the present): stop polling for it and
        learn the interval."""
        now = self.poller.clock() if now is None else now
        self.caught += self.poller.holds(self)
        self.poller.release(self)
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
        if until > self.poller.clock():  # else already overdue: the normal wake-up will do
            self.poller.hold(self, until)

    def reset(self) -> None:
        """The session ends or stops decoding: stop polling for it and forget the interval."""
        self.poller.release(self)
        self._last = self.period_s = None
