"""Prefixes across routes (issue #26) on stub routes, through the gateway and the official client: a prompt prefilled
on route A, then sent while A is full, lands on route B (disjoint nodes of the same ranges), whose hops pull the
prefix from A's nodes and compute only the new positions; the text equals a cold run's (the stub computes exactly,
so a pulled KV that differed in any value would change it). When the policy's inputs say computing is cheaper, or
a pulled piece fails its hash, B computes the prompt itself. The policy itself on its inputs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from actors.node import Node, NodeConfig
from actors.node.prefix_pull import PullPolicy
from actors.node.reuse import Shared
from actors.node.spot_check import SCRATCH_PREFIX
from schemas.session import Prompt
from schemas.settings import Settings
from tests.support.swarm import Swarm, Swarms, make_settings, stub
from tests.support.waiting import eventually

MODEL = "stub-model"
CHUNK = 16
QUESTION = [{"role": "system", "content": "You answer in short sentences about the sea, its boats and harbours."},
            {"role": "user", "content": "Tell me about the tides of the northern harbours."}]


def settings_for(nats_url: str, home: Any, **kw: Any) -> Settings:
    return make_settings(nats_url, home, prefill_chunk=CHUNK, prefix_reuse="token", **kw)


async def chat(swarm: Swarm, messages: list[dict[str, str]], max_tokens: int = 16) -> tuple[str, dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                                 temperature=0, extra_body={"ignore_eos": True})
    return reply.choices[0].message.content or "", (reply.model_extra or {})["swarmroute"]


def computed(nodes: list[Node]) -> list[dict[str, int]]:
    """Positions each node computed per closed session: the clients' sessions, not a spot check's scratch one (a
    node checks another's receipt at the default rate, 5% of sessions)."""
    return [{k: v for k, v in node.backend.closed_positions.items()  # type: ignore[attr-defined]
             if not k.startswith(SCRATCH_PREFIX)} for node in nodes]


def new_sessions(nodes: list[Node], before: list[dict[str, int]]) -> list[int]:
    """Positions each node computed for the sessions that closed since ``before``."""
    return [sum(v for k, v in now.items() if k not in was) for now, was in zip(computed(nodes), before, strict=True)]


@contextlib.asynccontextmanager
async def a_busy(swarm: Swarm) -> AsyncIterator[None]:
    """Route A's only session slots taken by a long stream for as long as the block runs."""
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    stream = await client.completions.create(model=MODEL, prompt="keep route A busy", max_tokens=4000, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True})
    task = asyncio.ensure_future(_drain(stream))
    try:
        a = swarm.nodes[:2]
        await eventually(lambda: all(n.sessions for n in a), timeout=10, what="route A busy")
        yield
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await stream.close()


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def two_routes(swarms: Swarms, settings: Settings) -> tuple[Swarm, list[Node]]:
    """Route A (n1, n2: one session slot each) with a tracker and a gateway; route B's nodes (b0, b1) are started
    by ``with_b``, once A is busy."""
    swarm = await swarms.start(settings, [stub(0, 4, max_sessions=1, delay_s=0.01),
                                          stub(4, 8, max_sessions=1, delay_s=0.01)], model_id=MODEL)
    return swarm, []


async def with_b(swarms: Swarms, swarm: Swarm, settings: Settings) -> list[Node]:
    """Route B: b0 (layers 0:4) and b1 (4:8), routable."""
    b = [await swarms.actor(Node(NodeConfig(node_id=f"b{i}", model_id=MODEL), stub(a, z, delay_s=0.01), settings))
         for i, (a, z) in enumerate(((0, 4), (4, 8)))]
    await swarm.wait_model(MODEL)
    await eventually(lambda: len(swarm.tracker.models().models[0].nodes) == 4, timeout=10, what="route B seen")
    return b


def prompt_len(swarm: Swarm, messages: list[dict[str, str]]) -> int:
    return len(swarm.nodes[0].backend.tokenize(Prompt(messages=messages)))  # type: ignore[arg-type]


async def test_route_b_pulls_the_prefix_route_a_kept_and_computes_only_the_new_tokens(
        nats_server: Any, tmp_path: Any, swarms: Swarms) -> None:
    settings = settings_for(nats_server.url, tmp_path / "home")
    swarm, _ = await two_routes(swarms, settings)
    first, _ = await chat(swarm, QUESTION)
    turn2 = [*QUESTION, {"role": "assistant", "content": first}, {"role": "user", "content": "And the south?"}]
    tokens = swarm.nodes[0].backend.tokenize(Prompt(messages=turn2))  # type: ignore[arg-type]
    held = swarm.nodes[0].reuse.cache.match(tokens)
    assert held is not None
    async with a_busy(swarm):
        b = await with_b(swarms, swarm, settings)
        before = computed(b)
        reply, telemetry = await chat(swarm, turn2)
    assert telemetry["route"][0]["node_id"] == "b0", telemetry["route"]
    prompt = prompt_len(swarm, turn2)
    reused = telemetry["prefill"]["reused"]
    assert reused > prompt // 2 and reused == held[2], (reused, held[2], prompt)  # A's first turn, to the token
    assert [n.prefix_pull.pulled_positions for n in b] == [reused, reused]
    assert [n.metrics.prefix_pulled._value.get() for n in b] == [reused, reused]  # noqa: SLF001
    # every hop of B computed the prompt's new positions and the reply's, nothing else
    assert new_sessions(b, before) == [prompt - reused + 16 - 1] * 2
    cold = await swarms.start(settings_for(nats_server.url, tmp_path / "cold", prefix_cache_mb=0, namespace="cold"),
                              [stub(0, 4), stub(4, 8)], model_id=MODEL)
    assert reply == (await chat(cold, turn2))[0]


