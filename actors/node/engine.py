"""Runs a backend on its own thread and batches concurrent sessions' steps into single forward passes.

Continuous batching: while one batch runs, newly submitted steps queue; the next batch takes all of them (up to the
backend's token budget), so a new prompt's prefill chunk joins running decodes instead of waiting for them to finish.
Every other backend call (open, close, tokenize) also runs on that thread, because llama.cpp contexts are not
thread-safe.

The worker is a plain thread that loops on its own queue rather than an executor driven from the event loop: each
hand-off between the loop and a worker costs a wake-up and a GIL hand-over (~0.1-0.2 ms each on a busy 2-core
node), which adds up to 5% of a small model's decode step. Three things keep hand-offs off the per-token path:

* a session whose next input is known as soon as its step ends (head and tail on one node: the next input is the
  token just sampled) runs as a *chain* (``StepEngine.chain``): the worker queues the follow-up step itself, and
  the event loop only consumes the outputs;
* a one-position step of the only active session, with the worker idle, runs *inline* on the event loop thread
  (``submit``): there is nothing to batch it with, and the loop would only wait for it. The loop is blocked for
  one decode step, never for a prefill chunk; with a second active session everything goes through the worker
  again, so concurrent sessions still share forward passes. Only for a backend computing on one thread
  (``BackendInfo.threads`` = 1): llama.cpp (and torch) run a pass on several threads with OpenMP, and libgomp
  keeps one thread pool per thread that starts a parallel region. Passes started from two threads mean two pools,
  more OpenMP threads than cores, and libgomp then stops spinning at barriers and sleeps on a futex instead, at
  every one of the hundreds of barriers of a pass: a 14-token prefill of the bundled model on 2 threads took 64 ms
  instead of 40 when decode steps ran on another thread than prefill chunks (measured, Xeon, 2 cores), and the
  same as on one thread;
* ``enqueue(handoff=True)`` of the only active session blocks the loop briefly until an idle worker has taken the
  step, so that the worker does not wait for the GIL while the loop goes on publishing.

Which steps ride a pass together (issue #20): before taking a batch the worker waits, briefly, only for the sessions
that rode the last pass of the oldest queued step (its *cohort*), not for every session of the previous pass: on a
route, sessions in different groups reach a hop at different times, and each group is one pass there. A session that
closed is waited for no more. On a head, decode steps of routes of several hops carry the route's hop count
(``enqueue(ring=h)``), and ``actors.node.ring.RingGroups`` says how many of them one pass may carry: all (one group:
every hop computes the same batch in turn) or a share, so that groups follow each other around the ring and the hops
compute different sessions at the same time, whichever it measured to be faster.

Prefill waits for running sessions (issue #30): every pass takes the queued steps of sessions already decoding
first and fills what is left of the token budget with prefill chunks (``enqueue(prefill=True)``), keeping room
for the oldest chunk so that prefill always moves too; a head's sessions admit their prefill through
``prefills`` (``actors.node.prefill_gate``), so that a burst of new sessions puts at most a couple of passes of
prefill on any hop of their routes at once. A burst of admissions then never starves decode, and never makes a
hop's answer wait past its timeout behind every other prompt.

Why one module of ~540 lines: one worker thread and the one lock (``_cond``) over its queues, which the batching,
the cohort wait, the inline runs, the chains and the hand-offs all read and write; split, that lock's rules (which
state it guards, who may wake the worker) would span modules. The ring grouping it consults lives in ``ring``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from actors.backend import Backend, StepInput, StepOutput
from actors.node.prefill_gate import PrefillGate
from actors.node.ring import MERGE_HOLD_S, RingGroups, RingSessions
from schemas.errors import NodeStoppingError, SessionNotFoundError

T = TypeVar("T")

GATHER_WINDOW_S = 0.001
"""How long the worker waits, before taking a batch, for the sessions that rode the last pass of the oldest queued
step to come back (their next frames arrive over HTTP within a fraction of a millisecond of each other). Without it
a batch of n decodes splits into 1 and n-1 for good."""

HANDOFF_WAIT_S = 0.002
"""Longest the event loop blocks after queueing a step for an idle worker, until the worker has taken it.

