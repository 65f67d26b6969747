"""Token-exact prefix reuse (issue #26) on the torch backend behind real nodes, tracker and gateway (real NATS, HTTP
on loopback, the official openai client): for each of the four cases (the same prompt again, a prompt that diverges
in its last tokens, users of one system prompt, a tool loop) a warm request's greedy text equals a cold route's,
every hop computes the prompt's new positions only (``node_prefill_positions``), and usage counts what was reused.
torch keeps its KV in host pieces (it parks nothing), so this is the second tier; tiny-llama has no sliding window, so
any common prefix can be taken, however long ago the kept session went past it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from schemas.settings import Settings
from tests.support.swarm import Swarm, Swarms, make_settings
from tests.support.torch_route import build_route

pytest.importorskip("torch")

MODEL = "tiny-llama"
BOUNDS = (0, 2, 4, 6)
SYSTEM = [2, *[3 + (i * 11) % 250 for i in range(60)]]


def settings_for(nats_url: str, home: Path, **kw: Any) -> Settings:
    return make_settings(nats_url, home, prefill_chunk=16, prefix_reuse="token", **kw)


async def complete(swarm: Swarm, prompt: list[int], max_tokens: int = 8) -> Any:
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    return await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True})


def computed(swarm: Swarm) -> list[float]:
    return [node.metrics.prefill_positions._value.get() for node in swarm.nodes]  # noqa: SLF001


async def warm_request(warm: Swarm, cold: Swarm, prompt: list[int], reused: int) -> str:
    before = computed(warm)
    reply = await complete(warm, prompt)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    assert (reply.model_extra or {})["swarmroute"]["prefill"].get("reused", 0) == reused
    assert reply.usage.prompt_tokens_details.cached_tokens == reused  # type: ignore[union-attr]
    assert [a - b for a, b in zip(computed(warm), before, strict=True)] == [len(prompt) - reused] * len(BOUNDS[1:])
    text = reply.choices[0].text
    assert text == (await complete(cold, prompt)).choices[0].text
    return text


async def test_the_four_reuse_cases_compute_only_new_tokens_and_answer_as_cold(nats_server: Any, tmp_path: Path,
                                                                               swarms: Swarms) -> None:
    warm = await swarms.start(settings_for(nats_server.url, tmp_path / "warm"), build_route(MODEL, BOUNDS),
                              model_id=MODEL)
    cold = await swarms.start(settings_for(nats_server.url, tmp_path / "cold", prefix_cache_mb=0, namespace="cold"),
                              build_route(MODEL, BOUNDS), model_id=MODEL)
    same = [*SYSTEM, 40, 41, 42]
    await complete(warm, same)
    await warm_request(warm, cold, same, len(same) - 1)  # the same prompt again: its last token only

    diverging = [*same[:-2], 77, 78]
    await warm_request(warm, cold, diverging, len(same) - 2)  # from where it diverges

    for user in ([90, 91, 92, 93], [100, 101], [110, 111, 112]):  # users of one system prompt
        await warm_request(warm, cold, [*SYSTEM, *user], len(SYSTEM))

    loop = [*SYSTEM, 120, 121]
    await complete(warm, loop)
    for result in ([130, 131, 132], [140, 141]):  # each turn resends the conversation, its reply, a tool result
        said = reply_tokens(warm, loop)
        assert len(said) == 7  # the kept KV: the prompt and every generated token but the last (never computed)
        turn = [*loop, *said, *result]
        await warm_request(warm, cold, turn, len(loop) + len(said))
        loop = turn


def reply_tokens(swarm: Swarm, prompt: list[int]) -> list[int]:
    """The tokens the last session on ``prompt`` generated, as the head kept them (its entry's tokens past the
    prompt)."""
    match = swarm.nodes[0].reuse.cache.match([*prompt, -1])  # type: ignore[attr-defined]
    assert match is not None and match[2] == len(prompt)
    return list(match[1].tokens[len(prompt):])
