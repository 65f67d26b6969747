"""The session roles (``actors.node.HeadSession``, ``HopSession``) without processes: a real ``StepEngine`` over
the stub backend, and fakes of their collaborators only. ``Peers`` stands for every other node of the route (the
``NodeClient`` calls a session makes: frames, tokens, failure reports, closes, probes; each request is recorded as
it is written and answered at once unless the test holds it), ``Published`` for NATS.

``Rig`` opens a session on one node as ``actors.node.opener`` does (the backend session first, the role by hop
index), and frees its backend session when it closes. What a session computed is checked against ``reference``:
the stub backend is deterministic per layer, so a fresh backend of the same layers fed the same input computes the
same thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
from pydantic import BaseModel

from actors.backend import Hidden, StepInput
from actors.backends.stub import StubBackend, StubConfig
from actors.node.engine import StepEngine
from actors.node.head_session import HeadSession
from actors.node.hop_session import HopSession
from actors.node.runtime import ClientProbe, NodeRuntime
from actors.node.session import NodeSession
from bus import frame as frames
from bus.nodeclient import NodeClient
from bus.subjects import Subjects
from schemas.errors import HopError, SwarmrouteError
from schemas.frame import FrameHeader, FrameKind, SampledToken, WireDType
from schemas.node import LayerRange
from schemas.route import Hop, Route
from schemas.session import FailureReason, SamplingParams, SessionEnd, SessionOpen, TokenEvent
from schemas.settings import Settings
from tests.support.waiting import eventually

MODEL, N_LAYERS, SHAPE = "stub-model", 8, (64,)


def route(session_id: str, *ranges: tuple[int, int]) -> Route:
    """Hops ``a``, ``b``, ``c``... holding ``ranges`` of the stub model, in order."""
    hops = [Hop(node_id=chr(ord("a") + i), endpoint=f"http://{chr(ord('a') + i)}", layers=LayerRange(start=s, end=e))
            for i, (s, e) in enumerate(ranges)]
    return Route(session_id=session_id, model_id=MODEL, n_layers=N_LAYERS, hidden_shape=list(SHAPE),
                 context_length=4096, hops=hops)


def stub(start: int, end: int) -> StubBackend:
    return StubBackend(StubConfig(model=MODEL, n_layers=N_LAYERS, layer_start=start, layer_end=end))


class Peers:
    """The route's other nodes, as the session's ``NodeClient`` reaches them. A frame or token is recorded the
    moment it is written (``send_frame`` / ``send_token`` are called), as the real client writes it then; its
    answer comes at once, or when the test releases it (``hold``), or as the ``HopError`` the test queued
    (``refuse``)."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, FrameHeader, Hidden]] = []
        self.tokens: list[tuple[str, SampledToken]] = []
        self.reports: list[tuple[str, FailureReason]] = []
        self.closed: list[str] = []
        self.answered: list[str] = []
        """Node ids, in the order their requests' answers were read."""
        self.held: asyncio.Event | None = None
        self._refusals: list[HopError] = []
        self.unreachable_head = False
        """``report_failure`` to the head fails (the tail then says it on NATS)."""

    def hold(self) -> asyncio.Event:
        """Answers wait until the returned event is set."""
        self.held = asyncio.Event()
        return self.held

    def refuse(self, node: str, message: str = "connection reset", *,
               peer_error: SwarmrouteError | None = None) -> None:
        """The next request's answer is a ``HopError`` from ``node``: unreachable, or answering ``peer_error``."""
        self._refusals.append(HopError(node, "unreachable", message) if peer_error is None else
                              HopError(node, "http_error", message, peer_status=peer_error.status,
                                       peer_error=peer_error))

    async def _answer(self, node: str) -> None:
        if self.held is not None:
            await self.held.wait()
        if self._refusals:
            raise self._refusals.pop(0)
        self.answered.append(node)

    def send_frame(self, node: str, endpoint: str, session_id: str, frame: bytes, **_: Any) -> Any:
        header, hidden = frames.decode(frame)
        self.frames.append((node, header, hidden))
        return self._answer(node)

    def send_token(self, node: str, endpoint: str, session_id: str, token_frame: bytes, **_: Any) -> Any:
        self.tokens.append((node, frames.decode_token(token_frame)))
        return self._answer(node)

    async def report_failure(self, node: str, endpoint: str, session_id: str, reason: FailureReason,
                             **_: Any) -> None:
        if self.unreachable_head:
            raise HopError(node, "unreachable", f"node {node} unreachable")
        self.reports.append((node, reason))

    async def close_session(self, node: str, endpoint: str, session_id: str, **_: Any) -> bool:
        self.closed.append(node)
        return True

    async def session_state(self, node: str, endpoint: str, session_id: str, **_: Any) -> str:
        return "open"

    async def probe(self, node: str, endpoint: str, **_: Any) -> bool:
        return True


