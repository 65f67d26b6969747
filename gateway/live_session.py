"""The gateway's side of a Route Session: route it, open it on every hop, relay its events, close it.

The gateway is not on the per-token path: it opens the session (tail first, head last — the head starts prefill as
soon as it is opened), then only listens on NATS for the head's token events and telemetry. The session's
head owns its fate (it detects failures anywhere downstream and publishes the end); the gateway follows, and only
finds what the head cannot report: the head itself gone (``bus.liveness`` probes of a silent session), events lost
on the bus, or a head silent past every timeout. Whatever the outcome, it frees the session on every hop that still
answers; a client that goes away gets its session cancelled by the head.

Why one module of ~450 lines: the session as the gateway follows it (``LiveSession``) and the manager that opens and
closes it on the route share its lifecycle, from routing to the last hop freed; each half alone reads as half a
protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus import capability, codec
from bus.connection import keep_cancellation
from bus.liveness import Silence, first_lost
from bus.nodeclient import NodeClient
from bus.subjects import Subjects
from bus.tracker_client import TrackerClient
from gateway import fanout
from gateway.constraints import check_choices
from schemas.constraint import OutputConstraint
from schemas.errors import (
    CapacityError,
    HopError,
    HopOpenError,
    RouteFailedError,
    SwarmrouteError,
)
from schemas.prefix import conversation_keys, request_keys
from schemas.route import Route
from schemas.session import (
    CONTEXT_CAP,
    TOKEN_SUBJECT_MESSAGES,
    FailureReason,
    HopGrant,
    Prompt,
    RouteChanged,
    SamplingParams,
    SessionEnd,
    SessionOpen,
    SessionPhase,
    Speculation,
    TokenEvent,
    session_budget,
)
from schemas.settings import Settings
from schemas.telemetry import GenerationTelemetry, PrefillProgress, RouteHopView
from schemas.tools import ToolCallFormat

log = logging.getLogger(__name__)

Event = TokenEvent | GenerationTelemetry | SessionEnd | None
"""What a session yields; ``None`` is a keep-alive tick while nothing happens."""

MAX_REROUTES = 3
"""Dead nodes a session may be routed around while it opens."""
LOST_GRACE_S = 0.5
"""After a hop is found lost, how long the gateway still waits for an event that was already on its way (the end of a
session whose last hop freed it just before it was probed) before it fails the session."""
FINISHED_KEPT = 1000
"""Finished sessions whose last telemetry snapshot the gateway keeps (GET /v1/sessions/{id}/telemetry)."""
T = TypeVar("T")


Constrain = Callable[[ToolCallFormat | None], OutputConstraint | None]
"""Builds the tail's output constraint once the head has said how it rendered the tools (``TokenizeReply``)."""


@dataclasses.dataclass
class GenerationRequest:
    model: str
    prompt: Prompt | None
    prompt_tokens: list[int] | None
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str]
    ignore_eos: bool = False
    n: int = 1  # choices; the route decodes one when greedy (gateway.fanout), else n, checked once routed
    constrain: Constrain | None = None  # between tokenizing and opening: the constraint from the head's tool format


