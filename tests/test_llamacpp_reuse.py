"""Prefix reuse (issue #18) on real llama.cpp shards of the bundled Gemma 3 270M, through the gateway and the
official client: the second turn of a chat takes every whole prefill chunk of the conversation so far from what the
first turn left on the nodes (every hop counts what it reused), prefills only the rest, and answers as a cold run of
the same request does. Positions the first turn decoded one at a time differ from a cold prefill's only as two batch
shapes of llama.cpp do, so a differing token is allowed only where the cold run's two best logits are within the
batch-noise bound (``BATCH_NOISE``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from bus.server import EmbeddedNats
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
    common: dict[str, Any] = dict(max_sessions=2, threads=1, cuts=(0, 9, 18), n_ctx=2048, prefill_chunk=64)
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
