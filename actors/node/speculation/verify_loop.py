"""The head's decode strategy in verify windows (issue #20): each ring carries the last sampled token and up to
``k`` drafts, so a window that the tail accepts whole emits ``k + 1`` tokens for one trip around the route. It
drives the head through its port (``actors.node.head_port.HeadPort``) like every decode strategy.

The loop keeps up to ``Speculation.windows`` windows in flight: the next one starts, before the one ahead of it has
come back, on the assumption that it will be accepted whole (its first input is the draft source's guess at that
window's last token), when the odds of that pay for the head's pass (``speculation.worth_optimism``). When a
verdict comes back:

* the next window's pass starts first, and the accepted tokens are announced while it runs (the tail has already
  applied the stop rules), as plain decoding starts its next step before it publishes a token;
* if every draft and the guess after them held, the windows behind it are still good and go on;
* otherwise they are stale: the head cuts its KV back to the last accepted position and starts again from the
  tail's own token; every other hop cuts back when the next window starts below its position, and the tail drops
  stale windows unread (a window is good only if it starts where the tail's KV ends, with the tail's last token).

Windows are numbered; hops compute them in number order (``actors.node.speculation.windows``), so HTTP reordering two
of them
cannot matter. The window sizer (``speculation.WindowSizer``) picks each window's length from the acceptance, the
passes' cost (``speculation.CostModel``) and the ring time measured: a window's round trip from the moment the head
sent it, less the other hops' passes, taken only from windows sent with none ahead of them (one behind another also
waits for that one at every hop). It goes down to plain decoding (one position, no drafts) where drafts do not pay.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

from actors.backend import KvBackend, StepInput
from actors.node.head_port import HeadPort
from actors.node.session import SessionFailed, StepFuture
from actors.node.speculation.drafts import DraftSource, propose_safely
from actors.node.speculation.policy import CostModel, WindowSizer, worth_optimism
from schemas.frame import FrameKind, SampledToken, SampledWindow
from schemas.session import FailureReason, SessionPhase, Speculation, TokenEvent
from schemas.telemetry import SpeculationView


class VerifyWindows:
    """The decode strategy (``actors.node.head_port.DecodeStrategy``) of a speculative session on several hops: each
    run decodes with a draft source of its own (``NodeRuntime.drafts``), closed when the run ends."""

    def __init__(self, speculation: Speculation) -> None:
        self.speculation = speculation
        self._accepted: list[int] | None = None
        """After a run failed (a hop lost, issue #31): the tokens it emitted, for the run after the repair."""

    def stop(self) -> None:
        """Nothing of its own runs: the windows' steps are awaited by its task."""

    async def run(self, port: HeadPort) -> None:
        spec = self.speculation
        decoder = SpeculativeDecode(port, port.rt.drafts(port.id, spec.source), max_k=spec.max_k,
                                    windows=spec.windows, accepted=self._accepted)
        try:
            await decoder.run()
        except SessionFailed:
            # The route lost a hop: what the windows in flight put into the head's KV beyond the accepted tokens
            # goes, so that a repair (``recovery.repair``) sees the head as plain decoding would leave it, and the
            # run after it goes on from the tokens emitted (announced already) with a window of its own.
            self._accepted = await decoder.settle_for_repair() or None
            raise
        finally:
            await decoder.source.close()


@dataclasses.dataclass
class Window:
    id: int
    start: int
    inputs: list[int]
    """The last sampled token (or, for an optimistic window, the guess at it) and the drafts."""
    sent_at: float
    compute_ms: float = 0.0
    """The head's forward pass of it."""
    alone: bool = True
    """Sent with no window ahead of it in flight: its round trip is the ring's alone (a window behind another also
    waits for the hops to finish that one)."""

    @property
    def drafts(self) -> int:
        return len(self.inputs) - 1


class SpeculativeDecode:
    """One run of the verify windows on the head (``head``, the port), from the prefill's token to the end."""

    def __init__(self, head: HeadPort, source: DraftSource, *, max_k: int, windows: int,
                 accepted: list[int] | None = None) -> None:
        self.head = head
        self.source = source
        self.max_windows = windows
        self.sizer = WindowSizer(max_k=max_k)
        self.cost = CostModel()
        self.in_flight: collections.deque[Window] = collections.deque()
        self._verdicts: dict[int, SampledWindow] = {}
        self._next_id = 1
        self._head_ms: float | None = None
        """The head's forward pass of a window (moving average): what a stale optimistic window wastes."""
        self.resumed = accepted is not None
        """A run after a repair: its last accepted token is in, and the next window starts from it."""
        self.accepted: list[int] = list(accepted) if accepted is not None else head.fed()
        """Every token the route emitted so far, in order (the last one is the next input): a replacement head
        (issue #31) starts with the tokens it recomputed, the first token it waits for comes after them."""

    # ---- the loop -----------------------------------------------------------------------------------------------

    def windows_in_flight(self) -> int:
        return len(self.in_flight)

    async def run(self) -> None:
        self.head.rt.metrics.speculating(self, True)
        try:
            await self._run()
        finally:
            self.head.rt.metrics.speculating(self, False)

    async def _run(self) -> None:
        head = self.head
        if self.resumed:
            await self._launch()
        else:
            first = await head.next_event()  # the prefill's token comes as a plain token frame
            if not await self._emitted([first], None):
                return
        while True:
            verdict = await self._verdict(self.in_flight[0].id)
            window = self.in_flight.popleft()
            if not await self._emitted(verdict.tokens, (window, verdict)):
                return

    async def _emitted(self, tokens: Sequence[TokenEvent | SampledToken],
                       judged: tuple[Window, SampledWindow] | None) -> bool:
        """The route emitted ``tokens`` (the prefill's token, or a window's verdict ``judged``): start the next
        window first, announce the tokens while it computes (a one-position window computed inline goes out first,
        as plain decoding's step does), then send it and any that may go in flight behind it. False (after
        completing the session) once one of them ends the generation."""
        head = self.head
        self.accepted.extend(t.token for t in tokens)
        if judged is not None:
            self._settle(*judged)
        ends = any(t.finish_reason is not None for t in tokens)
        started = None if ends else await self._start()
        if started is not None and started[1].done():
            await self._send(*started)
            started = None
        for t in tokens:
            event = t if isinstance(t, TokenEvent) else head.event_of(t)
            head.phase = SessionPhase.DECODE
            await head.announce(event, None)
            if event.finish_reason is not None:
                head.choices.first.end(event.finish_reason, event.seq + 1)
                await head.telemetry.speculating(self.view())  # the last figures go with the completion
                # Positions whose inputs came true: the window's first and the drafts emitted (none was rejected).
                keep = head.position if judged is None else \
                    judged[0].start + 1 + min(judged[1].accepted, len(judged[1].tokens))
                await head.complete(event, keep_positions=keep)
                return False
        await head.telemetry.speculating(self.view())
        if started is not None:
            await self._send(*started)
        await self._launch()
        return True

    # ---- windows --------------------------------------------------------------------------------------------------

    async def _launch(self) -> None:
        """Start windows until as many are in flight as the measured acceptance makes worth it."""
        while (started := await self._start()) is not None:
            await self._send(*started)

    async def _start(self) -> tuple[StepInput, StepFuture] | None:
        """The next window's inputs, its step queued on the head (or already run inline), if one should go now."""
        if len(self.in_flight) >= self.max_windows:
            return None
        if self.in_flight:
            odds = self.sizer.odds(self.in_flight[-1].drafts)
            if not worth_optimism(odds, ring_ms=self.sizer.ring_ms, head_ms=self._head_ms):
                return None
            history = [*self.head.request.prompt_tokens, *self.accepted, *self._flying_inputs()[1:]]
            guess = await propose_safely(self.source, history, 1 + self.sizer.next_k(self.sizer.max_k))
            if not guess:
                return None
            inputs = guess
        else:
            inputs = [self.accepted[-1]]
            k = self.sizer.next_k(self._room(self.sizer.max_k))
            if k:
                inputs += await propose_safely(self.source, [*self.head.request.prompt_tokens, *self.accepted], k)
        inputs = inputs[:1 + self._room(len(inputs) - 1)]
        if not inputs:
            return None
        item = StepInput(self.head.id, self.head.position, tokens=list(inputs))
        return item, self.head.rt.engine.enqueue(item, handoff=True)

    def _flying_inputs(self) -> list[int]:
        return [t for w in self.in_flight for t in w.inputs]

    def _room(self, wanted: int) -> int:
        """Drafts that still fit in the session's context and its ``max_tokens``."""
        head = self.head
        context = head.rt.engine.backend.info.context_length - head.position - 1
        left = head.request.max_tokens - len(self.accepted) - sum(len(w.inputs) for w in self.in_flight)
        return max(0, min(wanted, context, left))

    async def _send(self, item: StepInput, step: StepFuture) -> None:
        """Once the head has computed the window ``_start`` queued, send it as a verify frame."""
        head = self.head
        alone = not self.in_flight
        out, timing = await head.compute(head.choices.first, item, step)
        assert out.hidden is not None and item.tokens is not None
        window = Window(self._next_id, item.start_position, list(item.tokens), time.perf_counter(), timing.compute_ms,
                        alone)
        self._next_id += 1
        self._head_ms = timing.compute_ms if self._head_ms is None else 0.7 * self._head_ms + 0.3 * timing.compute_ms
        head.queue_frame(FrameKind.VERIFY, item.start_position, out.hidden, True, window.id, (head.stamp(timing),),
                          tokens=tuple(item.tokens))
        self.in_flight.append(window)
        head.rt.metrics.spec_windows.labels(source=self.source.name).inc()

    async def _verdict(self, window_id: int) -> SampledWindow:
        """The tail's verdict on window ``window_id`` (verdicts of later windows that came first wait)."""
        while window_id not in self._verdicts:
            item = await self.head.next_message()
            if isinstance(item, SampledWindow):
                self._verdicts[item.window] = item
            elif isinstance(item, FailureReason):
                raise SessionFailed(item)
        return self._verdicts.pop(window_id)

    def _settle(self, window: Window, verdict: SampledWindow) -> None:
        """After ``window``'s verdict: keep the windows behind it if the guess they were built on held, else drop
        them and cut the head's KV back."""
        head = self.head
        now = time.perf_counter()
        stamps = verdict.tokens[-1].stamps if verdict.tokens else ()
        compute = sum(s.compute_us for s in stamps) / 1e3
        # The round trip starts after the head's pass: only the other hops' passes are inside it.
        downstream = sum(s.compute_us for s in stamps if s.hop_index != head.hop_index) / 1e3
        self.cost.observe(len(window.inputs), compute)
        self.sizer.observe(offered=window.drafts, accepted=verdict.accepted,
                           ring_ms=max(0.0, (now - window.sent_at) * 1e3 - downstream) if window.alone else None,
                           base_ms=self.cost.base_ms, position_ms=self.cost.position_ms)
        metrics = head.rt.metrics
        source = self.source.name
        metrics.spec_drafts.labels(source=source, outcome="accepted").inc(verdict.accepted)
        metrics.spec_drafts.labels(source=source, outcome="rejected").inc(window.drafts - verdict.accepted)
        if window.drafts:
            metrics.spec_accepted.labels(source=source).observe(verdict.accepted)
        whole = verdict.accepted == window.drafts
        if whole:
            right = self.in_flight[0].inputs[0] == self.accepted[-1] if self.in_flight else None
            self.sizer.observe_guess(right)
            if right:
                return  # the windows behind it were built on what came true
        keep = window.start + verdict.accepted + 1
        self.in_flight.clear()
        self._verdicts.clear()
        if keep < head.position:
            backend = head.rt.engine.backend
            assert isinstance(backend, KvBackend)
            head.rt.engine.call_soon(backend.truncate, head.id, keep)
            head.choices.first.position = keep
            head.recovery.truncate(keep)

    async def settle_for_repair(self) -> list[int]:
        """After a hop was lost: cut the head's KV back to the positions whose inputs the route accepted (the
        windows in flight are void), and return the tokens emitted so far. A repair then rebuilds the lost hop up
        to there; the last accepted token goes back into the head's queue as the one the repair must not have
        sampled again (``RouteRepair._quiesce``), and the run after the repair drops it (it was announced)."""
        head = self.head
        self.in_flight.clear()
        self._verdicts.clear()
        if not self.accepted:
            return []
        keep = len(head.request.prompt_tokens) + len(self.accepted) - 1
        if keep < head.position:
            backend = head.rt.engine.backend
            assert isinstance(backend, KvBackend)
            await head.rt.engine.call(backend.truncate, head.id, keep)
            head.choices.first.position = keep
            head.recovery.truncate(keep)
        head.put_events([TokenEvent(session_id=head.id, seq=len(self.accepted) - 1, token=self.accepted[-1],
                                    text="")])
        return list(self.accepted)

    def view(self) -> SpeculationView:
        s = self.sizer
        return SpeculationView(source=self.source.name, windows=s.windows, drafts_offered=s.drafts_offered,
                               drafts_accepted=s.drafts_accepted,
                               acceptance=round(s.drafts_accepted / s.drafts_offered, 4) if s.drafts_offered else 0.0,
                               mean_accepted=round(s.mean_accepted, 3), in_flight=len(self.in_flight),
                               next_k=s.next_k(s.max_k))