class Published:
    """What a session published on NATS, by subject, in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, BaseModel]] = []

    async def __call__(self, subject: str, message: BaseModel) -> None:
        self.messages.append((subject, message))

    def on(self, subject: str) -> list[BaseModel]:
        return [m for s, m in self.messages if s == subject]

    def ends(self, subject: str) -> list[SessionEnd]:
        return [m for m in self.on(subject) if isinstance(m, SessionEnd)]

    def token_events(self, subject: str) -> list[TokenEvent]:
        return [m for m in self.on(subject) if isinstance(m, TokenEvent)]


class Rig:
    """One node's runtime: ``backend`` on a running ``StepEngine``, ``peers`` for the other nodes, ``published``
    for NATS."""

    def __init__(self, backend: StubBackend, settings: Settings, *, client_present: ClientProbe | None = None) -> None:
        self.backend = backend
        self.engine = StepEngine(backend)
        self.peers = Peers()
        self.published = Published()
        self.subjects = Subjects(settings.namespace)
        self.rt = NodeRuntime(node_id="node", engine=self.engine, client=cast(NodeClient, self.peers),
                              publish=self.published, subjects=self.subjects, settings=settings)
        if client_present is not None:
            self.rt.client_present = client_present
        self.closed: list[NodeSession] = []

    async def open(self, rt_route: Route, hop_index: int, prompt: list[int], *, max_tokens: int = 8, n: int = 1,
                   prefill_chunk: int = 512, seed: int | None = None) -> NodeSession:
        """Open and start the session as ``actors.node.opener`` does; greedy unless ``seed`` is given."""
        request = SessionOpen(session_id=rt_route.session_id, route=rt_route, hop_index=hop_index,
                              prompt_tokens=prompt, max_tokens=max_tokens, n=n, prefill_chunk=prefill_chunk,
                              ignore_eos=True,
                              sampling=SamplingParams(temperature=0.0) if seed is None else
                              SamplingParams(temperature=1.0, seed=seed))
        await self.engine.call(lambda: self.backend.open_session(request.session_id, prompt_tokens=prompt,
                                                                 sampling=request.sampling))
        role = HeadSession if hop_index == 0 else HopSession
        session = role(self.rt, request, hidden_shape=SHAPE, on_closed=self._closed)
        session.start()
        return session

    async def _closed(self, session: NodeSession) -> None:
        for backend_id in session.choices.backend_ids():
            await self.engine.call(self.backend.close_session, backend_id)
        self.closed.append(session)  # once its KV is freed: a test waiting for it may check that

    async def until(self, condition: Callable[[], object], what: str, timeout: float = 10.0) -> None:
        await eventually(condition, timeout=timeout, interval=0.005, what=what)


@contextlib.asynccontextmanager
async def rig(backend: StubBackend, tmp_path: Path, **settings: Any) -> AsyncIterator[Rig]:
    """A started ``Rig``, its engine stopped at the end (``settings``: overrides of the test's ``Settings``, and
    ``client_present``)."""
    present = settings.pop("client_present", None)
    base: dict[str, Any] = dict(home=tmp_path, client_probe_s=0.0, telemetry_interval_s=0.01, token_timeout_s=5.0,
                                first_token_timeout_s=5.0, hop_timeout_s=5.0)
    r = Rig(backend, Settings(**{**base, **settings}), client_present=present)
    await r.engine.start()
    try:
        yield r
    finally:
        await r.engine.stop()


def new_session_id() -> str:
    return uuid.uuid4().hex


def reference(backend: StubBackend, session_id: str, items: list[StepInput]) -> list[Any]:
    """What ``backend`` (fresh, of the same layers) computes for ``items`` in order: the outputs' hidden states, or
    their tokens on a tail."""
    backend.open_session(session_id, prompt_tokens=[], sampling=SamplingParams(temperature=0.0))
    outs = [backend.step([item])[0] for item in items]
    return [o.hidden if o.hidden is not None else o.token for o in outs]


def hidden_rows(n: int, seed: int = 0) -> Hidden:
    """``n`` positions of made-up hidden state (what an upstream hop would send)."""
    return np.random.default_rng(seed).standard_normal((n, *SHAPE)).astype(np.float32)


def header(session_id: str, kind: FrameKind, start: int, n: int, *, sample: bool = False, step: int = 0,
           choice: int = 0, group: int = 0, shape: tuple[int, ...] = SHAPE, epoch: int = 0) -> FrameHeader:
    """What an upstream hop would send to this one."""
    return FrameHeader(session_id=frames.session_bytes(session_id), kind=kind, dtype=WireDType.F32,
                       start_position=start, n_positions=n, position_shape=shape, step=step, sample=sample,
                       choice=choice, group=group, epoch=epoch)
