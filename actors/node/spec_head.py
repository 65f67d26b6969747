"""The head's decode loop in verify windows (issue #20): each ring carries the last sampled token and up to ``k``
drafts, so a window that the tail accepts whole emits ``k + 1`` tokens for one trip around the route.

The loop keeps up to ``Speculation.windows`` windows in flight: the next one starts, before the one ahead of it has
come back, on the assumption that it will be accepted whole (its first input is the draft source's guess at that
window's last token). When a verdict comes back:

* the accepted tokens are announced (the tail has already applied the stop rules);
* if every draft and the guess after them held, the windows behind it are still good and go on;
* otherwise they are stale: the head cuts its KV back to the last accepted position and starts again from the
  tail's own token; every other hop cuts back when the next window starts below its position, and the tail drops
  stale windows unread (a window is good only if it starts where the tail's KV ends, with the tail's last token).

Windows are numbered; hops compute them in number order (``actors.node.windows``), so HTTP reordering two of them
cannot matter. The window sizer (``speculation.WindowSizer``) picks each window's length from the acceptance and
ring time measured, down to plain decoding (one position, no drafts) where drafts do not pay.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import TYPE_CHECKING

from actors.backend import KvBackend, StepInput
from actors.node.drafts import DraftSource, propose_safely
from actors.node.session import SessionFailed
from actors.node.speculation import CostModel, WindowSizer
from schemas.frame import FrameKind, SampledWindow
from schemas.session import FailureReason, SessionPhase, TokenEvent
from schemas.telemetry import SpeculationView

if TYPE_CHECKING:
    from actors.node.head_session import HeadSession

OPTIMISM = 0.5
"""The least chance (measured acceptance, to the power of the window's inputs) that a window in flight is accepted
whole, for the head to start the next one before its verdict."""


@dataclasses.dataclass
class Window:
    id: int
    start: int
    inputs: list[int]
    """The last sampled token (or, for an optimistic window, the guess at it) and the drafts."""
    sent_at: float
    compute_ms: float = 0.0

    @property
    def drafts(self) -> int:
        return len(self.inputs) - 1


class SpeculativeDecode:
    def __init__(self, head: HeadSession, source: DraftSource, *, max_k: int, windows: int) -> None:
        self.head = head
        self.source = source
        self.max_windows = windows
        self.sizer = WindowSizer(max_k=max_k)
        self.cost = CostModel()
        self.in_flight: collections.deque[Window] = collections.deque()
        self._verdicts: dict[int, SampledWindow] = {}
        self._next_id = 1
        self.accepted: list[int] = []
        """Every token the route emitted so far, in order (the last one is the next input)."""

    # ---- the loop -----------------------------------------------------------------------------------------------

    async def run(self) -> None:
        head = self.head
        first = await head._next_event()  # the prefill's token comes as a plain token frame
        if not await self._emit([first]):
            return
        while True:
            await self._launch()
            verdict = await self._verdict(self.in_flight[0].id)
            window = self.in_flight.popleft()
            events = [head._event_of(t) for t in verdict.tokens]
            if not await self._emit(events):
                return
            self._settle(window, verdict)

    async def _emit(self, events: list[TokenEvent]) -> bool:
        """Announce the tokens; False (after completing the session) once one ends the generation."""
        head = self.head
        for event in events:
            head.phase = SessionPhase.DECODE
            await head._announce(event, None)
            self.accepted.append(event.token)
            if event.finish_reason is not None:
                head.choices.first.end(event.finish_reason, event.seq + 1)
                await head._complete(event, keep_positions=head.position - len(self._pending_positions()))
                return False
        await head.telemetry.speculating(self.view())
        return True

    def _pending_positions(self) -> list[int]:
        """Positions the head computed speculatively, not (yet) confirmed by a verdict."""
        return list(range(self.in_flight[0].start, self.head.position)) if self.in_flight else []

    # ---- windows --------------------------------------------------------------------------------------------------

    async def _launch(self) -> None:
        """Start windows until as many are in flight as the measured acceptance makes worth it."""
        while len(self.in_flight) < self.max_windows:
            if self.in_flight:
                last = self.in_flight[-1]
                odds = (self.sizer.acceptance or 0.0) ** (last.drafts + 1)
                if odds < OPTIMISM:
                    return
                history = [*self.head.request.prompt_tokens, *self.accepted, *self._flying_inputs()[1:]]
                guess = await propose_safely(self.source, history, 1 + self.sizer.next_k(self.sizer.max_k))
                if not guess:
                    return
                inputs = guess
            else:
                history = [*self.head.request.prompt_tokens, *self.accepted]
                inputs = [self.accepted[-1]]
                k = self.sizer.next_k(self._room(self.sizer.max_k))
                inputs += await propose_safely(self.source, history, k) if k else []
            inputs = inputs[:1 + self._room(len(inputs) - 1)]
            if not inputs:
                return
            await self._send(inputs)

    def _flying_inputs(self) -> list[int]:
        return [t for w in self.in_flight for t in w.inputs]

    def _room(self, wanted: int) -> int:
        """Drafts that still fit in the session's context and its ``max_tokens``."""
        head = self.head
        context = head.rt.engine.backend.info.context_length - head.position - 1
        left = head.request.max_tokens - len(self.accepted) - sum(len(w.inputs) for w in self.in_flight)
        return max(0, min(wanted, context, left))

    async def _send(self, inputs: list[int]) -> None:
        head = self.head
        choice = head.choices.first
        start = head.position
        item = StepInput(head.id, start, tokens=list(inputs))
        out, timing = await head._compute(choice, item)
        assert out.hidden is not None
        window = Window(self._next_id, start, list(inputs), time.perf_counter(), timing.compute_ms)
        self._next_id += 1
        head._queue_frame(FrameKind.VERIFY, start, out.hidden, True, window.id, (head._stamp(timing),),
                          tokens=tuple(inputs))
        self.in_flight.append(window)
        head.rt.metrics.spec_windows.inc()

    async def _verdict(self, window_id: int) -> SampledWindow:
        """The tail's verdict on window ``window_id`` (verdicts of later windows that came first wait)."""
        while window_id not in self._verdicts:
            item = await self.head._next_message()
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
        compute = sum(s.compute_us for s in verdict.tokens[-1].stamps) / 1e3 if verdict.tokens else 0.0
        self.cost.observe(len(window.inputs), compute)
        self.sizer.observe(offered=window.drafts, accepted=verdict.accepted,
                           ring_ms=max(0.0, (now - window.sent_at) * 1e3 - compute),
                           base_ms=self.cost.base_ms, position_ms=self.cost.position_ms)
        metrics = head.rt.metrics
        metrics.spec_drafts.labels(outcome="accepted").inc(verdict.accepted)
        metrics.spec_drafts.labels(outcome="rejected").inc(window.drafts - verdict.accepted)
        whole = verdict.accepted == window.drafts
        if whole and self.in_flight and self.in_flight[0].inputs[0] == self.accepted[-1]:
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

    def view(self) -> SpeculationView:
        s = self.sizer
        return SpeculationView(source=self.source.name, windows=s.windows, drafts_offered=s.drafts_offered,
                               drafts_accepted=s.drafts_accepted,
                               acceptance=round(s.drafts_accepted / s.drafts_offered, 4) if s.drafts_offered else 0.0,
                               mean_accepted=round(s.mean_accepted, 3), in_flight=len(self.in_flight),
                               next_k=s.next_k(s.max_k))
