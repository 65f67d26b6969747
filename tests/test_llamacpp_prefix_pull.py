"""Prefixes across routes (issue #26) on real llama.cpp shards of the bundled Gemma 3 270M, through the gateway and
the official client: two routes over disjoint nodes of the same ranges (A: n1 0:9, n2 9:18; B: b0, b1). Prompts
are prefilled on A (the only route then: these are the cold runs), then, with A full, sent again: they land on B,
whose hops pull the prefix from A's nodes and compute only the prompt's last position (counted on every hop), and
answer as the cold run did. When B's policy inputs say pulling costs more (a thin link to A, a fast prefill), B
computes the prompt; a piece that fails its hash is recomputed, never used. Prefix reuse moves logits only as two
batch shapes do, so a differing token is allowed only where the cold run's two best logits nearly tie
(``same_or_near_tie``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from actors.node import Node, NodeConfig
from actors.node.reuse import Shared
from bus.server import EmbeddedNats
from schemas.session import Prompt
from tests.support.swarm import Swarm, Swarms, make_settings, start_swarm
from tests.support.waiting import eventually
from tests.test_llamacpp_reuse import same_or_near_tie

pytest.importorskip("llama_cpp")

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
MODEL = "gemma"


def conversation(topic: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"{topic.capitalize()}: you are the clerk of the harbour office, answering "
                                          f"about {topic}. " * 12},
            {"role": "user", "content": f"What should I know about {topic} this week?"}]


PULLED, COMPUTED, CORRUPT = conversation("berths"), conversation("cranes"), conversation("customs forms")


@dataclasses.dataclass
class Routes:
    swarm: Swarm
    """Route A (n1, n2), the tracker and the gateway."""
    b: list[Node]
    cold: dict[str, Any]
    """Each prompt's cold reply on route A (with logprobs), by topic."""


