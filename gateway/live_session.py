"""One Route Session as the gateway follows it, from its routing to the last hop freed (``LiveSession``).

The gateway is not on the per-token path: it sends the head one ``SessionOpen`` (the head opens every later hop
itself, ``actors/node/route_open.py``; routing and opening: ``gateway.session_opener``), then only listens on NATS
for the head's token events and telemetry, checking them for losses. The session's head owns its fate (it detects
failures anywhere downstream and publishes the end); the gateway follows, and only finds what the head cannot
report: the head itself gone (``bus.liveness`` probes of a silent session), events lost on the bus, or a head silent
past every timeout. Whatever the outcome, it frees the session on every hop that still answers; a client that goes
away gets its session cancelled by the head.

A session keeps its own state: the opener tells it what it was routed to and opened with (``routed``, ``opened``);
what it needs from the gateway around it (the route's nodes, publishing a snapshot of its own, being forgotten once
freed) it is given at construction (``SessionLinks``), the same for every session (``gateway.session_manager``
keeps the set of them).

Why one module of ~370 lines: the events the session checks as they arrive and the failures it finds itself (a lost
or silent head, a client gone) end it through the same fields (``end``, the tokens seen), read by one loop; apart,
each half would reach into the other's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus import codec
from bus.liveness import Silence
from bus.subjects import Subjects
from gateway import fanout
from gateway.route_nodes import HeadLost, HeadState
from schemas.prefix import conversation_keys
from schemas.reasoning import ReasoningStart
from schemas.route import Route
from schemas.session import (
    MAX_EPOCH,
    TOKEN_SUBJECT_MESSAGES,
    FailureReason,
    Prompt,
    RouteChanged,
    SessionEnd,
    SessionOpen,
    SessionPhase,
    TokenEvent,
)
from schemas.settings import Settings
from schemas.telemetry import GenerationTelemetry, PrefillProgress, RouteHopView
from schemas.tools import ToolCallFormat

log = logging.getLogger(__name__)

Event = TokenEvent | GenerationTelemetry | SessionEnd | None
"""What a session yields; ``None`` is a keep-alive tick while nothing happens."""

LOST_GRACE_S = 0.5
"""After a hop is found lost, how long the gateway still waits for an event that was already on its way (the end of a
session whose last hop freed it just before it was probed) before it fails the session."""


class RouteCalls(Protocol):
    """What a session asks of its route's nodes (``gateway.route_nodes.RouteNodes``)."""

    async def find_lost(self, route: Route, session_id: str) -> tuple[str, str] | None: ...

    async def find_unresponsive(self, route: Route) -> str | None: ...

    async def free(self, route: Route, session_id: str, *, cancel: bool = False,
                   keys: list[str] | None = None) -> None: ...

    async def replace_head(self, route: Route, state: HeadState, *, exclude: list[str],
                           timeout_s: float) -> Route: ...


@dataclasses.dataclass(frozen=True)
class SessionLinks:
    """What a live session needs from the gateway around it: one for all of a gateway's sessions."""

    settings: Settings
    """Its timeouts: liveness probes, the first and every later token, one hop's answer."""
    nodes: RouteCalls
    publish: Callable[[GenerationTelemetry], Awaitable[None]]
    """Publishes a snapshot the gateway made itself (an end the head could not report) on its telemetry subject."""
    closed: Callable[[str, GenerationTelemetry | None], None]
    """Called once the session is freed on its hops, with its id and its last telemetry snapshot."""


