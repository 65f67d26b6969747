"""Prefix reuse (issue #18; token-exact, issue #26) on real llama.cpp shards of the bundled Gemma 3 270M, through
the gateway and the official client: the second turn of a chat takes the conversation so far, down to the token, from
what the first turn left on the nodes (every hop counts what it reused, and what it computed), prefills only the
rest, and answers as a cold run of the same request does; so do the same prompt sent again, a prompt that diverges in
its last words, users of one system prompt, and a tool loop. Positions the first turn decoded one at a time, and a
prompt's new tokens computed as one short chunk, differ from a cold prefill's only as two batch shapes of llama.cpp
do, so a differing token is allowed only where the cold run's two best logits are within the batch-noise bound
(``BATCH_NOISE``). A kept prefix that fails its hash is recomputed, never used."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from actors.node.prefix_cache import common_prefix
from bus.server import EmbeddedNats
from schemas.session import Prompt
from tests.support.swarm import Swarm, gemma_route
from tests.test_llamacpp_gateway import BATCH_NOISE

pytest.importorskip("llama_cpp")

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
MODEL = "gemma"
SYSTEM = ("You are a careful assistant for a harbour office. You answer questions about tides, berths, cranes, "
          "customs forms and the opening hours of the harbour office, briefly and exactly. ") * 4


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def routes(module_nats: EmbeddedNats, gemma_path: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Swarm, Swarm]]:
    work = tmp_path_factory.mktemp("reuse")
    common: dict[str, Any] = dict(max_sessions=2, threads=1, cuts=(0, 9, 18), n_ctx=2048, prefill_chunk=64,
                                  prefix_reuse="token")
    async with contextlib.AsyncExitStack() as stack:
        warm = await stack.enter_async_context(gemma_route(module_nats.url, gemma_path, work / "warm",
                                                           namespace="reuse-warm", **common))
        cold = await stack.enter_async_context(gemma_route(module_nats.url, gemma_path, work / "cold",
                                                           namespace="reuse-cold", prefix_cache_mb=0, **common))
        yield warm, cold


async def chat(swarm: Swarm, messages: list[dict[str, str]], **kw: Any) -> Any:
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=300)
    return await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,  # type: ignore[arg-type]
                                                **kw)


def reused_by_each_hop(swarm: Swarm) -> list[float]:
    return [node.metrics.prefix_reused._value.get() for node in swarm.nodes]  # noqa: SLF001


TIDE = {"type": "function", "function": {
    "name": "get_tide", "description": "The next high tide at a harbour.",
    "parameters": {"type": "object", "properties": {"harbour": {"type": "string"}}, "required": ["harbour"],
                   "additionalProperties": False}}}


def computed_by_each_hop(swarm: Swarm) -> list[float]:
    return [node.metrics.prefill_positions._value.get() for node in swarm.nodes]  # noqa: SLF001


def tokens_of(swarm: Swarm, messages: list[dict[str, Any]]) -> list[int]:
    return swarm.backends[0].tokenize(Prompt(messages=messages))


def same_or_near_tie(got: str, reference: Any) -> None:
    """``got`` is the cold ``reference``'s text, or parts from it only where its two best logits nearly tie."""
    expected = reference.choices[0].message.content or ""
    if got == expected:
        return
    content = reference.choices[0].logprobs.content
    text, at = "", 0
    for at, entry in enumerate(content):  # noqa: B007 - the first token where the two texts part
        if not got.startswith(text + entry.token):
            break
        text += entry.token
    best = sorted((c.logprob for c in content[at].top_logprobs), reverse=True)
    assert best[0] - best[1] < BATCH_NOISE, (at, best, got, expected)


async def warm_request(warm: Swarm, cold: Swarm, messages: list[dict[str, Any]], at_least: int,
                       **kw: Any) -> Any:
    """Send ``messages`` to the warm route: it reuses at least ``at_least`` positions (and at most all but the last
    prompt token), every hop computes the prompt's other positions only, usage says what was reused, and the text
    is the cold route's."""
    before = computed_by_each_hop(warm)
    reply = await chat(warm, messages, **kw)
    reused = (reply.model_extra or {})["swarmroute"]["prefill"].get("reused", 0)
    prompt = reply.usage.prompt_tokens
    assert at_least <= reused < prompt, (reused, at_least, prompt)
    assert reply.usage.prompt_tokens_details.cached_tokens == reused
    assert [a - b for a, b in zip(computed_by_each_hop(warm), before, strict=True)] == [prompt - reused] * 2
    same_or_near_tie(reply.choices[0].message.content or "", await chat(cold, messages, logprobs=True,
                                                                        top_logprobs=2, **kw))
    return reply


def system(topic: str) -> dict[str, str]:
    return {"role": "system", "content": f"You are the clerk of the harbour office, answering about {topic}. " * 6}


async def test_the_same_prompt_again_computes_its_last_token_only(routes: tuple[Swarm, Swarm]) -> None:
    warm, cold = routes
    messages = [system("berths"), {"role": "user", "content": "Which berth takes the ferry?"}]
    await chat(warm, messages)
    await warm_request(warm, cold, messages, len(tokens_of(warm, messages)) - 1)


async def test_a_prompt_that_diverges_in_its_last_words_computes_from_there(routes: tuple[Swarm, Swarm]) -> None:
    warm, cold = routes
    first = [system("cranes"), {"role": "user", "content": "How much can the big crane lift on Monday?"}]
    second = [system("cranes"), {"role": "user", "content": "How much can the big crane lift on Fridays?"}]
    await chat(warm, first)
    shared = common_prefix(tokens_of(warm, first), tokens_of(warm, second))
    assert shared > 40
    await warm_request(warm, cold, second, shared)