async def chat(swarm: Swarm, messages: list[dict[str, str]], **kw: Any) -> Any:
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=300)
    return await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,  # type: ignore[arg-type]
                                                **kw)


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def routes(module_nats: EmbeddedNats, gemma_path: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Routes]:
    from actors.backends import load_backend

    work = tmp_path_factory.mktemp("pull")
    (work / "shards").mkdir()
    backends = [load_backend("llamacpp", model_path=gemma_path, n_ctx=4096, max_sessions=1, threads=1,
                             layer_start=a, layer_end=z, shard_dir=work / "shards", resident_prefixes=3)
                for a, z in ((0, 9), (9, 18), (0, 9), (9, 18))]
    settings = make_settings(module_nats.url, work / "home", namespace="pull", prefill_chunk=64, prefix_reuse="token",
                             token_timeout_s=120.0, first_token_timeout_s=240.0, hop_timeout_s=120.0)
    try:
        async with contextlib.AsyncExitStack() as stack:
            swarm = await start_swarm(settings, backends[:2], model_id=MODEL)
            stack.push_async_callback(swarm.stop)
            cold = {m[1]["content"]: await chat(swarm, m, logprobs=True, top_logprobs=2)
                    for m in (PULLED, COMPUTED, CORRUPT)}
            # A full (one session slot per node, taken by a long stream), then route B comes up.
            client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=600)
            stream = await client.completions.create(model=MODEL, prompt="The harbour", max_tokens=1500,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            busy = asyncio.ensure_future(_drain(stream))
            stack.push_async_callback(stream.close)
            stack.callback(busy.cancel)
            await eventually(lambda: all(n.sessions for n in swarm.nodes), timeout=60, what="route A busy")
            async with Swarms() as starting:
                b = [await starting.actor(Node(NodeConfig(node_id=f"b{i}", model_id=MODEL), backend, settings))
                     for i, backend in enumerate(backends[2:])]
                starting.pop_all()
            for node in reversed(b):
                stack.push_async_callback(node.stop)
            await eventually(lambda: len(swarm.tracker.models().models[0].nodes) == 4, timeout=30,
                             what="route B routable")
            yield Routes(swarm, b, cold)
    finally:
        for backend in backends:
            backend.close()


def computed(nodes: list[Node]) -> list[float]:
    return [node.metrics.prefill_positions._value.get() for node in nodes]  # noqa: SLF001


def prompt_tokens(routes: Routes, messages: list[dict[str, str]]) -> int:
    return len(routes.b[0].backend.tokenize(Prompt(messages=messages)))  # type: ignore[arg-type]


async def on_b(routes: Routes, messages: list[dict[str, str]]) -> tuple[Any, int, list[float]]:
    """``messages`` sent with A full: it lands on B. The reply, the positions B reused, and what each B hop
    computed."""
    before = computed(routes.b)
    reply = await chat(routes.swarm, messages)
    telemetry = (reply.model_extra or {})["swarmroute"]
    assert [h["node_id"] for h in telemetry["route"]] == ["b0", "b1"], telemetry["route"]
    reused = telemetry["prefill"].get("reused", 0)
    assert reply.usage.prompt_tokens_details.cached_tokens == reused
    return reply, reused, [a - b for a, b in zip(computed(routes.b), before, strict=True)]


async def test_route_b_pulls_the_prefix_from_route_a_and_computes_only_the_new_position(routes: Routes) -> None:
    prompt = prompt_tokens(routes, PULLED)
    assert prompt > 150
    reply, reused, hop_computed = await on_b(routes, PULLED)
    assert reused == prompt - 1  # all but the last prompt token (the tail samples after it)
    assert hop_computed == [1, 1]
    assert [n.prefix_pull.pulled_positions for n in routes.b] == [reused, reused]
    assert [n.metrics.prefix_pulled._value.get() for n in routes.b] == [reused, reused]  # noqa: SLF001
    same_or_near_tie(reply.choices[0].message.content or "", routes.cold[PULLED[1]["content"]])


async def test_route_b_computes_the_prompt_when_its_policy_says_pulling_costs_more(routes: Routes) -> None:
    for node in routes.b:  # as measured: a thin link to A, and a fast prefill on B
        node.prefix_pull.policy.link_bps.update({"n1": 1e3, "n2": 1e3})
        node.prefix_pull.policy.prefill_pps = 1e5
    declined = [n.prefix_pull.declined for n in routes.b]
    pulled = [n.prefix_pull.pulled_positions for n in routes.b]
    try:
        reply, reused, hop_computed = await on_b(routes, COMPUTED)
    finally:
        for node in routes.b:
            node.prefix_pull.policy.link_bps.clear()
            node.prefix_pull.policy.prefill_pps = None
    prompt = prompt_tokens(routes, COMPUTED)
    assert reused < 16  # only what B kept itself (the chat template's first tokens)
    assert hop_computed == [prompt - reused] * 2
    assert [n.prefix_pull.declined for n in routes.b] == [d + 1 for d in declined]
    assert [n.prefix_pull.pulled_positions for n in routes.b] == pulled
    same_or_near_tie(reply.choices[0].message.content or "", routes.cold[COMPUTED[1]["content"]])


async def test_a_pulled_piece_that_fails_its_hash_is_recomputed_never_used(routes: Routes) -> None:
    source = routes.swarm.nodes[1]
    share = source.reuse.share

    async def flipped(prompt: list[int], have: int) -> Shared | None:  # a piece changed on its way (or at rest)
        shared = await share(prompt, have)
        if shared is None:
            return None
        last = shared.blobs[-1]
        return dataclasses.replace(shared, blobs=[*shared.blobs[:-1], last[:-1] + bytes([last[-1] ^ 1])])

    source.reuse.share = flipped  # type: ignore[method-assign]
    tail = routes.b[1]
    rejected, pulled = tail.metrics.prefix_rejected._value.get(), tail.prefix_pull.pulled_positions  # noqa: SLF001
    for node in routes.b:  # every piece pulled, whatever the rates measured so far: the last one is the bad one
        node.prefix_pull.policy.mode = "always"
    try:
        reply, reused, hop_computed = await on_b(routes, CORRUPT)
    finally:
        del source.reuse.share
        for node in routes.b:
            node.prefix_pull.policy.mode = "auto"
    prompt = prompt_tokens(routes, CORRUPT)
    assert reused < 16
    assert hop_computed == [prompt - reused] * 2
    assert tail.prefix_pull.pulled_positions == pulled
    assert tail.metrics.prefix_rejected._value.get() == rejected + 1  # noqa: SLF001
    same_or_near_tie(reply.choices[0].message.content or "", routes.cold[CORRUPT[1]["content"]])
