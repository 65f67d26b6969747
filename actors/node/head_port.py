"""The one way into a Route Session's head for what serves it: the prefill, the decode strategies and the repair.

The head (``actors.node.head_session.HeadSession``, the one implementation of ``HeadPort``) owns the session's
fate: its event queue and phase, the stall and probe handling, the end (complete, fail, cancel) and the client
watcher. The prefill (``actors.node.prefill``) and then a decode strategy (``DecodeStrategy``: ``actors.node.decode``
and the verify windows of ``actors.node.speculation.verify_loop``, chosen once when the session opens) decide which
steps the head computes and which frames it sends; a repair (``actors.node.recovery.repair``) moves the session
onto a new route. They ask the head through ``HeadPort`` only: what the route sent next, a step computed, a frame
queued, a token announced, the session completed, the route retargeted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from actors.backend import Hidden, StepInput, StepOutput
from actors.node.choices import Choice, Choices
from actors.node.engine import StepTiming
from actors.node.recovery.record import Recovery
from actors.node.runtime import NodeRuntime
from actors.node.session import SessionFailed, StepFuture
from actors.node.spot_receipt import SpotRecorder
from actors.node.telemetry import TelemetryPublisher
from schemas.frame import FrameKind, HopStamp, SampledToken, SampledWindow
from schemas.route import ReplayRequest, Route
from schemas.session import FailureReason, SessionOpen, SessionPhase, TokenEvent

RouteMessage = TokenEvent | SampledToken | SampledWindow | FailureReason
"""What the route sends a head: a token, a verify window's verdict, a hop's failure report."""
StepResult = tuple[StepOutput, StepTiming]


class HeadPort(Protocol):
    """What the prefill, a decode strategy or a repair may ask of the head it serves."""

    # ---- the session (read; ``phase`` is set by the loop that decodes) ------------------------------------------
    rt: NodeRuntime
    request: SessionOpen
    id: str
    route: Route
    hop_index: int
    is_tail: bool
    """Head and tail on one node."""
    session_token: str | None
    reused: int
    """Prompt positions taken from kept KV at open."""
    choices: Choices
    recovery: Recovery
    spot: SpotRecorder | None
    """Its spot-check receipt on this hop, when sampled (issue #28); on a 1-node route its head is its tail."""
    telemetry: TelemetryPublisher
    phase: SessionPhase

    @property
    def position(self) -> int:
        """Choice 0's KV position."""
        ...

    def touch(self) -> None:
        """Something happened: the session is not idle."""
        ...

    # ---- what the route sends ------------------------------------------------------------------------------------

    async def route_ready(self) -> bool:
        """Whether every hop after the head opened (waits for their answers; False: the open's answer says why)."""
        ...

    async def next_event(self) -> TokenEvent:
        """The next token (``SessionFailed`` for a report, a dead hop, silence past the token timeout)."""
        ...

    async def next_message(self) -> RouteMessage:
        """The next token, verdict or failure report, as it came (``SessionFailed`` for a dead hop or silence)."""
        ...

    def event_of(self, sampled: SampledToken) -> TokenEvent:
        """The gateway's view of a sampled token."""
        ...

    def sampled(self, choice: Choice, out: StepOutput, stamps: tuple[HopStamp, ...]) -> SampledToken:
        """Head and tail on one node: the record of the token ``out`` sampled (its stop rules applied)."""
        ...

    # ---- steps and frames ------------------------------------------------------------------------------------

    async def compute(self, choice: Choice, item: StepInput, queued: StepFuture | None = None) -> StepResult:
        """Run ``item`` (or await ``queued``, the same step already queued) and advance the choice past it."""
        ...

    def advance(self, choice: Choice, item: StepInput, timing: StepTiming) -> None:
        """A step the engine ran on its own (a chain's) put ``item``'s positions into the choice's KV."""
        ...

    def stamp(self, timing: StepTiming) -> HopStamp:
        ...

    def fork(self, position: int) -> list[Choice]:
        """n > 1, after the last prefill chunk forked the backend session: choices 1..n-1 at ``position``."""
        ...

    def forward(self, choice: Choice, result: StepResult, event: TokenEvent | SampledToken, group: int = 0) -> None:
        """Send the decode frame of the step that fed ``event``'s token on (``group``: the round's size, n > 1)."""
        ...

    def queue_frame(self, kind: FrameKind, start: int, hidden: Hidden, sample: bool, step: int,
                    stamps: tuple[HopStamp, ...], choice: int = 0, group: int = 0,
                    tokens: tuple[int, ...] | None = None) -> None:
        """Send one computed frame on (journaled first)."""
        ...

    def token_timeout(self) -> float:
        """How long the next token may take (the first one longer)."""
        ...

    def failed_here(self, kind: Literal["timeout", "backend_error"], message: str) -> SessionFailed:
        ...

    def backend_failed(self, exc: Exception) -> SessionFailed:
        ...

    # ---- the end -----------------------------------------------------------------------------------------------

    async def announce(self, event: TokenEvent, wall_ms: float | None) -> None:
        """Publish a token to the gateway, with its telemetry and metrics."""
        ...

    async def complete(self, event: TokenEvent, *, keep_positions: int | None = None) -> None:
        """The generation ended with ``event``: the session completes, its KV kept up to ``keep_positions``."""
        ...

    # ---- repair (issue #18) --------------------------------------------------------------------------------------

    def take_events(self) -> list[RouteMessage]:
        """Everything the route sent that has not been read yet (a repair looks at it, then ``put_events``)."""
        ...

    def put_events(self, events: Sequence[TokenEvent | SampledToken]) -> None:
        ...

    def fed(self) -> list[int]:
        """The generated tokens the head has fed into its KV, in order."""
        ...

    def retarget(self, route: Route, hop_index: int) -> None:
        """Go on as hop ``hop_index`` of the repaired ``route``."""
        ...

    def replay(self, request: ReplayRequest) -> int:
        """Resend the journal from ``request.start`` to the (new) successor; how many positions go out."""
        ...


class DecodeStrategy(Protocol):
    """One way of decoding a session after its prefill, chosen once at open (``head_session.decode_strategy``)."""

    async def run(self, port: HeadPort) -> None:
        """Decode until the session completes (``port.complete``) or fails (``SessionFailed``). Run again from the
        top after a repair."""
        ...

    def stop(self) -> None:
        """The session closes: stop what runs without the strategy's task (synchronous, at close)."""
        ...
