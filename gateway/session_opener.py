"""Routing a generation request and opening its session: the tracker's route, then one ``SessionOpen`` to the head.

The head opens every later hop itself while it starts prefilling (issue #20, ``actors/node/route_open.py``); it
tokenizes the prompt too, unless the prompt has tools (their constraint needs the head's tool format first: then the
gateway asks the head to tokenize before it opens). A hop found dead while opening is routed around; every other
refusal reaches the client with its own status (``gateway.route_nodes.passthrough``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from bus import capability
from bus.tracker_client import TrackerClient
from gateway import fanout
from gateway.constraints import check_choices
from gateway.live_session import LiveSession
from gateway.route_nodes import RouteNodes
from schemas.constraint import OutputConstraint
from schemas.errors import CapacityError, HopError, RouteFailedError
from schemas.prefix import request_keys
from schemas.route import Route
from schemas.session import (
    CONTEXT_CAP,
    HopGrant,
    Prompt,
    SamplingParams,
    SessionOpen,
    Speculation,
    session_budget,
)
from schemas.settings import Settings
from schemas.tools import ToolCallFormat

log = logging.getLogger(__name__)

MAX_REROUTES = 3
"""Dead nodes a session may be routed around while it opens."""

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
    session_id: str | None = None  # chosen by the caller (a background response's stream exists first), else new


class SessionOpener:
    """Injected with the tracker client, the route's nodes and the settings; holds no state of its own."""

    def __init__(self, tracker: TrackerClient, nodes: RouteNodes, settings: Settings) -> None:
        self._tracker = tracker
        self._nodes = nodes
        self._settings = settings

    async def open(self, session: LiveSession, request: GenerationRequest) -> None:
        """Route, then open on every hop. A hop found dead while opening (nothing listens: the registry still shows
        it until its entry expires) is excluded and the session routed again, so a client gets a working route or
        the tracker's 503 naming the layers nobody serves, not a 502 for a node that is already gone."""
        exclude: list[str] = []
        keys = request_keys(request.prompt.messages, request.prompt.text) if request.prompt is not None else []
        while True:
            with session.timed("route"):
                route = await self._route(request.model, session.id, exclude, keys)
            session.routed(route)
            try:
                await self._open(session, route, request)
                return
            except RouteFailedError as exc:
                dead = exc.__cause__
                if not (isinstance(dead, HopError) and dead.kind == "unreachable") or len(exclude) >= MAX_REROUTES:
                    raise
                log.info("session %s: node %s is gone; routing again without it", session.id, dead.node)
                exclude.append(dead.node)
                await self._nodes.free(route, session.id)

    async def _route(self, model: str, session_id: str, exclude: list[str] | None = None,
                     prefix_keys: list[str] | None = None) -> Route:
        return await self._route_with(model, session_id, exclude, standby=self._repairs,
                                      prefix_keys=prefix_keys or [])

    @property
    def _repairs(self) -> bool:
        """Sessions repair (and so every hop needs a standby for its snapshots) unless switched off."""
        return self._settings.repair

    async def _route_with(self, model: str, session_id: str, exclude: list[str] | None, *, standby: bool,
                          prefix_keys: list[str]) -> Route:
        """Ask for a route; while every route is full, ask again for up to ``route_retry_s`` before the 429.

        A slot freed a moment ago reaches the tracker with the node's next heartbeat, after the client that freed
        it may already be back: without the retry, a swarm within its capacity would refuse that client.
        """
        deadline = time.monotonic() + self._settings.route_retry_s
        wait = 0.02
        while True:
            try:
                return await self._tracker.route(model, session_id, exclude, standby=standby,
                                                 prefix_keys=prefix_keys)
            except CapacityError:
                if time.monotonic() + wait > deadline:
                    raise
                await asyncio.sleep(wait)
                wait = min(wait * 2, 0.2)

    async def _open(self, session: LiveSession, route: Route, request: GenerationRequest) -> None:
        """Open the session on its head, which opens every hop after it while it starts prefilling (issue #20).
        The head tokenizes a prompt itself (no round trip of its own) unless it has tools: their constraint needs
        the head's tool format first."""
        head = route.head
        tokens = request.prompt_tokens
        tool_format: ToolCallFormat | None = None
        if tokens is None and request.prompt is not None and request.prompt.tools is not None:
            with session.timed("tokenize"):
                reply = await self._nodes.tokenize(route, request.prompt)
            tokens, tool_format = reply.tokens, reply.tool_format
        route_n = fanout.route_choices(request.n, request.sampling)
        check_choices(route_n, route.max_sessions)  # the sequences every hop will hold, not the request's n
        sampling = request.sampling
        if request.constrain is not None:
            sampling = sampling.model_copy(update={"constraint": request.constrain(tool_format)})
        default = self._settings.default_max_tokens
        n_ctx = min(route.context_length, CONTEXT_CAP)
        # Without the tokens (the head tokenizes), the head checks the context as this would, with the same words.
        max_tokens = session_budget(len(tokens), request.max_tokens, default=default, context=n_ctx) \
            if tokens is not None else request.max_tokens or default
        speculate = self._speculation(sampling, route_n, len(route.hops))
        # A speculative session's KV goes back and forth between windows: it does not snapshot (issue #20); its
        # hops journal every accepted position instead, and a repair replays them from 0 (issue #31).
        repair = self._repairs and route_n == 1
        # Each hop gets only its own grants (for the session, and for its standby): the head passes each later
        # hop's on to it alone.
        downstream = [HopGrant(capability=h.capability, standby=h.standby.capability if h.standby else "")
                      for h in route.hops[1:]]
        request_open = SessionOpen(
            session_id=session.id, route=capability.strip(route, keep_standby=0), hop_index=0,
            prompt_tokens=tokens or [], prompt=request.prompt if tokens is None else None,
            fit_max_tokens=tokens is None and request.max_tokens is None, max_tokens=max_tokens, sampling=sampling,
            stop=request.stop, ignore_eos=request.ignore_eos, prefill_chunk=self._settings.prefill_chunk,
            capability=head.capability, n=route_n, repair=repair,
            snapshot_every=self._settings.snapshot_every if repair and speculate is None else 0, speculate=speculate,
            downstream=downstream)
        session.request = request_open  # what a replacement for a lost head starts from (issue #31)
        with session.timed("open"):
            opened = await self._nodes.open(route, request_open)
        session.opened(choices=route_n, fan_out=request.n // route_n, prompt_tokens=opened.prompt_tokens,
                       max_tokens=opened.max_tokens or max_tokens, tool_format=tool_format,
                       reasoning=opened.reasoning, reused=opened.reused)

    def _speculation(self, sampling: SamplingParams, n: int, hops: int) -> Speculation | None:
        """Verify windows for a session whose next token is a function of the logits alone (one choice, no grammar,
        no penalties, no logprobs) on a route of several hops, when the swarm is set to speculate (issue #20)."""
        s = self._settings
        plain = (sampling.constraint is None and sampling.logprobs is None and sampling.repeat_penalty == 1.0
                 and sampling.presence_penalty == 0.0 and sampling.frequency_penalty == 0.0)
        if s.speculation == "off" or n != 1 or hops < 2 or not plain or s.speculative_max_k == 0:
            return None
        return Speculation(source=s.speculation, max_k=s.speculative_max_k, windows=s.speculative_windows)
