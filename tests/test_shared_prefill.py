"""Sampled n > 1 shares one prefill (issue #26, item 3): every hop computes a prompt's positions once, whatever ``n``,
and forks the prompt's KV into the choices after its last chunk (``StepInput.forks``).

Counted with ``swarmroute_node_prefill_positions`` on every hop, through the gateway and the official client, on a
real llama.cpp route of the bundled Gemma 3 270M and on a torch route of tiny-llama: for chat and completions, cold
(nothing to reuse) and warm (token-exact prefix reuse: the prompt again computes its last token only, for n = 4 as for
n = 1). The four choices are really sampled apart (distinct texts), so the count is of a real fork, not of one
sequence fanned out. The Responses API has no ``n`` (OpenAI's neither): it is refused, naming the field.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from bus.server import EmbeddedNats
from tests.support.swarm import Swarm, Swarms, gemma_route, make_settings

ON_GEMMA = pytest.mark.asyncio(loop_scope="module")

GEMMA = "gemma"
TINY = "tiny-llama"
N = 4
STORY = ("The harbour master walked along the quay at dawn, counting the boats that had come in overnight and "
         "writing their names in a small notebook. ")


def computed(swarm: Swarm) -> list[float]:
    return [node.metrics.prefill_positions._value.get() for node in swarm.nodes]  # noqa: SLF001


def client(swarm: Swarm) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=300)


async def counted(swarm: Swarm, call: Any) -> tuple[list[float], Any]:
    """What every hop computed for one request, and its reply."""
    before = computed(swarm)
    reply = await call
    await swarm.freed()
    return [a - b for a, b in zip(computed(swarm), before, strict=True)], reply


def texts(reply: Any) -> list[str]:
    return [c.text if hasattr(c, "text") else c.message.content or "" for c in sorted(reply.choices,
                                                                                      key=lambda c: c.index)]


def completion(swarm: Swarm, model: str, prompt: str | list[int], n: int) -> Any:
    return client(swarm).completions.create(model=model, prompt=prompt, max_tokens=12, temperature=1.0, seed=7, n=n,
                                            extra_body={"ignore_eos": True})


def chat(swarm: Swarm, model: str, content: str, n: int) -> Any:
    return client(swarm).chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                 max_tokens=12, temperature=1.0, seed=7, n=n,
                                                 extra_body={"ignore_eos": True})


async def one_prefill_each(swarm: Swarm, make: Any, prompt: Any) -> None:
    """On a route that reuses nothing, n = 4 computes on every hop what n = 1 computes: the whole prompt, once."""
    single, reply1 = await counted(swarm, make(prompt, 1))
    several, reply4 = await counted(swarm, make(prompt, N))
    assert reply1.usage.prompt_tokens == reply4.usage.prompt_tokens
    assert single == several == [reply4.usage.prompt_tokens] * len(swarm.nodes), (single, several)
    assert len(reply4.choices) == N and len(set(texts(reply4))) > 1  # sampled apart: real forks


async def warm_like_n1(swarm: Swarm, make: Any, prompt: Any) -> None:
    """On a route that reuses a kept prefix: the prompt again computes its last token only, for n = 4 as for
    n = 1 (and the kept prefix a forked session leaves is reused in turn)."""
    await counted(swarm, make(prompt, 1))  # keeps the prompt
    several, reply4 = await counted(swarm, make(prompt, N))
    single, _ = await counted(swarm, make(prompt, 1))
    assert several == single == [1] * len(swarm.nodes), (several, single)
    assert reply4.usage.prompt_tokens_details.cached_tokens == reply4.usage.prompt_tokens - 1
    assert len(reply4.choices) == N and len(set(texts(reply4))) > 1


# ---- llama.cpp ------------------------------------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gemma(module_nats: EmbeddedNats, gemma_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Swarm, Swarm]]:
    pytest.importorskip("llama_cpp")
    work = tmp_path_factory.mktemp("nshare")
    common: dict[str, Any] = dict(max_sessions=N + 2, threads=1, cuts=(0, 9, 18), n_ctx=1024, prefill_chunk=32,
                                  prefix_reuse="token")
    async with contextlib.AsyncExitStack() as stack:
        cold = await stack.enter_async_context(gemma_route(module_nats.url, gemma_path, work / "cold",
                                                           namespace="nshare-cold", prefix_cache_mb=0, **common))
        warm = await stack.enter_async_context(gemma_route(module_nats.url, gemma_path, work / "warm",
                                                           namespace="nshare-warm", **common))
        yield cold, warm


@pytest.mark.slow
@ON_GEMMA
async def test_llamacpp_completion_n4_prefills_once(gemma: tuple[Swarm, Swarm]) -> None:
    cold, _ = gemma
    await one_prefill_each(cold, lambda p, n: completion(cold, GEMMA, p, n), STORY * 2)


@pytest.mark.slow
@ON_GEMMA
async def test_llamacpp_chat_n4_prefills_once(gemma: tuple[Swarm, Swarm]) -> None:
    cold, _ = gemma
    await one_prefill_each(cold, lambda p, n: chat(cold, GEMMA, p, n), STORY + "Which boats came in?")


@pytest.mark.slow
@ON_GEMMA
async def test_llamacpp_completion_n4_reuses_a_kept_prefix_as_n1_does(gemma: tuple[Swarm, Swarm]) -> None:
    _, warm = gemma
    await warm_like_n1(warm, lambda p, n: completion(warm, GEMMA, p, n), STORY * 3)


@pytest.mark.slow
@ON_GEMMA
async def test_llamacpp_chat_n4_reuses_a_kept_prefix_as_n1_does(gemma: tuple[Swarm, Swarm]) -> None:
    _, warm = gemma
    await warm_like_n1(warm, lambda p, n: chat(warm, GEMMA, p, n), STORY + "Who counted the boats?")


@ON_GEMMA
async def test_responses_have_no_n(gemma: tuple[Swarm, Swarm]) -> None:
    cold, _ = gemma
    async with httpx.AsyncClient(base_url=cold.base_url) as http:
        r = await http.post("/responses", json={"model": GEMMA, "input": "Hello", "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


# ---- torch ------------------------------------------------------------------------------------------------------


@pytest.fixture
def torch_route() -> Any:
    pytest.importorskip("torch")
    from tests.support.torch_route import build_route

    return build_route


@pytest.mark.asyncio
async def test_torch_n4_prefills_once_cold_and_warm(nats_server: EmbeddedNats, tmp_path: Path, swarms: Swarms,
                                                    torch_route: Any) -> None:
    bounds = (0, 2, 4, 6)
    routes = []
    for name, cache_mb in (("cold", 0.0), ("warm", 256.0)):
        settings = make_settings(nats_server.url, tmp_path / name, namespace=f"nshare-{name}", prefill_chunk=16,
                                 prefix_reuse="token", prefix_cache_mb=cache_mb)
        routes.append(await swarms.start(settings, torch_route(TINY, bounds, max_sessions=N + 2), model_id=TINY))
    cold, warm = routes
    prompt = [2, *[3 + (i * 7) % 250 for i in range(40)]]
    await one_prefill_each(cold, lambda p, n: completion(cold, TINY, p, n), prompt)
    await warm_like_n1(warm, lambda p, n: completion(warm, TINY, p, n), prompt)
