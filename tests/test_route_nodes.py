"""gateway.route_nodes: the gateway's calls to a session's route, against a real stub swarm (real NATS, stub nodes on
loopback) and a node that is gone (a port nobody listens on); how an open's refusals reach the client."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import nats
import pytest
import pytest_asyncio

from bus.nodeclient import NodeClient
from bus.server import EmbeddedNats
from bus.subjects import Subjects
from bus.tracker_client import TrackerClient
from gateway.route_nodes import RouteNodes, passthrough
from schemas.errors import BadRequestError, CapacityError, HopError, HopOpenError, RouteFailedError, SwarmrouteError
from schemas.route import Route
from schemas.session import Prompt
from tests.support.gateway import MESSAGES, MODEL, prompt_tokens, stub_swarm
from tests.support.swarm import Swarm

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT: list[dict[str, object]] = [dict(m) for m in MESSAGES]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async with stub_swarm(module_nats, tmp_path_factory.mktemp("swarm")) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module")
async def nodes() -> AsyncIterator[RouteNodes]:
    client = NodeClient(timeout_s=5.0)
    yield RouteNodes(client)
    await client.aclose()


async def routed(swarm: Swarm, session_id: str) -> Route:
    nc = await nats.connect(swarm.settings.nats_url)
    try:
        return await TrackerClient(nc, Subjects(swarm.settings.namespace)).route(MODEL, session_id)
    finally:
        await nc.drain()


def gone(route: Route) -> Route:
    """The route with its head at a loopback port nobody listens on (its process died)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    head = route.head.model_copy(update={"endpoint": f"http://127.0.0.1:{port}"})
    return route.model_copy(update={"hops": [head, *route.hops[1:]]})


async def test_the_head_tokenizes_a_prompt(swarm: Swarm, nodes: RouteNodes) -> None:
    route = await routed(swarm, "tok")
    reply = await nodes.tokenize(route, Prompt(messages=CHAT))
    assert len(reply.tokens) == prompt_tokens(swarm, messages=CHAT) and reply.tool_format is None


async def test_a_head_that_answers_is_neither_unresponsive_nor_lost_while_it_holds_the_session(
        swarm: Swarm, nodes: RouteNodes) -> None:
    route = await routed(swarm, "held")
    assert await nodes.find_unresponsive(route) is None
    lost = await nodes.find_lost(route, "held")  # never opened: the head answers it does not hold it
    assert lost is not None and lost[0] == route.head.node_id and "no longer holds the session" in lost[1]


async def test_a_head_that_is_gone_is_unresponsive_lost_and_freeing_still_returns(swarm: Swarm,
                                                                                   nodes: RouteNodes) -> None:
    route = gone(await routed(swarm, "dead"))
    assert await nodes.find_unresponsive(route) == route.head.node_id
    lost = await nodes.find_lost(route, "dead")
    assert lost is not None and lost[0] == route.head.node_id and "its process died" in lost[1]
    await nodes.free(route, "dead", cancel=True)  # every hop that answers frees it; the dead one is skipped


async def _raise(exc: Exception) -> None:
    raise exc


async def test_a_nodes_refusal_of_the_client_passes_through_as_is() -> None:
    refusal = BadRequestError("the stub backend does not render tools", param="tools")
    with pytest.raises(BadRequestError) as raised:
        await passthrough(_raise(HopError("n1", "http_error", "400", peer_status=400, peer_error=refusal)))
    assert raised.value is refusal
    full = CapacityError("no free slot")
    with pytest.raises(CapacityError) as busy:
        await passthrough(_raise(HopError("n1", "http_error", "429", peer_status=429, peer_error=full)))
    assert busy.value is full


async def test_a_hop_the_head_could_not_open_counts_as_that_hops_own_answer() -> None:
    refusal = BadRequestError("too long", param="messages")
    head_says = HopOpenError("hop n2 refused", node="n2", kind="http_error", peer_status=400, peer_error=refusal)
    with pytest.raises(BadRequestError) as raised:
        await passthrough(_raise(HopError("n1", "http_error", "502", peer_status=502, peer_error=head_says)))
    assert raised.value is refusal
    dead = HopOpenError("hop n2 is gone", node="n2", kind="unreachable")
    with pytest.raises(RouteFailedError) as failed:
        await passthrough(_raise(HopError("n1", "http_error", "502", peer_status=502, peer_error=dead)))
    cause = failed.value.__cause__
    assert isinstance(cause, HopError) and (cause.node, cause.kind) == ("n2", "unreachable")


async def test_a_refused_grant_or_a_dead_node_is_the_swarms_fault_not_the_clients() -> None:
    forbidden: SwarmrouteError = SwarmrouteError("bad grant")
    with pytest.raises(RouteFailedError) as refused:
        await passthrough(_raise(HopError("n1", "http_error", "403", peer_status=403, peer_error=forbidden)))
    assert refused.value.code == "capability_refused" and "node n1" in refused.value.message
    unreachable = HopError("n1", "unreachable", "connection refused")
    with pytest.raises(RouteFailedError) as failed:
        await passthrough(_raise(unreachable))
    assert failed.value.__cause__ is unreachable and failed.value.code != "capability_refused"
