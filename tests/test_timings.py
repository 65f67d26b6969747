"""llama.cpp-style ``timings`` (issue #26): llama-server's figures on every reply's last chunk (chat and text
completions, streamed and not) and, with ``timings_per_token``, on every token's chunk, from what the route measured.

Checked for presence and consistency, never for speed: the prompt's computed and reused tokens add up to its token
count, the tokens predicted are the completion's, drafts accepted are at most those verified, and the per-token and
per-second figures follow from the counts and times as llama-server derives them. Through the official ``openai``
client (the figures are an unknown field to it: ``model_extra``) on the bundled Gemma served by llama.cpp.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio

from gateway.timings import timings
from schemas.openai import CompletionRequest
from schemas.session import SessionPhase
from schemas.telemetry import GenerationTelemetry, PrefillProgress, SpeculationView

FIELDS = {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "cache_n", "predicted_n",
          "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
"""llama-server's ``server_slot_stats::to_json`` keys; ``draft_n`` and ``draft_n_accepted`` only after drafts."""


def consistent(t: dict[str, Any], *, prompt_tokens: int, completion_tokens: int) -> None:
    assert set(t) >= FIELDS
    assert t["prompt_n"] + t["cache_n"] == prompt_tokens and t["cache_n"] >= 0
    assert t["predicted_n"] == completion_tokens
    assert t["prompt_ms"] >= 0 and t["predicted_ms"] >= 0
    if t["prompt_ms"] > 0 and t["prompt_n"]:
        assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"], abs=1e-3)
        assert t["prompt_per_second"] == pytest.approx(1e3 * t["prompt_n"] / t["prompt_ms"], rel=1e-3)
    steps = t["predicted_n"] - 1  # the first token comes with the prefill
    if t["predicted_ms"] > 0 and steps > 0:
        assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / steps, abs=1e-3)
        assert t["predicted_per_second"] == pytest.approx(1e3 * steps / t["predicted_ms"], rel=1e-3)
    if "draft_n" in t:
        assert 0 <= t["draft_n_accepted"] <= t["draft_n"]


def test_the_figures_follow_from_the_routes_telemetry() -> None:
    snap = GenerationTelemetry(session_id="s", phase=SessionPhase.COMPLETE, prefill=PrefillProgress(
        done=40, total=40, reused=32), ttft_ms=20.0, elapsed_ms=120.0, generated_tokens=11)
    t = timings(40, 11, snap).model_dump(mode="json")
    assert t == {"cache_n": 32, "prompt_n": 8, "prompt_ms": 20.0, "prompt_per_token_ms": 2.5,
                 "prompt_per_second": 400.0, "predicted_n": 11, "predicted_ms": 100.0,
                 "predicted_per_token_ms": 10.0, "predicted_per_second": 100.0}  # no drafts: no draft keys
    spec = snap.model_copy(update={"speculation": SpeculationView(source="ngram", drafts_offered=9,
                                                                  drafts_accepted=4)})
    t = timings(40, 11, spec).model_dump(mode="json")
    assert (t["draft_n"], t["draft_n_accepted"]) == (9, 4)
    empty = timings(5, 0, None).model_dump(mode="json")  # nothing measured yet: zeros, never a division by zero
    assert empty["prompt_n"] == 5 and empty["predicted_per_second"] == 0.0 and empty["prompt_per_token_ms"] == 0.0


def test_timings_per_token_is_a_strict_boolean() -> None:
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x", "timings_per_token": True}).timings_per_token
    with pytest.raises(ValueError, match="timings_per_token"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "timings_per_token": "yes"})


# ---- the real route -------------------------------------------------------------------------------------------------

llama_cpp = pytest.importorskip("llama_cpp")

from actors.backends import load_backend  # noqa: E402
from bus.server import EmbeddedNats  # noqa: E402
from tests.support.swarm import Swarm, gemma_route, make_settings, start_swarm  # noqa: E402

MODEL = "gemma"
N = 12
MESSAGES: list[Any] = [{"role": "user", "content": "Name three colours."}]
_namespaces = itertools.count()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, gemma_path: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    backend = load_backend("llamacpp", model_path=gemma_path, n_ctx=1024, max_sessions=2, threads=1)  # see below
    # Small prefill chunks: reuse is whole chunks (issue #26 makes it token-exact), and these prompts are short.
    settings = make_settings(module_nats.url, tmp_path_factory.mktemp("timings") / "home", namespace="timings",
                             token_timeout_s=60.0, first_token_timeout_s=120.0, hop_timeout_s=60.0,
                             prefill_chunk=8)
    s = await start_swarm(settings, [backend], model_id=MODEL)
    yield s
    await s.stop()
    backend.close()


