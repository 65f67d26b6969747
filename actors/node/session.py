"""What every role of a Route Session on one node shares: its place in the route, its KV position, computing a step,
and sending frames on through its outbox. The roles are ``HopSession`` (every hop but the head: receive, compute,
forward) and ``HeadSession`` (the head: it owns the session's fate; its prefill and decode strategy drive it
through its port, ``head_port``). Each is built once what its open settled is known (``SessionStart``).

The ring: the head embeds and runs its layers, then sends the hidden state to the next hop; each hop appends the
positions to its own KV and forwards; the tail samples and posts the token straight back to the head, which starts
the next step. The gateway only listens (NATS), so it is never on the per-token path. A node answers a frame only
after it has computed it, so an upstream hop learns at once if its successor died mid-compute.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from actors.backend import Hidden, KvBackend, StepInput, StepOutput
from actors.node.choices import Choice, Choices
from actors.node.engine import StepTiming
from actors.node.generation import Generation
from actors.node.outbox import Outbound, Outbox
from actors.node.recovery.journal import Entry
from actors.node.recovery.record import Recovery
from actors.node.route_open import RouteOpening
from actors.node.runtime import NodeRuntime
from actors.node.spin import ArrivalSpinner
from bus import frame as frames
from schemas.errors import BadRequestError, FrameError, HopError, StaleEpochError, SwarmrouteError
from schemas.frame import FrameHeader, FrameKind, HopStamp, SampledToken, SampledWindow
from schemas.route import Hop, ReplayRequest, Route
from schemas.session import FailureReason, SessionOpen, SessionPhase, TokenEvent, TokenLogprobs

log = logging.getLogger(__name__)
StepFuture = asyncio.Future[tuple[StepOutput, StepTiming]]


class SessionFailed(Exception):
    def __init__(self, reason: FailureReason) -> None:
        super().__init__(reason.message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class SessionStart:
    """What the node settled while opening a session (``actors.node.opener``), handed to its role in one piece. What
    a replacement hop resumes from (issue #18) comes in the open itself (``SessionOpen.resume``)."""

    session_token: str | None = None
    """The capability's session token (admission on): sent on every request to this session's other hops."""
    reused: int = 0
    """Prompt positions taken from kept KV (prefix reuse, issue #18): the session prefills from there."""
    opening: RouteOpening | None = None
    """Head: the hops after it, still opening (issue #20); its first frame and the open's answer wait for them."""


PLAIN_START = SessionStart()
"""No admission, nothing reused, no hops to open (the session roles' tests open sessions so)."""


class NodeSession:
    """One Route Session as one node sees it. ``close()`` is idempotent and safe from the session's own tasks."""

    def __init__(self, rt: NodeRuntime, request: SessionOpen, *, hidden_shape: tuple[int, ...],
                 on_closed: Callable[[NodeSession], Awaitable[None]], start: SessionStart = PLAIN_START) -> None:
        self.rt = rt
        self.request = request
        self.id = request.session_id
        self.raw_id = frames.session_bytes(self.id)
        self.route = request.route
        self.hop_index = request.hop_index
        self.is_head = self.hop_index == 0
        self.is_tail = self.hop_index == len(self.route.hops) - 1
        self.hidden_shape = hidden_shape
        self.phase = SessionPhase.PREFILL
        self.closed = False
        self.last_activity = time.monotonic()
        self.frames_received = 0
        self.bytes_received = 0
        self.positions_received = 0
        self.session_token = start.session_token
        """Bound at open when the node checks capabilities; sent on every request to this session's other hops."""
        self.keep = 0
        """It completed: the first ``keep`` positions of its KV are kept for prefix reuse when it closes."""
        self.reused = start.reused
        """Prompt positions it took from kept KV at open (it then prefills from there)."""
        self._on_closed = on_closed
        self._next: Hop | None = None if self.is_tail else self.route.hops[self.hop_index + 1]
        self.outbox = self._make_outbox()
        """Frames to the next hop, or (on a tail that is not the head) tokens to the head; never both."""
        self.choices = Choices(self.id, request.n, self._new_generation())
        """Choice 0 is the session itself; n > 1 adds the forks after the last prefill chunk."""
        self._round_sends: set[asyncio.Task[None]] = set()
        """n > 1: a round's frames, each sent at once (``queue_frame``)."""
        self._spinner = ArrivalSpinner(rt.poller, rt.settings.hop_spin_grace_s)
        """Polls the loop until this session's next decode frame or token (multi-node routes)."""
        self.recovery = Recovery(rt, request, self.route.hops[self.hop_index], is_tail=self.is_tail,
                                 session_token=lambda: self.session_token)
        """Tokens, journal, snapshots and epoch: what lets the session survive a lost node (issue #18)."""
        self.spot = rt.spot_recorder(request, start.reused)
        """Its spot-check receipt, when this session is sampled on this hop (issue #28)."""
        resume = request.resume
        if resume is not None:  # a replacement for a lost hop: the node imported the KV up to ``resume.start``
            self.choices.first.position = resume.start
            self.recovery.tokens = [*request.prompt_tokens, *resume.generated]
        elif start.reused:
            self.choices.first.position = start.reused

    @property
    def position(self) -> int:
        """Choice 0's KV position (every choice's until they fork)."""
        return self.choices.first.position

    @property
    def generation(self) -> Generation | None:
        return self.choices.first.generation

    def _new_generation(self) -> Generation | None:
        """Tail: one per choice."""
        if not self.is_tail:
            return None
        backend = self.rt.engine.backend
        request = self.request
        return Generation(max_tokens=request.max_tokens, stops=request.stop, ignore_eos=request.ignore_eos,
                          token_bytes=backend.token_bytes, is_eog=backend.is_end_of_generation,
                          context_length=backend.info.context_length)

    def fork(self, position: int) -> list[Choice]:
        """After the last prefill chunk forked the backend session: choices 1..n-1 at ``position``."""
        return self.choices.add_forks(position, [self._new_generation() for _ in range(self.request.n - 1)])

    def _make_outbox(self) -> Outbox | None:
        peer, kind = (self._next, "frame") if self._next is not None else (self.route.head, "token")
        if self.is_head and self.is_tail:
            return None
        return Outbox(self.id[:8], self._outbox_failed,
                      lambda seconds: self.rt.metrics.hop(peer.node_id, kind, seconds))

    def retarget(self, route: Route, hop_index: int) -> None:
        """A repaired route (issue #18): the session goes on as hop ``hop_index`` of ``route``. A new successor (or
        an outbox that stopped on the lost node) gets a fresh outbox; what the old one still held is dropped, and
        the journal has it."""
        old_next, self.route, self.hop_index = self._next, route, hop_index
        self._next = None if self.is_tail else route.hops[hop_index + 1]
        if self.outbox is None:
            return
        dead = self.outbox.task is not None and self.outbox.task.done()
        if dead or (self._next is not None and old_next is not None and self._next.node_id != old_next.node_id):
            old = self.outbox
            if old.task is not None:
                old.task.cancel()
            old.close()
            fresh = self._make_outbox()
            assert fresh is not None
            self.outbox = fresh
            fresh.start()

    # ---- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self.outbox is not None:
            self.outbox.start()
        self.recovery.start()

    def _tasks(self) -> list[asyncio.Task[None]]:
        """The role's own tasks, cancelled at close."""
        own = [self.outbox.task] if self.outbox is not None and self.outbox.task is not None else []
        return [*own, *self._round_sends]

    def _stopping(self) -> None:
        """The role's synchronous clean-up at close, before any task is cancelled."""

    async def close(self) -> None:
        """Free the KV and stop every task."""
        if self.closed:
            return
        self.closed = True
        self._stopping()
        self._spinner.reset()
        current = asyncio.current_task()
        others = [t for t in self._tasks() if t is not current]
        for task in others:
            task.cancel()
        await self._on_closed(self)
        await asyncio.gather(*others, return_exceptions=True)  # no task outlives its session
        if self.spot is not None:
            self.spot.seal()
        await self.recovery.close()
        if self.outbox is not None:
            self.outbox.close()

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    # ---- what the HTTP front hands in (actors.node.hop_api) --------------------------------------------------

    def on_frame(self, header: FrameHeader, hidden: Hidden, nbytes: int) -> int | Awaitable[int]:
        raise FrameError("the head takes tokens, not frames")

    def on_token(self, event: TokenEvent | SampledToken) -> None:
        raise BadRequestError("tokens go to the session's head")

    def on_failure_report(self, reason: FailureReason) -> None:
        raise BadRequestError("failures are reported to the session's head")

    def on_window(self, window: SampledWindow) -> None:
        raise BadRequestError("verify windows' verdicts go to the session's head")

    # ---- computing ---------------------------------------------------------------------------------------------

    async def compute(self, choice: Choice, item: StepInput,
                      queued: StepFuture | None = None) -> tuple[StepOutput, StepTiming]:
        """Run ``item`` (or await ``queued``, the same step already queued) and advance the choice's position."""
        step = queued if queued is not None else self.rt.engine.enqueue(item, handoff=True)
        await settled(step)
        return self._step_result(choice, item, step)

    def _step_result(self, choice: Choice, item: StepInput, step: StepFuture,
                     tokens: tuple[int, ...] | None = None) -> tuple[StepOutput, StepTiming]:
        """A finished step's output, with the choice advanced past it (``tokens``: the frame's, on a hop); a backend
        failure as ``SessionFailed``."""
        try:
            out, timing = step.result()
        except SwarmrouteError:
            raise
        except Exception as exc:
            raise self.backend_failed(exc) from exc
        self.advance(choice, item, timing, tokens)
        return out, timing

    def backend_failed(self, exc: Exception) -> SessionFailed:
        return self.failed_here("backend_error", f"backend failed on node {self.rt.node_id}: {exc!r}")

    def failed_here(self, kind: Literal["timeout", "backend_error"], message: str) -> SessionFailed:
        return SessionFailed(FailureReason(node_id=self.rt.node_id, phase=self.phase, kind=kind, message=message))

    def advance(self, choice: Choice, item: StepInput, timing: StepTiming,
                tokens: tuple[int, ...] | None = None) -> None:
        """The step of ``item`` ran: the choice's KV grew by its positions (whose tokens are ``item.tokens`` on the
        head, ``tokens`` from the frame elsewhere)."""
        start = choice.position
        choice.position += item.n_positions
        if choice.index == 0:
            self.recovery.computed(start, choice.position, item.tokens if tokens is None else tokens)
            if self.spot is not None:
                self.spot.computed(start, item, timing.batch_size)
        # Metrics wait for the next loop turn: right after a forward pass the caches are cold and every line of
        # Python costs several times its usual price; the frame or token goes out first.
        asyncio.get_running_loop().call_soon(self.rt.metrics.step, "decode" if self.phase is SessionPhase.DECODE
                                             else "prefill", timing.compute_ms, timing.queue_ms)

    def stamp(self, timing: StepTiming) -> HopStamp:
        return HopStamp(self.hop_index, int(timing.compute_ms * 1000), int(timing.queue_ms * 1000))

    def sampled(self, choice: Choice, out: StepOutput, stamps: tuple[HopStamp, ...]) -> SampledToken:
        """The tail's record of one sampled token: its text and, if it ends the choice's generation, why; its
        logprobs when the session asked for them."""
        assert out.token is not None
        return self._sampled_token(choice, out.token, stamps, out.logprobs)

    def _sampled_token(self, choice: Choice, token: int, stamps: tuple[HopStamp, ...],
                       logprobs: TokenLogprobs | None = None) -> SampledToken:
        generation = choice.generation
        assert generation is not None
        text, finish = generation.accept(token)
        return SampledToken(session_id=self.raw_id, seq=generation.count - 1, token=token, text=text,
                            finish_reason=finish, stamps=stamps, choice=choice.index, logprobs=logprobs,
                            epoch=self.recovery.epoch)

    async def restart_generation(self, generated: list[int]) -> None:
        """Tail (a head that is its own tail too): the stop rules and the sampler, random state included, as if they
        had seen exactly ``generated`` (the tokens the head, or the gateway, has)."""
        generation = self._new_generation()
        assert generation is not None
        for token in generated:
            generation.accept(token)
        self.choices.first.generation = generation
        self.phase = SessionPhase.DECODE if generated else SessionPhase.PREFILL
        await self.rt.engine.call(self._kv().replay_sampled, self.id, list(generated))

    def _kv(self) -> KvBackend:
        backend = self.rt.engine.backend
        if not isinstance(backend, KvBackend):
            raise BadRequestError(f"node {self.rt.node_id}'s {backend.info.kind} backend cannot cut or rebuild KV")
        return backend

    # ---- sending on --------------------------------------------------------------------------------------------

    def queue_frame(self, kind: FrameKind, start: int, hidden: Hidden, sample: bool, step: int,
                    stamps: tuple[HopStamp, ...], choice: int = 0, group: int = 0,
                    tokens: tuple[int, ...] | None = None) -> None:
        """Send one computed frame on (journaled first, so a replacement of the successor can be rebuilt)."""
        if choice == 0:
            self.recovery.record(Entry(kind, start, hidden, sample, step, tokens))
            if self.spot is not None:
                self.spot.sent(start, hidden)
        if not self.recovery.forwards(start):
            return  # a replacement rebuilding: its successor holds these positions already
        self._send_frame(kind, start, hidden, sample, step, stamps, choice, group, tokens)

    def _send_frame(self, kind: FrameKind, start: int, hidden: Hidden, sample: bool, step: int,
                    stamps: tuple[HopStamp, ...], choice: int = 0, group: int = 0,
                    tokens: tuple[int, ...] | None = None, *, causal: bool | None = None) -> None:
        header = FrameHeader(session_id=self.raw_id, kind=kind, dtype=self.rt.wire_dtype, start_position=start,
                             n_positions=int(hidden.shape[0]), position_shape=self.hidden_shape, step=step,
                             sample=sample, stamps=stamps, choice=choice, group=group, epoch=self.recovery.epoch,
                             tokens=tokens)
        data = frames.encode(header, hidden)
        nxt = self._next
        assert nxt is not None and self.outbox is not None
        timeout = self.rt.settings.hop_timeout_s

        def send() -> Outbound:
            return self.rt.client.send_frame(nxt.node_id, nxt.endpoint, self.id, data, timeout=timeout,
                                             session_token=self.session_token)

        if group > 1:
            # A round's frames are answered only once the whole round has been computed downstream: each must be
            # on the wire at once, not when the outbox gets to awaiting it (it awaits them in order, and the first
            # would wait for the others for good when no idle connection could write them).
            task = asyncio.ensure_future(send())
            self._round_sends.add(task)
            task.add_done_callback(self._round_sends.discard)
            self.outbox.send(lambda: _answer_of(task), causal=True)
            return
        self.outbox.send(send, causal=kind is FrameKind.DECODE if causal is None else causal)

    async def _outbox_failed(self, exc: HopError) -> None:
        if isinstance(exc.peer_error, StaleEpochError):
            # The successor went on to a newer epoch of the route without this node: it was routed around (an
            # evicted node is alive). The head owns the session; a report would read as its successor failing.
            log.info("session %s: routed around by a repair (%s); closing it here", self.id[:8], exc)
            await self.close()
            return
        await self._report(FailureReason(node_id=exc.node, phase=self.phase, kind=exc.kind, message=str(exc)))

    async def _report(self, reason: FailureReason) -> None:
        """A hop this session sends to failed (or this node's backend did)."""
        raise NotImplementedError

    def replay(self, request: ReplayRequest) -> int:
        """Resend what this hop computed for its successor from ``request.start`` on (its journal), one frame at a
        time and each after the previous one's answer, to the successor the repaired route gave it. Returns how
        many positions go out."""
        journal = self.recovery.journal
        entries = journal.since(request.start) if journal is not None else None
        if entries is None:
            held = f"from position {journal.start}" if journal is not None else "nothing (no journal)"
            raise BadRequestError(f"session {self.id} on node {self.rt.node_id} can replay {held}, not from "
                                  f"{request.start}", code="journal_too_short")
        if request.epoch != self.recovery.epoch:
            raise StaleEpochError(f"replay for epoch {request.epoch}; session {self.id} is at epoch "
                                  f"{self.recovery.epoch}")
        for e in entries:
            self._send_frame(e.kind, e.start, e.hidden, e.sample, e.step, (), tokens=e.tokens, causal=False)
        return sum(int(e.hidden.shape[0]) for e in entries)


async def settled(step: StepFuture) -> None:
    """Wait for a step to finish, however it ends: ``_step_result`` then reads its result or failure. Cancelling the
    waiter still cancels the step."""
    with contextlib.suppress(Exception):
        await step


async def _answer_of(request: asyncio.Task[None]) -> None:
    """What the outbox awaits for a request already under way as a task."""
    await request
