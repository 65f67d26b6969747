"""A Route Session on its head node: the session's one owner, its fate and nothing else.

The head holds the session's event queue (what the route sends back: ``on_token``, ``on_window``, failure
reports) and its phase; it notices a failure anywhere downstream (a hop's report, its own outbox's connection
errors, or silence past the token timeout, then a probe of every hop to name the dead one) and it alone publishes
the terminal telemetry and the ``SessionEnd`` (complete, failed or cancelled), then frees the session on every
other hop. The gateway only follows, except for what the head cannot report: its own death (``gateway.live_session``).

What it computes is decided elsewhere, through its port (``actors.node.head_port.HeadPort``): the prefill
(``actors.node.prefill``), then the decode strategy its open settled (``decode_strategy``), and a repair
(``actors.node.recovery.repair``) when it loses a hop. One thing stays here: plain decoding on several hops starts
each next step in ``on_token`` itself, inline where it can, before the driver task wakes (per-token path).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from actors.node.choices import Choice
from actors.node.decode.local_chain import LocalChain
from actors.node.decode.relay import Relay
from actors.node.decode.rounds import Rounds
from actors.node.head_port import DecodeStrategy, RouteMessage, StepResult
from actors.node.head_watch import lost_downstream, stalled, watch_client
from actors.node.prefill import prefill
from actors.node.recovery.repair import RepairFailed, RouteRepair, phase_after, replaceable
from actors.node.recovery.takeover import HeadTakeover, TakeoverFailed
from actors.node.runtime import NodeRuntime
from actors.node.session import PLAIN_START, NodeSession, SessionFailed, SessionStart
from actors.node.speculation.verify_loop import VerifyWindows
from actors.node.telemetry import TelemetryPublisher
from bus.liveness import Silence
from schemas.errors import SwarmrouteError
from schemas.frame import FrameKind, SampledToken, SampledWindow
from schemas.session import (
    FailureReason,
    FinishReason,
    HopTiming,
    SessionEnd,
    SessionOpen,
    SessionPhase,
    TokenEvent,
)

log = logging.getLogger(__name__)
DRAIN_S = 1.0
"""Longest a completing session waits for the answers to its last requests before it closes."""


def decode_strategy(request: SessionOpen, *, is_tail: bool) -> DecodeStrategy:
    """How a session decodes after its prefill, settled by its open."""
    if request.n > 1:
        return Rounds(local=is_tail)
    if request.speculate is not None and not is_tail:
        return VerifyWindows(request.speculate)
    return LocalChain() if is_tail else Relay()


class HeadSession(NodeSession):
    """The head of a Route Session, and the one implementation of ``actors.node.head_port.HeadPort``."""

    def __init__(self, rt: NodeRuntime, request: SessionOpen, *, hidden_shape: tuple[int, ...],
                 on_closed: Callable[[NodeSession], Awaitable[None]], start: SessionStart = PLAIN_START) -> None:
        super().__init__(rt, request, hidden_shape=hidden_shape, on_closed=on_closed, start=start)
        self._events: asyncio.Queue[RouteMessage] = asyncio.Queue()
        self._driver: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        """Asks every ``client_probe_s`` whether the session's client still listens (``head_watch.watch_client``)."""
        self._strategy = decode_strategy(request, is_tail=self.is_tail)
        self._steps_inline = request.n == 1 and request.speculate is None
        """``on_token`` starts the next step itself (``decode.relay``); otherwise the strategy's task does."""
        self._opening = start.opening
        """The hops after the head, still opening (issue #20: the head opens them while its prefill starts)."""
        resume = request.resume  # a replacement for a lost head (issue #31): its telemetry goes on from the old one's
        self.telemetry = TelemetryPublisher(
            self.route, lambda snap: self.rt.publish(self.rt.subjects.telemetry(self.id), snap),
            interval_s=self.rt.settings.telemetry_interval_s,
            first_seq=resume.telemetry_seq + 1 if resume is not None else 1)
        if resume is not None:
            self.telemetry.generated = len(resume.generated)
        self.repairs = request.epoch
        self.lost_nodes: list[str] = []
        """Nodes this session lost: never routed to again (issue #18)."""
        self._repairing = False
        """A repair is under way: tokens of the old route are dropped (the repaired one samples them again)."""

    @property
    def ring_key(self) -> tuple[str, ...]:
        """Its decode steps' route, for the engine's grouping of sessions around the ring (issue #20)."""
        return tuple(h.node_id for h in self.route.hops)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        super().start()
        self._driver = asyncio.create_task(self._drive(), name=f"drive-{self.id[:8]}")
        if self.rt.settings.client_probe_s > 0:
            watch = watch_client(self.rt.client_present, self.id, every_s=self.rt.settings.client_probe_s,
                                 closed=lambda: self.closed, cancel=self.cancel)
            self._watcher = asyncio.create_task(watch, name=f"client-{self.id[:8]}")

    def _tasks(self) -> list[asyncio.Task[None]]:
        return [*super()._tasks(), *(t for t in (self._driver, self._watcher) if t is not None)]

    async def route_ready(self) -> bool:
        return self._opening is None or await self._opening.done()

    async def route_opened(self) -> None:
        """The open's answer waits for this: every later hop opened, or the ``HopOpenError`` saying which did not,
        once this session has closed (it has published nothing then)."""
        if self._opening is None:
            return
        try:
            await self._opening.result()
        except BaseException:
            await self.close()
            raise

    def _stopping(self) -> None:
        self._strategy.stop()
        for choice in self.choices.all:
            if choice.prefetched is not None:
                choice.prefetched[1].cancel()

    async def _report(self, reason: FailureReason) -> None:
        self._events.put_nowait(reason)

    def on_failure_report(self, reason: FailureReason) -> None:
        """Head: a downstream node reported a failure."""
        self._events.put_nowait(reason)

    def on_window(self, window: SampledWindow) -> None:
        """Head: the tail's verdict on a verify window (issue #20), for the speculative loop."""
        self._spinner.arrived()
        self.touch()
        if not self._repairing and all(t.epoch >= self.recovery.epoch for t in window.tokens):
            self._events.put_nowait(window)

    def on_token(self, event: TokenEvent | SampledToken) -> None:
        """Head: the tail posted a sampled token. The next step is queued at once, ahead of the driver task waking
        up to publish the token: that wake-up is off the per-token path."""
        arrived = time.perf_counter()
        self._spinner.arrived(arrived)
        self.touch()
        if self._repairing or (isinstance(event, SampledToken) and event.epoch < self.recovery.epoch):
            return  # sampled on the route as it was before the repair: the repaired route samples it again
        choice = self.choices.get(event.choice if isinstance(event, SampledToken) else event.index)
        if not self._steps_inline:  # decoded in rounds or in verify windows: the strategy starts the steps
            self._events.put_nowait(event)
            return
        choice.arrivals[event.seq] = arrived
        if event.finish_reason is None and not self.closed and choice.prefetched is None:
            self.phase = SessionPhase.DECODE  # the first token ends the prefill, on every count
            item = choice.decode_step(event.token)
            # The first token goes to the client before the step it feeds (its TTFT would wait a whole decode
            # step); that step runs on the worker meanwhile. Every later one: the step first (inline if it can).
            step = self.rt.engine.enqueue(item, handoff=True, inline=event.seq > 0, ring=self.ring_key)
            forwarded = step.done() and not step.cancelled() and step.exception() is None
            if forwarded:
                # It ran inline: the frame leaves now, before the driver task even wakes (failures go its way).
                self.advance(choice, item, step.result()[1])
                self.forward(choice, step.result(), event)
            choice.prefetched = (event.seq, step, forwarded)
        self._events.put_nowait(event)

    # ---- the driver -------------------------------------------------------------------------------------------

    async def _drive(self) -> None:
        try:
            takeover = HeadTakeover(self) if self.request.resume is not None else None
            cut = await self._take_over(takeover) if takeover is not None else 0
            first_tokens = await prefill(self)
            if first_tokens is None:
                return  # the hops after it did not open: the open's answer says why, and closes the session
            if takeover is not None:
                await takeover.catch_up(cut)
            self.put_events(first_tokens)  # head and tail on this node: the prefill sampled them here
            while True:
                try:
                    await self._strategy.run(self)
                    return
                except SessionFailed as failed:
                    if not await self._repaired(failed.reason):
                        raise
        except SessionFailed as failed:
            await self._fail(failed.reason)
        except asyncio.CancelledError:
            raise
        except SwarmrouteError as exc:
            await self._fail(FailureReason(node_id=self.rt.node_id, phase=self.phase, kind="backend_error",
                                           message=exc.message))
        except Exception as exc:
            log.exception("session %s failed on its head", self.id)
            await self._fail(FailureReason(node_id=self.rt.node_id, phase=self.phase, kind="internal",
                                           message=f"{type(exc).__name__}: {exc}"))

    def forward(self, choice: Choice, result: StepResult, event: TokenEvent | SampledToken, group: int = 0) -> None:
        out, timing = result
        assert out.hidden is not None
        self.queue_frame(FrameKind.DECODE, choice.position - 1, out.hidden, True, event.seq + 1,
                         (self.stamp(timing),), choice.index, group, (event.token,))
        self._spinner.idle()

    async def announce(self, event: TokenEvent, wall_ms: float | None) -> None:
        """Publish a token to the gateway, with its telemetry and metrics."""
        await self.rt.publish(self.rt.subjects.tokens(self.id), event)
        await self.telemetry.token(event.hop_timings, wall_ms)
        self.rt.metrics.token(self.telemetry.generated, self.telemetry.ttft_ms, wall_ms, event.hop_timings,
                              len(self.route.hops))

    def token_timeout(self) -> float:
        first = self.telemetry.generated == 0
        return self.rt.settings.first_token_timeout_s if first else self.rt.settings.token_timeout_s

    async def next_event(self) -> TokenEvent:
        """The next token from the tail, or ``SessionFailed``: a hop's report, a hop found dead while the route is
        silent (``bus.liveness``: at once), or silence past the token timeout."""
        item = await self.next_message()
        if isinstance(item, FailureReason):
            raise SessionFailed(item)
        if isinstance(item, SampledWindow):
            raise SessionFailed(FailureReason(node_id=self.route.tail.node_id, phase=self.phase, kind="protocol",
                                              message="a verify window's verdict for a session without windows"))
        return self.event_of(item) if isinstance(item, SampledToken) else item

    async def next_message(self) -> RouteMessage:
        """What the route sends next (a token, a window's verdict, a hop's failure report), or ``SessionFailed`` for
        a hop found dead while the route is silent or silence past the token timeout."""
        limit = self.token_timeout()
        silence = Silence(self.rt.settings.liveness_probe_s)
        while True:
            try:
                async with asyncio.timeout(silence.wait(limit)):  # no task per token, unlike wait_for
                    item = await self._events.get()
                break
            except TimeoutError:
                if silence.lasted() >= limit:
                    reason = await stalled(self.rt.client, self.route.hops[1:], self.phase, limit)
                    raise SessionFailed(reason) from None
                if silence.probe_due():
                    arrived = await lost_downstream(self.rt.client, self.route.hops[1:], self.id, self.phase,
                                                    self._events, session_token=self.session_token)
                    silence.probed()
                    if arrived is not None:
                        item = arrived
                        break
        return item

    async def complete(self, event: TokenEvent, *, keep_positions: int | None = None) -> None:
        assert event.finish_reason is not None
        end = self._ended(SessionPhase.COMPLETE, self.choices.completion_tokens(),
                          finish_reason=self.choices.first.finish_reason or event.finish_reason)
        end.choices = self.choices.reports()
        await self.telemetry.complete(event.finish_reason)
        # Every hop frees the session before the client can learn it ended: a client that opens its next session
        # at once must find the slots free, or a swarm within its capacity refuses it (tests/test_load.py).
        if self.outbox is not None:
            await self.outbox.drain(DRAIN_S)
        # Its KV may serve a request that continues it (issue #18); speculative positions never confirmed stay out.
        self.keep = self.position if keep_positions is None else keep_positions
        await self.close()
        await self._release_route(keep=self.keep)
        await self.rt.publish(self.rt.subjects.tokens(self.id), end)

    async def cancel(self, why: str) -> None:
        """End the session as cancelled (its client went away): telemetry and ``SessionEnd`` for monitors, every
        hop freed. Nothing if it already ended."""
        if self.closed or self.phase.terminal:
            return  # it ended on its own meanwhile
        log.info("session %s cancelled: %s", self.id, why)  # a client that leaves is no fault
        await self.close()  # first: the driver stops, so the session cannot also complete or fail meanwhile
        end = self._ended(SessionPhase.CANCELLED, self.telemetry.generated)
        await self.telemetry.cancel()
        await self.rt.publish(self.rt.subjects.tokens(self.id), end)  # for monitors; the client is gone
        await self._release_route()

    def _ended(self, phase: SessionPhase, completion_tokens: int, *, finish_reason: FinishReason | None = None,
               failure: FailureReason | None = None) -> SessionEnd:
        """Enter a terminal phase, count it, and build the session's ``SessionEnd``; callers order the telemetry,
        the freeing and the publishing as their case needs."""
        self.phase = phase
        self.rt.metrics.sessions_ended.labels(outcome=phase.value).inc()
        return SessionEnd(session_id=self.id, phase=phase, finish_reason=finish_reason, failure=failure,
                          prompt_tokens=len(self.request.prompt_tokens), completion_tokens=completion_tokens)

    async def _release_route(self, *, keep: int = 0) -> None:
        """Head, at the end: free the session on every other hop (``keep``: it completed, and they may keep its KV
        for reuse). The gateway does the same, but it may be gone, and then the tail (and any middle hop) would hold
        its KV until the idle TTL. Idempotent on the nodes."""
        await asyncio.gather(*(self.rt.client.close_session(h.node_id, h.endpoint, self.id, timeout=1.0,
                                                            session_token=self.session_token, keep=keep)
                               for h in self.route.hops[1:]), return_exceptions=True)

    async def _fail(self, reason: FailureReason) -> None:
        log.warning("session %s failed: %s", self.id, reason.message)
        end = self._ended(SessionPhase.FAILED, self.telemetry.generated, failure=reason)
        await self.telemetry.fail(reason)
        await self.rt.publish(self.rt.subjects.tokens(self.id), end)
        await self.close()
        await self._release_route()

    # ---- repair (issue #18) ------------------------------------------------------------------------------------

    async def _take_over(self, takeover: HeadTakeover) -> int:
        """A replacement for a lost head (issue #31): re-bind the later hops; where the tail samples from."""
        self.phase = SessionPhase.REPAIRING
        try:
            cut = await takeover.rebind()
            self.phase = phase_after(takeover.resume.generated)
            return cut
        except TakeoverFailed as exc:
            raise SessionFailed(FailureReason(node_id=self.rt.node_id, phase=phase_after(self.fed()),
                                              kind="unreachable", message=str(exc))) from None

    async def _repaired(self, reason: FailureReason) -> bool:
        """Route around the hop ``reason`` names, if the session repairs and that hop can be replaced; False when
        it cannot even be tried (the caller then fails the session with ``reason``). A repair that fails raises
        ``SessionFailed`` saying why."""
        lost = replaceable(self.request, self.route, reason, repairs=self.repairs, limit=self.rt.settings.max_repairs)
        if lost is None or self.closed or self.is_tail:
            return False
        log.warning("session %s lost %s (%s); repairing", self.id[:8], reason.node_id, reason.message)
        self.phase = SessionPhase.REPAIRING
        self._repairing = True
        try:
            view = await RouteRepair(self, lost, reason, repairs=self.repairs, lost_nodes=self.lost_nodes).run()
        except RepairFailed as exc:
            self.rt.metrics.repairs.labels(outcome="failed").inc()
            raise SessionFailed(reason.model_copy(update={
                "message": f"{reason.message}; repair impossible: {exc}"})) from None
        finally:
            self._repairing = False
        self.repairs += 1
        self.lost_nodes.append(reason.node_id or "")
        self.rt.metrics.repairs.labels(outcome="repaired").inc()
        self.phase = phase_after(self.fed())
        await self.telemetry.repaired(self.route, view, self.phase)
        return True

    def fed(self) -> list[int]:
        """The generated tokens this head has fed into its KV, in order."""
        return self.recovery.tokens[len(self.request.prompt_tokens):self.position]

    def take_events(self) -> list[RouteMessage]:
        """Everything the route sent that the driver has not read yet (a repair looks at it, then ``put_events``)."""
        events = []
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return events

    def put_events(self, events: Sequence[TokenEvent | SampledToken]) -> None:
        for event in events:
            self._events.put_nowait(event)

    def event_of(self, sampled: SampledToken) -> TokenEvent:
        """The gateway's view of a sampled token. Built on the head, after the step it feeds has been started: a
        validated model costs tens of microseconds right after a forward pass."""
        hops = self.route.hops
        timings = [HopTiming(node_id=hops[s.hop_index].node_id, compute_ms=s.compute_us / 1000,
                             queue_ms=s.queue_us / 1000) for s in sampled.stamps if s.hop_index < len(hops)]
        lp = sampled.logprobs
        return TokenEvent(session_id=self.id, seq=sampled.seq, token=sampled.token, text=sampled.text,
                          finish_reason=sampled.finish_reason, hop_timings=timings, index=sampled.choice,
                          logprobs=None if lp is None else lp.with_bytes(self.rt.engine.backend.token_bytes))
