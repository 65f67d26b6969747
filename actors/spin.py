"""Keeping a node's event loop polling for the moment a session's next hop message is due.

Between two decode steps a node idles while the rest of the ring computes, and its event loop sleeps in the
kernel. Waking it when the next frame (or, on the head, the token) arrives costs a scheduler wake-up, on a VM often
a halted virtual CPU, and then runs the handler on cold caches: 0.1-0.2 ms per hop measured on this project's
2-core VMs, a third of the hop budget. Busy-polling only around the expected arrival removes most of it at a small,
bounded CPU cost: the arrival interval of a decoding session is steady (the ring's compute), so the loop polls from
``lead_s`` before the expected arrival until the message comes, or at most ``lead_s`` after it.

The spin is a chain of ``call_soon`` callbacks: the loop keeps polling its sockets without a timeout, so a
message is handled in the loop turn it arrives in, and everything else on the loop runs as usual meanwhile.
Timers of asyncio's loops (and libuv's, under uvloop) fire with up to a millisecond of slack, which is why the
default lead is 1 ms. ``lead_s = 0`` turns the spin off.
"""

from __future__ import annotations

import asyncio
import time

_ALPHA = 0.3
"""Weight of the newest interval in the moving average."""
_MAX_PERIOD_S = 1.0
"""Intervals longer than this (a stall, a slow prefill) teach nothing about the next one and are not averaged."""


class ArrivalSpinner:
    """One session's decode messages on one node: call ``arrived`` when one comes in and ``idle`` when the node is
    done with it (its forward or token written); the loop then polls around the next expected arrival."""

    def __init__(self, lead_s: float) -> None:
        self.lead_s = lead_s
        self.period_s: float | None = None
        """Moving average of the interval between arrivals."""
        self.spun_s = 0.0
        """Total time spent polling (for tests and metrics)."""
        self.caught = 0
        """Arrivals that found the loop polling."""
        self.arrivals = 0
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

    def reset(self) -> None:
        """The arrivals stopped being steady (the session ended or left decoding): forget the interval."""
        self._stop(time.perf_counter())
        self._last = self.period_s = None

    def _stop(self, now: float) -> None:
        self._epoch += 1  # a pending or running spin ends at its next callback
        if self._spinning:
            self.spun_s += now - self._spin_started
            self._spinning = False

    def idle(self) -> None:
        """The node has nothing more to do for this session until its next message: poll around its arrival."""
        if self.lead_s <= 0 or self.period_s is None or self._last is None:
            return
        due = self._last + self.period_s
        start_in = due - self.lead_s - time.perf_counter()
        if start_in <= -self.lead_s:
            return  # already late past the window: the normal wake-up will do
        self._epoch += 1
        asyncio.get_running_loop().call_later(max(0.0, start_in), self._spin, self._epoch, due + self.lead_s)

    def _spin(self, epoch: int, until: float) -> None:
        if epoch != self._epoch:
            return  # stopped (and counted), or re-armed
        now = time.perf_counter()
        if not self._spinning:
            self._spinning, self._spin_started = True, now
        if now < until:
            asyncio.get_running_loop().call_soon(self._spin, epoch, until)
        else:
            self._spinning = False
            self.spun_s += now - self._spin_started
