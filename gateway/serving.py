"""OpenAI chat and text completions on top of Route Sessions (protocol models live in schemas.openai).

Streaming follows the official client's tolerances: the first chunk already carries the route under the
``swarmroute`` key, before any token; choice-less telemetry chunks only when ``stream_options.include_telemetry``;
usage on a last choice-less chunk with ``stream_options.include_usage``; a failure mid-stream is an error chunk
followed by ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway import sse
from gateway.live_session import Event, GenerationRequest, LiveSession, SessionManager
from gateway.metrics import GatewayMetrics, RequestClock
from schemas.errors import BadRequestError, RouteFailedError
from schemas.openai import (
    TELEMETRY_KEY,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionRequest,
    Usage,
    _GenerationRequest,
)
from schemas.session import Prompt, SamplingParams, SessionEnd, SessionPhase, TokenEvent
from schemas.telemetry import GenerationTelemetry

log = logging.getLogger(__name__)

_UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "logit_bias")


def _reject_unsupported(req: _GenerationRequest) -> None:
    if req.n != 1:
        raise BadRequestError("only n=1 is supported", param="n")
    extra = req.model_extra or {}
    for name in _UNSUPPORTED:
        if extra.get(name):
            raise BadRequestError(f"{name!r} is not supported by this server", param=name)
    if extra.get("logprobs") or extra.get("top_logprobs"):
        raise BadRequestError("logprobs are not supported by this server", param="logprobs")
    fmt = extra.get("response_format")
    if fmt and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise BadRequestError("only response_format {'type': 'text'} is supported", param="response_format")


def _sampling(req: _GenerationRequest) -> SamplingParams:
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                          seed=req.seed, repeat_penalty=req.repeat_penalty, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty)


def _telemetry(snap: GenerationTelemetry | None) -> dict[str, Any]:
    return {TELEMETRY_KEY: snap.model_dump(mode="json")} if snap is not None else {}


class _Stream:
    """Shared event loop of both endpoints; ``make_chunk`` builds an endpoint-specific chunk."""

    def __init__(self, session: LiveSession, *, include_usage: bool, include_telemetry: bool) -> None:
        self.session = session
        self.include_usage = include_usage
        self.include_telemetry = include_telemetry
        self.sent_seq = -1

    def fresh_telemetry(self) -> GenerationTelemetry | None:
        snap = self.session.telemetry
        if snap is None or snap.seq <= self.sent_seq:
            return None
        self.sent_seq = snap.seq
        return snap


_MAX_COALESCED = 32
"""Most SSE events one write carries when the gateway catches up."""


class _ChunkTemplate:
    """A token chunk's SSE bytes with the text spliced into a body rendered once: token chunks differ only in
    their text, and building and dumping the pydantic chunk per token cost more than the rest of the relay."""

    _MARK = "\x00swarmroute-token-text\x00"

    def __init__(self, make_chunk: Callable[[str | None, str | None, bool], dict[str, Any]]) -> None:
        # sse.data and json.dumps(text) escape a string the same way, so the splice equals a full render.
        self._head, self._tail = sse.data(make_chunk(self._MARK, None, False)).split(json.dumps(self._MARK).encode())

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

    def _clock(self, session: LiveSession) -> RequestClock:
        clock = self._clocks.get(session.id)
        if clock is None:
            clock = self._clocks[session.id] = self.metrics.clock(session.created)
        return clock

    # ---- session helpers ---------------------------------------------------------------------------------------

    def _close_later(self, session: LiveSession, *, cancelled: bool) -> None:
        """Cleanup must survive the cancellation of the request task that triggers it."""
        self._clock(session).finish(None if cancelled else session.end, session.telemetry, len(session.prompt_tokens))
        self._clocks.pop(session.id, None)
        task = asyncio.get_running_loop().create_task(session.close(cancelled=cancelled))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _collect(self, session: LiveSession, request: Request) -> tuple[str, SessionEnd]:
        pieces: list[str] = []
        cancelled = True
        watcher = asyncio.create_task(_wait_disconnect(request))
        try:
            async for event in session.events():
                if watcher.done():
                    break
                if isinstance(event, TokenEvent):
                    self._clock(session).token()
                    pieces.append(event.text)
            cancelled = session.end is None
        finally:
            watcher.cancel()
            self._close_later(session, cancelled=cancelled)
        assert session.end is not None
        return "".join(pieces), session.end

    @staticmethod
    def _raise_if_failed(end: SessionEnd) -> None:
        if end.phase is SessionPhase.FAILED:
            reason = end.failure
            message = reason.describe() if reason else "the route failed"
            raise RouteFailedError(f"route session {end.session_id}: {message}",
                                   code=reason.kind if reason else None,
                                   details={"failure": reason.model_dump(mode="json")} if reason else None)

    def _usage(self, session: LiveSession, end: SessionEnd | None) -> Usage:
        completion = end.completion_tokens if end and end.completion_tokens else session.tokens_seen
        return Usage(prompt_tokens=len(session.prompt_tokens), completion_tokens=completion,
                     total_tokens=len(session.prompt_tokens) + completion)

    async def _stream(self, session: LiveSession, state: _Stream,
                      make_chunk: Callable[[str | None, str | None, bool], dict[str, Any]]) -> AsyncIterator[bytes]:
        """make_chunk(text, finish_reason, first) -> chunk dict without telemetry.

        Events that are already waiting when one is rendered go out in the same write: a gateway that fell behind
        (a busy machine, many streams) catches up in one send instead of one per token. Each token is still its
        own SSE event."""
        done = False
        token_chunk = _ChunkTemplate(make_chunk)
        try:
            yield sse.data({**make_chunk(None, None, True), **_telemetry(state.fresh_telemetry())})
            out: list[bytes] = []
            async for event in session.events():
                self._render(event, session, state, make_chunk, token_chunk, out)
                if out and (not session.backlog or len(out) >= _MAX_COALESCED):
                    yield b"".join(out)
                    out.clear()
            out.append(sse.DONE)
            yield b"".join(out)
            done = True
        finally:
            self._close_later(session, cancelled=not done and session.end is None)

    def _render(self, event: Event, session: LiveSession, state: _Stream,
                make_chunk: Callable[[str | None, str | None, bool], dict[str, Any]], token_chunk: _ChunkTemplate,
                out: list[bytes]) -> None:
        if event is None:
            out.append(sse.KEEPALIVE)
        elif isinstance(event, GenerationTelemetry):
            if state.include_telemetry:
                out.append(sse.data({**make_chunk(None, None, False), "choices": [],
                                     **_telemetry(state.fresh_telemetry())}))
        elif isinstance(event, TokenEvent):
            self._clock(session).token()
            if event.text:
                snap = state.fresh_telemetry()
                out.append(token_chunk.render(event.text) if snap is None
                           else sse.data({**make_chunk(event.text, None, False), **_telemetry(snap)}))
        elif event.phase is SessionPhase.COMPLETE:
            out.append(sse.data({**make_chunk(None, event.finish_reason or "stop", False),
                                 **_telemetry(session.telemetry)}))
            if state.include_usage:
                out.append(sse.data({**make_chunk(None, None, False), "choices": [],
                                     "usage": self._usage(session, event).model_dump()}))
        else:
            failure = event.failure
            message = failure.describe() if failure else f"session ended: {event.phase.value}"
            body: dict[str, Any] = {"error": {"message": message, "type": "route_failed",
                                              "code": failure.kind if failure else "route_failed",
                                              "param": None,
                                              "failure": failure.model_dump(mode="json") if failure else None}}
            out.append(sse.data({**body, **_telemetry(session.telemetry)}))

    # ---- endpoints ---------------------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        _reject_unsupported(req)
        try:
            messages: list[dict[str, object]] = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as exc:
            raise BadRequestError(str(exc), param="messages") from None
        session = await self.sessions.start(GenerationRequest(
            model=req.model, prompt=Prompt(messages=messages), prompt_tokens=None,
            max_tokens=req.max_completion_tokens or req.max_tokens, sampling=_sampling(req), stop=req.stop_list(),
            ignore_eos=req.ignore_eos))
        cid = f"chatcmpl-{session.id}"
        if req.stream:
            opts = req.stream_options
            state = _Stream(session, include_usage=bool(opts and opts.include_usage),
                            include_telemetry=bool(opts and opts.include_telemetry))

            def chunk(text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
                delta = ChatDelta(role="assistant", content="") if first else ChatDelta(content=text)
                return ChatCompletionChunk(id=cid, model=req.model, choices=[
                    ChatChunkChoice(delta=delta, finish_reason=finish)]).model_dump(mode="json", exclude_none=True)

            return StreamingResponse(self._stream(session, state, chunk), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-swarmroute-session": session.id})
        text, end = await self._collect(session, request)
        self._raise_if_failed(end)
        body = ChatCompletion(id=cid, model=req.model, usage=self._usage(session, end), choices=[
            ChatChoice(message=ChatMessageOut(content=text), finish_reason=end.finish_reason)])
        return JSONResponse({**body.model_dump(mode="json"), **_telemetry(session.telemetry)},
                            headers={"x-swarmroute-session": session.id})

    async def completion(self, req: CompletionRequest, request: Request) -> Response:
        _reject_unsupported(req)
        is_tokens = isinstance(req.prompt, list)
        if is_tokens and req.echo:
            raise BadRequestError("echo is supported for text prompts only", param="echo")
        if is_tokens and not req.prompt:
            raise BadRequestError("prompt must not be empty", param="prompt")
        session = await self.sessions.start(GenerationRequest(
            model=req.model, prompt=None if is_tokens else Prompt(text=str(req.prompt)),
            prompt_tokens=list(req.prompt) if is_tokens else None,  # type: ignore[arg-type]
            max_tokens=req.max_tokens, sampling=_sampling(req), stop=req.stop_list(), ignore_eos=req.ignore_eos))
        cid = f"cmpl-{session.id}"
        prefix = str(req.prompt) if req.echo else ""
        if req.stream:
            opts = req.stream_options
            state = _Stream(session, include_usage=bool(opts and opts.include_usage),
                            include_telemetry=bool(opts and opts.include_telemetry))

            def chunk(text: str | None, finish: str | None, first: bool) -> dict[str, Any]:
                content = prefix if first else (text or "")
                return Completion(id=cid, model=req.model, object="text_completion", choices=[
                    CompletionChoice(text=content, finish_reason=finish)]).model_dump(mode="json", exclude_none=True)

            return StreamingResponse(self._stream(session, state, chunk), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-swarmroute-session": session.id})
        text, end = await self._collect(session, request)
        self._raise_if_failed(end)
        body = Completion(id=cid, model=req.model, usage=self._usage(session, end), choices=[
            CompletionChoice(text=prefix + text, finish_reason=end.finish_reason)])
        return JSONResponse({**body.model_dump(mode="json"), **_telemetry(session.telemetry)},
                            headers={"x-swarmroute-session": session.id})

    async def aclose(self) -> None:
        if self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)


async def _wait_disconnect(request: Request) -> None:
    with contextlib.suppress(Exception):
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)