The worker needs the GIL to start a pass; the loop thread, busy right after queueing (publishing the token,
answering the request), would otherwise keep it for a switch interval at a time: ~0.4 ms per step measured on a
2-node route. Blocking briefly hands the GIL over; the loop gets it back once the pass is inside llama.cpp."""

BURST_GAP_S = 0.0002
"""With other sessions active, the worker also waits (within ``GATHER_WINDOW_S``) while steps keep arriving less
than this apart: the frames one pass of the hop before sends arrive back to back, and belong in one pass here."""

SOLO_WINDOW_S = 0.25
"""A session counts as active on this node for this long after its last submitted step."""

PREFILL_PASSES = 2
"""The most full passes of prefill (the backend's token budget each) a head may have under way on its routes at
once (``prefills``, whose limit is otherwise the time its measured rate needs): two, so that on a route the head
computes the next sessions' chunks while the hop after it computes the previous ones."""

RATE_WEIGHT = 0.3
"""Weight of the latest pass in the measured prefill rate (an exponential average over passes with prefill)."""

Follow = Callable[[StepInput, StepOutput], "StepInput | None"]
"""Called on the worker thread after a chained step: the session's next step, or ``None`` to end the chain."""


@dataclasses.dataclass(slots=True)
class StepTiming:
    """What one submitted step cost: time waiting for the worker, and the batched forward pass it rode in."""

    queue_ms: float
    compute_ms: float
    batch_size: int


Result = tuple[StepOutput, StepTiming]


class StepChain:
    """The outputs of one session's chained steps, in order. ``next`` waits for the following one; ``None`` means
    the chain ended (its follow function returned ``None``, or ``stop`` was called)."""

    def __init__(self, follow: Follow) -> None:
        self.follow = follow
        self.stopped = False
        """Set from the loop; read by the worker before it runs or queues another step (a bool store is atomic)."""
        self._results: asyncio.Queue[Result | BaseException | None] = asyncio.Queue()

    async def next(self) -> Result | None:
        item = await self._results.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """No further step is queued; a step already running still completes (and its output is dropped)."""
        self.stopped = True

    def _put(self, item: Result | BaseException | None) -> None:
        self._results.put_nowait(item)


@dataclasses.dataclass(slots=True)
class _Pending:
    item: StepInput
    queued_at: float
    future: asyncio.Future[Result] | None = None
    chain: StepChain | None = None
    taken: threading.Event | None = None
    """Set by the worker when the pass carrying this step starts (``enqueue(handoff=True)`` waits for it)."""
    ring: tuple[str, ...] = ()
    """A head's decode step on a route of several hops: the route's nodes (empty: any other step)."""
    prefill: bool = False
    """A prompt's chunk: it rides a pass after the steps of the sessions already decoding."""

    def abandoned(self) -> bool:
        return (self.chain is not None and self.chain.stopped) or (self.future is not None and self.future.done())


@dataclasses.dataclass(slots=True)
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]


