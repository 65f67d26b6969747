"""Issue #20 on the performance path: the bundled Gemma 3 270M as real 2- and 3-node llama.cpp routes, greedy with
speculation (prompt lookup, windows in flight) against plain greedy, through the gateway and the official client.

A verify window computes several positions in one forward pass, and ggml's CPU kernels are not batch-invariant,
so the two runs may pick different tokens where the plain run's two best logits are close: the texts must agree up
to the first token where they differ, and that token's top-2 margin in the plain run must be within the batch-noise
bound (``BATCH_NOISE``, measured for this backend: tests/test_llamacpp_gateway.py). Flips are counted and printed;
on the stub and torch backends (tests/test_speculative_route.py) there are none."""

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
PROMPTS = [
    "Repeat after me exactly: the red fox runs past the old mill, the red fox runs past the old mill, the red fox",
    "def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return a + b + c\n\n\ndef add4(a, b, c, d):\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday, Wednesday,",
]


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[(0, 12, 18), (0, 6, 12, 18)],
                        ids=["2-node", "3-node"])
async def routes(request: Any, module_nats: EmbeddedNats, gemma_path: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Swarm, Swarm]]:
    work = tmp_path_factory.mktemp("spec")
    common: dict[str, Any] = dict(max_sessions=2, threads=1, cuts=request.param, prefix_cache_mb=0)
    name = f"spec{len(request.param)}"
    async with contextlib.AsyncExitStack() as stack:
        plain = await stack.enter_async_context(gemma_route(module_nats.url, gemma_path, work / "plain",
                                                            namespace=f"{name}-plain", **common))
        spec = await stack.enter_async_context(gemma_route(module_nats.url, gemma_path, work / "spec",
                                                           namespace=f"{name}-spec", speculation="ngram",
                                                           speculative_windows=2, **common))
        yield plain, spec


def client(swarm: Swarm) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=300)


async def test_greedy_with_speculation_is_greedy_without_up_to_batch_noise(routes: tuple[Swarm, Swarm]) -> None:
    plain, spec = routes
    flips, drafts = 0, 0
    for prompt in PROMPTS:
        ref = await client(plain).completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                                     logprobs=2, extra_body={"ignore_eos": True})
        got = await client(spec).completions.create(model=MODEL, prompt=prompt, max_tokens=48, temperature=0,
                                                    extra_body={"ignore_eos": True})
        view = (got.model_extra or {})["swarmroute"]["speculation"]
        drafts += view["drafts_accepted"]
        expected, text = ref.choices[0].text, got.choices[0].text
        if text == expected:
            continue
        lp = ref.choices[0].logprobs
        assert lp is not None and lp.top_logprobs is not None and lp.text_offset is not None
        at = next(i for i, (a, b) in enumerate(zip(expected, text, strict=False)) if a != b) \
            if any(a != b for a, b in zip(expected, text, strict=False)) else min(len(expected), len(text))
        token = max(i for i, offset in enumerate(lp.text_offset) if offset <= at)  # offsets in the completion
        best = sorted(lp.top_logprobs[token].values(), reverse=True)
        margin = best[0] - best[1] if len(best) > 1 else float("inf")
        assert margin < BATCH_NOISE, (prompt, token, margin, expected, text)
        flips += 1
    print(f"speculative greedy: {flips} flip(s) at near-ties over {len(PROMPTS)} prompts; {drafts} drafts accepted")
    assert drafts > 0, "no window carried an accepted draft: the test proved nothing about speculation"


async def test_every_hop_frees_the_session(routes: tuple[Swarm, Swarm]) -> None:
    _, spec = routes
    await client(spec).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
    await spec.freed()
    for backend in spec.backends:
        assert all(backend.seq_cells(s) == (-1, -1) for s in range(backend.max_sessions + 1))

