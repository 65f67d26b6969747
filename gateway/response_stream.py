"""``POST /v1/responses``: the Responses API (text and function calling) on a Route Session.

The request becomes the head's chat turns, tools and output constraint (``gateway.responses``); each token's text
goes through the tool-call parser (when there are tools) into a ``ResponseBuilder``, whose events are sent as the
SDK expects them (``event:`` and ``data:`` lines). Every event carries the latest not-yet-sent telemetry snapshot
under the ``swarmroute`` key, as chat chunks do; a non-streamed reply is the builder's response with the last one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway import sse
from gateway.live_session import LiveSession
from gateway.responses import ResponseBuilder, chat_messages, request_logprobs, request_tools, sse_event, text_format
from gateway.serving import OpenAIServing, StreamState, constrain_hook, refuse_unsupported, telemetry_extra
from gateway.session_opener import GenerationRequest
from gateway.tools import ContentDelta, ReplyDelta, ToolCallParser
from schemas.errors import BadRequestError
from schemas.openai_responses import ResponseEvent, ResponsesRequest
from schemas.session import Prompt, SamplingParams, SessionEnd, SessionPhase, TokenEvent


class _Reply:
    """One response as its tokens arrive: text through the parser (with tools) into the builder."""

    def __init__(self, req: ResponsesRequest, session: LiveSession, *, tools: bool) -> None:
        self.session = session
        self.builder = ResponseBuilder(req, response_id=f"resp_{session.id}")
        fmt = session.tool_format
        self.parser = ToolCallParser(fmt) if tools and fmt is not None else None

    def token(self, event: TokenEvent) -> list[ResponseEvent]:
        deltas: list[ReplyDelta]
        if self.parser is not None:
            deltas = self.parser.feed(event.text) if event.text else []
        else:
            deltas = [ContentDelta(event.text)] if event.text else []
        return self.builder.feed(deltas, [event.logprobs] if event.logprobs is not None else [])

    def collect(self, event: TokenEvent) -> None:
        """A whole reply: the builder accumulates; its events are not sent."""
        self.token(event)

    def end(self, end: SessionEnd) -> list[ResponseEvent]:
        if end.phase is not SessionPhase.COMPLETE:
            failure = end.failure
            return self.builder.fail(failure.kind if failure else end.phase.value,
                                     failure.describe() if failure else f"session ended: {end.phase.value}")
        events = self.builder.feed(self.parser.finish()[0]) if self.parser is not None else []
        completion = end.completion_tokens or self.session.tokens_seen
        return events + self.builder.finish(end.finish_reason, input_tokens=self.session.n_prompt,
                                            output_tokens=completion)


class ResponsesServing:
    """The endpoint; shares the chat endpoints' session handling (``OpenAIServing``)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def respond(self, req: ResponsesRequest, request: Request) -> Response:
        refuse_unsupported(req)
        found = req.unsupported_param()
        if found is not None:
            raise BadRequestError(f"{found[0]!r}: {found[1]}", param=found[0])
        tools = request_tools(req)
        kind, schema = text_format(req)
        sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                  top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
                                  logprobs=request_logprobs(req))
        session = await self.serving.sessions.start(GenerationRequest(
            model=req.model, prompt=Prompt(messages=chat_messages(req), tools=tools), prompt_tokens=None,
            max_tokens=req.max_output_tokens, sampling=sampling, stop=[],
            constrain=constrain_hook(kind, schema, tools)))
        reply = _Reply(req, session, tools=tools is not None)
        if req.stream:
            state = StreamState(session, include_usage=False, include_telemetry=False)
            return StreamingResponse(self._stream(session, state, reply), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-swarmroute-session": session.id})
        end = await self.serving.collect(session, request, reply)
        reply.end(end)
        self.serving.raise_if_failed(end)
        return JSONResponse({**reply.builder.response.model_dump(mode="json", by_alias=True),
                             **telemetry_extra(session.telemetry)}, headers={"x-swarmroute-session": session.id})

    async def _stream(self, session: LiveSession, state: StreamState, reply: _Reply) -> AsyncIterator[bytes]:
        """Events already waiting go out in one write, as in chat streams; each is still its own SSE event."""
        done = False
        clock = self.serving.clock(session)
        try:
            yield b"".join(self._send(reply.builder.start(), state))
            out: list[bytes] = []
            async for event in session.events():
                if event is None:
                    out.append(sse.KEEPALIVE)
                elif isinstance(event, TokenEvent):
                    clock.token()
                    out += self._send(reply.token(event), state)
                elif isinstance(event, SessionEnd):
                    *firsts, last = reply.end(event)
                    out += self._send(firsts, state)
                    out.append(sse_event(last, telemetry_extra(session.telemetry)))  # the terminal snapshot
                # telemetry rides the next event
                if out and (not session.backlog or len(out) >= 32):
                    yield b"".join(out)
                    out.clear()
            if out:
                yield b"".join(out)
            done = True
        finally:
            self.serving.close_later(session, cancelled=not done and session.end is None)

    @staticmethod
    def _send(events: list[ResponseEvent], state: StreamState) -> list[bytes]:
        return [sse_event(event, telemetry_extra(state.fresh_telemetry())) for event in events]