class LiveSession:
    """One running Route Session. Iterate ``events()`` until a SessionEnd; always ``close()``."""

    def __init__(self, manager: SessionManager, session_id: str) -> None:
        self._m = manager
        self.id = session_id
        self.route: Route | None = None
        self.n_prompt = 0
        """Prompt tokens, as the head counted them."""
        self.max_tokens = 0
        self.telemetry: GenerationTelemetry | None = None
        self.end: SessionEnd | None = None
        self.tokens_seen = 0  # of every choice the route decodes
        self.n, self.seen = 1, [0]  # the route's choices, and tokens seen per choice (each one's seq counts from 0)
        self.fan_out = 1
        """Request choices per route choice: ``n`` when greedy (``gateway.fanout``: the route decodes one), else 1."""
        self._held = 0  # fanned-out copies of a token not yet yielded (they count in ``backlog``)
        self.tool_format: ToolCallFormat | None = None  # how the head asked the model to write tool calls
        self.prompt: Prompt | None = None
        self.reply: list[str] = []
        """Choice 0's text so far: with the prompt, the prefix keys of what the hops keep (issue #18)."""
        self._queue: asyncio.Queue[TokenEvent | GenerationTelemetry | SessionEnd] = asyncio.Queue()
        self._subs: list[Subscription] = []
        self._nats_stats: dict[str, int] = {}
        """The gateway connection's live counters (nats.py ``Client.stats``), read for ``reconnects``."""
        self._reconnects_before = 0
        self._epoch = 0
        """The route's repair count as the head last announced it (``RouteChanged``)."""
        self._closed = False
        self.created = time.monotonic()
        self.setup: dict[str, float] = {}
        """Seconds spent per setup step (``route``, ``tokenize``, ``open``, ``first_token``): what the first token
        waited for (``swarmroute_gateway_setup_seconds``)."""
        self.opened_at: float | None = None

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        """Add the time the block takes to ``setup[step]``."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.setup[step] = self.setup.get(step, 0.0) + time.monotonic() - started

    async def subscribe(self, nc: NATS, subjects: Subjects) -> None:
        """One subscription for both the token and the telemetry subject, so their relative order is kept."""
        telemetry_subject = subjects.telemetry(self.id)
        client_subject = subjects.client(self.id)

        async def on_message(msg: Msg) -> None:
            try:
                if msg.subject == client_subject:  # the head asks whether this session's client still listens
                    if msg.reply:
                        with contextlib.suppress(Exception):  # NATS reconnecting: the head asks again
                            await msg.respond(b"")
                    return
                if msg.subject == telemetry_subject:
                    self._queue.put_nowait(codec.decode(msg.data, GenerationTelemetry))
                    return
                message = codec.decode_tagged(msg.data, TOKEN_SUBJECT_MESSAGES)
                if isinstance(message, RouteChanged):  # the head repaired the route: free the session there
                    if self.route is not None and message.epoch > self._epoch:
                        self._epoch = message.epoch
                        self.route = _with_token(message.route, self.route)
                    return
                assert isinstance(message, TokenEvent | SessionEnd)
                self._queue.put_nowait(message)
            except codec.DecodeError as exc:
                log.warning("session %s: undecodable message on %s: %s", self.id, msg.subject, exc)

        self._subs = [await nc.subscribe(subjects.session_events(self.id), cb=on_message)]
        self._nats_stats = nc.stats
        self._reconnects_before = nc.stats.get("reconnects", 0)

    @property
    def backlog(self) -> int:
        """Events received but not yet consumed."""
        return self._queue.qsize() + self._held

    def events(self) -> AsyncIterator[Event]:
        """Token events (of every request choice) and telemetry in arrival order, then exactly one SessionEnd."""
        events = self._route_events()
        # A plain request pays nothing for the fan-out: no extra generator on its per-token path.
        return events if self.fan_out == 1 else self._fanned(events)

    async def _fanned(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """Greedy n > 1: each token of the route's one choice, once per request choice; the end counts them all.
        The end replaces ``self.end`` before it is yielded, so whoever reads ``end`` sees the request's choices
        (and the route's generator stops when resumed)."""
        async for event in events:
            if isinstance(event, TokenEvent):
                copies = fanout.fan_token(event, self.fan_out)
                for i, copy in enumerate(copies):
                    self._held = len(copies) - 1 - i  # the stream writes a token's copies in one send
                    yield copy
                self._held = 0
            elif isinstance(event, SessionEnd):
                self.end = fanout.fan_end(event, self.fan_out)
                yield self.end
            else:
                yield event

    async def _route_events(self) -> AsyncIterator[Event]:
        """The route's events (its own choices), checked for losses."""
        settings = self._m.settings
        silence = Silence(settings.liveness_probe_s)
        while self.end is None:
            # A backstop: the head owns the session's fate and reports a silent route itself within the token
            # timeout (plus one hop timeout to probe); only a head that cannot report is the gateway's to find.
            limit = settings.hop_timeout_s + (settings.token_timeout_s if self.tokens_seen
                                              else settings.first_token_timeout_s)
            if silence.lasted() >= limit:
                yield await self._fail_stalled(limit)
                return
            if silence.probe_due():
                lost = await self._m.find_lost(self.route, self.id) if self.route else None
                silence.probed()
                if lost is not None:
                    event = await self._next_event(LOST_GRACE_S)  # the route's last words may still be on the bus
                    if event is None:
                        yield await self._fail_lost(*lost)
                        return
                    silence.broken()
                    processed = self._absorb(event)
                    if processed is not None:
                        yield processed
                continue
            event = await self._next_event(silence.wait(limit))
            if event is None:
                if silence.keepalive_due():
                    yield None
                continue
            silence.broken()
            processed = self._absorb(event)
            if processed is not None:
                yield processed

    async def _next_event(self, wait: float) -> TokenEvent | GenerationTelemetry | SessionEnd | None:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            pass
        try:
            async with asyncio.timeout(max(0.0, wait)):  # no task per event, unlike wait_for
                return await self._queue.get()
        except TimeoutError:
            return None

    def abort(self, reason: FailureReason) -> None:
        """End the session from outside (the gateway shutting down): its stream ends with this failure."""
        if self.end is None:
            self._queue.put_nowait(SessionEnd(session_id=self.id, phase=SessionPhase.FAILED, failure=reason,
                                              prompt_tokens=self.n_prompt,
                                              completion_tokens=self.tokens_seen))

    def _absorb(self, event: TokenEvent | GenerationTelemetry | SessionEnd) -> Event:
        if isinstance(event, GenerationTelemetry):
            if self.telemetry is None or event.seq > self.telemetry.seq:
                self.telemetry = event
                return event
            return None
        if isinstance(event, SessionEnd):
            sent = event.completion_tokens
            if event.phase is SessionPhase.COMPLETE and sent is not None and sent != self.tokens_seen:
                # The last tokens have no successor to reveal the gap: the end's count does.
                return self._lost(f"the head sent {sent} tokens, {self.tokens_seen} arrived")
            if event.phase is SessionPhase.COMPLETE:
                for choice in event.choices:  # n > 1: the same, choice by choice
                    seen = self.seen[choice.index] if choice.index < self.n else 0
                    if choice.completion_tokens != seen:
                        return self._lost(f"the head sent {choice.completion_tokens} tokens of choice "
                                          f"{choice.index}, {seen} arrived")
            self.end = event
            return event
        index = event.index
        if index >= self.n:
            return self._lost(f"token of choice {index} on a session of {self.n} choices")
        if event.seq != self.seen[index]:
            which = f" of choice {index}" if self.n > 1 else ""
            return self._lost(f"token {self.seen[index]}{which} was lost on the bus (received token {event.seq})")
        self.seen[index] += 1
        if not self.tokens_seen and self.opened_at is not None:
            self.setup["first_token"] = time.monotonic() - self.opened_at
        self.tokens_seen += 1
        if index == 0:
            self.reply.append(event.text)
        return event

    def _lost(self, message: str) -> SessionEnd:
        reason = FailureReason(node_id=self.route.head.node_id if self.route else None, phase=SessionPhase.DECODE,
                               kind="protocol", message=message)
        self.end = SessionEnd(session_id=self.id, phase=SessionPhase.FAILED, failure=reason)
        return self.end

    def _current_phase(self) -> SessionPhase:
        return self.telemetry.phase if self.telemetry and not self.telemetry.phase.terminal else SessionPhase.PREFILL

    async def _fail_lost(self, node: str, why: str) -> SessionEnd:
        phase = self._current_phase()
        reason = FailureReason(node_id=node, phase=phase, kind="unreachable", message=why)
        self.end = SessionEnd(session_id=self.id, phase=SessionPhase.FAILED, failure=reason,
                              prompt_tokens=self.n_prompt, completion_tokens=self.tokens_seen)
        await self._m.publish_telemetry(self, SessionPhase.FAILED, failure=reason)
        return self.end

    async def _fail_stalled(self, waited: float) -> SessionEnd:
        node = await self._m.find_unresponsive(self.route) if self.route else None
        phase = self._current_phase()
        if node is None and self._nats_stats.get("reconnects", 0) > self._reconnects_before:
            # Every hop answers, and this gateway lost its NATS connection meanwhile: core NATS is at-most-once,
            # so the rest of the stream (possibly its end) was published while nobody here was subscribed.
            reason = FailureReason(node_id=None, phase=phase, kind="protocol",
                                   message=f"the stream was lost on the bus: the gateway's NATS connection dropped "
                                           f"during {phase.value} and no event came for {waited:g}s after")
        else:
            message = (f"node {node} stopped answering" if node else "the route went silent") + \
                      f" during {phase.value}; no event for {waited:g}s"
            reason = FailureReason(node_id=node, phase=phase, kind="timeout", message=message)
        self.end = SessionEnd(session_id=self.id, phase=SessionPhase.FAILED, failure=reason,
                              prompt_tokens=self.n_prompt, completion_tokens=self.tokens_seen)
        await self._m.publish_telemetry(self, SessionPhase.FAILED, failure=reason)
        return self.end

    async def close(self, *, cancelled: bool = False) -> None:
        """Free the session on every hop; if the client went away before its end, the head is told to cancel it
        (it publishes the ``cancelled`` end). Idempotent."""
        if self._closed:
            return
        self._closed = True
        cancel = cancelled and self.end is None
        if cancel:  # the head owns the session's end and publishes it when told to cancel (below)
            self.end = SessionEnd(session_id=self.id, phase=SessionPhase.CANCELLED,
                                  prompt_tokens=self.n_prompt, completion_tokens=self.tokens_seen)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self.route is not None:
            keys = self._conversation_keys() if self.end is not None and self.end.phase is SessionPhase.COMPLETE \
                else []
            await self._m.close_on_hops(self.route, self.id, cancel=cancel, keys=keys)
        self._m.forget(self)

    def _conversation_keys(self) -> list[str]:
        """What the hops kept of this session, named so that a request continuing it is routed to them."""
        if self.prompt is None or self.n != 1:
            return []
        return conversation_keys(self.prompt.messages, self.prompt.text, "".join(self.reply))


async def _passthrough(awaitable: Awaitable[T]) -> T:
    """A node refusing with a 4xx/429 is the client's problem or a busy node: pass its error through as is. A hop
    the head could not open (``HopOpenError``) counts as that hop's own answer."""
    try:
        return await awaitable
    except HopError as raised:
        exc = raised.peer_error.as_hop_error() if isinstance(raised.peer_error, HopOpenError) else raised
        if exc.peer_status in (401, 403):  # the swarm's own grant was refused: not the API client's fault
            raise RouteFailedError(f"node {exc.node} refused the session capability: {exc.message}",
                                   code="capability_refused") from exc
        if exc.peer_error is not None and exc.peer_status is not None and exc.peer_status < 500:
            raise exc.peer_error from None
        raise RouteFailedError(f"could not open the session: {exc.message}") from exc


class SessionManager:
    """Creates Route Sessions; injected with the NATS connection, the tracker client and the node client."""

    def __init__(self, nc: NATS, tracker: TrackerClient, nodes: NodeClient, settings: Settings) -> None:
        self.nc = nc
        self.tracker = tracker
        self.nodes = nodes
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self.live: dict[str, LiveSession] = {}
        self.finished: dict[str, GenerationTelemetry] = {}
        self.finished_limit = FINISHED_KEPT

    async def start(self, request: GenerationRequest) -> LiveSession:
        """Route and open a session; raises a SwarmrouteError (with its HTTP status) before any token flows."""
        session = LiveSession(self, uuid.uuid4().hex)
        self.live[session.id] = session
        try:
            await session.subscribe(self.nc, self.subjects)
            await self.publish_telemetry(session, SessionPhase.ROUTING, seq=0)
            await self._route_and_open(session, request)
        except BaseException as exc:
            if isinstance(exc, SwarmrouteError) and session.route is not None:
                reason = FailureReason(node_id=getattr(exc, "node", None), phase=SessionPhase.ROUTING,
                                       kind="http_error", message=exc.message)
                await self.publish_telemetry(session, SessionPhase.FAILED, failure=reason)
            await session.close()
            raise
        return session

    async def _route_and_open(self, session: LiveSession, request: GenerationRequest) -> None:
        """Route, then open on every hop. A hop found dead while opening (nothing listens: the registry still shows
        it until its entry expires) is excluded and the session routed again, so a client gets a working route or
        the tracker's 503 naming the layers nobody serves, not a 502 for a node that is already gone."""
        exclude: list[str] = []
        session.prompt = request.prompt
        keys = request_keys(request.prompt.messages, request.prompt.text) if request.prompt is not None else []
        while True:
            with session.timed("route"):
                session.route = await self._route(request.model, session.id, exclude, keys)
            # Kept locally so a stream's first chunk shows the route before any token; the head's snapshots
            # (seq >= 1) supersede it.
            session.telemetry = self.snapshot(session, SessionPhase.ROUTING, seq=0)
            try:
                await self._open(session, request)
                session.opened_at = time.monotonic()
                return
            except RouteFailedError as exc:
                dead = exc.__cause__
                if not (isinstance(dead, HopError) and dead.kind == "unreachable") or len(exclude) >= MAX_REROUTES:
                    raise
                log.info("session %s: node %s is gone; routing again without it", session.id, dead.node)
                exclude.append(dead.node)
                await self.close_on_hops(session.route, session.id)

    async def _route(self, model: str, session_id: str, exclude: list[str] | None = None,
                     prefix_keys: list[str] | None = None) -> Route:
        return await self._route_with(model, session_id, exclude, standby=self._repairs,
                                      prefix_keys=prefix_keys or [])

    @property
    def _repairs(self) -> bool:
        """Sessions repair (and so every hop needs a standby for its snapshots) unless switched off."""
        return self.settings.repair

    async def _route_with(self, model: str, session_id: str, exclude: list[str] | None, *, standby: bool,
                          prefix_keys: list[str]) -> Route:
        """Ask for a route; while every route is full, ask again for up to ``route_retry_s`` before the 429.

        A slot freed a moment ago reaches the tracker with the node's next heartbeat, after the client that freed
        it may already be back: without the retry, a swarm within its capacity would refuse that client.
        """
        deadline = time.monotonic() + self.settings.route_retry_s
        wait = 0.02
        while True:
            try:
                return await self.tracker.route(model, session_id, exclude, standby=standby,
                                                prefix_keys=prefix_keys)
            except CapacityError:
                if time.monotonic() + wait > deadline:
                    raise
                await asyncio.sleep(wait)
                wait = min(wait * 2, 0.2)

    async def _open(self, session: LiveSession, request: GenerationRequest) -> None:
        """Open the session on its head, which opens every hop after it while it starts prefilling (issue #20).
        The head tokenizes a prompt itself (no round trip of its own) unless it has tools: their constraint needs
        the head's tool format first."""
        route = session.route
        assert route is not None
        head = route.head
        tokens = request.prompt_tokens
        if tokens is None and request.prompt is not None and request.prompt.tools is not None:
            with session.timed("tokenize"):
                reply = await _passthrough(self.nodes.tokenize_reply(head.node_id, head.endpoint, request.prompt,
                                                                     capability=head.capability))
            tokens, session.tool_format = reply.tokens, reply.tool_format
        route_n = fanout.route_choices(request.n, request.sampling)
        check_choices(route_n, route.max_sessions)  # the sequences every hop will hold, not the request's n
        sampling = request.sampling
        if request.constrain is not None:
            sampling = sampling.model_copy(update={"constraint": request.constrain(session.tool_format)})
        default = self.settings.default_max_tokens
        n_ctx = min(route.context_length, CONTEXT_CAP)
        # Without the tokens (the head tokenizes), the head checks the context as this would, with the same words.
        max_tokens = session_budget(len(tokens), request.max_tokens, default=default, context=n_ctx) \
            if tokens is not None else request.max_tokens or default
        session.n, session.seen, session.fan_out = route_n, [0] * route_n, request.n // route_n
        speculate = self._speculation(sampling, route_n, len(route.hops))
        # A speculative session's KV goes back and forth between windows: it does not snapshot (issue #20).
        repair = self._repairs and route_n == 1 and speculate is None
        # Each hop gets only its own grants (for the session, and for its standby): the head passes each later
        # hop's on to it alone.
        downstream = [HopGrant(capability=h.capability, standby=h.standby.capability if h.standby else "")
                      for h in route.hops[1:]]
        request_open = SessionOpen(
            session_id=session.id, route=capability.strip(route, keep_standby=0), hop_index=0,
            prompt_tokens=tokens or [], prompt=request.prompt if tokens is None else None,
            fit_max_tokens=tokens is None and request.max_tokens is None, max_tokens=max_tokens, sampling=sampling,
            stop=request.stop, ignore_eos=request.ignore_eos, prefill_chunk=self.settings.prefill_chunk,
            capability=head.capability, n=route_n, repair=repair,
            snapshot_every=self.settings.snapshot_every if repair else 0, speculate=speculate, downstream=downstream)
        with session.timed("open"):
            opened = await _passthrough(self.nodes.open_session(head.node_id, head.endpoint, request_open))
        session.n_prompt, session.max_tokens = opened.prompt_tokens, opened.max_tokens or max_tokens

    def _speculation(self, sampling: SamplingParams, n: int, hops: int) -> Speculation | None:
        """Verify windows for a session whose next token is a function of the logits alone (one choice, no grammar,
        no penalties, no logprobs) on a route of several hops, when the swarm is set to speculate (issue #20)."""
        s = self.settings
        plain = (sampling.constraint is None and sampling.logprobs is None and sampling.repeat_penalty == 1.0
                 and sampling.presence_penalty == 0.0 and sampling.frequency_penalty == 0.0)
        if s.speculation == "off" or n != 1 or hops < 2 or not plain or s.speculative_max_k == 0:
            return None
        return Speculation(source=s.speculation, max_k=s.speculative_max_k, windows=s.speculative_windows)

    async def publish_telemetry(self, session: LiveSession, phase: SessionPhase, *, seq: int | None = None,
                                failure: FailureReason | None = None) -> None:
        snap = self.snapshot(session, phase, seq=seq, failure=failure)
        if phase.terminal:
            self._remember(session.id, snap)
        with contextlib.suppress(Exception):
            await self.nc.publish(self.subjects.telemetry(session.id), codec.encode(snap))
            keep_cancellation()

    @staticmethod
    def snapshot(session: LiveSession, phase: SessionPhase, *, seq: int | None = None,
                 failure: FailureReason | None = None) -> GenerationTelemetry:
        """The gateway's own view of a session (routing, or an end the head could not report)."""
        last = session.telemetry
        return GenerationTelemetry(
            session_id=session.id, seq=seq if seq is not None else (last.seq + 1 if last else 1), phase=phase,
            model=session.route.model_id if session.route else "",
            route=last.route if last else ([RouteHopView(node_id=h.node_id, layers=h.layers, health="unknown")
                                            for h in session.route.hops] if session.route else []),
            route_health="failed" if phase is SessionPhase.FAILED else (last.route_health if last else "unknown"),
            prefill=last.prefill if last else PrefillProgress(),
            generated_tokens=session.tokens_seen, tokens_per_s=last.tokens_per_s if last else 0.0,
            ttft_ms=last.ttft_ms if last else None, failure=failure)

    async def find_unresponsive(self, route: Route | None) -> str | None:
        """The head, if it does not answer its health check: a live head would have reported the route's
        silence itself."""
        if route is None:
            return None
        head = route.head
        return None if await self.nodes.probe(head.node_id, head.endpoint) else head.node_id

    async def find_lost(self, route: Route, session_id: str) -> tuple[str, str] | None:
        """The head, if its process is gone or it lost the session, and why. Only the head: every other hop's
        death is the head's to find and report (it owns the session's fate)."""
        token = capability.session_token_of(route)
        return await first_lost(self.nodes, route.hops[:1], session_id, session_token=token)

    async def close_on_hops(self, route: Route, session_id: str, *, cancel: bool = False,
                            keys: list[str] | None = None) -> None:
        """Free the session on every hop (idempotent there); ``cancel`` asks the head to end it as cancelled."""
        token = capability.session_token_of(route)
        await asyncio.gather(*(self.nodes.close_session(h.node_id, h.endpoint, session_id, session_token=token,
                                                        cancel=cancel and i == 0, keys=keys or ())
                               for i, h in enumerate(route.hops)))

    def forget(self, session: LiveSession) -> None:
        self.live.pop(session.id, None)
        if session.telemetry is not None and session.id not in self.finished:
            self._remember(session.id, session.telemetry)

    def _remember(self, session_id: str, snap: GenerationTelemetry) -> None:
        """Keep a finished session's last snapshot for late telemetry readers, oldest dropped beyond the limit
        (every ending goes through here: an unbounded table grew by ~5 KiB per session, tests/test_load.py)."""
        self.finished[session_id] = snap
        while len(self.finished) > self.finished_limit:
            self.finished.pop(next(iter(self.finished)))


def _with_token(route: Route, before: Route) -> Route:
    """A repaired route as the head announced it (capabilities stripped), with the session token this gateway
    frees the session with (the same for every epoch) kept on its head."""
    head = route.hops[0].model_copy(update={"capability": before.hops[0].capability})
    return route.model_copy(update={"hops": [head, *route.hops[1:]]})
