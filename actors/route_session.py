"""One Route Session as seen by one node: its local KV position, frame handling, and — on the head — the driver.

The ring: the head embeds and runs its layers, then sends the hidden state to the next hop; each hop appends the
positions to its own KV and forwards; the tail samples and posts the token straight back to the head, which starts
the next step. The gateway only listens (NATS), so it is never on the per-token path.

Frames for one session leave a node in order through a per-session outbox. A node answers a frame only after it has
computed it, so an upstream hop learns at once if its successor died mid-compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal

from actors.backend import Hidden, StepInput, StepOutput
from actors.engine import StepChain, StepTiming
from actors.generation import Generation
from actors.runtime import NodeRuntime
from actors.spin import ArrivalSpinner
from actors.telemetry import TelemetryPublisher
from bus import frame as frames
from bus.nodeclient import HopError
from schemas.errors import BackendError, FrameError, SwarmrouteError
from schemas.frame import FrameHeader, FrameKind, HopStamp, SampledToken
from schemas.route import Hop
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

StepFuture = asyncio.Future[tuple[StepOutput, StepTiming]]

_DRAIN_S = 1.0
"""Longest a completing session waits for the answers to its last requests before it closes."""
Outbound = Coroutine[Any, Any, None]
"""One request to another node, already started (see ``RouteSession._send``)."""


class SessionFailed(Exception):
    def __init__(self, reason: FailureReason) -> None:
        super().__init__(reason.message)
        self.reason = reason


class RouteSession:
    def __init__(self, rt: NodeRuntime, request: SessionOpen, *, is_head: bool, is_tail: bool,
                 hidden_shape: tuple[int, ...], on_closed: Callable[[RouteSession], Awaitable[None]]) -> None:
        self.rt = rt
        self.request = request
        self.id = request.session_id
        self.raw_id = frames.session_bytes(self.id)
        self.route = request.route
        self.hop_index = request.hop_index
        self.is_head, self.is_tail = is_head, is_tail
        self.hidden_shape = hidden_shape
        self.position = 0
        self.phase = SessionPhase.PREFILL
        self.closed = False
        self.last_activity = time.monotonic()
        self.frames_received = 0
        self.bytes_received = 0
        self.positions_received = 0
        self._on_closed = on_closed
        self._next: Hop | None = None if is_tail else self.route.hops[self.hop_index + 1]
        self._outbox: asyncio.Queue[Outbound | Callable[[], Outbound] | asyncio.Event] = asyncio.Queue()
        self._sending = False
        """The outbox task is awaiting an answer."""
        self._unwritten = 0
        """Requests queued in the outbox but not yet written (``_send``)."""
        self._sender: asyncio.Task[None] | None = None
        self._frame_step: StepFuture | None = None
        """A frame's step queued for the backend's worker: later frames wait for it (``on_frame``)."""
        self.generation: Generation | None = None
        if is_tail:
            backend = rt.engine.backend
            self.generation = Generation(max_tokens=request.max_tokens, stops=request.stop,
                                         ignore_eos=request.ignore_eos, token_bytes=backend.token_bytes,
                                         is_eog=backend.is_end_of_generation)
        self._events: asyncio.Queue[TokenEvent | SampledToken | FailureReason] = asyncio.Queue()
        self._driver: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        """Head: asks every ``client_probe_s`` whether the session's client still listens (``_watch_client``)."""
        self._chain: StepChain | None = None
        self._arrivals: dict[int, float] = {}
        """Head: when each token (by seq) reached ``on_token``, for the step wall time in telemetry."""
        self._spinner = ArrivalSpinner(rt.poller, rt.settings.hop_spin_grace_s)
        """Polls the loop until this session's next decode frame or token (multi-node routes)."""
        self._prefetched: tuple[int, StepFuture, bool] | None = None
        """Head of a multi-node route: the step ``on_token`` queued for token ``seq`` (its future, and whether its
        frame has already been forwarded), for the driver to pick up."""
        self.telemetry: TelemetryPublisher | None = None
        self.session_token: str | None = None
        """Bound at open when the node checks capabilities; sent on every request to this session's other hops."""

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        if not (self.is_head and self.is_tail):
            self._sender = asyncio.create_task(self._send_loop(), name=f"outbox-{self.id[:8]}")
        if self.is_head:
            self.telemetry = TelemetryPublisher(
                self.route, lambda snap: self.rt.publish(self.rt.subjects.telemetry(self.id), snap),
                interval_s=self.rt.settings.telemetry_interval_s)
            self._driver = asyncio.create_task(self._drive(), name=f"drive-{self.id[:8]}")
            if self.rt.settings.client_probe_s > 0:
                self._watcher = asyncio.create_task(self._watch_client(), name=f"client-{self.id[:8]}")

    async def close(self) -> None:
        """Free the KV and stop every task. Idempotent; safe from within the session's own tasks."""
        if self.closed:
            return
        self.closed = True
        if self._chain is not None:
            self._chain.stop()
        if self._prefetched is not None:
            self._prefetched[1].cancel()
        self._spinner.reset()
        current = asyncio.current_task()
        others = [t for t in (self._driver, self._sender, self._watcher) if t is not None and t is not current]
        for task in others:
            task.cancel()
        await self._on_closed(self)
        await asyncio.gather(*others, return_exceptions=True)  # no task outlives its session
        self._drop_outbox()

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    # ---- frames (every hop but the head) ---------------------------------------------------------------------

    def on_frame(self, header: FrameHeader, hidden: Hidden, nbytes: int) -> int | Awaitable[int]:
        """Validate, compute and queue the forward of one frame; returns the new KV position. When the step runs
        inline (a lone session's decode position on an idle engine) all of it happens before this returns, the
        forward included; otherwise the position comes from the awaitable returned."""
        self._check_frame(header)
        if header.kind is FrameKind.DECODE:
            self._spinner.arrived()
        if self._frame_step is not None:
            return self._on_frame_later(header, hidden, nbytes)
        return self._run_frame(header, hidden, nbytes)

    def _check_frame(self, header: FrameHeader) -> None:
        """The frame's own session id was matched with the URL's by the HTTP front (``actors.hop_api``)."""
        if self.is_head:
            raise FrameError("the head takes tokens, not frames")
        if header.position_shape != self.hidden_shape:
            raise FrameError(f"frame position shape {list(header.position_shape)} does not match this model's "
                             f"{list(self.hidden_shape)}")

    async def _on_frame_later(self, header: FrameHeader, hidden: Hidden, nbytes: int) -> int:
        """A frame that came while the previous one is still computing: it runs after it, in arrival order."""
        while self._frame_step is not None:
            await asyncio.wait([self._frame_step])
        ran = self._run_frame(header, hidden, nbytes)
        return ran if isinstance(ran, int) else await ran

    def _run_frame(self, header: FrameHeader, hidden: Hidden, nbytes: int) -> int | Awaitable[int]:
        if header.start_position != self.position:
            raise FrameError(f"frame starts at position {header.start_position}; session {self.id} is at "
                             f"{self.position}", code="position_mismatch")
        if self.position + header.n_positions > self.rt.engine.backend.info.context_length:
            raise FrameError(f"frame would grow the session past the context of "
                             f"{self.rt.engine.backend.info.context_length} tokens")
        self.touch()
        self.frames_received += 1
        self.bytes_received += nbytes
        asyncio.get_running_loop().call_soon(self.rt.metrics.frame_bytes.inc, nbytes)
        self.positions_received += header.n_positions
        if header.kind is FrameKind.DECODE:
            self.phase = SessionPhase.DECODE
        item = StepInput(self.id, header.start_position, hidden=hidden, sample=header.sample and self.is_tail)
        step = self.rt.engine.enqueue(item, handoff=True)
        if step.done():
            return self._frame_computed(header, item, step)
        self._frame_step = step
        return self._frame_awaited(header, item, step)

    async def _frame_awaited(self, header: FrameHeader, item: StepInput, step: StepFuture) -> int:
        try:
            await _settled(step)
        finally:
            self._frame_step = None
        return self._frame_computed(header, item, step)

    def _frame_computed(self, header: FrameHeader, item: StepInput, step: StepFuture) -> int:
        """The frame's step has run: advance, then send its forward (or the token) on."""
        try:
            out, timing = self._step_result(item, step)
        except SessionFailed as failed:
            asyncio.create_task(self._report(failed.reason))
            raise BackendError(failed.reason.message) from None
        stamps = (*header.stamps, self._stamp(timing))
        if self.is_tail:
            if header.sample:
                assert out.token is not None
                self._queue_token(out.token, stamps)
        else:
            assert out.hidden is not None
            self._queue_frame(header.kind, header.start_position, out.hidden, header.sample, header.step, stamps)
        if header.kind is FrameKind.DECODE and self.phase is SessionPhase.DECODE:
            self._spinner.idle()
        return self.position

    def _step_result(self, item: StepInput, step: StepFuture) -> tuple[StepOutput, StepTiming]:
        """A finished step's output, with the session advanced past it; a backend failure as ``SessionFailed``."""
        try:
            out, timing = step.result()
        except SwarmrouteError:
            raise
        except Exception as exc:
            raise self._backend_failed(exc) from exc
        self._advance(item.n_positions, timing)
        return out, timing

    async def _compute(self, item: StepInput, queued: StepFuture | None = None) -> tuple[StepOutput, StepTiming]:
        """Run ``item`` (or await ``queued``, the same step already queued) and advance the session's position."""
        step = queued if queued is not None else self.rt.engine.enqueue(item, handoff=True)
        await _settled(step)
        return self._step_result(item, step)

    def _backend_failed(self, exc: Exception) -> SessionFailed:
        return self._failed_here("backend_error", f"backend failed on node {self.rt.node_id}: {exc!r}")

    def _advance(self, n_positions: int, timing: StepTiming) -> None:
        self.position += n_positions
        # Metrics wait for the next loop turn: right after a forward pass the caches are cold and every line of
        # Python costs several times its usual price; the frame or token goes out first.
        asyncio.get_running_loop().call_soon(self.rt.metrics.step, "decode" if self.phase is SessionPhase.DECODE
                                             else "prefill", timing.compute_ms, timing.queue_ms)

    def _stamp(self, timing: StepTiming) -> HopStamp:
        return HopStamp(self.hop_index, int(timing.compute_ms * 1000), int(timing.queue_ms * 1000))

    # ---- outbound, in order ----------------------------------------------------------------------------------

    def _queue_frame(self, kind: FrameKind, start: int, hidden: Hidden, sample: bool, step: int,
                     stamps: tuple[HopStamp, ...]) -> None:
        header = FrameHeader(session_id=self.raw_id, kind=kind, dtype=self.rt.wire_dtype, start_position=start,
                             n_positions=int(hidden.shape[0]), position_shape=self.hidden_shape, step=step,
                             sample=sample, stamps=stamps)
        data = frames.encode(header, hidden)
        nxt = self._next
        assert nxt is not None
        timeout = self.rt.settings.hop_timeout_s
        self._send(lambda: self.rt.client.send_frame(nxt.node_id, nxt.endpoint, self.id, data, timeout=timeout,
                                                     session_token=self.session_token),
                   causal=kind is FrameKind.DECODE)

    def _sampled(self, token: int, stamps: tuple[HopStamp, ...]) -> SampledToken:
        assert self.generation is not None
        text, finish = self.generation.accept(token)
        return SampledToken(session_id=self.raw_id, seq=self.generation.count - 1, token=token, text=text,
                            finish_reason=finish, stamps=stamps)

    def _event_of(self, sampled: SampledToken) -> TokenEvent:
        """The gateway's view of a sampled token. Built on the head, after the step it feeds has been started: a
        validated model costs tens of microseconds right after a forward pass."""
        hops = self.route.hops
        timings = [HopTiming(node_id=hops[s.hop_index].node_id, compute_ms=s.compute_us / 1000,
                             queue_ms=s.queue_us / 1000) for s in sampled.stamps if s.hop_index < len(hops)]
        return TokenEvent(session_id=self.id, seq=sampled.seq, token=sampled.token, text=sampled.text,
                          finish_reason=sampled.finish_reason, hop_timings=timings)

    def _queue_token(self, token: int, stamps: tuple[HopStamp, ...]) -> None:
        sampled = self._sampled(token, stamps)
        if self.is_head:
            self._events.put_nowait(sampled)
            return
        head = self.route.head
        timeout = self.rt.settings.hop_timeout_s
        data = frames.encode_token(sampled)
        self._send(lambda: self.rt.client.send_token(head.node_id, head.endpoint, self.id, data, timeout=timeout,
                                                     session_token=self.session_token), causal=True)
        if sampled.finish_reason is not None:
            self.phase = SessionPhase.COMPLETE

    def _send(self, start: Callable[[], Outbound], *, causal: bool) -> None:
        """Queue one request to the next hop (or, on the tail, to the head), in order. ``start`` writes the request
        when called; the outbox task, a loop turn away, awaits the answers in order.

        When it may be written at once: a decode frame or a token (``causal``) exists only because the previous
        one was computed downstream (its token came back), so it can never overtake it and goes out as soon as
        nothing of this session's is still unwritten. A prefill chunk goes out only when the previous request has
        been answered: chunks follow each other without waiting for the ring, and must reach the next hop in order.
        """
        if self._sender is None or self.closed or self._unwritten or (
                not causal and (self._sending or not self._outbox.empty())):
            self._unwritten += 1
            self._outbox.put_nowait(start)
            return
        self._outbox.put_nowait(start())

    async def _send_loop(self) -> None:
        # The outbox carries frames to the next hop, or (on the tail) tokens to the head: never both.
        peer, kind = (self._next.node_id, "frame") if self._next is not None else (self.route.head.node_id, "token")
        while True:
            item = await self._outbox.get()
            if isinstance(item, asyncio.Event):
                item.set()
                continue
            self._sending = True
            if not asyncio.iscoroutine(item):
                self._unwritten -= 1
            try:
                started = time.perf_counter()
                await (item if asyncio.iscoroutine(item) else item())
                self.rt.metrics.hop(peer, kind, time.perf_counter() - started)
            except HopError as exc:
                await self._report(FailureReason(node_id=exc.node, phase=self.phase, kind=exc.kind, message=str(exc)))
                return
            finally:
                self._sending = False

    async def _drain_outbox(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for the answers to what was sent: the last frame's answer comes just after
        the last token, and cancelling its read would lose its hop metric and close a pooled connection."""
        if self._sender is None or self._sender.done():
            return
        drained = asyncio.Event()
        self._outbox.put_nowait(drained)  # the send loop sets it when it gets there
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await drained.wait()

    def _drop_outbox(self) -> None:
        """At close: requests never sent are dropped; one already written is closed unawaited."""
        while not self._outbox.empty():
            item = self._outbox.get_nowait()
            if asyncio.iscoroutine(item):
                item.close()

    async def _report(self, reason: FailureReason) -> None:
        """A hop failed: the head fails the session; any other node tells the head, or NATS if the head is gone."""
        if self.is_head:
            self._events.put_nowait(reason)
            return
        head = self.route.head
        try:
            await self.rt.client.report_failure(head.node_id, head.endpoint, self.id, reason,
                                                session_token=self.session_token)
        except HopError:
            end = SessionEnd(session_id=self.id, phase=SessionPhase.FAILED, failure=reason)
            await self.rt.publish(self.rt.subjects.tokens(self.id), end)
        await self.close()

    def on_failure_report(self, reason: FailureReason) -> None:
        """Head: a downstream node reported a failure."""
        self._events.put_nowait(reason)

    def on_token(self, event: TokenEvent | SampledToken) -> None:
        """Head: the tail posted a sampled token. The next step is queued at once, ahead of the driver task waking
        up to publish the token: that wake-up is off the per-token path."""
        arrived = time.perf_counter()
        self._spinner.arrived(arrived)
        self.touch()
        self._arrivals[event.seq] = arrived
        if event.finish_reason is None and not self.closed and self._prefetched is None:
            self.phase = SessionPhase.DECODE  # the first token ends the prefill, on every count
            item = self._decode_step(event.token)
            step = self.rt.engine.enqueue(item, handoff=True)
            forwarded = step.done() and not step.cancelled() and step.exception() is None
            if forwarded:
                # It ran inline: the frame leaves now, before the driver task even wakes (failures go its way).
                self._advance(item.n_positions, step.result()[1])
                self._forward(step.result(), event)
            self._prefetched = (event.seq, step, forwarded)
        self._events.put_nowait(event)

    # ---- the head's driver -----------------------------------------------------------------------------------

    async def _drive(self) -> None:
        assert self.telemetry is not None
        try:
            await self.telemetry.set_phase(SessionPhase.PREFILL)
            await self._prefill()
            await self._decode()
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

    async def _prefill(self) -> None:
        assert self.telemetry is not None
        tokens = self.request.prompt_tokens
        chunk = self.request.prefill_chunk
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            last = start + len(part) >= len(tokens)
            out, timing = await self._compute(StepInput(self.id, start, tokens=part, sample=last and self.is_tail))
            self.touch()
            if self.is_tail:
                if last:
                    assert out.token is not None
                    self._queue_token(out.token, (self._stamp(timing),))
            else:
                assert out.hidden is not None
                self._queue_frame(FrameKind.PREFILL, start, out.hidden, last, 0, (self._stamp(timing),))
            await self.telemetry.prefill_progress(start + len(part), len(tokens))

    async def _decode(self) -> None:
        if self.is_tail:
            await self._decode_local()
            return
        assert self.telemetry is not None
        step_started: float | None = None
        while True:
            event = await self._next_event()
            # Timed from the token's arrival: on_token may already have run the next step inline since.
            now = self._arrivals.pop(event.seq, None) or time.perf_counter()
            wall_ms = (now - step_started) * 1e3 if step_started is not None else None
            self.phase = SessionPhase.DECODE
            if event.finish_reason is not None:
                await self._announce(event, wall_ms)
                await self._complete(event)
                return
            queued, forwarded = self._take_prefetched(event)
            step_started = now  # the next step started (or was queued) as this token arrived
            if forwarded:
                await self._announce(event, wall_ms)
                continue
            if queued is not None and queued.done():
                # It ran inline but was not forwarded (it failed, or was cancelled): _compute raises that first.
                self._forward(await self._compute(self._decode_step(event.token), queued), event)
                await self._announce(event, wall_ms)
                continue
            # Start the next forward pass first (on_token has usually queued it already): publishing the token and
            # telemetry then overlaps it instead of delaying it.
            step = asyncio.ensure_future(self._compute(self._decode_step(event.token), queued))
            try:
                await self._announce(event, wall_ms)
            except BaseException:
                step.cancel()
                raise
            self._forward(await step, event)

    def _forward(self, result: tuple[StepOutput, StepTiming], event: TokenEvent | SampledToken) -> None:
        out, timing = result
        assert out.hidden is not None
        self._queue_frame(FrameKind.DECODE, self.position - 1, out.hidden, True, event.seq + 1,
                          (self._stamp(timing),))
        self._spinner.idle()

    def _decode_step(self, token: int) -> StepInput:
        return StepInput(self.id, self.position, tokens=[token], sample=self.is_tail)

    def _take_prefetched(self, event: TokenEvent) -> tuple[StepFuture | None, bool]:
        """The step ``on_token`` queued for this token and whether it is forwarded; (None, False) if none."""
        prefetched, self._prefetched = self._prefetched, None
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
        last = time.perf_counter()
        wall_ms: float | None = None
        while True:
            self.phase = SessionPhase.DECODE
            if event.finish_reason is None and self._chain is None:
                self._chain = self.rt.engine.chain(self._decode_step(event.token), self._follow_local)
            await self._announce(event, wall_ms)
            if event.finish_reason is not None:
                if self._chain is not None:
                    self._chain.stop()  # a stop string ended it: the step already queued is dropped
                await self._complete(event)
                return
            out, timing = await self._next_local(event.token)
            now = time.perf_counter()
            wall_ms, last = (now - last) * 1e3, now
            assert out.token is not None
            event = self._event_of(self._sampled(out.token, (self._stamp(timing),)))

    def _follow_local(self, item: StepInput, out: StepOutput) -> StepInput | None:
        """On the engine's thread: the next chained step, unless this output ends the generation for certain
        (end of generation, max_tokens, context). Stop strings are the loop's to find; it then stops the chain."""
        token = out.token
        if token is None:
            return None
        generated = item.start_position + 2 - len(self.request.prompt_tokens)
        backend = self.rt.engine.backend
        end = (generated >= self.request.max_tokens or item.start_position + 2 > backend.info.context_length
               or (not self.request.ignore_eos and backend.is_end_of_generation(token)))
        return None if end else StepInput(self.id, item.start_position + 1, tokens=[token], sample=True)

    async def _next_local(self, token: int) -> tuple[StepOutput, StepTiming]:
        assert self.telemetry is not None
        while True:
            if self._chain is None:
                self._chain = self.rt.engine.chain(self._decode_step(token), self._follow_local)
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
                self._advance(1, timing)
                return out, timing
            # The chain ended although the generation goes on (its rules differ from ``Generation``'s): restart it.
            self._chain = None

    def _failed_here(self, kind: Literal["timeout", "backend_error"], message: str) -> SessionFailed:
        return SessionFailed(FailureReason(node_id=self.rt.node_id, phase=self.phase, kind=kind, message=message))

    async def _announce(self, event: TokenEvent, wall_ms: float | None) -> None:
        """Publish a token to the gateway, with its telemetry and metrics."""
        assert self.telemetry is not None
        await self.rt.publish(self.rt.subjects.tokens(self.id), event)
        await self.telemetry.token(event.hop_timings, wall_ms)
        self.rt.metrics.token(self.telemetry.generated, self.telemetry.ttft_ms, wall_ms, event.hop_timings,
                              len(self.route.hops))

    def _token_timeout(self) -> float:
        first = self.telemetry is not None and self.telemetry.generated == 0
        return self.rt.settings.first_token_timeout_s if first else self.rt.settings.token_timeout_s

    async def _next_event(self) -> TokenEvent:
        timeout = self._token_timeout()
        try:
            async with asyncio.timeout(timeout):  # no task per token, unlike wait_for
                item = await self._events.get()
        except TimeoutError:
            raise SessionFailed(await self._diagnose_stall(timeout)) from None
        if isinstance(item, FailureReason):
            raise SessionFailed(item)
        return self._event_of(item) if isinstance(item, SampledToken) else item

    async def _diagnose_stall(self, waited: float) -> FailureReason:
        """No token in time: name the first hop that does not answer, else the route as a whole."""
        for hop in self.route.hops[1:]:
            if not await self.rt.client.probe(hop.node_id, hop.endpoint):
                return FailureReason(node_id=hop.node_id, phase=self.phase, kind="timeout",
                                     message=f"node {hop.node_id} stopped answering; no token for {waited:g}s")
        return FailureReason(node_id=None, phase=self.phase, kind="timeout",
                             message=f"no token from the route for {waited:g}s although every hop answers")

    async def _complete(self, event: TokenEvent) -> None:
        assert self.telemetry is not None and event.finish_reason is not None
        end = self._ended(SessionPhase.COMPLETE, event.seq + 1, finish_reason=event.finish_reason)
        await self.telemetry.complete(event.finish_reason)
        # Every hop frees the session before the client can learn it ended: a client that opens its next session
        # at once must find the slots free, or a swarm within its capacity refuses it (tests/test_load.py).
        await self._drain_outbox(_DRAIN_S)
        await self.close()
        await self._release_route()
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
                await self._cancel(f"its client stopped listening (no subscriber for {CLIENT_MISSES} probes "
                                   f"{self.rt.settings.client_probe_s:g}s apart)")
                return

    async def _cancel(self, why: str) -> None:
        assert self.telemetry is not None
        if self.closed:
            return  # it ended on its own meanwhile
        log.warning("session %s cancelled: %s", self.id, why)
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

    async def _release_route(self) -> None:
        """Head, at the end: free the session on every other hop. The gateway does the same, but it may be gone,
        and then the tail (and any middle hop) would hold its KV until the idle TTL. Idempotent on the nodes."""
        await asyncio.gather(*(self.rt.client.close_session(h.node_id, h.endpoint, self.id, timeout=1.0,
                                                            session_token=self.session_token)
                               for h in self.route.hops[1:]), return_exceptions=True)

    async def _fail(self, reason: FailureReason) -> None:
        assert self.telemetry is not None
        log.warning("session %s failed: %s", self.id, reason.message)
        end = self._ended(SessionPhase.FAILED, self.telemetry.generated, failure=reason)
        await self.telemetry.fail(reason)
        await self.rt.publish(self.rt.subjects.tokens(self.id), end)
        await self.close()
        await self._release_route()


async def _settled(step: StepFuture) -> None:
    """Wait for a step to finish, however it ends: ``_step_result`` then reads its result or failure. Cancelling the
    waiter still cancels the step."""
    with contextlib.suppress(Exception):
        await step
