"""A short prompt pipelined through a real 2-node llama.cpp route in sub-chunks (issue #26, ``prefill_subchunks``):
the head computes the second part while the tail computes the first (each hop counts two prefill steps), and the
greedy text is llama.cpp's in one process, or parts from it only where llama.cpp's two best logits nearly tie (the
sub-chunks' batch shapes round differently from one step's in ggml's kernels: ``BATCH_NOISE``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import openai
import pytest
import pytest_asyncio

from actors.node import Node
from bus.server import EmbeddedNats
from tests.support.swarm import Swarm, gemma_route
from tests.test_llamacpp_gateway import BATCH_NOISE

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
MODEL = "gemma"
N = 24


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def route(module_nats: EmbeddedNats, gemma_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async with gemma_route(module_nats.url, gemma_path, tmp_path_factory.mktemp("subchunks"), namespace="subchunks",
                           max_sessions=2, threads=1, cuts=(0, 9, 18), prefix_cache_mb=0,
                           prefill_subchunks=2) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def reference(gemma_path: Path) -> Iterator[llama_cpp.Llama]:
    llm = llama_cpp.Llama(str(gemma_path), n_ctx=1024, n_threads=1, n_threads_batch=1, verbose=False, logits_all=True)
    yield llm
    llm.close()


def greedy(llm: llama_cpp.Llama, prompt: str) -> Any:
    llm.reset()  # no prefix reuse from the previous call: a fresh prompt, as the node runs it
    return llm.create_completion(prompt, max_tokens=N, temperature=0.0, logprobs=2)["choices"][0]  # type: ignore[index]


def prefill_steps(node: Node) -> float:
    return next((s.value for m in node.metrics.step_seconds.collect() for s in m.samples
                 if s.name == "swarmroute_node_step_seconds_count" and s.labels.get("kind") == "prefill"), 0.0)


@pytest.mark.parametrize("prompt", ["The apple 3: the capital of France is", "def fibonacci(n): return n if n < 2 else",
                                    "Once upon a time, in a land far away, there lived",
                                    "The recipe for a good harbour chowder starts with the fish, then the"])
async def test_a_short_prompt_in_sub_chunks_gives_llama_cpp_s_greedy_text(route: Swarm, reference: llama_cpp.Llama,
                                                                          prompt: str) -> None:
    expected = await asyncio.to_thread(greedy, reference, prompt)
    steps = [prefill_steps(n) for n in route.nodes]
    client = openai.AsyncOpenAI(base_url=route.base_url, api_key="unused", max_retries=0, timeout=300)
    got = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0)
    assert got.usage is not None and got.usage.prompt_tokens >= 8  # two sub-chunks of 4 or more
    assert [prefill_steps(n) - s for n, s in zip(route.nodes, steps, strict=True)] == [2, 2]
    text = got.choices[0].text
    if text == expected["text"]:
        return
    logprobs = expected["logprobs"]
    done = ""
    for at, token in enumerate(logprobs["tokens"]):  # noqa: B007 - the first token where the two texts part
        if not text.startswith(done + token):
            break
        done += token
    best = sorted(logprobs["top_logprobs"][at].values(), reverse=True)
    assert best[0] - best[1] < BATCH_NOISE, (at, best, text, expected["text"])
