"""gateway.session_manager: the gateway's set of sessions, against a real stub swarm (real NATS, tracker and stub
nodes on loopback): a session is live from its start until it is freed, then only its last snapshot is kept, in a
bounded table; a start that fails leaves nothing live, and one that fails once routed says so on its telemetry."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import nats
import pytest
import pytest_asyncio
from nats.aio.msg import Msg

from bus import codec
from bus.nodeclient import NodeClient
from bus.server import EmbeddedNats
from bus.subjects import Subjects
from bus.tracker_client import TrackerClient
from gateway.session_manager import SessionManager
from gateway.session_opener import GenerationRequest
from schemas.errors import BadRequestError, SwarmrouteError
from schemas.session import Prompt, SamplingParams, SessionEnd, SessionPhase
from schemas.telemetry import GenerationTelemetry
from tests.support.gateway import MESSAGES, MODEL, stub_swarm
from tests.support.swarm import Swarm
from tests.support.waiting import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT: list[dict[str, object]] = [dict(m) for m in MESSAGES]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async with stub_swarm(module_nats, tmp_path_factory.mktemp("swarm")) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module")
async def manager(swarm: Swarm) -> AsyncIterator[SessionManager]:
    nc = await nats.connect(swarm.settings.nats_url)
    client = NodeClient(timeout_s=5.0)
    manager = SessionManager(nc, TrackerClient(nc, Subjects(swarm.settings.namespace)), client, swarm.settings)
    yield manager
    for session in list(manager.live.values()):
        await session.close(cancelled=True)
    await client.aclose()
    await nc.drain()


class Tap:
    """Every telemetry snapshot published in the manager's namespace, as a monitoring tool sees them."""

    def __init__(self, manager: SessionManager) -> None:
        self.nc, self.subject = manager.nc, manager.subjects.telemetry()
        self.seen: list[GenerationTelemetry] = []

    async def __aenter__(self) -> Tap:
        async def on_msg(msg: Msg) -> None:
            with contextlib.suppress(codec.DecodeError):
                self.seen.append(codec.decode(msg.data, GenerationTelemetry))

        self.sub = await self.nc.subscribe(self.subject, cb=on_msg)
        await self.nc.flush()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sub.unsubscribe()

    async def phases(self, what: str, expected: list[SessionPhase]) -> None:
        await eventually(lambda: [s.phase for s in self.seen] == expected, timeout=5.0,
                         what=lambda: f"{what} on the telemetry subject (seen: {self.seen})")


def request(*, n: int = 1, temperature: float = 0.0, model: str = MODEL) -> GenerationRequest:
    return GenerationRequest(model=model, prompt=Prompt(messages=CHAT), prompt_tokens=None, max_tokens=3,
                             sampling=SamplingParams(temperature=temperature), stop=[], n=n)


async def run(manager: SessionManager) -> str:
    """One session started, read to its end and closed; its id."""
    session = await manager.start(request())
    assert manager.live[session.id] is session
    ends = [e async for e in session.events() if isinstance(e, SessionEnd)]
    await session.close()
    assert [e.phase for e in ends] == [SessionPhase.COMPLETE]
    return session.id


async def test_a_session_is_live_until_it_is_freed_then_its_last_snapshot_is_kept(swarm: Swarm,
                                                                                   manager: SessionManager) -> None:
    session = await manager.start(request())
    assert manager.live == {session.id: session} and session.id not in manager.finished
    async for _ in session.events():
        pass
    await session.close()
    assert session.id not in manager.live and manager.finished[session.id] == session.telemetry
    await swarm.freed()


async def test_the_finished_table_keeps_the_latest_only(swarm: Swarm, manager: SessionManager) -> None:
    manager.finished_limit = 2
    ids = [await run(manager) for _ in range(3)]
    assert list(manager.finished) == ids[1:]


async def test_a_start_refused_before_routing_leaves_nothing_behind(manager: SessionManager) -> None:
    async with Tap(manager) as tap:
        with pytest.raises(SwarmrouteError) as refused:
            await manager.start(request(model="no-such-model"))
        await tap.phases("the gateway's first word", [SessionPhase.ROUTING])
    assert refused.value.status == 404 and not manager.live and not manager.finished
    assert tap.seen[0].seq == 0 and tap.seen[0].route == []


async def test_a_start_refused_once_routed_publishes_and_keeps_its_failure(swarm: Swarm,
                                                                           manager: SessionManager) -> None:
    async with Tap(manager) as tap:
        with pytest.raises(BadRequestError):
            await manager.start(request(n=64, temperature=0.8))  # more sampled choices than the route holds
        await tap.phases("routing, then the failure", [SessionPhase.ROUTING, SessionPhase.FAILED])
    assert not manager.live
    [(sid, kept)] = manager.finished.items()
    assert kept == tap.seen[-1] and sid == kept.session_id
    assert kept.failure is not None and (kept.failure.kind, kept.failure.phase) == ("http_error", SessionPhase.ROUTING)
    assert [h.node_id for h in kept.route] == ["n1", "n2"]
    await swarm.freed()
