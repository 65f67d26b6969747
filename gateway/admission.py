"""The gateway's admission queue (issue #30): requests beyond the free capacity wait their turn, not a 429.

Why at the gateway and not the tracker: the gateway holds the client's connection, so it can show a stream its
place (telemetry phase ``queued``) and notice a client that leaves; trackers stay stateless answerers of route
requests (run several in one queue group), and the capacity truth stays where it is: the tracker's view of the
nodes' advertisements, and each node's own refusal when that view is stale. The queue asks for a route; a
``capacity_exceeded`` answer (from the tracker or a node, the route's reservation released at once by the node's
settlement, ``actors.node.admission.Settlements``) puts the request back at the head of its line.

Fairness: one line per API key (digest); turns go round the keys, so a key with one request waiting is at most one
turn per other waiting key from the next free slot, however many requests another key queued. One request tries
at a time at first (route + open on the head), more while they are admitted (a window growing by one per admission
up to ``MAX_TRIES``, back to one at the first "no capacity"); the head of the queue asks again at once when a
session on this gateway ends, and otherwise backs off up to ``queue_poll_s`` (capacity freed by other gateways).

Refusals are only ``queue_full`` (the bound is reached and the key is not below the biggest key's share) and
``queue_timeout`` (``queue_wait_s`` passed), both 429 with ``Retry-After`` from the queue's length and the measured
service rate. A streamed request that waits gets its response started with choice-less chunks whose ``swarmroute``
telemetry says ``queued`` with its position and ETA (``AdmissionMiddleware``); a later refusal or error is then an
error chunk and ``[DONE]``. A non-streamed request simply waits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from nats.aio.client import Client as NATS
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bus import codec
from bus.nodeclient import NodeClient
from bus.tracker_client import TrackerClient
from gateway import sse
from gateway.limits import GENERATION_PATHS, key_digest
from gateway.live_session import LiveSession
from gateway.metrics import GatewayMetrics
from gateway.session_manager import SessionManager
from gateway.session_opener import GenerationRequest
from schemas.errors import CapacityError, SwarmrouteError
from schemas.openai import TELEMETRY_KEY
from schemas.session import SessionPhase
from schemas.settings import Settings
from schemas.telemetry import GenerationTelemetry, QueuePosition, QueueStats

log = logging.getLogger(__name__)
T = TypeVar("T")

NO_CAPACITY = "capacity_exceeded"
"""The code of a refusal that means "no free slot now" (tracker or node): the request waits instead."""
FIRST_RETRY_S = 0.02
"""The head of the queue asks again this soon after a refusal, doubling up to ``queue_poll_s``."""
WOKEN_RETRY_S = 0.02
"""After a session here ended and the try it woke still found no capacity (the freed node's advertisement may not
have reached the tracker yet), the head of the queue asks again this soon, doubling up to ``queue_poll_s``."""
NOTIFY_EVERY_S = 1.0
"""A waiting stream gets a fresh ``queued`` chunk at least this often (its ETA moves), and when its position does."""
RATE_WINDOW = 32
"""Session ends the service rate is measured over (at most ``RATE_HORIZON_S`` old)."""
RATE_HORIZON_S = 120.0
PUBLISH_EVERY_S = 1.0
MAX_TRIES = 8
"""Most requests of one model's queue trying for a slot at once (the dispatcher's window)."""

Outcome = Literal["admitted", "no_capacity", "failed", "left"]


class ClientGoneError(SwarmrouteError):
    """The client closed its connection while its request waited: a cancellation, not an error (nginx's 499)."""

    status = 499
    error_type = "cancelled"
    code = "client_gone"


@dataclasses.dataclass(frozen=True)
class QueueLimits:
    max_waiting: int = 256
    """Requests waiting on this gateway, all models; 0 turns the queue off."""
    max_wait_s: float = 120.0
    poll_s: float = 0.25

    @classmethod
    def from_settings(cls, settings: Settings) -> QueueLimits:
        return cls(max_waiting=settings.queue_max, max_wait_s=settings.queue_wait_s, poll_s=settings.queue_poll_s)


class ServiceRate:
    """Sessions ended per second, over the most recent ones: what a place in the queue is worth in seconds."""

    def __init__(self) -> None:
        self._ends: collections.deque[float] = collections.deque(maxlen=RATE_WINDOW)

    def ended(self, now: float) -> None:
        self._ends.append(now)

    def per_s(self, now: float) -> float | None:
        ends = [t for t in self._ends if now - t <= RATE_HORIZON_S]
        if len(ends) < 2 or ends[-1] <= ends[0]:
            return None
        # The gap since the last end counts too: a rate that stopped is not the rate of its last burst.
        return (len(ends) - 1) / (max(ends[-1], now) - ends[0])


class Waiter:
    """The HTTP side of one generation request, as the queue sees it: its key, whether (and how) its stream shows
    the queue, and whether its client is still there. Set for the request's task by ``AdmissionMiddleware``."""

    def __init__(self, key: str = "", notify: Callable[[GenerationTelemetry], Awaitable[None]] | None = None,
                 gone: Callable[[Callable[[], None]], bool] | None = None) -> None:
        self.key = key
        self.notify = notify
        self._gone = gone

    def watch(self, on_gone: Callable[[], None]) -> bool:
        """Call ``on_gone`` when the client leaves; True if it already has."""
        return self._gone(on_gone) if self._gone is not None else False


CURRENT: contextvars.ContextVar[Waiter] = contextvars.ContextVar("swarmroute_admission_waiter")


class Ticket:
    def __init__(self, model: str, key: str, waiter: Waiter | None, now: float) -> None:
        self.id = "q" + uuid.uuid4().hex[:15]
        self.model = model
        self.key = key
        self.waiter = waiter
        self.joined = now
        self.wake = asyncio.Event()
        self.turn: asyncio.Future[Outcome] | None = None
        self.dropped: str | None = None  # why the queue let it go: timeout | displaced | left
        self.gone = False


class ModelQueue:
    """The requests waiting for one model: a line per key, turns round the keys."""

    def __init__(self) -> None:
        self.lines: collections.OrderedDict[str, collections.deque[Ticket]] = collections.OrderedDict()
        self.wake = asyncio.Event()
        self.dispatcher: asyncio.Task[None] | None = None
        self.rate = ServiceRate()

    def __len__(self) -> int:
        return sum(len(line) for line in self.lines.values())

    @property
    def idle(self) -> bool:
        return not self.lines and self.dispatcher is None

    def order(self) -> list[Ticket]:
        """Who goes next, in turn order: every key's first, then every key's second, ..."""
        lines = list(self.lines.values())
        out: list[Ticket] = []
        depth = 0
        while True:
            row = [line[depth] for line in lines if len(line) > depth]
            if not row:
                return out
            out.extend(row)
            depth += 1

    def position(self, ticket: Ticket) -> int:
        line = self.lines.get(ticket.key)
        if line is None or ticket not in line:
            return 0
        depth = line.index(ticket)
        keys = list(self.lines)
        mine = keys.index(ticket.key)
        # Every key ahead in the round serves min(len, depth + 1) before it; every key after it, min(len, depth).
        ahead = sum(min(len(self.lines[k]), depth + (1 if i < mine else 0)) for i, k in enumerate(keys) if i != mine)
        return ahead + depth + 1

    def join(self, ticket: Ticket) -> None:
        self.lines.setdefault(ticket.key, collections.deque()).append(ticket)

    def remove(self, ticket: Ticket, *, served: bool) -> None:
        line = self.lines.get(ticket.key)
        if line is None or ticket not in line:
            return
        line.remove(ticket)
        if not line:
            del self.lines[ticket.key]
        elif served:
            self.lines.move_to_end(ticket.key)  # its next request waits for every other key's turn


class AdmissionQueue:
    """Every model's queue on this gateway, its bound, its figures. Single event loop: no locks."""

    def __init__(self, limits: QueueLimits, metrics: GatewayMetrics | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self.models: dict[str, ModelQueue] = {}
        self.admitted = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.on_change: Callable[[], None] | None = None
        """Called when a request joins (the gateway's figures publisher starts)."""
        if metrics is not None:
            metrics.bind_queue(waiting=lambda: self.waiting, service_rate=self.service_rate)

    @property
    def enabled(self) -> bool:
        return self.limits.max_waiting > 0

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self.models.values())

    def service_rate(self) -> float | None:
        now = time.monotonic()
        rates = [r for q in self.models.values() if (r := q.rate.per_s(now)) is not None]
        return sum(rates) if rates else None

    def _queue(self, model: str) -> ModelQueue:
        queue = self.models.get(model)
        if queue is None:
            queue = self.models[model] = ModelQueue()
        return queue

    def retry_after(self, model: str) -> float:
        """Seconds until a request joining now could expect its turn: the queue's length at the service rate."""
        queue = self.models.get(model)
        rate = queue.rate.per_s(time.monotonic()) if queue is not None else None
        if rate is None or queue is None:
            return 1.0
        return max(1.0, min(self.limits.max_wait_s, (len(queue) + 1) / rate))

    def ended(self, model: str) -> None:
        """A session of ``model`` admitted here ended: its slot is free, the head of the line asks at once."""
        queue = self._queue(model)
        queue.rate.ended(time.monotonic())
        queue.wake.set()

    def stats(self, gateway: str) -> QueueStats:
        now = time.monotonic()
        tickets = [t for q in self.models.values() for line in q.lines.values() for t in line]
        rate = self.service_rate()
        return QueueStats(gateway=gateway, waiting=len(tickets),
                          by_model={m: len(q) for m, q in self.models.items() if len(q)},
                          oldest_wait_s=round(max((now - t.joined for t in tickets), default=0.0), 3),
                          admitted=self.admitted, dropped=dict(self.dropped),
                          service_rate=round(rate, 3) if rate is not None else None)

    # ---- admission -----------------------------------------------------------------------------------------------

    async def admit(self, model: str, start: Callable[[], Awaitable[T]]) -> T:
        """``start()`` now if nobody waits for ``model``, else (or if it finds no capacity) when this request's
        turn comes; raises ``CapacityError`` (queue_full, queue_timeout) or ``ClientGoneError``."""
        if not self.enabled:
            return await start()
        known = self.models.get(model)
        if known is None or known.idle:
            try:
                return await start()
            except CapacityError as exc:
                if exc.code != NO_CAPACITY:
                    raise
        # Only a model some route serves gets here (the tracker found its nodes busy): queues are not made for
        # whatever names clients send.
        queue = self._queue(model)
        ticket = self._join(queue, model, CURRENT.get(None))
        try:
            return await self._wait_and_start(queue, ticket, start)
        finally:
            queue.remove(ticket, served=False)
            self._release_turn(ticket)  # cancelled while it held the turn: the next in line must not wait for it

    def _join(self, queue: ModelQueue, model: str, waiter: Waiter | None) -> Ticket:
        key = waiter.key if waiter is not None else ""
        if self.waiting >= self.limits.max_waiting and not self._displace_for(key):
            self._drop("full")
            raise CapacityError(f"the gateway's admission queue is full ({self.limits.max_waiting} requests "
                                f"waiting); retry later", retry_after=self.retry_after(model), code="queue_full")
        ticket = Ticket(model, key, waiter, time.monotonic())
        queue.join(ticket)
        if waiter is not None and waiter.watch(lambda: self._left(ticket)):
            self._left(ticket)
        if queue.dispatcher is None:
            queue.dispatcher = asyncio.create_task(self._dispatch(queue), name=f"admission-{model[:24]}")
        if self.on_change is not None:
            self.on_change()
        return ticket

    def _displace_for(self, key: str) -> bool:
        """The queue is full: a key below the biggest key's count takes the place of that key's newest request
        (one that is not trying right now). False when ``key`` is itself among the biggest."""
        counts: collections.Counter[str] = collections.Counter()
        for q in self.models.values():
            for k, line in q.lines.items():
                counts[k] += len(line)
        if not counts:
            return False
        biggest, most = counts.most_common(1)[0]
        if counts[key] + 1 >= most:
            return False
        newest = [t for q in self.models.values() for t in q.lines.get(biggest, ()) if t.turn is None]
        if not newest:
            return False
        victim = max(newest, key=lambda t: t.joined)
        victim.dropped = "displaced"
        self.models[victim.model].remove(victim, served=False)
        victim.wake.set()
        return True

    def _left(self, ticket: Ticket) -> None:
        ticket.gone = True
        ticket.wake.set()

    def _drop(self, reason: str, waited: float | None = None) -> None:
        self.dropped[reason] += 1
        if self.metrics is not None:
            self.metrics.queue_dropped.labels(reason=reason).inc()
            if waited is not None:
                self.metrics.queue_wait.observe(waited)

    async def _wait_and_start(self, queue: ModelQueue, ticket: Ticket, start: Callable[[], Awaitable[T]]) -> T:
        while True:
            turn = await self._wait_turn(queue, ticket)
            try:
                result = await start()
            except CapacityError as exc:
                if exc.code != NO_CAPACITY:
                    turn.set_result("failed")
                    raise
                if self.metrics is not None:
                    self.metrics.queue_retries.inc()
                ticket.turn = None
                turn.set_result("no_capacity")  # still first in line: the dispatcher asks again for it
                continue
            except BaseException:
                if not turn.done():
                    turn.set_result("failed")
                raise
            waited = time.monotonic() - ticket.joined
            queue.remove(ticket, served=True)
            self.admitted += 1
            if self.metrics is not None:
                self.metrics.queue_admitted.inc()
                self.metrics.queue_wait.observe(waited)
            turn.set_result("admitted")
            return result

    async def _wait_turn(self, queue: ModelQueue, ticket: Ticket) -> asyncio.Future[Outcome]:
        deadline = ticket.joined + self.limits.max_wait_s
        shown: tuple[int, float] | None = None
        while True:
            now = time.monotonic()
            if ticket.dropped == "displaced":
                self._drop("displaced", now - ticket.joined)
                raise CapacityError("the gateway's admission queue is full and another API key's request took "
                                    "this one's place (each key gets its share)",
                                    retry_after=self.retry_after(ticket.model), code="queue_full")
            if ticket.gone:
                self._release_turn(ticket)
                self._drop("left", now - ticket.joined)
                raise ClientGoneError("the client left while its request waited for capacity")
            if ticket.turn is not None:
                return ticket.turn
            if now >= deadline:
                self._drop("timeout", now - ticket.joined)
                raise CapacityError(f"no capacity for model {ticket.model!r} within {self.limits.max_wait_s:g}s in "
                                    f"the admission queue", retry_after=self.retry_after(ticket.model),
                                    code="queue_timeout")
            position = queue.position(ticket)
            if ticket.waiter is not None and ticket.waiter.notify is not None and position and (
                    shown is None or shown[0] != position or now - shown[1] >= NOTIFY_EVERY_S):
                shown = (position, now)
                await ticket.waiter.notify(self._telemetry(queue, ticket, position, now))
                continue  # the send may have taken a while: look again before sleeping
            ticket.wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, min(NOTIFY_EVERY_S, deadline - now))):
                    await ticket.wake.wait()

    def _release_turn(self, ticket: Ticket) -> None:
        turn, ticket.turn = ticket.turn, None
        if turn is not None and not turn.done():
            turn.set_result("left")

    def _telemetry(self, queue: ModelQueue, ticket: Ticket, position: int, now: float) -> GenerationTelemetry:
        rate = queue.rate.per_s(now)
        view = QueuePosition(position=position, waiting=len(queue), eta_s=round(position / rate, 2) if rate else None,
                             waited_s=round(now - ticket.joined, 3), max_wait_s=self.limits.max_wait_s)
        return GenerationTelemetry(session_id=ticket.id, phase=SessionPhase.QUEUED, model=ticket.model, queue=view,
                                   elapsed_ms=round((now - ticket.joined) * 1e3, 1))

    async def _dispatch(self, queue: ModelQueue) -> None:
        """Give turns in line order, up to a window of tries at once: it grows by one with each admission (slots
        free in waves, and a wave's opens then overlap instead of queueing behind each other) and falls back to one
        at the first "no capacity"; then, once the tries in flight are done, wait for a session to end here (since
        those tries began) or the backoff (doubling up to ``poll_s``) before the next."""
        backoff, window = FIRST_RETRY_S, 1
        trying: set[asyncio.Future[Outcome]] = set()
        loop = asyncio.get_running_loop()
        try:
            while queue.lines or trying:
                if not trying:
                    # From here on a session that ends wakes the wait below, even while these tries are in flight
                    # (cleared after them, the news of a slot freed meanwhile was lost until the next poll).
                    queue.wake.clear()
                for ticket in queue.order():
                    if len(trying) >= window:
                        break
                    if ticket.turn is None:
                        ticket.turn = loop.create_future()
                        trying.add(ticket.turn)
                        ticket.wake.set()
                if not trying:
                    return
                done, _ = await asyncio.wait(trying, return_when=asyncio.FIRST_COMPLETED)
                trying -= done
                outcomes = {turn.result() for turn in done}
                if "no_capacity" not in outcomes:
                    window = min(window + ("admitted" in outcomes), MAX_TRIES)
                    backoff = FIRST_RETRY_S
                    continue
                window = 1
                if trying:
                    continue  # the tries still in flight find out the same: wait for them first
                woken = False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(backoff):
                        await queue.wake.wait()
                        woken = True
                backoff = WOKEN_RETRY_S if woken else min(backoff * 2, self.limits.poll_s)
        finally:
            queue.dispatcher = None


