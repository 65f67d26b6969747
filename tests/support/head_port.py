"""A fake head (``actors.node.head_port.HeadPort``) for driving one decode strategy on its own, without processes.

The strategy's collaborator is faked, nothing else: its steps run on a real ``StepEngine`` over the stub backend
(``Rig``), its KV bookkeeping is a real ``Choices`` and ``Recovery``, its telemetry a real ``TelemetryPublisher``.
The test plays the route: it puts what the tail sends into ``inbox`` (``send``) and reads what the strategy did:
the steps it had computed (``computed``), the frames it queued (``frames``, decode frames through ``forward``
included), the tokens it announced (``announced``) and how it completed (``completed``, ``kept``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Literal

from actors.backend import Hidden, StepInput, StepOutput
from actors.node.choices import Choice, Choices
from actors.node.engine import StepTiming
from actors.node.generation import Generation
from actors.node.head_port import RouteMessage, StepResult
from actors.node.recovery.record import Recovery
from actors.node.session import SessionFailed, StepFuture
from actors.node.spot_receipt import SpotRecorder
from actors.node.telemetry import TelemetryPublisher
from bus import frame as frames
from schemas.frame import FrameKind, HopStamp, SampledToken, SampledWindow
from schemas.route import ReplayRequest, Route
from schemas.session import FailureReason, SamplingParams, SessionOpen, SessionPhase, Speculation, TokenEvent
from schemas.telemetry import GenerationTelemetry
from tests.support.sessions import Rig


@dataclasses.dataclass(frozen=True)
class Frame:
    kind: FrameKind
    start: int
    positions: int
    step: int
    choice: int
    group: int
    tokens: tuple[int, ...] | None
    hidden: Hidden


class FakePort:
    """The head of ``route`` (hop 0) on the rig's node; ``is_tail``: head and tail on this node."""

    def __init__(self, rig: Rig, route: Route, prompt: list[int], *, max_tokens: int = 8, n: int = 1,
                 speculate: Speculation | None = None) -> None:
        self.rig = rig
        self.rt = rig.rt
        self.request = SessionOpen(session_id=route.session_id, route=route, hop_index=0, prompt_tokens=prompt,
                                   max_tokens=max_tokens, n=n, ignore_eos=True, speculate=speculate,
                                   sampling=SamplingParams(temperature=0.0))
        self.id = route.session_id
        self.raw_id = frames.session_bytes(self.id)
        self.route = route
        self.hop_index = 0
        self.is_tail = len(route.hops) == 1
        self.session_token: str | None = None
        self.reused = 0
        self.choices = Choices(self.id, n, self._generation())
        self.recovery = Recovery(self.rt, self.request, route.hops[0], is_tail=self.is_tail,
                                 session_token=lambda: None)
        self.spot: SpotRecorder | None = None
        self.snapshots: list[GenerationTelemetry] = []
        self.telemetry = TelemetryPublisher(route, self._telemetry, interval_s=0.0)
        self.phase = SessionPhase.PREFILL
        self.inbox: asyncio.Queue[RouteMessage] = asyncio.Queue()
        self.computed: list[StepInput] = []
        self.advanced: list[StepInput] = []
        """Steps the engine ran on its own (a chain's), reported through ``advance``."""
        self.frames: list[Frame] = []
        self.announced: list[TokenEvent] = []
        self.completed: TokenEvent | None = None
        self.kept: int | None = None

    async def _telemetry(self, snapshot: GenerationTelemetry) -> None:
        self.snapshots.append(snapshot)

    def _generation(self) -> Generation | None:
        if not self.is_tail:
            return None
        backend = self.rt.engine.backend
        return Generation(max_tokens=self.request.max_tokens, stops=[], ignore_eos=True,
                          token_bytes=backend.token_bytes, is_eog=backend.is_end_of_generation)

    # ---- what the test does ------------------------------------------------------------------------------------

    def send(self, message: RouteMessage) -> None:
        """The route sends the head ``message``."""
        self.inbox.put_nowait(message)

    def token(self, seq: int, value: int, *, choice: int = 0, finish: Literal["stop", "length"] | None = None,
              ) -> SampledToken:
        """What the tail (the last hop) posts for ``seq``."""
        return SampledToken(session_id=self.raw_id, seq=seq, token=value, text=chr(value), finish_reason=finish,
                            stamps=(HopStamp(len(self.route.hops) - 1, 1500, 20),), choice=choice)

    def window(self, window: int, accepted: int, tokens: Sequence[SampledToken]) -> SampledWindow:
        return SampledWindow(self.raw_id, window, accepted, tuple(tokens))

    def decode_frames(self, kind: FrameKind = FrameKind.DECODE) -> list[Frame]:
        return [f for f in self.frames if f.kind is kind]

    # ---- the port ----------------------------------------------------------------------------------------------

    @property
    def position(self) -> int:
        return self.choices.first.position

    def touch(self) -> None:
        pass

    async def route_ready(self) -> bool:
        return True

    async def next_event(self) -> TokenEvent:
        item = await self.next_message()
        if isinstance(item, FailureReason):
            raise SessionFailed(item)
        assert isinstance(item, SampledToken | TokenEvent), f"a strategy without windows read {item!r}"
        return self.event_of(item) if isinstance(item, SampledToken) else item

    async def next_message(self) -> RouteMessage:
        async with asyncio.timeout(10.0):  # a strategy waiting for what the test never sends fails the test
            return await self.inbox.get()

    def event_of(self, sampled: SampledToken) -> TokenEvent:
        return TokenEvent(session_id=self.id, seq=sampled.seq, token=sampled.token, text=sampled.text,
                          finish_reason=sampled.finish_reason, index=sampled.choice)

    def sampled(self, choice: Choice, out: StepOutput, stamps: tuple[HopStamp, ...]) -> SampledToken:
        assert out.token is not None and choice.generation is not None
        text, finish = choice.generation.accept(out.token)
        return SampledToken(session_id=self.raw_id, seq=choice.generation.count - 1, token=out.token, text=text,
                            finish_reason=finish, stamps=stamps, choice=choice.index)

    async def compute(self, choice: Choice, item: StepInput, queued: StepFuture | None = None) -> StepResult:
        self.computed.append(item)
        step = queued if queued is not None else self.rt.engine.enqueue(item, handoff=True)
        out, timing = await step
        self._grow(choice, item)
        return out, timing

    def advance(self, choice: Choice, item: StepInput, timing: StepTiming) -> None:
        self.advanced.append(item)
        self._grow(choice, item)

    def _grow(self, choice: Choice, item: StepInput) -> None:
        start = choice.position
        choice.position += item.n_positions
        if choice.index == 0:
            self.recovery.computed(start, choice.position, item.tokens)

    def stamp(self, timing: StepTiming) -> HopStamp:
        return HopStamp(0, int(timing.compute_ms * 1000), int(timing.queue_ms * 1000))

    def fork(self, position: int) -> list[Choice]:
        return self.choices.add_forks(position, [self._generation() for _ in range(self.request.n - 1)])

    def forward(self, choice: Choice, result: StepResult, event: TokenEvent | SampledToken, group: int = 0) -> None:
        out, timing = result
        assert out.hidden is not None
        self.queue_frame(FrameKind.DECODE, choice.position - 1, out.hidden, True, event.seq + 1,
                         (self.stamp(timing),), choice.index, group, (event.token,))

    def queue_frame(self, kind: FrameKind, start: int, hidden: Hidden, sample: bool, step: int,
                    stamps: tuple[HopStamp, ...], choice: int = 0, group: int = 0,
                    tokens: tuple[int, ...] | None = None) -> None:
        self.frames.append(Frame(kind, start, int(hidden.shape[0]), step, choice, group, tokens, hidden))

    def token_timeout(self) -> float:
        return 5.0

    def failed_here(self, kind: Literal["timeout", "backend_error"], message: str) -> SessionFailed:
        return SessionFailed(FailureReason(node_id=self.rt.node_id, phase=self.phase, kind=kind, message=message))

    def backend_failed(self, exc: Exception) -> SessionFailed:
        return self.failed_here("backend_error", repr(exc))

    async def announce(self, event: TokenEvent, wall_ms: float | None) -> None:
        self.announced.append(event)

    async def complete(self, event: TokenEvent, *, keep_positions: int | None = None) -> None:
        assert self.completed is None, "a session completes once"
        self.completed = event
        self.kept = self.position if keep_positions is None else keep_positions
        self.phase = SessionPhase.COMPLETE

    def take_events(self) -> list[RouteMessage]:
        events = []
        while not self.inbox.empty():
            events.append(self.inbox.get_nowait())
        return events

    def put_events(self, events: Sequence[TokenEvent | SampledToken]) -> None:
        for event in events:
            self.inbox.put_nowait(event)

    def fed(self) -> list[int]:
        return self.recovery.tokens[len(self.request.prompt_tokens):self.position]

    def retarget(self, route: Route, hop_index: int) -> None:
        self.route, self.hop_index = route, hop_index

    def replay(self, request: ReplayRequest) -> int:
        return 0