async def test_users_of_one_system_prompt_share_it(routes: tuple[Swarm, Swarm]) -> None:
    warm, cold = routes
    questions = ["When do you open?", "Where do I file customs form C?", "Is the slipway free today?",
                 "How deep is berth four?"]
    users = [[system("customs forms"), {"role": "user", "content": q}] for q in questions]
    await chat(warm, users[0])
    for earlier, user in zip(users, users[1:], strict=False):  # more users than resident slots: host pieces too
        await warm_request(warm, cold, user, common_prefix(tokens_of(warm, earlier), tokens_of(warm, user)))


async def test_each_turn_of_a_tool_loop_computes_the_tool_result_only(routes: tuple[Swarm, Swarm]) -> None:
    warm, cold = routes
    messages: list[dict[str, Any]] = [system("tides"), {"role": "user", "content": "When is high tide at Northport?"}]
    previous = await chat(warm, messages, tools=[TIDE])
    for i, harbour in enumerate(("Northport", "Eastwick")):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_tide", "arguments": json.dumps({"harbour": harbour})}}
        messages = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{i}", "content": f"High tide at {harbour}: 14:0{i}."}]
        previous = await warm_request(warm, cold, messages, previous.usage.prompt_tokens, tools=[TIDE])


async def test_a_kept_prefix_that_fails_its_hash_is_recomputed(routes: tuple[Swarm, Swarm]) -> None:
    warm, cold = routes
    messages = [system("opening hours"), {"role": "user", "content": "Are you open at Easter?"}]
    await chat(warm, messages)
    tail = warm.nodes[1]
    for entry in tail.reuse.cache._entries.values():  # noqa: SLF001 - the tail's kept KV no longer what was kept
        entry.token_hash = "0" * 64
    before, rejected = computed_by_each_hop(warm), tail.metrics.prefix_rejected._value.get()  # noqa: SLF001
    reply = await chat(warm, messages)
    prompt = reply.usage.prompt_tokens
    assert "reused" not in (reply.model_extra or {})["swarmroute"]["prefill"]
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert [a - b for a, b in zip(computed_by_each_hop(warm), before, strict=True)] == [prompt, prompt]
    assert tail.metrics.prefix_rejected._value.get() > rejected  # noqa: SLF001
    same_or_near_tie(reply.choices[0].message.content or "", await chat(cold, messages, logprobs=True,
                                                                        top_logprobs=2))


async def test_the_second_turn_prefills_only_what_is_new_and_answers_as_a_cold_run(
        routes: tuple[Swarm, Swarm]) -> None:
    warm, cold = routes
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When does the office open?"}]
    first = await chat(warm, turn1)
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content or ""},
             {"role": "user", "content": "And on Sundays?"}]
    before = reused_by_each_hop(warm)
    second = await chat(warm, turn2)
    reused = (second.model_extra or {})["swarmroute"]["prefill"].get("reused", 0)
    prompt = second.usage.prompt_tokens
    assert prompt - 24 <= reused < prompt, (reused, prompt)  # down to the token: all but the new user turn
    assert [a - b for a, b in zip(reused_by_each_hop(warm), before, strict=True)] == [reused, reused]
    reference = await chat(cold, turn2, logprobs=True, top_logprobs=2)
    got, expected = second.choices[0].message.content or "", reference.choices[0].message.content or ""
    if got != expected:
        content = reference.choices[0].logprobs.content
        text, at = "", 0
        for at, entry in enumerate(content):  # noqa: B007 - the first token where the two texts part
            if not got.startswith(text + entry.token):
                break
            text += entry.token
        best = sorted((c.logprob for c in content[at].top_logprobs), reverse=True)
        assert best[0] - best[1] < BATCH_NOISE, (at, best, got, expected)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def invariant_route(module_nats: EmbeddedNats, gemma_path: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    """Nodes that compute the sessions that ask batch-invariantly (``llama_batch_invariant=request``), with the
    product's default prefix reuse (``token``)."""
    async with gemma_route(module_nats.url, gemma_path, tmp_path_factory.mktemp("reuse-invariant") / "w",
                           namespace="reuse-invariant", max_sessions=2, threads=1, cuts=(0, 9, 18), n_ctx=2048,
                           prefill_chunk=64, batch_invariant="request", prefix_reuse="token") as swarm:
        yield swarm


def logprobs_of(reply: Any) -> list[tuple[str, float, list[float]]]:
    return [(e.token, e.logprob, [c.logprob for c in e.top_logprobs]) for e in reply.choices[0].logprobs.content]


async def test_a_batch_invariant_request_reuses_whole_chunks_and_answers_bit_for_bit(invariant_route: Swarm) -> None:
    """Token reuse rounds differently from a cold run (a parked prefix's cells, a short last batch); a session that
    asks for batch invariance reuses whole chunks of host pieces only, and its logprobs are the cold run's exactly.
    The same node still reuses down to the token for the requests that do not ask."""
    swarm = invariant_route
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is the crane free on Monday?"}]
    ask = {"logprobs": True, "top_logprobs": 3, "extra_body": {"batch_invariant": True}}
    cold = await chat(swarm, messages, **ask)
    prompt = cold.usage.prompt_tokens
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert prompt > 2 * 64
    before = computed_by_each_hop(swarm)
    warm = await chat(swarm, messages, **ask)
    whole = (prompt - 1) // 64 * 64
    assert warm.usage.prompt_tokens_details.cached_tokens == whole
    assert [a - b for a, b in zip(computed_by_each_hop(swarm), before, strict=True)] == [prompt - whole] * 2
    assert logprobs_of(warm) == logprobs_of(cold)  # bit for bit, not within a tolerance
    plain = await chat(swarm, messages)
    assert plain.usage.prompt_tokens_details.cached_tokens == prompt - 1  # down to the token