class AdmittedSessions(SessionManager):
    """The gateway's session manager with every ``start`` going through the admission queue: the one place a
    request acquires capacity. With the queue on, the queue does the asking again (``route_retry_s`` is not used:
    each try is one route request)."""

    def __init__(self, nc: NATS, tracker: TrackerClient, nodes: NodeClient, settings: Settings,
                 admission: AdmissionQueue) -> None:
        if admission.enabled:
            settings = settings.model_copy(update={"route_retry_s": 0.0})
        super().__init__(nc, tracker, nodes, settings)
        self.admission = admission
        self._models: dict[str, str] = {}
        """Admitted session id -> the model its request named (the queue it frees a place in when it ends)."""
        self._publisher: asyncio.Task[None] | None = None
        admission.on_change = self._publish_soon

    async def start(self, request: GenerationRequest) -> LiveSession:
        session = await self.admission.admit(request.model, lambda: super(AdmittedSessions, self).start(request))
        self._models[session.id] = request.model
        return session

    def _closed(self, session_id: str, last: GenerationTelemetry | None) -> None:
        super()._closed(session_id, last)
        model = self._models.pop(session_id, None)
        if model is not None:
            self.admission.ended(model)

    def _publish_soon(self) -> None:
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.create_task(self._publish_stats(), name="admission-stats")

    async def _publish_stats(self) -> None:
        """The queue's figures for ``swarmroute watch``, every second while requests wait, and once when it
        empties (so watchers see it drained)."""
        name = self.settings.member_name or "gateway"
        subject = self.subjects.gateway_queue(name)
        while True:
            stats = self.admission.stats(name)
            with contextlib.suppress(Exception):  # NATS reconnecting: the next second's figures go out
                await self.nc.publish(subject, codec.encode(stats))
            if not stats.waiting:
                return
            await asyncio.sleep(PUBLISH_EVERY_S)