async def test_route_b_computes_when_its_policy_says_pulling_costs_more(nats_server: Any, tmp_path: Any,
                                                                      swarms: Swarms) -> None:
    settings = settings_for(nats_server.url, tmp_path / "home")
    swarm, _ = await two_routes(swarms, settings)
    await chat(swarm, QUESTION)
    async with a_busy(swarm):
        b = await with_b(swarms, swarm, settings)
        for node in b:  # as measured on a thin link to A and a fast prefill here
            node.prefix_pull.policy.link_bps.update({"n1": 10.0, "n2": 10.0})
            node.prefix_pull.policy.prefill_pps = 1e6
        before = computed(b)
        _, telemetry = await chat(swarm, QUESTION)
    assert telemetry["route"][0]["node_id"] == "b0"
    assert "reused" not in telemetry["prefill"]
    assert [n.prefix_pull.declined for n in b] == [1, 1]
    assert [n.prefix_pull.pulled_positions for n in b] == [0, 0]
    assert new_sessions(b, before) == [prompt_len(swarm, QUESTION) + 16 - 1] * 2


async def test_a_pulled_piece_that_fails_its_hash_is_recomputed_never_used(nats_server: Any, tmp_path: Any,
                                                                          swarms: Swarms) -> None:
    settings = settings_for(nats_server.url, tmp_path / "home")
    swarm, _ = await two_routes(swarms, settings)
    expected, _ = await chat(swarm, QUESTION)
    tail = swarm.nodes[1]
    share = tail.reuse.share

    async def flipped(prompt: list[int], have: int) -> Shared | None:  # the source's piece no longer what was kept
        shared = await share(prompt, have)
        assert shared is not None
        first = shared.blobs[0]
        return Shared(shared.reusable, shared.tokens, shared.bounds, [bytes([first[0] ^ 1]) + first[1:],
                                                                       *shared.blobs[1:]], shared.digests)

    tail.reuse.share = flipped  # type: ignore[method-assign]
    async with a_busy(swarm):
        b = await with_b(swarms, swarm, settings)
        before = computed(b)
        reply, telemetry = await chat(swarm, QUESTION)
    assert telemetry["route"][0]["node_id"] == "b0"
    assert "reused" not in telemetry["prefill"]
    assert b[1].prefix_pull.rejected == 1 and b[1].prefix_pull.pulled_positions == 0
    assert b[1].metrics.prefix_rejected._value.get() == 1  # noqa: SLF001
    assert new_sessions(b, before) == [prompt_len(swarm, QUESTION) + 16 - 1] * 2
    assert reply == expected


@pytest.mark.parametrize(("link", "pps", "nbytes", "positions", "pull"), [
    (None, None, 10**6, 100, True),  # nothing measured yet: the first piece measures the link
    (1e6, None, 10**6, 100, True),
    (1e6, 1000.0, 10**6, 100, False),  # 1 s to pull against 0.1 s to compute
    (1e8, 1000.0, 10**6, 100, True),  # 0.01 s against 0.1 s
])
def test_the_policy_pulls_only_when_that_beats_computing(link: float | None, pps: float | None, nbytes: int,
                                                         positions: int, pull: bool) -> None:
    policy = PullPolicy(lambda: pps)
    if link is not None:
        policy.link_bps["src"] = link
    assert policy.worth("src", nbytes, positions) is pull
    assert PullPolicy(lambda: pps, mode="never").worth("src", nbytes, positions) is False
    assert PullPolicy(lambda: pps, mode="always").worth("src", nbytes, positions) is True


def test_the_policy_learns_the_link_from_what_it_pulled() -> None:
    policy = PullPolicy(lambda: 1000.0)
    policy.observe("src", 10**6, 2.0)  # 0.5 MB/s: 2 s for a MB against 0.1 s of compute
    assert not policy.worth("src", 10**6, 100)
    assert policy.worth("other", 10**6, 100)  # another source is measured on its own
    with pytest.raises(ValueError, match="prefix_pull"):
        PullPolicy(lambda: None, mode="sometimes")
