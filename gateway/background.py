"""Background responses (issue #31): ``POST /v1/responses`` with ``background: true``, then by id on any gateway.

    GET  /v1/responses/{id}                                 the response as it stands (output so far, or final)
    GET  /v1/responses/{id}?stream=true&starting_after=N    every event after sequence number N, then live
    POST /v1/responses/{id}/cancel                          the session cancelled on its route

Who drives a background generation: its head, as for every session, and nothing of it is tied to a gateway. The
opening gateway creates the response's JetStream stream before the head opens (``gateway.response_store``): the
stream captures everything the head publishes for the session, and answers the head's client probes, so the head
runs the session to its end whether or not any gateway lives. The gateway that opened it follows it as any session
(``LiveSession``: losses the head cannot report, the hops freed at the end) and appends an end it found itself;
if that gateway dies, the head goes on publishing into the stream, and any gateway reading it takes over finding a
head that died too (``_Replay``).

Every gateway renders a response's stream events from the same inputs, the ``ResponseRecord`` and the token-subject
messages in stream order, through the same pure builder (``gateway.responses.ResponseReply``, item ids derived from
the response id), so sequence number N is the same event on every gateway: a client resumed on gateway B after N
gets every later event exactly once, and the same text it would have had from A.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping

from starlette.responses import JSONResponse, Response, StreamingResponse

from bus import capability
from bus.nodeclient import NodeClient
from gateway import sse
from gateway.live_session import LiveSession
from gateway.reasoning import splits
from gateway.response_store import ResponseStore, StoredMessage
from gateway.responses import ResponseReply, sse_event
from gateway.route_nodes import RouteNodes
from gateway.serving import OpenAIServing
from gateway.session_opener import GenerationRequest
from schemas.errors import BadRequestError, NotFoundError
from schemas.openai_responses import ResponseEvent, ResponseObject, ResponseRecord, ResponsesRequest
from schemas.session import FailureReason, RouteChanged, SessionEnd, SessionPhase, TokenEvent
from schemas.settings import Settings

log = logging.getLogger(__name__)

RESPONSE_ID = re.compile(r"^resp_([0-9a-f]{32})$")
"""A background response's id: ``resp_`` and its session id."""
TICK_S = 5.0
"""A live stream's keep-alive spacing while nothing happens."""
CANCEL_POLL_S = 0.05
QUERY_PARAMS = frozenset({"stream", "starting_after", "include", "include[]", "include_obfuscation"})
"""What ``GET /v1/responses/{id}`` takes (the SDK's ``responses.retrieve``); ``include`` changes nothing here: a
background response carries what its request asked for."""


def session_of(response_id: str) -> str:
    """The session behind a response id; a 404 for any id no background response could have."""
    match = RESPONSE_ID.match(response_id)
    if match is None:
        raise NotFoundError(f"No response found with id '{response_id}'", param="response_id",
                            code="response_not_found")
    return match.group(1)


@dataclasses.dataclass(frozen=True)
class StreamQuery:
    stream: bool
    starting_after: int


def parse_query(params: Mapping[str, str]) -> StreamQuery:
    """``stream`` and ``starting_after`` of a retrieve; anything malformed is a 400 naming it."""
    unknown = sorted(set(params) - QUERY_PARAMS)
    if unknown:
        raise BadRequestError(f"unknown query parameter {unknown[0]!r}", param=unknown[0])
    stream_arg = params.get("stream", "false").lower()
    if stream_arg not in ("true", "false", "1", "0"):
        raise BadRequestError(f"stream must be true or false, got {params['stream']!r}", param="stream")
    stream = stream_arg in ("true", "1")
    raw = params.get("starting_after")
    if raw is None:
        return StreamQuery(stream, -1)
    if not re.fullmatch(r"[0-9]{1,18}", raw):
        raise BadRequestError(f"starting_after must be a non-negative integer (a sequence number), got {raw!r}",
                              param="starting_after")
    if not stream:
        raise BadRequestError("starting_after applies to a stream: add stream=true", param="starting_after")
    return StreamQuery(stream, int(raw))


