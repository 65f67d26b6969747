"""How much prefill a node's head sessions have under way on their routes at once (issue #30); only sessions
with hops after the head wait here (head and tail on one node: no frame waits anywhere, and the engine's passes
already take decode steps first).

A hop answers a frame only once it has computed it, within the hop timeout, and it computes its queued steps a
batch at a time. Sessions admitted together (a burst of 64 with capacity for all of them) each send their prompt's
first chunk at once, so without a bound the last frame at the tail waits behind every other prompt's chunk: 64
prompts of the bundled model took one loaded tail longer than the 10 s hop timeout, and all 64 failed. The gate
bounds what any hop holds of one head's prefill, whatever the burst: a session holds a ticket for its chunk's
positions from its first chunk until its prefill is over on the whole route (its first decode step, or its
close); sessions beyond the limit wait in arrival order and start at the step boundary where earlier prefills
ended. The limit is time, not a count: what this node computes, at the prefill rate it measured, within a share
of the hop timeout (``within_s``), at most ``cap`` positions (a couple of passes). A machine loaded far beyond
its cores prefilled the bundled model at 40-90 positions a second per half (measured: a 512-position pass took
5-13 s), an idle one at several hundred: a count right for one trips the hop timeout on the other. The hops after
the head are taken to compute about as fast (the same machines, a share of the layers each). Until a rate is
measured, and whenever one chunk is more than the limit, a session prefills alone. The node's step engine
(``actors.node.engine``) takes the running sessions' decode steps into every pass ahead of prefill chunks, so a
burst never starves decode either.

This is llama-server's and vLLM's scheduling (a token budget per step, decodes first, waiting prompts admitted as
the budget frees) applied to a pipeline: the budget counts the positions in flight on the route, not only those in
this node's next pass, because the hops after the head see the same burst a pass later.

Used from the node's event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Awaitable, Callable


@dataclasses.dataclass(slots=True)
class _Waiter:
    session_id: str
    positions: int
    within_s: float
    admitted: asyncio.Future[None]


class PrefillGate:
    def __init__(self, cap: int, rate: Callable[[], float | None]) -> None:
        """``cap``: the most positions under way at once; ``rate``: this node's prefill positions per second, as
        measured (None: not yet)."""
        if cap < 1:
            raise ValueError("the prefill cap must be positive")
        self.cap = cap
        self._rate = rate
        self._held: dict[str, int] = {}
        """Session id -> the positions its ticket holds."""
        self._waiting: collections.deque[_Waiter] = collections.deque()
        self.in_flight = 0
        """Positions of prefill under way (the sum of the tickets held)."""
        self.admitted = 0
        self.waited = 0
        """Sessions that had to wait for an earlier prefill to end."""
        self.overdue = 0
        """Sessions that went after ``max_wait_s`` without their turn."""

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def holds(self, session_id: str) -> bool:
        return session_id in self._held

    def limit(self, within_s: float) -> int:
        """Positions this node prefills within ``within_s`` at its measured rate (0 before a rate), at most ``cap``."""
        rate = self._rate()
        return 0 if rate is None else min(self.cap, int(rate * within_s))

    def try_admit(self, session_id: str, positions: int, within_s: float) -> bool:
        """Admit ``session_id`` to prefill ``positions`` positions (its chunk's) now, if they fit the limit for
        ``within_s`` (or nothing else is under way: a chunk over the limit still goes, alone) and nobody waits
        before it. A session admitted twice keeps its first ticket."""
        if session_id in self._held:
            return True
        positions = max(1, positions)
        if self._waiting or not self._fits(positions, within_s):
            return False
        self._take(session_id, positions)
        return True

    async def admit(self, session_id: str, positions: int, within_s: float, *,
                    keepalive: Callable[[], Awaitable[None]] | None = None, every_s: float = 1.0,
                    max_wait_s: float | None = None) -> None:
        """``try_admit``, or wait in line until the prefills ahead of it ended, calling ``keepalive`` every
        ``every_s`` meanwhile (the session's telemetry: its gateway takes a silent session for a lost one). After
        ``max_wait_s`` (checked at a keepalive) it goes regardless: the hops after the head free a session idle
        for ``session_idle_ttl_s``, and one that waited that long would find its route gone."""
        if self.try_admit(session_id, positions, within_s):
            return
        waiter = _Waiter(session_id, max(1, positions), within_s, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        self.waited += 1
        began = time.monotonic()
        try:
            while not (await asyncio.wait([waiter.admitted], timeout=every_s if keepalive else None))[0]:
                assert keepalive is not None
                await keepalive()
                if max_wait_s is not None and time.monotonic() - began >= max_wait_s and not waiter.admitted.done():
                    self._waiting.remove(waiter)
                    self._take(session_id, waiter.positions)
                    self.overdue += 1
                    return
        except BaseException:
            if waiter.admitted.done() and not waiter.admitted.cancelled():
                self.release(session_id)  # admitted as it was cancelled: the ticket goes back
            else:
                waiter.admitted.cancel()
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
                self._wake()  # it may have held up smaller ones behind it
            raise

    def release(self, session_id: str) -> None:
        """The session's prefill is over on its route (or it closed): its positions go to whoever waits next.
        Idempotent; nothing for a session without a ticket."""
        positions = self._held.pop(session_id, None)
        if positions is None:
            return
        self.in_flight -= positions
        self._wake()

    def _fits(self, positions: int, within_s: float) -> bool:
        return self.in_flight == 0 or self.in_flight + positions <= self.limit(within_s)

    def _take(self, session_id: str, positions: int) -> None:
        self._held[session_id] = positions
        self.in_flight += positions
        self.admitted += 1

    def _wake(self) -> None:
        # In arrival order, and the first that does not fit stops the line: a long prompt is not overtaken for good
        # by short ones arriving after it.
        while self._waiting and self._fits(self._waiting[0].positions, self._waiting[0].within_s):
            waiter = self._waiting.popleft()
            if waiter.admitted.done():
                continue
            self._take(waiter.session_id, waiter.positions)
            waiter.admitted.set_result(None)
