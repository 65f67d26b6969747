"""gateway.session_opener: routing a request and opening its session on the head, against a real stub swarm (real
NATS, tracker and stub nodes on loopback); what the opener tells the session, and how the route's refusals reach the
caller. Which sessions speculate is decided from the request and the route alone (no swarm)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS

from bus.nodeclient import NodeClient
from bus.server import EmbeddedNats
from bus.subjects import Subjects
from bus.tracker_client import TrackerClient
from gateway.live_session import LiveSession, SessionLinks
from gateway.route_nodes import RouteNodes
from gateway.session_opener import GenerationRequest, SessionOpener
from schemas.errors import BadRequestError, SwarmrouteError
from schemas.session import Prompt, SamplingParams
from schemas.settings import Settings
from schemas.telemetry import GenerationTelemetry
from schemas.tools import FunctionSpec, ToolSet
from tests.support.gateway import MESSAGES, MODEL, prompt_tokens, stub_swarm
from tests.support.swarm import Swarm

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT: list[dict[str, object]] = [dict(m) for m in MESSAGES]
GREEDY = SamplingParams(temperature=0.0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async with stub_swarm(module_nats, tmp_path_factory.mktemp("swarm")) as s:
        yield s


class Opening:
    """An opener on the swarm, and sessions for it whose links free them on their real hops."""

    def __init__(self, nc: NATS, client: NodeClient, settings: Settings) -> None:
        self.nodes = RouteNodes(client)
        self.opener = SessionOpener(TrackerClient(nc, Subjects(settings.namespace)), self.nodes, settings)
        self.links = SessionLinks(settings=settings, nodes=self.nodes, publish=self._ignore,
                                  closed=lambda sid, last: None)

    async def _ignore(self, snap: GenerationTelemetry) -> None:
        return None

    def session(self, prompt: Prompt | None) -> LiveSession:
        return LiveSession(self.links, uuid.uuid4().hex, prompt)


@pytest_asyncio.fixture(loop_scope="module")
async def opening(swarm: Swarm) -> AsyncIterator[Opening]:
    nc = await nats.connect(swarm.settings.nats_url)
    client = NodeClient(timeout_s=5.0)
    yield Opening(nc, client, swarm.settings)
    await client.aclose()
    await nc.drain()


def request(prompt: Prompt | None = None, *, n: int = 1, sampling: SamplingParams = GREEDY,
            model: str = MODEL) -> GenerationRequest:
    return GenerationRequest(model=model, prompt=prompt or Prompt(messages=CHAT), prompt_tokens=None,
                             max_tokens=5, sampling=sampling, stop=[], n=n)


async def test_a_session_is_routed_over_the_swarm_and_opened_with_the_heads_count(swarm: Swarm,
                                                                                     opening: Opening) -> None:
    session = opening.session(Prompt(messages=CHAT))
    await opening.opener.open(session, request())
    try:
        assert session.route is not None
        assert [h.node_id for h in session.route.hops] == [n.config.node_id for n in swarm.nodes]
        assert session.telemetry is not None and [h.node_id for h in session.telemetry.route] == ["n1", "n2"]
        assert session.n_prompt == prompt_tokens(swarm, messages=CHAT) and session.max_tokens == 5
        assert (session.n, session.fan_out) == (1, 1) and session.opened_at is not None
        assert {"route", "open"} <= set(session.setup) and "tokenize" not in session.setup  # the head tokenized
        assert set(swarm.held()) == {"n1", "n2"}
    finally:
        await session.close(cancelled=True)
    await swarm.freed()


async def test_greedy_choices_are_one_sequence_on_the_route_and_sampled_ones_fork(swarm: Swarm,
                                                                                  opening: Opening) -> None:
    greedy = opening.session(None)
    await opening.opener.open(greedy, request(n=3))
    sampled = opening.session(None)
    await opening.opener.open(sampled, request(n=2, sampling=SamplingParams(temperature=0.8, seed=1)))
    try:
        assert (greedy.n, greedy.seen, greedy.fan_out) == (1, [0], 3)
        assert (sampled.n, sampled.seen, sampled.fan_out) == (2, [0, 0], 1)
    finally:
        await greedy.close(cancelled=True)
        await sampled.close(cancelled=True)
    await swarm.freed()


async def test_more_sampled_choices_than_the_route_holds_are_refused_once_routed(swarm: Swarm,
                                                                                 opening: Opening) -> None:
    session = opening.session(None)
    with pytest.raises(BadRequestError) as refused:
        await opening.opener.open(session, request(n=64, sampling=SamplingParams(temperature=0.8)))
    assert refused.value.param == "n" and session.route is not None and session.opened_at is None


async def test_a_prompt_with_tools_is_tokenized_first_and_the_heads_refusal_reaches_the_caller(
        swarm: Swarm, opening: Opening) -> None:
    tools = ToolSet(tools=[FunctionSpec(name="get_time")])
    session = opening.session(None)
    with pytest.raises(BadRequestError) as refused:  # the stub backend renders no tools: a 400 naming them
        await opening.opener.open(session, request(Prompt(messages=CHAT, tools=tools)))
    assert refused.value.param == "tools" and "tokenize" in session.setup and "open" not in session.setup


async def test_an_unknown_model_is_refused_before_any_route(opening: Opening) -> None:
    session = opening.session(None)
    with pytest.raises(SwarmrouteError) as refused:
        await opening.opener.open(session, request(model="no-such-model"))
    assert refused.value.status == 404 and session.route is None


def opener(**settings: object) -> SessionOpener:
    """No tracker or node is asked: speculation is decided from the settings and the request."""
    return SessionOpener(None, None, Settings(**settings))  # type: ignore[arg-type]


async def test_only_plain_single_choice_sessions_on_several_hops_speculate() -> None:
    on = opener(speculation="ngram", speculative_max_k=4)
    plain = SamplingParams(temperature=0.0)
    speculation = on._speculation(plain, 1, 2)
    assert speculation is not None and (speculation.source, speculation.max_k) == ("ngram", 4)
    assert on._speculation(plain, 2, 2) is None  # choices fork
    assert on._speculation(plain, 1, 1) is None  # one hop: nothing to overlap
    assert on._speculation(SamplingParams(logprobs=0), 1, 2) is None
    assert on._speculation(SamplingParams(repeat_penalty=1.1), 1, 2) is None
    assert opener(speculation="off")._speculation(plain, 1, 2) is None
    assert opener(speculation="ngram", speculative_max_k=0)._speculation(plain, 1, 2) is None