class ResponseView:
    """One background response rebuilt from its record and its stream's messages, in stream order."""

    def __init__(self, record: ResponseRecord) -> None:
        self.record = record
        req = ResponsesRequest.model_validate(record.request)
        self.reply = ResponseReply(req, response_id=record.response_id, prompt_tokens=record.prompt_tokens,
                                   tool_format=record.tool_format, created_at=record.created_at,
                                   reasoning=record.reasoning)
        self.ended = False
        self._next_seq = 0

    def start(self) -> list[ResponseEvent]:
        return self.reply.builder.start()

    def feed(self, message: StoredMessage) -> list[ResponseEvent]:
        """The events one message of the stream makes; none after the first end (a later one, appended by a
        gateway that found the session lost as the head ended it, changes nothing)."""
        if self.ended or isinstance(message, RouteChanged):
            return []
        if isinstance(message, SessionEnd):
            self.ended = True
            return self.reply.end(message)
        if message.index != 0 or message.seq < self._next_seq:
            return []  # a repaired route's head publishes from where it was: never twice the same token
        if message.seq > self._next_seq:
            self.ended = True
            return self.reply.end(SessionEnd(
                session_id=self.record.session_id, phase=SessionPhase.FAILED, failure=FailureReason(
                    node_id=self.record.route.head.node_id, phase=SessionPhase.DECODE, kind="protocol",
                    message=f"token {self._next_seq} is missing from the response's stream (next: {message.seq})")))
        self._next_seq += 1
        return self.reply.token(message)

    @property
    def response(self) -> ResponseObject:
        return self.reply.builder.current()