# ---- the HTTP side: streams that show their place ---------------------------------------------------------------

_KINDS = {"/v1/chat/completions": "chat.completion.chunk", "/v1/completions": "text_completion",
          "/v1/responses": ""}
_DISCONNECT: Message = {"type": "http.disconnect"}


class _Exchange:
    """One generation request's ASGI exchange: the body is teed as the app reads it (to learn ``stream`` and
    ``model``), a watcher owns ``receive`` once the request waits (to see the client leave), and the response is
    started early for a stream that waits (then the app's own start is dropped and an error becomes a chunk)."""

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self._body: list[bytes] = []
        self._body_done = False
        self._watch: asyncio.Task[Message] | None = None
        self._gone = False
        self._on_gone: list[Callable[[], None]] = []
        self.started = False
        """We started the response (a waiting stream): the app's own start is not sent."""
        self._app_status = 200
        self._error: list[bytes] = []
        self._stream: bool | None = None
        self._model = ""

    # -- receive --
    async def receive(self) -> Message:
        if self._gone:
            return _DISCONNECT
        if self._watch is not None:
            message = await asyncio.shield(self._watch)
        else:
            message = await self._receive()
            if message["type"] == "http.request":
                self._body.append(message.get("body", b""))
                self._body_done = not message.get("more_body", False)
        if message["type"] == "http.disconnect":
            self._left()
        return message

    def watch(self, on_gone: Callable[[], None]) -> bool:
        """The request waits: see the client leave (the body has been read: only a disconnect can come)."""
        self._on_gone.append(on_gone)
        if self._watch is None and self._body_done and not self._gone:
            self._watch = asyncio.ensure_future(self._receive())
            self._watch.add_done_callback(self._watched)
        return self._gone

    def _watched(self, task: asyncio.Task[Message]) -> None:
        if task.cancelled() or task.exception() is not None or task.result()["type"] == "http.disconnect":
            self._left()

    def _left(self) -> None:
        if self._gone:
            return
        self._gone = True
        for callback in self._on_gone:
            callback()

    def close(self) -> None:
        if self._watch is not None and not self._watch.done():
            self._watch.cancel()

    def _peek(self) -> None:
        """``stream`` and ``model`` from the body the app read (it was parsed and validated already)."""
        if self._stream is not None:
            return
        self._stream = False
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            body = json.loads(b"".join(self._body))
            self._stream = body.get("stream") is True
            self._model = str(body.get("model", ""))

    # -- send --
    async def notify(self, snap: GenerationTelemetry) -> None:
        self._peek()
        if not self._stream or self._gone:
            return
        if not self.started:
            self.started = True
            await self._send({"type": "http.response.start", "status": 200,
                              "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                          (b"cache-control", b"no-cache"),
                                          (b"x-swarmroute-queue", snap.session_id.encode())]})
        kind = _KINDS.get(self.scope["path"], "")
        if kind:
            chunk: dict[str, Any] = {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{snap.session_id}",
                                     "object": kind, "created": int(time.time()), "model": self._model,
                                     "choices": [], TELEMETRY_KEY: snap.model_dump(mode="json")}
            payload = sse.data(chunk)
        else:  # the Responses API's events have no place for it: an SSE comment keeps the stream alive
            q = snap.queue
            payload = f": queued position={q.position if q else 0} eta_s={q.eta_s if q else None}\n\n".encode()
        with contextlib.suppress(Exception):  # a client that just left: its watcher says so
            await self._send({"type": "http.response.body", "body": payload, "more_body": True})

    async def send(self, message: Message) -> None:
        if not self.started:
            await self._send(message)
            return
        if message["type"] == "http.response.start":
            self._app_status = int(message["status"])
            return
        if message["type"] != "http.response.body":
            return
        if self._app_status == 200:
            await self._send(message)
            return
        # The app refused after the stream showed its place: its JSON error becomes the stream's error chunk.
        self._error.append(message.get("body", b""))
        if not message.get("more_body", False):
            await self._send({"type": "http.response.body", "more_body": False,
                              "body": b"data: " + b"".join(self._error).strip() + b"\n\n" + sse.DONE})


class AdmissionMiddleware:
    """Pure ASGI, outside the concurrency limits (a waiting request holds no slot), inside the API key check."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(scope, receive, send)
        token = CURRENT.set(Waiter(key_digest(Headers(scope=scope)), notify=exchange.notify, gone=exchange.watch))
        try:
            await self.app(scope, exchange.receive, exchange.send)
        finally:
            CURRENT.reset(token)
            exchange.close()
