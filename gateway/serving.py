"""OpenAI chat and text completions on top of Route Sessions (protocol models live in schemas.openai).

Streaming follows the official client's tolerances: the first chunk already carries the route under the
``swarmroute`` key, before any token; choice-less telemetry chunks only when ``stream_options.include_telemetry``;
usage on a last choice-less chunk with ``stream_options.include_usage``; llama.cpp-style ``timings`` on the last
chunk, and on every token's with ``timings_per_token`` (``gateway.timings``); a failure mid-stream is an error chunk
followed by ``[DONE]``. Choices (n > 1), logprobs and tool calls are assembled per choice by ``gateway.replies``;
the Responses API is ``gateway.response_stream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from bus.http_edge import ClientGone
from gateway import sse
from gateway.constraints import FormatKind, chat_tools, constraint_for, response_format_of
from gateway.constraints import chat_logprobs as logprobs_asked
from gateway.live_session import Event, LiveSession
from gateway.messages import head_messages
from gateway.metrics import GatewayMetrics, RequestClock
from gateway.reasoning import splits
from gateway.replies import Replies
from gateway.session_manager import SessionManager
from gateway.session_opener import Constrain, GenerationRequest
from gateway.timings import TimingsClock, timings
from schemas.errors import BadRequestError, RouteFailedError, SwarmrouteError
from schemas.openai import (
    TELEMETRY_KEY,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    PromptTokensDetails,
    Usage,
    _GenerationRequest,
    unsupported_param,
)
from schemas.reasoning import ReasoningFormat
from schemas.session import Prompt, SamplingParams, SessionEnd, SessionPhase, TokenEvent
from schemas.telemetry import GenerationTelemetry
from schemas.tools import ToolSet

log = logging.getLogger(__name__)


def refuse_unsupported(req: BaseModel) -> None:
    """A parameter swarmroute cannot honour is a 400 naming it, never silently ignored."""
    found = unsupported_param(req)
    if found is not None:
        name, why = found
        raise BadRequestError(f"{name!r}: {why}", param=name)


def _sampling(req: _GenerationRequest, logprobs: int | None) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                          seed=req.seed, repeat_penalty=req.repeat_penalty, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, logprobs=logprobs,
                          batch_invariant=req.batch_invariant)


def constrain_hook(kind: FormatKind, schema: dict[str, Any] | None, tools: ToolSet | None) -> Constrain | None:
    """The hook that builds the tail's constraint from the head's tool-call format; ``None`` for free text."""
    if kind == "text" and tools is None:
        return None
    return lambda tool_format: constraint_for(kind, schema, tools, tool_format)


class Collector(Protocol):
    """What a whole (non-streamed) reply is fed each token to."""

    def collect(self, event: TokenEvent) -> None: ...


def telemetry_extra(snap: GenerationTelemetry | None) -> dict[str, Any]:
    return {TELEMETRY_KEY: snap.model_dump(mode="json")} if snap is not None else {}


def timings_extra(session: LiveSession, completion_tokens: int) -> dict[str, Any]:
    """A reply's final llama.cpp-style ``timings`` (issue #26), from the route's last telemetry."""
    return {"timings": timings(session.n_prompt, completion_tokens, session.telemetry).model_dump(mode="json")}


class StreamState:
    """Shared event loop of both endpoints; ``make_chunk`` builds an endpoint-specific chunk."""

    def __init__(self, session: LiveSession, *, include_usage: bool, include_telemetry: bool,
                 timings_per_token: bool = False) -> None:
        self.session = session
        self.include_usage = include_usage
        self.include_telemetry = include_telemetry
        self.sent_seq = -1
        self.clock = TimingsClock() if timings_per_token else None
        """llama-server's ``timings_per_token``: each token's chunk carries the figures so far."""

    def running_timings(self) -> dict[str, Any]:
        if self.clock is None:
            return {}
        return {"timings": self.clock.running(self.session.n_prompt, self.session.telemetry).model_dump(mode="json")}

    def fresh_telemetry(self) -> GenerationTelemetry | None:
        snap = self.session.telemetry
        if snap is None or snap.seq <= self.sent_seq:
            return None
        self.sent_seq = snap.seq
        return snap


_MAX_COALESCED = 32
"""Most SSE events one write carries when the gateway catches up."""


class _ChunkTemplate:
    """A plain request's token chunk as SSE bytes with the text spliced into a body rendered once: token chunks
    differ only in their text, and building and dumping the pydantic chunk per token cost more than the rest of the
    relay."""

    _MARK = "\x00swarmroute-token-text\x00"

    def __init__(self, replies: Replies) -> None:
        # sse.data and json.dumps(text) escape a string the same way, so the splice equals a full render.
        chunk = replies.chunk([replies.plain_choice(self._MARK, None)])
        self._head, self._tail = sse.data(chunk).split(json.dumps(self._MARK).encode())

    def render(self, text: str) -> bytes:
        return self._head + json.dumps(text).encode() + self._tail


class OpenAIServing:
    """Serving logic for the OpenAI endpoints; the session manager (the engine) is injected."""

    def __init__(self, sessions: SessionManager, metrics: GatewayMetrics | None = None) -> None:
        self.sessions = sessions
        self._cleanups: set[asyncio.Task[None]] = set()
        self.metrics = metrics or GatewayMetrics()
        self.metrics.bind(live_sessions=lambda: len(sessions.live))
        self._clocks: dict[str, RequestClock] = {}

    def clock(self, session: LiveSession) -> RequestClock:
        clock = self._clocks.get(session.id)
        if clock is None:
            clock = self._clocks[session.id] = self.metrics.clock(session.created, session.setup)
        return clock

    # ---- session helpers ---------------------------------------------------------------------------------------

    def close_later(self, session: LiveSession, *, cancelled: bool) -> None:
        """Cleanup must survive the cancellation of the request task that triggers it. A session cancelled here
        (its request ended first: the client went away) is logged once, at info: no error."""
        if cancelled:
            log.info("session %s cancelled: its request ended before the session did (the client went away)",
                     session.id)
        self.clock(session).finish(None if cancelled else session.end, session.telemetry, session.n_prompt)
        self._clocks.pop(session.id, None)
        task = asyncio.get_running_loop().create_task(session.close(cancelled=cancelled))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def collect(self, session: LiveSession, request: Request, replies: Collector) -> SessionEnd:
        """A whole reply; ``ClientGone`` when the client leaves first (the session is cancelled: no error)."""
        left = False
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            async for event in session.events():
                if watcher.done():
                    left = True
                    break
                if isinstance(event, TokenEvent):
                    self.clock(session).token()
                    replies.collect(event)
        finally:
            watcher.cancel()
            self.close_later(session, cancelled=session.end is None)
        if left:
            raise ClientGone(f"the client went away before session {session.id} ended")
        if session.end is None:
            raise SwarmrouteError(f"session {session.id}: its events ended without a SessionEnd")
        return session.end

    @staticmethod
    def raise_if_failed(end: SessionEnd) -> None:
        if end.phase is SessionPhase.FAILED:
            reason = end.failure
            message = reason.describe() if reason else "the route failed"
            raise RouteFailedError(f"route session {end.session_id}: {message}",
                                   code=reason.kind if reason else None,
                                   details={"failure": reason.model_dump(mode="json")} if reason else None)

    def _usage(self, session: LiveSession, end: SessionEnd | None) -> Usage:
        completion = end.completion_tokens if end and end.completion_tokens else session.tokens_seen
        return Usage(prompt_tokens=session.n_prompt, completion_tokens=completion,
                     total_tokens=session.n_prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=session.n_cached))

    async def _stream(self, session: LiveSession, state: StreamState, replies: Replies) -> AsyncIterator[bytes]:
        """Events that are already waiting when one is rendered go out in the same write: a gateway that fell behind
        (a busy machine, many streams) catches up in one send instead of one per token. Each token is still its
        own SSE event."""
        done = False
        token_chunk = _ChunkTemplate(replies) if replies.plain and state.clock is None else None
        try:
            yield sse.data({**replies.opening(), **telemetry_extra(state.fresh_telemetry())})
            out: list[bytes] = []
            async for event in session.events():
                self._render(event, session, state, replies, token_chunk, out)
                if out and (not session.backlog or len(out) >= _MAX_COALESCED):
                    yield b"".join(out)
                    out.clear()
            out.append(sse.DONE)
            yield b"".join(out)
            done = True
        finally:
            self.close_later(session, cancelled=not done and session.end is None)

    def _render(self, event: Event, session: LiveSession, state: StreamState, replies: Replies,
                token_chunk: _ChunkTemplate | None, out: list[bytes]) -> None:
        if event is None:
            out.append(sse.KEEPALIVE)
        elif isinstance(event, GenerationTelemetry):
            if state.include_telemetry:
                out.append(sse.data({**replies.chunk([]), **telemetry_extra(state.fresh_telemetry())}))
        elif isinstance(event, TokenEvent):
            self.clock(session).token()
            if state.clock is not None:
                state.clock.token()
            if token_chunk is not None:  # plain: nothing per token but the text
                if event.text:
                    snap = state.fresh_telemetry()
                    out.append(token_chunk.render(event.text) if snap is None
                               else sse.data({**replies.chunk([replies.plain_choice(event.text, None)]),
                                              **telemetry_extra(snap)}))
                return
            body = replies.token(event)
            if body is not None:
                out.append(sse.data({**replies.chunk([body]), **telemetry_extra(state.fresh_telemetry()),
                                     **state.running_timings()}))
        elif event.phase is SessionPhase.COMPLETE:
            *firsts, last = replies.closing(event)
            usage = self._usage(session, event)
            final = timings_extra(session, usage.completion_tokens)  # on the stream's last chunk, as llama-server
            out.extend(sse.data(replies.chunk([body])) for body in firsts)
            out.append(sse.data({**replies.chunk([last]), **telemetry_extra(session.telemetry),
                                 **({} if state.include_usage else final)}))
            if state.include_usage:
                out.append(sse.data({**replies.chunk([]), "usage": usage.model_dump(), **final}))
        else:
            out.append(sse.data({**failure_body(event), **telemetry_extra(session.telemetry)}))

    # ---- endpoints ---------------------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        refuse_unsupported(req)
        tools = chat_tools(req)
        kind, schema = response_format_of(req.response_format)
        session = await self.sessions.start(GenerationRequest(
            model=req.model, prompt=Prompt(messages=head_messages(req.messages), tools=tools), prompt_tokens=None,
            max_tokens=req.max_completion_tokens or req.max_tokens, sampling=_sampling(req, logprobs_asked(req)),
            stop=req.stop_list(), ignore_eos=req.ignore_eos, n=req.n, constrain=constrain_hook(kind, schema, tools)))
        fmt = self.reasoning_format(req.reasoning_format)
        replies = Replies("chat", n=req.n, logprobs=req.logprobs, tool_format=session.tool_format if tools else None,
                          cid=f"chatcmpl-{session.id}", model=req.model,
                          reasoning=session.reasoning if splits(fmt, session.reasoning, streamed=req.stream) else None,
                          inline_reasoning=fmt == "deepseek-legacy")
        if req.stream:
            return self._streaming(session, req, replies)
        end = await self.collect(session, request, replies)
        self.raise_if_failed(end)
        usage = self._usage(session, end)
        body = ChatCompletion(id=replies.cid, model=req.model, usage=usage, choices=replies.chat_choices(end))
        return JSONResponse({**body.model_dump(mode="json"), **telemetry_extra(session.telemetry),
                             **timings_extra(session, usage.completion_tokens)},
                            headers={"x-swarmroute-session": session.id})

    def reasoning_format(self, asked: ReasoningFormat | None) -> ReasoningFormat:
        """The request's ``reasoning_format``, else the server's (``Settings.reasoning_format``)."""
        return asked or self.sessions.settings.reasoning_format

    async def completion(self, req: CompletionRequest, request: Request) -> Response:
        refuse_unsupported(req)
        is_tokens = isinstance(req.prompt, list)
        if is_tokens and req.echo:
            raise BadRequestError("echo is supported for text prompts only", param="echo")
        if is_tokens and not req.prompt:
            raise BadRequestError("prompt must not be empty", param="prompt")
        kind, schema = response_format_of(req.response_format)
        session = await self.sessions.start(GenerationRequest(
            model=req.model, prompt=None if is_tokens else Prompt(text=str(req.prompt)),
            prompt_tokens=list(req.prompt) if is_tokens else None,  # type: ignore[arg-type]
            max_tokens=req.max_tokens, sampling=_sampling(req, req.logprobs), stop=req.stop_list(),
            ignore_eos=req.ignore_eos, n=req.n, constrain=constrain_hook(kind, schema, None)))
        replies = Replies("completion", n=req.n, logprobs=req.logprobs is not None, tool_format=None,
                          cid=f"cmpl-{session.id}", model=req.model, prefix=str(req.prompt) if req.echo else "")
        if req.stream:
            return self._streaming(session, req, replies)
        end = await self.collect(session, request, replies)
        self.raise_if_failed(end)
        usage = self._usage(session, end)
        body = Completion(id=replies.cid, model=req.model, usage=usage, choices=replies.completion_choices(end))
        return JSONResponse({**body.model_dump(mode="json"), **telemetry_extra(session.telemetry),
                             **timings_extra(session, usage.completion_tokens)},
                            headers={"x-swarmroute-session": session.id})

    def _streaming(self, session: LiveSession, req: _GenerationRequest, replies: Replies) -> StreamingResponse:
        opts = req.stream_options
        state = StreamState(session, include_usage=bool(opts and opts.include_usage),
                            include_telemetry=bool(opts and opts.include_telemetry),
                            timings_per_token=req.timings_per_token)
        return StreamingResponse(self._stream(session, state, replies), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-swarmroute-session": session.id})

    async def aclose(self) -> None:
        if self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)


def failure_body(end: SessionEnd) -> dict[str, Any]:
    """A stream's error chunk for a session that did not complete."""
    failure = end.failure
    message = failure.describe() if failure else f"session ended: {end.phase.value}"
    return {"error": {"message": message, "type": "route_failed",
                      "code": failure.kind if failure else "route_failed", "param": None,
                      "failure": failure.model_dump(mode="json") if failure else None}}


async def _wait_disconnect(request: Request) -> None:
    with contextlib.suppress(Exception):
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
