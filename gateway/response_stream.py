"""``POST /v1/responses``: the Responses API (text and function calling) on a Route Session.

The request becomes the head's chat turns, tools and output constraint (``gateway.responses``); each token's text
goes through the tool-call parser (when there are tools) into a ``ResponseBuilder``, whose events are sent as the
SDK expects them (``event:`` and ``data:`` lines). Every event carries the latest not-yet-sent telemetry snapshot
under the ``swarmroute`` key, as chat chunks do; a non-streamed reply is the builder's response with the last one.
A background request (``background: true``) is ``gateway.background``'s: its events are read back from JetStream,
on any gateway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway import sse
from gateway.background import BackgroundResponses
from gateway.live_session import LiveSession
from gateway.reasoning import splits
from gateway.responses import ResponseReply, chat_messages, request_logprobs, request_tools, sse_event, text_format
from gateway.serving import OpenAIServing, StreamState, constrain_hook, refuse_unsupported, telemetry_extra
from gateway.session_opener import GenerationRequest
from schemas.errors import BadRequestError
from schemas.openai_responses import ResponseEvent, ResponsesRequest
from schemas.session import Prompt, SamplingParams, SessionEnd, TokenEvent


def _reply(req: ResponsesRequest, session: LiveSession, split: bool) -> ResponseReply:
    """``split``: the server's reasoning format asks for a think block apart (a ``reasoning`` item, issue #27)."""
    return ResponseReply(req, response_id=f"resp_{session.id}", prompt_tokens=session.n_prompt,
                         tool_format=session.tool_format, reasoning=session.reasoning if split else None)


class ResponsesServing:
    """The endpoint; shares the chat endpoints' session handling (``OpenAIServing``)."""

    def __init__(self, serving: OpenAIServing, background: BackgroundResponses | None = None) -> None:
        self.serving = serving
        self.background = background

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
        generation = GenerationRequest(
            model=req.model, prompt=Prompt(messages=chat_messages(req), tools=tools), prompt_tokens=None,
            max_tokens=req.max_output_tokens, sampling=sampling, stop=[],
            constrain=constrain_hook(kind, schema, tools))
        if req.background:
            if self.background is None:
                raise BadRequestError("'background': this gateway keeps no background responses", param="background")
            return await self.background.create(req, generation)
        session = await self.serving.sessions.start(generation)
        reply = _reply(req, session, splits(self.serving.reasoning_format(None), session.reasoning, streamed=False))
        if req.stream:
            state = StreamState(session, include_usage=False, include_telemetry=False)
            return StreamingResponse(self._stream(session, state, reply), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-swarmroute-session": session.id})
        end = await self.serving.collect(session, request, reply)
        reply.end(end)
        self.serving.raise_if_failed(end)
        return JSONResponse({**reply.builder.response.model_dump(mode="json", by_alias=True),
                             **telemetry_extra(session.telemetry)}, headers={"x-swarmroute-session": session.id})

    async def _stream(self, session: LiveSession, state: StreamState, reply: ResponseReply) -> AsyncIterator[bytes]:
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
                    events = reply.end(event)  # none when cancelled: the SDK has no event for it
                    out += self._send(events[:-1], state)
                    out += [sse_event(last, telemetry_extra(session.telemetry)) for last in events[-1:]]
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