class StepEngine:
    def __init__(self, backend: Backend, *, ring: RingGroups | None = None,
                 on_pass: Callable[[int], None] | None = None) -> None:
        self.backend = backend
        self.ring = ring or RingGroups()
        self._on_pass = on_pass
        """Called on the worker after every forward pass with how many steps it carried (a metric)."""
        self._cond = threading.Condition()
        self._steps: list[_Pending] = []
        self._calls: collections.deque[_Call] = collections.deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cohort: dict[str, frozenset[str]] = {}
        """Worker: session id -> the sessions of the last pass it rode (the gather waits for those)."""
        self._rings = RingSessions(self.ring, window_s=SOLO_WINDOW_S)
        """Worker: the sessions whose ring steps (``enqueue(ring=)``) are grouped, by route."""
        self._seen_at: dict[str, float] = {}
        """Worker: session id -> when a pass last carried one of its steps."""
        self._busy = False
        """The worker is running a batch or a call (set under ``_cond`` when it takes the work)."""
        self._inline = False
        """A step runs on the loop thread (guarded by ``_cond``); the worker takes nothing meanwhile."""
        self._last_step: dict[str, float] = {}
        """Session id -> when it last submitted a step (monotonic): who is active, for the inline decision."""
        self.may_inline = (backend.info.threads or 1) == 1
        """Steps may run on the loop thread: only a backend on one thread (module docstring: OpenMP's pools)."""
        self.prefill_rate: float | None = None
        """Positions per second of the latest passes that carried prefill chunks (written by the worker)."""
        self.prefills = PrefillGate(PREFILL_PASSES * backend.max_batch_tokens, lambda: self.prefill_rate)
        """Loop: the prefill a head's sessions have under way; a session's first step that is not a prefill chunk,
        or its close, ends its ticket."""
        self.batches_run = 0
        self.max_batch_seen = 0

    async def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._stopping = False
            self._thread = threading.Thread(target=self._work, name="backend", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        """Finish the running batch, fail everything queued, join the worker. Safe to call twice."""
        thread, self._thread = self._thread, None
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if thread is not None:
            await asyncio.to_thread(thread.join)
        with self._cond:
            steps, self._steps = self._steps, []
            calls, self._calls = list(self._calls), collections.deque()
        for p in steps:
            self._fail(p, NodeStoppingError("node is stopping"))
        for c in calls:
            if not c.future.done():
                c.future.set_exception(NodeStoppingError("node is stopping"))

    # ---- the loop's side --------------------------------------------------------------------------------------

    async def close_session(self, session_id: str) -> None:
        """Free a backend session on the worker, and drop every step of it still queued: a closed session's step
        in a batch would fail the whole forward pass, and with it every other session riding in it. The session
        no longer counts as active, and no batch waits for it."""
        self.prefills.release(session_id)
        await self.call(self._close_now, session_id)
        self._last_step.pop(session_id, None)

    def _close_now(self, session_id: str) -> None:
        """On the worker thread, between forward passes."""
        self.backend.close_session(session_id)
        with self._cond:
            self._cohort.pop(session_id, None)
            self._seen_at.pop(session_id, None)
            self._rings.forget(session_id)
            dropped = [p for p in self._steps if p.item.session_id == session_id]
            self._steps = [p for p in self._steps if p.item.session_id != session_id]
        for p in dropped:
            self._to_loop(StepEngine._fail, p, SessionNotFoundError(f"session {session_id} was closed"))

    def call_soon(self, fn: Callable[..., object], *args: object) -> asyncio.Future[Any]:
        """``call`` without waiting: queued now, so it runs on the worker before any step queued after it (calls
        go ahead of batches). The returned future says how it went."""
        future: asyncio.Future[Any] = self._running_loop().create_future()
        self._enqueue_call(_Call(lambda: fn(*args), future))
        return future

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run a backend method on the worker thread, serialized with forward passes."""
        future: asyncio.Future[T] = self._running_loop().create_future()
        self._enqueue_call(_Call(lambda: fn(*args), future))
        return await future

    async def submit(self, item: StepInput) -> Result:
        """One step; resolves when the batch it rode in has run (or at once if it ran inline)."""
        return await self.enqueue(item, handoff=True)

    def enqueue(self, item: StepInput, *, handoff: bool = False, inline: bool = True,
                ring: tuple[str, ...] = (), prefill: bool = False) -> asyncio.Future[Result]:
        """``submit`` without waiting: the step is queued before this returns (cancel the future to drop it), or,
        alone on an idle engine, already run inline (the future is done; ``inline=False``: never, the loop has
        something more urgent to do meanwhile). ``handoff``: if the worker is idle, block (at most
        ``HANDOFF_WAIT_S``) until it has taken the step. ``ring``: a head's decode step, the nodes of its route
        (its passes are grouped, see the module's docstring). ``prefill``: a prompt's chunk, which rides a pass after
        the decoding sessions' steps; a head session's first other step ends its prefill ticket (``prefills``)."""
        future: asyncio.Future[Result] = self._running_loop().create_future()
        if not prefill:
            self.prefills.release(item.session_id)
        if self._claim_inline(item, allowed=inline):
            try:
                future.set_result(self._run_inline(item))
            except Exception as exc:  # noqa: BLE001 - delivered to the awaiting caller, as from the worker
                future.set_exception(exc)
            return future
        # Only for a lone session: with others active the worker should wait for their steps and batch them.
        wait = handoff and not self._busy and len(self._last_step) == 1
        pending = _Pending(item, time.perf_counter(), future=future, taken=threading.Event() if wait else None,
                           ring=ring if len(ring) > 1 and item.n_positions == 1 else (), prefill=prefill)
        self._enqueue(pending)
        if pending.taken is not None:
            pending.taken.wait(HANDOFF_WAIT_S)
        return future

    def enqueue_group(self, items: list[StepInput]) -> list[asyncio.Future[Result]]:
        """Steps of different sessions that must ride one forward pass (the choices of an n > 1 session, one round
        of decode): queued at once, so the worker takes them together, in this order, and never inline. A batch's
        shape moves llama.cpp's results a little: choices that always step together compute the same thing every
        time, which a seeded request's reproducibility depends on."""
        loop = self._running_loop()
        now, mono = time.perf_counter(), time.monotonic()
        pendings = [_Pending(item, now, future=loop.create_future()) for item in items]
        for item in items:
            self._last_step[item.session_id] = mono
            self.prefills.release(item.session_id)
        with self._cond:
            if self._stopping:
                raise NodeStoppingError("node is stopping")
            self._steps.extend(pendings)
            self._cond.notify()
        return [p.future for p in pendings if p.future is not None]

    def _claim_inline(self, item: StepInput, *, allowed: bool = True) -> bool:
        """Count the session as active; True if its step is to run inline now (``allowed``: the caller permits it)."""
        now = time.monotonic()
        last = self._last_step
        last[item.session_id] = now
        if len(last) > 1:
            for sid in [sid for sid, t in last.items() if now - t > SOLO_WINDOW_S]:
                del last[sid]
        if not (allowed and self.may_inline) or item.n_positions != 1 or len(last) != 1:
            return False
        with self._cond:
            if self._busy or self._inline or self._steps or self._calls or self._stopping:
                return False
            self._inline = True
            return True

    def _run_inline(self, item: StepInput) -> Result:
        started = time.perf_counter()
        try:
            out = self.backend.step([item])[0]
        finally:
            with self._cond:
                self._inline = False
                if self._steps or self._calls or self._stopping:  # waking an idle worker costs the GIL (~50 us)
                    self._cond.notify()
        self.batches_run += 1
        self.max_batch_seen = max(self.max_batch_seen, 1)
        if self._on_pass is not None:
            self._on_pass(1)
        return out, StepTiming(0.0, (time.perf_counter() - started) * 1e3, 1)

    def chain(self, first: StepInput, follow: Follow) -> StepChain:
        """Run ``first``, then whatever ``follow`` makes of each output, without a round trip through the loop."""
        self._running_loop()
        self.prefills.release(first.session_id)
        chain = StepChain(follow)
        self._enqueue(_Pending(first, time.perf_counter(), chain=chain))
        return chain

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._thread is None or self._loop is None:
            raise NodeStoppingError("the step engine is not running")
        return self._loop

    def _enqueue(self, pending: _Pending) -> None:
        with self._cond:
            if self._stopping:
                raise NodeStoppingError("node is stopping")
            # ``self._steps`` is read under the lock: the worker replaces the list when it takes a batch, and a
            # bound ``append`` taken before the lock could put the step in the list it just dropped.
            self._steps.append(pending)
            self._cond.notify()

    def _enqueue_call(self, call: _Call) -> None:
        with self._cond:
            if self._stopping:
                raise NodeStoppingError("node is stopping")
            self._calls.append(call)
            self._cond.notify()

    # ---- the worker -------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._inline or not (self._steps or self._calls or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    return
                calls = list(self._calls)
                self._calls.clear()
                batch = [] if calls else self._take_batch()
                self._busy = bool(calls or batch)
            try:
                for c in calls:
                    self._run_call(c)
                if batch:
                    self._run_batch(batch)
            finally:
                self._busy = False

    def _take_batch(self) -> list[_Pending]:
        """With ``_cond`` held: wait briefly for the steps that belong with the oldest queued one (``_gather``), then
        take what fits the budget and, of a head's ring steps, what the route's grouping allows: the steps of
        sessions already decoding first, with room kept for the oldest prefill chunk, then prefill chunks."""
        first = next((p for p in self._steps if not p.abandoned()), None)
        if first is not None:
            self._gather(first)
            if self._calls:  # arrived while gathering: it goes ahead of the steps queued after it (``call_soon``)
                return []
        now = time.monotonic()
        self._rings.prune(now)
        for sid in [sid for sid, t in self._seen_at.items() if now - t > SOLO_WINDOW_S]:
            del self._seen_at[sid]
        caps: dict[tuple[str, ...], int] = {}
        ringed: dict[tuple[str, ...], int] = {}
        budget = self.backend.max_batch_tokens
        batch: list[_Pending] = []
        rest: list[_Pending] = []
        seen: set[str] = set()
        used = 0
        live = [p for p in self._steps if not p.abandoned()]
        oldest = next((p for p in live if p.prefill), None)
        reserve = oldest.item.n_positions if oldest is not None else 0
        for p in [*(p for p in live if not p.prefill), *(p for p in live if p.prefill)]:
            n = p.item.n_positions
            if p.ring and p.ring not in caps:
                caps[p.ring] = self._ring_cap(p.ring, now)
            # A session's steps stay in order, one per pass; the first item always goes so nothing starves, and
            # decoding sessions leave room for the oldest prefill chunk.
            room = budget if p.prefill else budget - reserve
            if p.item.session_id in seen or (batch and used + n > room) or (
                    p.ring and ringed.get(p.ring, 0) >= caps[p.ring]):
                rest.append(p)
                continue
            batch.append(p)
            seen.add(p.item.session_id)
            used += n
            if p.ring:
                ringed[p.ring] = ringed.get(p.ring, 0) + 1
                self._rings.taken(p.item.session_id, p.ring, now)
        self._steps = rest
        cohort = frozenset(seen)
        for sid in seen:
            self._cohort[sid] = cohort
            self._seen_at[sid] = now
        self.ring.stepped(sum(ringed.values()))
        return batch

    def _ring_cap(self, route: tuple[str, ...], now: float) -> int:
        """How many ring steps of ``route`` one pass may carry, by its grouping."""
        queued = {p.item.session_id for p in self._steps if p.ring == route}
        return self._rings.cap(route, len(self._rings.on(route, queued)), now)

    def _gather(self, first: _Pending) -> None:
        """With ``_cond`` held, wait for what belongs in one pass with ``first``: the sessions of the last pass it
        rode (its cohort, for at most ``GATHER_WINDOW_S``), steps still arriving back to back (other sessions
        active), and, for a head's ring step whose group is smaller than its route's grouping wants, the route's
        sessions due within ``MERGE_HOLD_S`` (groups that drifted apart merge once, then stay together)."""
        start = time.monotonic()
        expected = self._cohort.get(first.item.session_id, frozenset())
        others = any(sid != first.item.session_id for sid in self._seen_at)
        merge: set[str] = set()
        cap = 1
        if first.ring:
            on_route = {p.item.session_id for p in self._steps if p.ring == first.ring}
            cap = self._ring_cap(first.ring, start)
            if len(on_route) < cap:
                merge = self._rings.due(first.ring, start, MERGE_HOLD_S) - on_route
        count, last = len(self._steps), start
        while not self._calls and not self._stopping:
            now = time.monotonic()
            if len(self._steps) != count:
                count, last = len(self._steps), now
            queued = {p.item.session_id for p in self._steps}
            until: float | None = None
            if now < start + GATHER_WINDOW_S:
                if any(sid not in queued and sid in self._cohort for sid in expected):  # not closed meanwhile
                    until = start + GATHER_WINDOW_S
                elif others and now - last < BURST_GAP_S:
                    until = last + BURST_GAP_S
            if merge and now < start + MERGE_HOLD_S and any(sid not in queued for sid in merge) and \
                    sum(1 for p in self._steps if p.ring == first.ring) < cap:
                until = start + MERGE_HOLD_S
            if until is None:
                return
            self._cond.wait(max(0.0, until - now))

    def _run_call(self, call: _Call) -> None:
        try:
            result = call.fn()
        except BaseException as exc:  # noqa: BLE001 - the caller gets whatever the backend raised
            self._to_loop(_reject, call.future, exc)
        else:
            self._to_loop(_resolve, call.future, result)

    def _run_batch(self, batch: list[_Pending]) -> None:
        started = time.perf_counter()
        for p in batch:
            if p.taken is not None:
                p.taken.set()
        try:
            outputs = self.backend.step([p.item for p in batch])
        except BaseException as exc:  # noqa: BLE001 - every waiter must learn why its step failed
            self._to_loop(_fail_all, batch, exc)
            return
        compute_ms = (time.perf_counter() - started) * 1e3
        if any(p.prefill for p in batch):
            rate = sum(p.item.n_positions for p in batch) / max(compute_ms, 1e-3) * 1e3
            self.prefill_rate = rate if self.prefill_rate is None else (
                RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * self.prefill_rate)
        self.batches_run += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        if self._on_pass is not None:
            self._on_pass(len(batch))
        results = [(p, (out, StepTiming((started - p.queued_at) * 1e3, compute_ms, len(batch))))
                   for p, out in zip(batch, outputs, strict=True)]
        followers = [self._follow(p, r[0]) for p, r in results]
        queued = [f for f in followers if isinstance(f, _Pending)]
        if queued:
            with self._cond:
                # Ahead of anything queued meanwhile: the chain's step is next in its session's order anyway.
                self._steps[:0] = queued
        # Idle before the results reach the loop: a session that answers at once (its next decode step) must find
        # the worker idle to run inline; the worker touches the backend again only after taking new work.
        self._busy = False
        self._to_loop(_deliver_all, [(p, r, f) for (p, r), f in zip(results, followers, strict=True)])

    def _follow(self, pending: _Pending, out: StepOutput) -> _Pending | BaseException | None:
        """The chain's next step; ``None`` when the chain ends here; the exception if its follow function failed."""
        chain = pending.chain
        if chain is None or chain.stopped:
            return None
        try:
            nxt = chain.follow(pending.item, out)
        except BaseException as exc:  # noqa: BLE001 - a broken follow ends its chain, not the worker
            return exc
        return None if nxt is None else _Pending(nxt, time.perf_counter(), chain=chain)

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        # RuntimeError: the loop closed under a stopping node, and nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    @staticmethod
    def _fail(pending: _Pending, exc: BaseException) -> None:
        if pending.future is not None and not pending.future.done():
            pending.future.set_exception(exc)
        if pending.chain is not None:
            pending.chain._put(exc)


def _resolve(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _reject(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _fail_all(batch: list[_Pending], exc: BaseException) -> None:
    for p in batch:
        StepEngine._fail(p, exc)


def _deliver_all(results: list[tuple[_Pending, Result, _Pending | BaseException | None]]) -> None:
    for pending, result, follower in results:
        if pending.future is not None:
            _resolve(pending.future, result)
        chain = pending.chain
        if chain is None or chain.stopped:
            continue
        chain._put(result)
        if follower is None or isinstance(follower, BaseException):
            chain._put(follower)  # the end of the chain, or why it broke