class LiveSession:
    """One running Route Session. Iterate ``events()`` until a SessionEnd; always ``close()``."""

    def __init__(self, links: SessionLinks, session_id: str, prompt: Prompt | None = None) -> None:
        self._links = links
        self.id = session_id
        self.route: Route | None = None
        self.n_prompt = 0
        self.n_cached = 0
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
        self.reasoning: ReasoningStart | None = None
        """Where the reply starts relative to a think block (``schemas.reasoning``); None: plain text."""
        self.prompt = prompt
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
        self.request: SessionOpen | None = None
        """The open the head is sent (set by the opener): with ``generated``, what a replacement head starts from
        (issue #31)."""
        self.generated: list[int] = []
        """Choice 0's token ids so far."""
        self.lost_heads: list[str] = []
        """Heads this session lost and had replaced (never routed to again)."""

    @contextlib.contextmanager
    def timed(self, step: str) -> Iterator[None]:
        """Add the time the block takes to ``setup[step]``."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.setup[step] = self.setup.get(step, 0.0) + time.monotonic() - started

    def routed(self, route: Route) -> None:
        """The tracker's route, before it is opened. Its snapshot is kept locally so that a stream's first chunk shows
        the route before any token; the head's snapshots (seq >= 1) supersede it."""
        self.route = route
        self.telemetry = self.snapshot(SessionPhase.ROUTING, seq=0)

    def opened(self, *, choices: int, fan_out: int, prompt_tokens: int, max_tokens: int,
               tool_format: ToolCallFormat | None, reasoning: ReasoningStart | None = None,
               reused: int = 0) -> None:
        """The head opened the route: the route's choices, each fanned out to ``fan_out`` request choices, the
        prompt and budget as the head settled them (``reused``: prompt positions taken from kept KV), and where the
        reply starts relative to a think block."""
        self.n_cached = reused
        self.n, self.seen, self.fan_out = choices, [0] * choices, fan_out
        self.n_prompt, self.max_tokens, self.tool_format = prompt_tokens, max_tokens, tool_format
        self.reasoning = reasoning
        self.opened_at = time.monotonic()

    def snapshot(self, phase: SessionPhase, *, seq: int | None = None,
                 failure: FailureReason | None = None) -> GenerationTelemetry:
        """The gateway's own view of the session (routing, or an end the head could not report)."""
        last, route = self.telemetry, self.route
        return GenerationTelemetry(
            session_id=self.id, seq=seq if seq is not None else (last.seq + 1 if last else 1), phase=phase,
            model=route.model_id if route else "",
            route=last.route if last else ([RouteHopView(node_id=h.node_id, layers=h.layers, health="unknown")
                                            for h in route.hops] if route else []),
            route_health="failed" if phase is SessionPhase.FAILED else (last.route_health if last else "unknown"),
            prefill=last.prefill if last else PrefillProgress(),
            generated_tokens=self.tokens_seen, tokens_per_s=last.tokens_per_s if last else 0.0,
            ttft_ms=last.ttft_ms if last else None, failure=failure)

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
        settings = self._links.settings
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
                lost = await self._links.nodes.find_lost(self.route, self.id) if self.route else None
                silence.probed()
                if lost is not None:
                    event = await self._next_event(LOST_GRACE_S)  # the route's last words may still be on the bus
                    if event is None:
                        failed = await self._replace_head(*lost)
                        if failed is not None:
                            yield failed
                            return
                        silence.broken()
                        continue
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
            self.generated.append(event.token)
        return event

    def _lost(self, message: str) -> SessionEnd:
        reason = FailureReason(node_id=self.route.head.node_id if self.route else None, phase=SessionPhase.DECODE,
                               kind="protocol", message=message)
        self.end = SessionEnd(session_id=self.id, phase=SessionPhase.FAILED, failure=reason)
        return self.end

    def _current_phase(self) -> SessionPhase:
        return self.telemetry.phase if self.telemetry and not self.telemetry.phase.terminal else SessionPhase.PREFILL

    def _head_replaceable(self) -> bool:
        """A lost head can be replaced (issue #31): the session repairs, decodes one choice (in verify windows
        or not) and has repairs left. On a route of several hops the tail still holds the sampler; on a 1-node
        route the replacement rebuilds it from the tokens the client has (``backend.replay_sampled``)."""
        request, route = self.request, self.route
        return (request is not None and route is not None and request.repair and request.n == 1 and self.n == 1
                and self._epoch < MAX_EPOCH and len(self.lost_heads) < self._links.settings.max_repairs)

    def _not_replaced(self) -> str:
        """Why a lost head is not replaced, for the session's failure message ("" for a plain fail-stop: repair
        off, or the session not opened yet)."""
        request = self.request
        if request is None or not self._links.settings.repair:
            return ""
        if self.n > 1:  # opened without repair (``gateway.session_opener``)
            return (f"; not repaired: a session of {self.n} sampled choices is not repaired after losing its head "
                    f"(the head keeps no snapshot or journal of forked choices and the gateway no per-choice "
                    f"cut; greedy n and n = 1 are)")
        return (f"; repair impossible: its repairs are used up ({len(self.lost_heads)} heads replaced, route epoch "
                f"{self._epoch}; at most {self._links.settings.max_repairs} repairs)")

    async def _replace_head(self, node: str, why: str) -> SessionEnd | None:
        """The head is gone: have a node serving its layers take the session over (``RouteNodes.replace_head``);
        None once it has (the stream goes on), else the session's failure naming the head."""
        if not self._head_replaceable():
            return await self._fail_lost(node, why + self._not_replaced())
        assert self.request is not None and self.route is not None
        log.warning("session %s lost its head %s (%s); replacing it", self.id[:8], node, why)
        repairing = self.snapshot(SessionPhase.REPAIRING)
        await self._links.publish(repairing)
        state = HeadState(request=self.request, generated=list(self.generated), n_prompt=self.n_prompt,
                          max_tokens=self.max_tokens, epoch=self._epoch + 1, telemetry_seq=repairing.seq)
        try:
            route = await self._links.nodes.replace_head(self.route, state, exclude=[node, *self.lost_heads],
                                                         timeout_s=self._links.settings.repair_timeout_s)
        except HeadLost as exc:
            return await self._fail_lost(node, f"{why}; repair impossible: {exc}")
        self.lost_heads.append(node)
        self._epoch = max(self._epoch, state.epoch)  # its RouteChanged may have come first
        self.route = route
        log.info("session %s: %s took the head over", self.id[:8], route.head.node_id)
        return None

    async def _fail_lost(self, node: str, why: str) -> SessionEnd:
        phase = self._current_phase()
        reason = FailureReason(node_id=node, phase=phase, kind="unreachable", message=why)
        self.end = SessionEnd(session_id=self.id, phase=SessionPhase.FAILED, failure=reason,
                              prompt_tokens=self.n_prompt, completion_tokens=self.tokens_seen)
        await self._links.publish(self.snapshot(SessionPhase.FAILED, failure=reason))
        return self.end

    async def _fail_stalled(self, waited: float) -> SessionEnd:
        node = await self._links.nodes.find_unresponsive(self.route) if self.route else None
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
        await self._links.publish(self.snapshot(SessionPhase.FAILED, failure=reason))
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
            await self._links.nodes.free(self.route, self.id, cancel=cancel, keys=keys)
        self._links.closed(self.id, self.telemetry)

    def _conversation_keys(self) -> list[str]:
        """What the hops kept of this session, named so that a request continuing it is routed to them."""
        if self.prompt is None or self.n != 1:
            return []
        return conversation_keys(self.prompt.messages, self.prompt.text, "".join(self.reply))


def _with_token(route: Route, before: Route) -> Route:
    """A repaired route as the head announced it (capabilities stripped), with the session token this gateway
    frees the session with (the same for every epoch) kept on its head."""
    head = route.hops[0].model_copy(update={"capability": before.hops[0].capability})
    return route.model_copy(update={"hops": [head, *route.hops[1:]]})
