"""A Route Session on its head node: it drives prefill and decode and owns the session's fate.

The head runs its own layers on the prompt in chunks, then, for every token the tail posts back (``on_token``),
the next decode step; it publishes each token and the session's telemetry on NATS for the gateway. It owns the
session's fate: it detects a failure anywhere downstream (a hop's report, its own outbox's connection errors, or
silence past the token timeout, then a probe of every hop to name the dead one), and it alone publishes the
terminal telemetry and the ``SessionEnd`` (complete, failed or cancelled), then frees the session on every other
hop. The gateway only follows, except for what the head cannot report: its own death (``gateway.live_session``).

With head and tail on one node the engine chains the steps on its worker (each sampled token is the next input);
the stop rules stay ``Generation``'s (``Generation.ends_for_certain``).

Why one module of ~550 lines: one class, the session's one owner, whose prefill, four decode loops (ring, local
chain, n > 1 rounds, verify windows: ``spec_head``) and terminal phases share its event queue and phase; split, the
fate would have several owners (the repair it drives lives in ``repair``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from actors.backend import StepInput, StepOutput
from actors.node.choices import Choice
from actors.node.engine import StepChain, StepTiming
from actors.node.recovery.repair import RepairFailed, RouteRepair, phase_after
from actors.node.route_open import RouteOpening
from actors.node.runtime import NodeRuntime
from actors.node.session import NodeSession, SessionFailed, StepFuture
from actors.node.speculation.verify_loop import SpeculativeDecode
from actors.node.telemetry import TelemetryPublisher
from bus.liveness import Silence, first_lost
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
CLIENT_MISSES = 3
"""Probes in a row that must find no subscriber before a head cancels a session (``_watch_client``)."""
LOST_GRACE_S = 0.5
"""After a hop is found lost, how long the head still waits for word already on its way before failing."""
DRAIN_S = 1.0
"""Longest a completing session waits for the answers to its last requests before it closes."""


class HeadSession(NodeSession):
    def __init__(self, rt: NodeRuntime, request: SessionOpen, *, hidden_shape: tuple[int, ...],
                 on_closed: Callable[[NodeSession], Awaitable[None]]) -> None:
        super().__init__(rt, request, hidden_shape=hidden_shape, on_closed=on_closed)
        self._events: asyncio.Queue[TokenEvent | SampledToken | SampledWindow | FailureReason] = asyncio.Queue()
        self._driver: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        """Asks every ``client_probe_s`` whether the session's client still listens (``_watch_client``)."""
        self._chain: StepChain | None = None
        self.telemetry = TelemetryPublisher(
            self.route, lambda snap: self.rt.publish(self.rt.subjects.telemetry(self.id), snap),
            interval_s=self.rt.settings.telemetry_interval_s)
        self.repairs = 0
        self.lost_nodes: list[str] = []
        """Nodes this session lost: never routed to again (issue #18)."""
        self._repairing = False
        """A repair is under way: tokens of the old route are dropped (the repaired one samples them again)."""
        self.opening: RouteOpening | None = None
        """The hops after the head, still opening (issue #20: the head opens them while its prefill starts)."""

    @property
    def ring_key(self) -> tuple[str, ...]:
        """Its decode steps' route, for the engine's grouping of sessions around the ring (issue #20)."""
        return tuple(h.node_id for h in self.route.hops)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        super().start()
        self._driver = asyncio.create_task(self._drive(), name=f"drive-{self.id[:8]}")
        if self.rt.settings.client_probe_s > 0:
            self._watcher = asyncio.create_task(self._watch_client(), name=f"client-{self.id[:8]}")

    def _tasks(self) -> list[asyncio.Task[None]]:
        return [*super()._tasks(), *(t for t in (self._driver, self._watcher) if t is not None)]

    def _stopping(self) -> None:
        if self._chain is not None:
            self._chain.stop()
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
        if self.request.n > 1 or self.request.speculate is not None:
            # Decoded in rounds (``_decode_rounds``) or in verify windows (``spec_head``): the driver starts steps.
            self._events.put_nowait(event)
            return
        choice.arrivals[event.seq] = arrived
        if event.finish_reason is None and not self.closed and choice.prefetched is None:
            self.phase = SessionPhase.DECODE  # the first token ends the prefill, on every count
            item = self._decode_step(choice, event.token)
            # The first token goes to the client before the step it feeds (its TTFT would wait a whole decode
            # step); that step runs on the worker meanwhile. Every later one: the step first (inline if it can).
            step = self.rt.engine.enqueue(item, handoff=True, inline=event.seq > 0, ring=self.ring_key)
            forwarded = step.done() and not step.cancelled() and step.exception() is None
            if forwarded:
                # It ran inline: the frame leaves now, before the driver task even wakes (failures go its way).
                self._advance(choice, item, step.result()[1])
                self._forward(choice, step.result(), event)
            choice.prefetched = (event.seq, step, forwarded)
        self._events.put_nowait(event)

    # ---- the driver -------------------------------------------------------------------------------------------

    async def _drive(self) -> None:
        try:
            if not await self._prefill():
                return  # the hops after it did not open: the open's answer says why, and closes the session
            while True:
                try:
                    await self._decode()
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

    async def _prefill(self) -> bool:
        """Prefill the prompt, chunk by chunk; False if the hops after the head could not be opened (nothing is
        sent or published then). The first chunk starts computing before the head knows they all opened."""
        tokens = self.request.prompt_tokens
        chunk = self.request.prefill_chunk
        announced = False
        for start in range(self.position, len(tokens), chunk):
            part = tokens[start:start + chunk]
            last = start + len(part) >= len(tokens)
            first = self.choices.first
            # n > 1: the last chunk forks the prompt's KV into every choice (on the tail: their first tokens too).
            item = StepInput(self.id, start, tokens=part, sample=last and self.is_tail,
                             forks=self.choices.fork_ids() if last else ())
            queued = self.rt.engine.enqueue(item, handoff=True)
            if not announced:
                announced = True
                if self.opening is not None and not await self.opening.done():
                    queued.cancel()
                    return False
                await self.telemetry.set_phase(SessionPhase.PREFILL)
                if self.reused:  # prefix reuse: every hop holds the first ``reused`` positions already
                    await self.telemetry.prefill_progress(self.reused, len(tokens), reused=self.reused)
            out, timing = await self._compute(first, item, queued)
            forks = self._fork(first.position) if item.forks else []
            self.touch()
            if self.is_tail:
                if last:
                    stamps = (self._stamp(timing),)
                    self._events.put_nowait(self._sampled(first, out, stamps))
                    for fork, fork_out in zip(forks, out.forks, strict=True):
                        self._events.put_nowait(self._sampled(fork, fork_out, stamps))
            else:
                assert out.hidden is not None
                self._queue_frame(FrameKind.PREFILL, start, out.hidden, last, 0, (self._stamp(timing),))
            await self.telemetry.prefill_progress(start + len(part), len(tokens))
        return True

    async def _decode(self) -> None:
        if self.request.n > 1:
            await self._decode_rounds()
            return
        spec = self.request.speculate
        if spec is not None and not self.is_tail:
            decoder = SpeculativeDecode(self, self.rt.drafts(self.id, spec.source), max_k=spec.max_k,
                                        windows=spec.windows)
            try:
                await decoder.run()
            finally:
                await decoder.source.close()
            return
        if self.is_tail:
            await self._decode_local()
            return
        choice = self.choices.first
        while True:
            event = await self._next_event()
            # Timed from the token's arrival: on_token may already have run the next step inline since.
            now = choice.arrivals.pop(event.seq, None) or time.perf_counter()
            wall_ms = (now - choice.step_started) * 1e3 if choice.step_started is not None else None
            self.phase = SessionPhase.DECODE
            if event.finish_reason is not None:
                await self._announce(event, wall_ms)
                choice.end(event.finish_reason, event.seq + 1)
                await self._complete(event)
                return
            queued, forwarded = self._take_prefetched(choice, event)
            choice.step_started = now  # the next step started (or was queued) as this token arrived
            if forwarded:
                await self._announce(event, wall_ms)
                continue
            if queued is not None and queued.done():
                # It ran inline but was not forwarded (it failed, or was cancelled): _compute raises that first.
                self._forward(choice, await self._compute(choice, self._decode_step(choice, event.token), queued),
                              event)
                await self._announce(event, wall_ms)
                continue
            # Start the next forward pass first (on_token has usually queued it already): publishing the token and
            # telemetry then overlaps it instead of delaying it.
            step = asyncio.ensure_future(self._compute(choice, self._decode_step(choice, event.token), queued))
            try:
                await self._announce(event, wall_ms)
            except BaseException:
                step.cancel()
                raise
            self._forward(choice, await step, event)

    def _forward(self, choice: Choice, result: tuple[StepOutput, StepTiming], event: TokenEvent | SampledToken,
                 group: int = 0) -> None:
        out, timing = result
        assert out.hidden is not None
        self._queue_frame(FrameKind.DECODE, choice.position - 1, out.hidden, True, event.seq + 1,
                          (self._stamp(timing),), choice.index, group, (event.token,))
        self._spinner.idle()

    @staticmethod
    def _decode_step(choice: Choice, token: int, *, sample: bool = False) -> StepInput:
        return StepInput(choice.backend_id, choice.position, tokens=[token], sample=sample)

    @staticmethod
    def _take_prefetched(choice: Choice, event: TokenEvent) -> tuple[StepFuture | None, bool]:
        """The step ``on_token`` queued for this token and whether it is forwarded; (None, False) if none."""
        prefetched, choice.prefetched = choice.prefetched, None
        if prefetched is None:
            return None, False
        seq, future, forwarded = prefetched
        if seq != event.seq:
            future.cancel()
            return None, False
        return future, forwarded

    async def _decode_local(self) -> None:
        """Head and tail on this node: the engine chains the steps itself (each sampled token is the next input),
        so the loop only turns outputs into token events; it stops the chain when generation ends."""
        event = await self._next_event()
        first = self.choices.first
        last = time.perf_counter()
        wall_ms: float | None = None
        while True:
            self.phase = SessionPhase.DECODE
            if event.finish_reason is None and self._chain is None:
                self._chain = self.rt.engine.chain(self._decode_step(first, event.token, sample=True),
                                                   self._follow_local)
            await self._announce(event, wall_ms)
            if event.finish_reason is not None:
                if self._chain is not None:
                    self._chain.stop()  # a stop string ended it: the step already queued is dropped
                first.end(event.finish_reason, event.seq + 1)
                await self._complete(event)
                return
            out, timing = await self._next_local(event.token)
            now = time.perf_counter()
            wall_ms, last = (now - last) * 1e3, now
            event = self._event_of(self._sampled(first, out, (self._stamp(timing),)))

    async def _decode_rounds(self) -> None:
        """n > 1, in rounds: once every live choice's token is in, their steps are queued together and their frames
        name the round's size, so on every hop one forward pass carries the same choices in the same order (a
        seeded request comes out the same every time although a batch's shape moves llama.cpp's results)."""
        pending: dict[int, TokenEvent] = {}
        last = time.perf_counter()
        wall_ms: float | None = None
        while True:
            live = [c for c in self.choices.all if not c.ended]
            while len(pending) < len(live):
                event = await self._next_event()
                pending[event.index] = event
            self.phase = SessionPhase.DECODE
            going: list[tuple[Choice, TokenEvent]] = []
            for choice in live:
                event = pending.pop(choice.index)
                await self._announce(event, wall_ms)
                if event.finish_reason is not None:
                    choice.end(event.finish_reason, event.seq + 1)
                else:
                    going.append((choice, event))
            if not going:
                await self._complete(event)
                return
            items = [self._decode_step(choice, event.token, sample=self.is_tail) for choice, event in going]
            steps = self.rt.engine.enqueue_group(items)
            timeout = self._token_timeout()
            try:
                async with asyncio.timeout(timeout):
                    results = [await self._compute(c, i, f) for (c, _), i, f in zip(going, items, steps, strict=True)]
            except TimeoutError:
                raise self._failed_here("timeout", f"no step on node {self.rt.node_id} for {timeout:g}s") from None
            now = time.perf_counter()
            wall_ms, last = (now - last) * 1e3, now
            for (choice, event), (out, timing) in zip(going, results, strict=True):
                if self.is_tail:  # head and tail on this node: the next round's tokens are here already
                    pending[choice.index] = self._event_of(self._sampled(choice, out, (self._stamp(timing),)))
                else:
                    self._forward(choice, (out, timing), event, len(going))

    def _follow_local(self, item: StepInput, out: StepOutput) -> StepInput | None:
        """On the engine's thread: the next chained step, unless this output ends the generation for certain
        (``Generation.ends_for_certain``). Stop strings are the loop's to find; it then stops the chain."""
        token = out.token
        if token is None:
            return None
        assert self.generation is not None
        generated = item.start_position + 2 - len(self.request.prompt_tokens)
        if self.generation.ends_for_certain(token, generated, position=item.start_position + 2):
            return None
        return StepInput(self.id, item.start_position + 1, tokens=[token], sample=True)

    async def _next_local(self, token: int) -> tuple[StepOutput, StepTiming]:
        while True:
            if self._chain is None:
                self._chain = self.rt.engine.chain(self._decode_step(self.choices.first, token, sample=True),
                                                   self._follow_local)
            timeout = self._token_timeout()
            try:
                async with asyncio.timeout(timeout):  # no task per token, unlike wait_for
                    result = await self._chain.next()
            except TimeoutError:
                raise self._failed_here("timeout", f"no token from node {self.rt.node_id} for {timeout:g}s") from None
            except SwarmrouteError:
                raise
            except Exception as exc:
                raise self._backend_failed(exc) from exc
            if result is not None:
                out, timing = result
                first = self.choices.first
                self._advance(first, StepInput(self.id, first.position, tokens=[token]), timing)
                return out, timing
            # The chain ended although the generation goes on (its rules differ from ``Generation``'s): restart it.
            self._chain = None

    async def _announce(self, event: TokenEvent, wall_ms: float | None) -> None:
        """Publish a token to the gateway, with its telemetry and metrics."""
        await self.rt.publish(self.rt.subjects.tokens(self.id), event)
        await self.telemetry.token(event.hop_timings, wall_ms)
        self.rt.metrics.token(self.telemetry.generated, self.telemetry.ttft_ms, wall_ms, event.hop_timings,
                              len(self.route.hops))

    def _token_timeout(self) -> float:
        first = self.telemetry.generated == 0
        return self.rt.settings.first_token_timeout_s if first else self.rt.settings.token_timeout_s

    async def _next_event(self) -> TokenEvent:
        """The next token from the tail, or ``SessionFailed``: a hop's report, a hop found dead while the route is
        silent (``bus.liveness``: at once), or silence past the token timeout."""
        item = await self._next_message()
        if isinstance(item, FailureReason):
            raise SessionFailed(item)
        if isinstance(item, SampledWindow):
            raise SessionFailed(FailureReason(node_id=self.route.tail.node_id, phase=self.phase, kind="protocol",
                                              message="a verify window's verdict for a session without windows"))
        return self._event_of(item) if isinstance(item, SampledToken) else item

    async def _next_message(self) -> TokenEvent | SampledToken | SampledWindow | FailureReason:
        """What the route sends next (a token, a window's verdict, a hop's failure report), or ``SessionFailed`` for
        a hop found dead while the route is silent or silence past the token timeout."""
        limit = self._token_timeout()
        silence = Silence(self.rt.settings.liveness_probe_s)
        while True:
            try:
                async with asyncio.timeout(silence.wait(limit)):  # no task per token, unlike wait_for
                    item = await self._events.get()
                break
            except TimeoutError:
                if silence.lasted() >= limit:
                    raise SessionFailed(await self._diagnose_stall(limit)) from None
                if silence.probe_due():
                    arrived = await self._probe_downstream()
                    silence.probed()
                    if arrived is not None:
                        item = arrived
                        break
        return item

    async def _probe_downstream(self) -> TokenEvent | SampledToken | SampledWindow | FailureReason | None:
        """Fail at once if a downstream hop is dead or lost the session, unless word (a failure report, a token)
        arrives within the grace that messages already on their way need: that word is returned."""
        lost = await first_lost(self.rt.client, self.route.hops[1:], self.id, session_token=self.session_token)
        if lost is None:
            return None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(LOST_GRACE_S):
                return await self._events.get()
        node, why = lost
        raise SessionFailed(FailureReason(node_id=node, phase=self.phase, kind="unreachable", message=why))

    async def _diagnose_stall(self, waited: float) -> FailureReason:
        """No token in time: name the first hop that does not answer, else the route as a whole."""
        for hop in self.route.hops[1:]:
            if not await self.rt.client.probe(hop.node_id, hop.endpoint):
                return FailureReason(node_id=hop.node_id, phase=self.phase, kind="timeout",
                                     message=f"node {hop.node_id} stopped answering; no token for {waited:g}s")
        return FailureReason(node_id=None, phase=self.phase, kind="timeout",
                             message=f"no token from the route for {waited:g}s although every hop answers")

    async def _complete(self, event: TokenEvent, *, keep_positions: int | None = None) -> None:
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

    async def _watch_client(self) -> None:
        """Cancel the session once its client is gone: NATS reports no subscriber for ``CLIENT_MISSES`` probes in
        a row. A killed gateway tells nobody; without this its sessions would generate to ``max_tokens`` and hold
        a KV slot on every hop meanwhile. A probe without an answer (a NATS outage, a slow gateway) proves nothing
        and resets nothing: only "no responders" counts, several times, so a gateway reconnecting is not taken for
        a dead one.

        The loop checks ``closed`` itself: a cancellation can be lost inside nats.py's request (see
        ``bus.connection.keep_cancellation``), and a watcher that went on probing after ``close()`` had cancelled
        it kept ``close()`` waiting for it for good."""
        misses = 0
        while not self.closed:
            await asyncio.sleep(self.rt.settings.client_probe_s)
            present = await self.rt.client_present(self.id)
            if self.closed:
                return
            misses = misses + 1 if present is False else 0 if present else misses
            if misses >= CLIENT_MISSES:
                await self.cancel(f"its client stopped listening (no subscriber for {CLIENT_MISSES} probes "
                                   f"{self.rt.settings.client_probe_s:g}s apart)")
                return

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

    async def _repaired(self, reason: FailureReason) -> bool:
        """Route around the hop ``reason`` names, if the session repairs and that hop can be replaced; False when
        it cannot even be tried (the caller then fails the session with ``reason``). A repair that fails raises
        ``SessionFailed`` saying why."""
        lost = next((i for i, h in enumerate(self.route.hops) if h.node_id == reason.node_id), 0)
        # Only a node that is gone or silent is replaced: one that answers with an error would answer a
        # replacement's frames the same way (its input, not the node, is the problem).
        if (reason.kind not in ("unreachable", "timeout") or not self.request.repair or self.request.n > 1
                or lost == 0 or self.closed
                or self.repairs >= self.rt.settings.max_repairs or self.is_tail):
            return False
        log.warning("session %s lost %s (%s); repairing", self.id[:8], reason.node_id, reason.message)
        self.phase = SessionPhase.REPAIRING
        self._repairing = True
        try:
            view = await RouteRepair(self, lost, reason).run()
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

    def take_events(self) -> list[TokenEvent | SampledToken | SampledWindow | FailureReason]:
        """Everything the route sent that the driver has not read yet (a repair looks at it, then ``put_events``)."""
        events = []
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return events

    def put_events(self, events: list[TokenEvent | SampledToken]) -> None:
        for event in events:
            self._events.put_nowait(event)

    def _event_of(self, sampled: SampledToken) -> TokenEvent:
        """The gateway's view of a sampled token. Built on the head, after the step it feeds has been started: a
        validated model costs tens of microseconds right after a forward pass."""
        hops = self.route.hops
        timings = [HopTiming(node_id=hops[s.hop_index].node_id, compute_ms=s.compute_us / 1000,
                             queue_ms=s.queue_us / 1000) for s in sampled.stamps if s.hop_index < len(hops)]
        lp = sampled.logprobs
        return TokenEvent(session_id=self.id, seq=sampled.seq, token=sampled.token, text=sampled.text,
                          finish_reason=sampled.finish_reason, hop_timings=timings, index=sampled.choice,
                          logprobs=None if lp is None else lp.with_bytes(self.rt.engine.backend.token_bytes))
