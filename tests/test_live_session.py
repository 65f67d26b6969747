"""gateway.live_session: one session as the gateway follows it, on a real nats-server, its links faked.

The head's messages are published on the session's real subjects; what the session asks of its route's nodes
(find the head lost or unresponsive, free the session) goes to a fake that records it and answers as the test says,
and what it publishes or reports closed is recorded. Opening is tests/test_session_opener.py's.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from bus import codec
from bus.server import EmbeddedNats
from bus.subjects import Subjects
from gateway.live_session import Event, LiveSession, SessionLinks
from schemas.node import LayerRange
from schemas.prefix import conversation_keys
from schemas.route import Hop, Route
from schemas.session import FailureReason, Prompt, RouteChanged, SessionEnd, SessionPhase, TokenEvent
from schemas.settings import Settings
from schemas.telemetry import GenerationTelemetry
from tests.support.swarm import make_settings

_namespaces = itertools.count()
PROMPT = Prompt(messages=[{"role": "user", "content": "Tell me about the fox."}])


def route(*nodes: str, grant: str = "grant-a") -> Route:
    """Hops over the 8 layers of a model, the head's with a session grant."""
    cuts = [i * 8 // len(nodes) for i in range(len(nodes) + 1)]
    hops = [Hop(node_id=n, endpoint=f"http://{n}", layers=LayerRange(start=cuts[i], end=cuts[i + 1]),
                capability=grant if i == 0 else "")
            for i, n in enumerate(nodes)]
    return Route(session_id="s", model_id="m", n_layers=8, hidden_shape=[4], context_length=64, hops=hops)


class Nodes:
    """The route's nodes as the session reaches them: ``lost`` and ``unresponsive`` are the answers the test sets;
    ``on_probe`` runs once, when the head is first probed (its last words crossing the probe); ``freed`` records
    every free."""

    def __init__(self) -> None:
        self.lost: tuple[str, str] | None = None
        self.unresponsive: str | None = None
        self.on_probe: Callable[[], Awaitable[None]] | None = None
        self.probes = 0
        self.freed: list[tuple[Route, str, bool, list[str]]] = []

    async def find_lost(self, route: Route, session_id: str) -> tuple[str, str] | None:
        self.probes += 1
        on_probe, self.on_probe = self.on_probe, None
        if on_probe is not None:
            await on_probe()
        return self.lost

    async def find_unresponsive(self, route: Route) -> str | None:
        return self.unresponsive

    async def free(self, route: Route, session_id: str, *, cancel: bool = False,
                   keys: list[str] | None = None) -> None:
        self.freed.append((route, session_id, cancel, list(keys or [])))


class Rig:
    """A session subscribed on a real NATS connection, and what it did to its links."""

    def __init__(self, nc: NATS, settings: Settings) -> None:
        self.nc, self.subjects = nc, Subjects(settings.namespace)
        self.nodes = Nodes()
        self.published: list[GenerationTelemetry] = []
        self.closed: list[tuple[str, GenerationTelemetry | None]] = []
        self.links = SessionLinks(settings=settings, nodes=self.nodes, publish=self._publish,
                                  closed=lambda sid, last: self.closed.append((sid, last)))

    async def _publish(self, snap: GenerationTelemetry) -> None:
        self.published.append(snap)

    async def session(self, route_: Route | None = None, *, choices: int = 1, fan_out: int = 1) -> LiveSession:
        """Subscribed, routed and opened as the opener leaves it."""
        session = LiveSession(self.links, uuid.uuid4().hex, PROMPT)
        await session.subscribe(self.nc, self.subjects)
        await self.nc.flush()
        session.routed(route_ or route("a", "b"))
        session.opened(choices=choices, fan_out=fan_out, prompt_tokens=7, max_tokens=16, tool_format=None)
        return session

    async def send(self, session: LiveSession, *messages: TokenEvent | SessionEnd | RouteChanged) -> None:
        for message in messages:
            await self.nc.publish(self.subjects.tokens(session.id), codec.encode(message))
        await self.nc.flush()

    async def telemetry(self, session: LiveSession, seq: int, phase: SessionPhase = SessionPhase.DECODE) -> None:
        snap = GenerationTelemetry(session_id=session.id, seq=seq, phase=phase, model="m")
        await self.nc.publish(self.subjects.telemetry(session.id), codec.encode(snap))
        await self.nc.flush()


def settings_for(server: EmbeddedNats, tmp_path: Path, **overrides: object) -> Settings:
    return make_settings(server.url, tmp_path / "home", namespace=f"ls{next(_namespaces)}", **overrides)


@pytest.fixture
async def nc(module_nats: EmbeddedNats) -> AsyncIterator[NATS]:
    client = await nats.connect(module_nats.url)
    yield client
    await client.drain()


@pytest.fixture
def rig(nc: NATS, module_nats: EmbeddedNats, tmp_path: Path) -> Rig:
    return Rig(nc, settings_for(module_nats, tmp_path))


def token(session: LiveSession, seq: int, text: str, index: int = 0) -> TokenEvent:
    return TokenEvent(session_id=session.id, seq=seq, token=seq, text=text, index=index)


def end(session: LiveSession, tokens: int, phase: SessionPhase = SessionPhase.COMPLETE) -> SessionEnd:
    return SessionEnd(session_id=session.id, phase=phase, finish_reason="stop", prompt_tokens=7,
                      completion_tokens=tokens)


async def drain(session: LiveSession) -> list[Event]:
    """Every event but the keep-alive ticks, up to and with the end."""
    return [e async for e in session.events() if e is not None]


async def test_events_arrive_in_order_and_the_end_frees_every_hop_with_what_they_keep(rig: Rig) -> None:
    session = await rig.session()
    await rig.telemetry(session, 1)
    await rig.send(session, token(session, 0, "The"), token(session, 1, " fox"), end(session, 2))
    events = await drain(session)
    assert [type(e) for e in events] == [GenerationTelemetry, TokenEvent, TokenEvent, SessionEnd]
    assert isinstance(events[-1], SessionEnd) and session.end is events[-1]
    assert events[-1].phase is SessionPhase.COMPLETE
    assert session.reply == ["The", " fox"] and session.tokens_seen == 2 and "first_token" in session.setup
    await session.close()
    await session.close()  # idempotent: freed once, reported closed once
    assert rig.nodes.freed == [(route("a", "b"), session.id, False,
                                conversation_keys(PROMPT.messages, PROMPT.text, "The fox"))]
    assert rig.closed == [(session.id, events[0])] and rig.published == []


async def test_a_token_lost_on_the_bus_fails_the_session_without_keeping_anything(rig: Rig) -> None:
    session = await rig.session()
    await rig.send(session, token(session, 0, "The"), token(session, 2, " fox"))
    *_, last = await drain(session)
    assert isinstance(last, SessionEnd) and last.phase is SessionPhase.FAILED and last.failure is not None
    assert last.failure.kind == "protocol" and last.failure.node_id == "a"
    assert "token 1 was lost on the bus (received token 2)" in last.failure.message
    await session.close()
    assert [keys for *_, keys in rig.nodes.freed] == [[]]


async def test_an_end_counting_tokens_that_never_arrived_fails_the_session(rig: Rig) -> None:
    session = await rig.session()
    await rig.send(session, token(session, 0, "The"), end(session, 2))
    *_, last = await drain(session)
    assert isinstance(last, SessionEnd) and last.phase is SessionPhase.FAILED and last.failure is not None
    assert "the head sent 2 tokens, 1 arrived" in last.failure.message
    await session.close()


async def test_older_telemetry_is_dropped(rig: Rig) -> None:
    session = await rig.session()
    await rig.telemetry(session, 2)
    await rig.telemetry(session, 1)
    await rig.send(session, end(session, 0))
    events = await drain(session)
    assert [e.seq for e in events if isinstance(e, GenerationTelemetry)] == [2]
    assert session.telemetry is not None and session.telemetry.seq == 2
    await session.close()


async def test_greedy_fan_out_gives_each_token_to_every_request_choice(rig: Rig) -> None:
    session = await rig.session(fan_out=3)
    await rig.send(session, token(session, 0, "The"), end(session, 1))
    events = await drain(session)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [(t.index, t.text) for t in tokens] == [(0, "The"), (1, "The"), (2, "The")]
    assert isinstance(events[-1], SessionEnd) and session.end is events[-1]
    assert session.end.completion_tokens == 3 and [c.index for c in session.end.choices] == [0, 1, 2]
    await session.close()


async def test_a_lost_head_fails_the_session_naming_it_and_the_gateway_publishes_the_end(
        nc: NATS, module_nats: EmbeddedNats, tmp_path: Path) -> None:
    rig = Rig(nc, settings_for(module_nats, tmp_path, liveness_probe_s=0.05))
    rig.nodes.lost = ("a", "nothing listens at http://a any more")
    session = await rig.session()
    *_, last = await drain(session)
    assert isinstance(last, SessionEnd) and last.phase is SessionPhase.FAILED and last.failure is not None
    assert (last.failure.node_id, last.failure.kind) == ("a", "unreachable")
    assert last.prompt_tokens == 7 and last.completion_tokens == 0
    [published] = rig.published
    assert published.session_id == session.id and published.phase is SessionPhase.FAILED
    assert published.failure == last.failure and published.route_health == "failed"
    await session.close()


async def test_the_heads_last_words_crossing_its_probe_still_end_the_session(
        nc: NATS, module_nats: EmbeddedNats, tmp_path: Path) -> None:
    """The head freed the session just after publishing its end: it reads as lost, but the end is on its way."""
    rig = Rig(nc, settings_for(module_nats, tmp_path, liveness_probe_s=0.05))
    session = await rig.session()
    rig.nodes.lost = ("a", "it answers but no longer holds the session")
    rig.nodes.on_probe = lambda: rig.send(session, token(session, 0, "The"), end(session, 1))
    events = await drain(session)
    assert isinstance(events[-1], SessionEnd) and events[-1].phase is SessionPhase.COMPLETE
    assert rig.nodes.probes >= 1 and rig.published == []
    await session.close()


async def test_a_silent_route_fails_after_its_timeout_naming_the_head_that_stopped_answering(
        nc: NATS, module_nats: EmbeddedNats, tmp_path: Path) -> None:
    rig = Rig(nc, settings_for(module_nats, tmp_path, liveness_probe_s=0.0, hop_timeout_s=0.05,
                               first_token_timeout_s=0.1))
    rig.nodes.unresponsive = "a"
    session = await rig.session()
    *_, last = await drain(session)
    assert isinstance(last, SessionEnd) and last.failure is not None and last.failure.kind == "timeout"
    # No snapshot of the head came yet: the session is still in its routing phase.
    assert last.failure.node_id == "a" and "node a stopped answering during routing" in last.failure.message
    assert [p.failure for p in rig.published] == [last.failure]
    await session.close()


async def test_a_silent_route_whose_head_answers_went_silent(nc: NATS, module_nats: EmbeddedNats,
                                                             tmp_path: Path) -> None:
    rig = Rig(nc, settings_for(module_nats, tmp_path, liveness_probe_s=0.0, hop_timeout_s=0.05,
                               first_token_timeout_s=0.1))
    session = await rig.session()
    *_, last = await drain(session)
    assert isinstance(last, SessionEnd) and last.failure is not None and last.failure.node_id is None
    assert last.failure.message.startswith("the route went silent during routing")
    await session.close()


async def test_a_client_gone_before_the_end_has_the_head_cancel_it(rig: Rig) -> None:
    session = await rig.session()
    await rig.send(session, token(session, 0, "The"))
    await session.close(cancelled=True)
    assert session.end is not None and session.end.phase is SessionPhase.CANCELLED
    assert session.end.completion_tokens == 0  # nobody read the token: it was not seen
    assert rig.nodes.freed == [(route("a", "b"), session.id, True, [])]
    assert [sid for sid, _ in rig.closed] == [session.id]


async def test_a_client_gone_after_the_end_cancels_nothing(rig: Rig) -> None:
    session = await rig.session()
    await rig.send(session, end(session, 0))
    await drain(session)
    await session.close(cancelled=True)
    assert session.end is not None and session.end.phase is SessionPhase.COMPLETE
    assert [cancel for _, _, cancel, _ in rig.nodes.freed] == [False]


async def test_abort_ends_the_stream_with_its_reason(rig: Rig) -> None:
    session = await rig.session()
    reason = FailureReason(phase=SessionPhase.PREFILL, kind="internal", message="the gateway is shutting down")
    session.abort(reason)
    [last] = await drain(session)
    assert isinstance(last, SessionEnd) and last.failure == reason and session.end is last
    session.abort(FailureReason(phase=SessionPhase.DECODE, kind="internal", message="again"))  # ended: no effect
    assert session.backlog == 0
    await session.close()


async def test_a_repaired_route_is_freed_on_its_new_hops_with_the_sessions_own_token(rig: Rig) -> None:
    session = await rig.session(route("a", "b"))
    repaired, older = route("a", "c", grant=""), route("a", "d", grant="")
    await rig.send(session, RouteChanged(session_id=session.id, epoch=2, route=repaired),
                   RouteChanged(session_id=session.id, epoch=1, route=older),  # superseded: ignored
                   end(session, 0))
    await drain(session)
    await session.close()
    [(freed, *_)] = rig.nodes.freed
    assert [h.node_id for h in freed.hops] == ["a", "c"] and freed.head.capability == "grant-a"


async def test_the_head_asking_whether_the_client_listens_gets_an_answer(rig: Rig) -> None:
    session = await rig.session()
    reply = await rig.nc.request(rig.subjects.client(session.id), b"", timeout=5.0)
    assert reply.data == b""
    await session.close()


async def test_the_gateways_own_snapshots_follow_the_last_one_and_show_the_route(rig: Rig) -> None:
    session = LiveSession(rig.links, "s1")
    assert session.snapshot(SessionPhase.ROUTING, seq=0).route == []  # not routed yet
    session.routed(route("a", "b"))
    routing = session.telemetry
    assert routing is not None and routing.seq == 0 and routing.phase is SessionPhase.ROUTING
    assert [(h.node_id, h.health) for h in routing.route] == [("a", "unknown"), ("b", "unknown")]
    failed = session.snapshot(SessionPhase.FAILED)
    assert failed.seq == 1 and failed.route_health == "failed" and failed.model == "m"
