"""The head opens the rest of its route (``actors.node.route_open``, issue #20): what each later hop is sent, and a
hop that refuses reaching the client as if the gateway had opened it itself. Real nodes, gateway and NATS; the stub
backend stands in for the model."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import openai
import pytest

from actors.node.route_open import downstream_open
from bus.nodeclient import NodeClient
from schemas.errors import CapacityError, HopError, HopOpenError
from schemas.node import LayerRange
from schemas.route import Hop, Route
from schemas.session import HopGrant, Prompt, SessionOpen
from schemas.snapshot import StandbyRef
from tests.support.swarm import Swarm, Swarms, make_settings, stub

MODEL = "stub-model"
FIRST, SECOND = uuid.uuid4().hex, uuid.uuid4().hex


def _route() -> Route:
    hops = [Hop(node_id=n, endpoint=f"http://127.0.0.1:{9000 + i}", layers=LayerRange(start=4 * i, end=4 * i + 4),
                capability=f"grant-{n}", standby=StandbyRef(node_id=f"spare-{n}", endpoint="http://127.0.0.1:9999",
                                                            capability=f"standby-{n}"))
            for i, n in enumerate(("head", "mid", "tail"))]
    return Route(session_id="s1", model_id=MODEL, n_layers=12, hidden_shape=[8], context_length=256, hops=hops)


def test_each_later_hop_is_sent_only_its_own_grants_and_the_heads_tokens() -> None:
    route = _route()
    grants = [HopGrant(capability=f"grant-{n}", standby=f"standby-{n}") for n in ("mid", "tail")]
    stripped = route.model_copy(update={"hops": [h.model_copy(update={"capability": "" if i else h.capability})
                                                 for i, h in enumerate(route.hops)]})
    head = SessionOpen(session_id="s1", route=stripped, hop_index=0, prompt_tokens=[5, 6, 7], max_tokens=9,
                       capability="grant-head", downstream=grants, reuse_limit=3)
    tail = downstream_open(head, 2, grants[1])
    assert tail.hop_index == 2 and tail.capability == "grant-tail"
    assert tail.prompt_tokens == [5, 6, 7] and tail.max_tokens == 9
    assert tail.downstream is None and tail.prompt is None and tail.reuse_limit is None
    assert [h.capability for h in tail.route.hops] == ["", "", ""], "no hop's session grant travels onward"
    standby = [h.standby.capability if h.standby else None for h in tail.route.hops]
    assert standby == ["", "", "standby-tail"], "only its own standby grant"


def test_only_the_head_tokenizes_and_only_without_tools() -> None:
    route = _route()
    with pytest.raises(ValueError, match="only the head"):
        SessionOpen(session_id="s1", route=route, hop_index=1, prompt=Prompt(text="hi"), max_tokens=4)
    with pytest.raises(ValueError, match="prompt_tokens must not be empty"):
        SessionOpen(session_id="s1", route=route, hop_index=0, max_tokens=4)
    with pytest.raises(ValueError, match="one grant per hop"):
        SessionOpen(session_id="s1", route=route, hop_index=0, prompt_tokens=[1], max_tokens=4,
                    downstream=[HopGrant(capability="x")])


@pytest.fixture
async def tail_full(nats_server: object, tmp_path: Path, swarms: Swarms) -> Swarm:
    """A head with room for two sessions and a tail with room for one."""
    settings = make_settings(nats_server.url, tmp_path / "home", route_retry_s=0.3)  # type: ignore[attr-defined]
    return await swarms.start(settings, [stub(0, 4, max_sessions=2, delay_s=0.01),
                                         stub(4, 8, max_sessions=1, delay_s=0.01)], model_id=MODEL)


def _open(swarm: Swarm, session_id: str) -> SessionOpen:
    """The head's open of a route over the swarm's two nodes (no secret: no grants), as the gateway sends it."""
    head, tail = swarm.nodes
    hops = [Hop(node_id=n.config.node_id, endpoint=n.endpoint, layers=n.backend.layers) for n in swarm.nodes]
    route = Route(session_id=session_id, model_id=MODEL, n_layers=8, hidden_shape=list(head.backend.info.hidden_shape),
                  context_length=head.backend.info.context_length, hops=hops)
    return SessionOpen(session_id=session_id, route=route, hop_index=0, prompt=Prompt(text="hello"), max_tokens=4,
                       downstream=[HopGrant()])


async def test_a_later_hop_that_refuses_fails_the_heads_open_with_its_answer(tail_full: Swarm) -> None:
    """The tail is full: the head's open fails with a ``HopOpenError`` carrying the tail's own 429, which the
    gateway turns back into the tail's refusal; the head keeps nothing of the session it had started."""
    head, tail = tail_full.nodes
    client = NodeClient()
    try:
        opened = await client.open_session(head.config.node_id, head.endpoint, _open(tail_full, FIRST))
        assert opened.prompt_tokens == len(head.backend.tokenize(Prompt(text="hello")))
        assert set(tail.sessions) == {FIRST}, "the head opened the tail itself"
        with pytest.raises(HopError) as refused:
            await client.open_session(head.config.node_id, head.endpoint, _open(tail_full, SECOND))
        relayed = refused.value.peer_error
        assert isinstance(relayed, HopOpenError), refused.value
        assert relayed.node == tail.config.node_id and relayed.peer_status == 429
        assert isinstance(relayed.as_hop_error().peer_error, CapacityError)
        assert SECOND not in head.sessions and SECOND not in head.backend.open_sessions  # type: ignore[attr-defined]
        assert set(tail.sessions) == {FIRST}
        with pytest.raises(HopError) as bad:
            await client.open_session(head.config.node_id, head.endpoint, _open(tail_full, "not-a-uuid"))
        assert bad.value.peer_status == 400 and "uuid" in bad.value.message
        for node in (head, tail):  # the gateway closes every hop of a session it opened
            await client.close_session(node.config.node_id, node.endpoint, FIRST)
    finally:
        await client.aclose()
    await tail_full.freed()


async def test_the_head_tokenizes_and_settles_the_budget(tail_full: Swarm) -> None:
    """No tokenize round trip: the head counts the prompt and fits the default budget to the context it leaves,
    and the usage the client gets is the head's count."""
    client = openai.AsyncOpenAI(base_url=tail_full.base_url, api_key="unused", max_retries=0)
    done = await client.completions.create(model=MODEL, prompt="hello world", max_tokens=3)
    head = tail_full.nodes[0]
    expected = len(head.backend.tokenize(Prompt(text="hello world")))
    assert done.usage is not None and done.usage.prompt_tokens == expected
    assert done.usage.completion_tokens == 3
    await asyncio.wait_for(tail_full.freed(), 10)