# One thread per node: on a 2-core machine under a load of ~20, two llama.cpp threads were seen to stall a session
# for minutes (on main as well).

def client(swarm: Swarm) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=300)


def of(obj: Any) -> dict[str, Any] | None:
    return (obj.model_extra or {}).get("timings")




@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_whole_replies_carry_timings_beside_the_telemetry(swarm: Swarm) -> None:
    chat = await client(swarm).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)
    assert chat.usage is not None and (chat.model_extra or {}).get("swarmroute")
    t = of(chat)
    assert t is not None
    consistent(t, prompt_tokens=chat.usage.prompt_tokens, completion_tokens=chat.usage.completion_tokens)
    text = await client(swarm).completions.create(model=MODEL, prompt="The colours of the rainbow are",
                                                  max_tokens=N, temperature=0)
    assert text.usage is not None and text.to_dict()["timings"] == of(text)
    consistent(of(text) or {}, prompt_tokens=text.usage.prompt_tokens,
               completion_tokens=text.usage.completion_tokens)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_stream_carries_them_on_its_last_chunk_only(swarm: Swarm, include_usage: bool) -> None:
    stream = await client(swarm).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True} if include_usage else None)
    chunks = [c async for c in stream]
    assert [i for i, c in enumerate(chunks) if of(c) is not None] == [len(chunks) - 1]
    tokens = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    last = chunks[-1]
    t = of(last)
    assert t is not None
    if include_usage:
        assert last.usage is not None and not last.choices
        consistent(t, prompt_tokens=last.usage.prompt_tokens, completion_tokens=last.usage.completion_tokens)
    else:
        assert last.choices[0].finish_reason == "length"
        assert t["predicted_n"] == N and t["predicted_n"] >= tokens
    text = await client(swarm).completions.create(model=MODEL, prompt="The colours of the rainbow are",
                                                  max_tokens=N, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    text_chunks = [c async for c in text]
    assert [i for i, c in enumerate(text_chunks) if of(c) is not None] == [len(text_chunks) - 1]
    usage = text_chunks[-1].usage
    assert usage is not None
    consistent(of(text_chunks[-1]) or {}, prompt_tokens=usage.prompt_tokens,
               completion_tokens=usage.completion_tokens)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_timings_per_token_puts_the_figures_so_far_on_every_tokens_chunk(swarm: Swarm) -> None:
    stream = await client(swarm).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"timings_per_token": True, "ignore_eos": True})
    chunks = [c async for c in stream]
    token_chunks = [c for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert token_chunks and all(of(c) is not None for c in token_chunks)
    counts = [of(c)["predicted_n"] for c in token_chunks]  # type: ignore[index]
    assert counts == sorted(counts) and counts[-1] <= N
    times = [of(c)["predicted_ms"] for c in token_chunks]  # type: ignore[index]
    assert times == sorted(times)
    usage = chunks[-1].usage
    assert usage is not None
    for c in token_chunks:
        t = of(c)
        assert t is not None and t["prompt_n"] + t["cache_n"] == usage.prompt_tokens
    consistent(of(chunks[-1]) or {}, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_the_next_turn_counts_its_reused_prompt_as_cache_n(swarm: Swarm) -> None:
    first = await client(swarm).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N, temperature=0)
    turn = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And three more?"}]
    second = await client(swarm).chat.completions.create(model=MODEL, messages=turn, max_tokens=N, temperature=0)
    assert second.usage is not None
    t = of(second)
    assert t is not None and t["cache_n"] > 0  # the kept first turn's KV
    consistent(t, prompt_tokens=second.usage.prompt_tokens, completion_tokens=second.usage.completion_tokens)


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="module")
async def test_a_speculative_route_reports_its_drafts(module_nats: EmbeddedNats, gemma_path: Path,
                                                     tmp_path: Path) -> None:
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,"
    async with gemma_route(module_nats.url, gemma_path, tmp_path, namespace=f"tspec{next(_namespaces)}",
                           max_sessions=2, threads=1, speculation="ngram") as route:
        reply = await client(route).completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                       extra_body={"ignore_eos": True})
    assert reply.usage is not None
    t = of(reply)
    assert t is not None and t.get("draft_n", 0) > 0
    consistent(t, prompt_tokens=reply.usage.prompt_tokens, completion_tokens=reply.usage.completion_tokens)