class BackgroundResponses:
    """Background responses on one gateway: opening them, and serving any gateway's by id."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore, nodes: NodeClient, settings: Settings) -> None:
        self.serving = serving
        self.store = store
        self.nodes = nodes
        self.route_nodes = RouteNodes(nodes)
        self.settings = settings
        self.driving: dict[str, asyncio.Task[None]] = {}
        """Sessions this gateway opened and follows (``LiveSession``), by id: left running when it stops."""
        self._sweeper: asyncio.Task[None] | None = None

    # ---- opening --------------------------------------------------------------------------------------------

    async def create(self, req: ResponsesRequest, generation: GenerationRequest) -> Response:
        """Open the session with its stream in place, store its record, and answer at once: the response as it
        stands (``in_progress``), or with ``stream`` its events from the first, read back from the stream."""
        session_id = uuid.uuid4().hex
        await self.store.create(session_id)
        try:
            session = await self.serving.sessions.start(dataclasses.replace(generation, session_id=session_id))
        except BaseException:
            await self.store.delete(session_id)
            raise
        assert session.route is not None
        record = ResponseRecord(
            response_id=f"resp_{session_id}", session_id=session_id, created_at=float(int(time.time())),
            request=req.model_dump(mode="json", by_alias=True, exclude_unset=True), prompt_tokens=session.n_prompt,
            tool_format=session.tool_format, route=session.route,
            # Decided once, here: every gateway then renders the block as this one's live stream would have, whatever
            # its own reasoning format.
            reasoning=session.reasoning if splits(self.serving.reasoning_format(None), session.reasoning,
                                                  streamed=False) else None)
        try:
            await self.store.put_record(record)
        except BaseException:
            self.serving.close_later(session, cancelled=True)  # nobody could ever read it: no use running it
            await self.store.delete(session_id)
            raise
        self._follow(session)
        headers = {"x-swarmroute-session": session_id}
        if req.stream:
            return StreamingResponse(self._replay(record, after=-1), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", **headers})
        view = await self._snapshot(record)
        return JSONResponse(view.response.model_dump(mode="json", by_alias=True), headers=headers)

    def _follow(self, session: LiveSession) -> None:
        task = asyncio.get_running_loop().create_task(self._drive(session), name=f"background-{session.id[:8]}")
        self.driving[session.id] = task
        task.add_done_callback(lambda _: self.driving.pop(session.id, None))

    async def _drive(self, session: LiveSession) -> None:
        """Follow the session as a streamed one would be followed, with nobody reading here: the stream has the
        events. Cancelled (this gateway stopping) it leaves the session running: it is not this gateway's."""
        clock = self.serving.clock(session)
        try:
            async for event in session.events():
                if isinstance(event, TokenEvent):
                    clock.token()
        except Exception:  # noqa: BLE001 - a bug here must not end a session its head runs on
            log.exception("background response %s: following its session failed; it runs on unfollowed",
                          session.id)
            self.serving.sessions.live.pop(session.id, None)
            return
        end = session.end
        if end is not None and not await self.store.ended(session.id):
            await self.store.append_end(end)  # found here (the head lost, silent): the head could not publish it
        self.serving.close_later(session, cancelled=False)

    async def aclose(self) -> set[str]:
        """This gateway stops: its background sessions run on (their heads publish into their streams); their ids,
        which the gateway must not end with its streams."""
        running = set(self.driving)
        tasks = [*self.driving.values(), *([self._sweeper] if self._sweeper else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for session_id in running:  # followed here no more; its NATS subscriptions end with the connection
            self.serving.sessions.live.pop(session_id, None)
        return running

    # ---- by id, on any gateway ------------------------------------------------------------------------------

    async def retrieve(self, response_id: str, params: Mapping[str, str]) -> Response:
        query = parse_query(params)
        session_id = session_of(response_id)
        record = await self.store.record(session_id, response_id)
        if query.stream:
            return StreamingResponse(self._replay(record, after=query.starting_after), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        view = await self._snapshot(record)
        return JSONResponse(view.response.model_dump(mode="json", by_alias=True))

    async def cancel(self, response_id: str) -> Response:
        """The head ends the session as cancelled and frees its route; a head gone meanwhile cannot, so then the
        cancelled end is appended here. A response that already ended is answered as it stands."""
        session_id = session_of(response_id)
        record = await self.store.record(session_id, response_id)
        if not await self.store.ended(session_id):
            route = record.route
            head = route.head
            await self.nodes.close_session(head.node_id, head.endpoint, session_id, cancel=True,
                                           session_token=capability.session_token_of(route))
            await self.route_nodes.free(route, session_id)  # whatever a hop still holds (idempotent there)
            if not await self._ended(session_id, self.settings.hop_timeout_s):
                await self.store.append_end(SessionEnd(session_id=session_id, phase=SessionPhase.CANCELLED,
                                                       prompt_tokens=record.prompt_tokens))
        view = await self._snapshot(record)
        return JSONResponse(view.response.model_dump(mode="json", by_alias=True))

    async def _ended(self, session_id: str, within: float) -> bool:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if await self.store.ended(session_id):
                return True
            await asyncio.sleep(CANCEL_POLL_S)
        return False

    async def _snapshot(self, record: ResponseRecord) -> ResponseView:
        view = ResponseView(record)
        view.start()
        async for message in self.store.messages(record.session_id, follow=False, tick_s=TICK_S):
            if message is not None:
                view.feed(message)
        return view

    async def _replay(self, record: ResponseRecord, *, after: int) -> AsyncIterator[bytes]:
        """Every event after ``after``, then the live ones as the head publishes them, until the end. A reader
        whose stream stays silent past the session's timeouts probes the head: if it is gone (and with it,
        possibly, the gateway that would have found it), the failed end is appended for every reader."""
        view = ResponseView(record)
        first = [sse_event(e) for e in view.start() if e.sequence_number > after]
        if first:
            yield b"".join(first)
        quiet = time.monotonic()
        async for message in self.store.messages(record.session_id, follow=True, tick_s=TICK_S):
            if message is None:
                yield sse.KEEPALIVE
                if time.monotonic() - quiet >= self._silence_limit(view):
                    await self._check_head(record, view)
                    quiet = time.monotonic()
                continue
            quiet = time.monotonic()
            events = [sse_event(e) for e in view.feed(message) if e.sequence_number > after]
            if events:
                yield b"".join(events)
            if view.ended:
                return

    def _silence_limit(self, view: ResponseView) -> float:
        s = self.settings
        return s.hop_timeout_s + (s.token_timeout_s if view.reply.tokens else s.first_token_timeout_s)

    async def _check_head(self, record: ResponseRecord, view: ResponseView) -> None:
        lost = await self.route_nodes.find_lost(record.route, record.session_id)
        if lost is None:
            return
        node, why = lost
        log.warning("background response %s: its head %s is lost (%s)", record.response_id, node, why)
        await self.store.append_end(SessionEnd(
            session_id=record.session_id, phase=SessionPhase.FAILED, prompt_tokens=record.prompt_tokens,
            completion_tokens=view.reply.tokens,
            failure=FailureReason(node_id=node, phase=SessionPhase.DECODE if view.reply.tokens
                                  else SessionPhase.PREFILL, kind="unreachable", message=why)))

    # ---- retention ------------------------------------------------------------------------------------------

    def start_sweeping(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="responses-sweep")

    async def _sweep(self) -> None:
        every = max(1.0, min(60.0, self.settings.responses_retention_s / 2))
        while True:
            await asyncio.sleep(every)
            try:
                deleted = await self.store.sweep()
            except Exception as exc:  # noqa: BLE001 - NATS away: the next sweep tries again
                log.debug("responses sweep failed: %s", exc)
                continue
            if deleted:
                log.info("deleted %d background responses past their retention window", deleted)
