"""n > 1 and logprobs through real nodes (actors/node/choices.py): the official ``openai`` client -> gateway -> real
NATS and tracker -> stub nodes on loopback, on a 2-node route (every hop forks, frames name their choice) and on one
node (head and tail together: the choices step in lockstep).

At temperature 0 the route decodes one choice and the gateway gives its tokens to all n (gateway/fanout.py): the
choices are the n = 1 reply by construction, on any backend, and n may exceed what the route holds. Sampled choices
fork on every hop; they are what exercises the forks here (seeded reproducibility, batched forward passes, each
choice's logprobs). Logprobs are checked against the stub's own logits for the same tokens, driven directly.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import pytest_asyncio

from actors.backend import StepInput
from actors.backends.stub import StubBackend, StubConfig
from bus.server import EmbeddedNats
from schemas.errors import BadRequestError, CapacityError
from schemas.route import RouteRequest
from schemas.session import Prompt, SamplingParams, SessionOpen
from tests.support.swarm import Swarm, make_settings, start_swarm

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "stub-model"
MAX_SESSIONS = 6
_namespaces = itertools.count()


def stubs(*ranges: tuple[int, int]) -> list[StubBackend]:
    return [StubBackend(StubConfig(model=MODEL, n_layers=8, layer_start=a, layer_end=b, max_sessions=MAX_SESSIONS))
            for a, b in ranges]


async def _swarm(server: EmbeddedNats, home: Path, backends: list[StubBackend]) -> AsyncIterator[Swarm]:
    settings = make_settings(server.url, home, namespace=f"choices{next(_namespaces)}")
    s = await start_swarm(settings, backends, model_id=MODEL)
    yield s
    await s.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def two(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async for s in _swarm(module_nats, tmp_path_factory.mktemp("two"), stubs((0, 3), (3, 8))):
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def one(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async for s in _swarm(module_nats, tmp_path_factory.mktemp("one"), stubs((0, 8))):
        yield s


def client(swarm: Swarm) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)


async def streamed_choices(swarm: Swarm, **kw: Any) -> tuple[dict[int, str], dict[int, str | None], Any]:
    stream = await client(swarm).completions.create(model=MODEL, stream=True,
                                                    stream_options={"include_usage": True}, **kw)
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    return texts, finishes, usage


async def test_n3_greedy_gives_three_equal_choices_on_two_nodes(two: Swarm) -> None:
    await three_equal_choices(two)


async def test_n3_greedy_gives_three_equal_choices_on_one_node(one: Swarm) -> None:
    await three_equal_choices(one)


async def three_equal_choices(swarm: Swarm) -> None:
    """n = 3 at temperature 0: three choices equal to n = 1, streamed and not; usage counts them all."""
    body: dict[str, Any] = {"prompt": "The fox", "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    single = await client(swarm).completions.create(model=MODEL, **body)
    whole = await client(swarm).completions.create(model=MODEL, n=3, **body)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [single.choices[0].text] * 3
    assert [c.finish_reason for c in whole.choices] == ["length"] * 3
    assert whole.usage is not None and whole.usage.completion_tokens == 3 * 12
    texts, finishes, usage = await streamed_choices(swarm, n=3, **body)
    assert texts == {i: single.choices[0].text for i in range(3)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 36
    await swarm.freed()


async def test_greedy_choices_are_one_sequence_on_every_hop(two: Swarm) -> None:
    """More greedy choices than the route can hold at once: one sequence, decoded alone (no batch of choices on
    any hop), given to every choice; the same n sampled is a 400, since every sampled choice is a sequence."""
    n = MAX_SESSIONS + 1
    body: dict[str, Any] = {"prompt": "The fox", "max_tokens": 10, "extra_body": {"ignore_eos": True}}
    single = await client(two).completions.create(model=MODEL, temperature=0, **body)
    engines = [node.engine for node in two.nodes]
    for e in engines:
        e.max_batch_seen = 0
    texts, finishes, usage = await streamed_choices(two, n=n, temperature=0, **body)
    assert texts == {i: single.choices[0].text for i in range(n)}
    assert finishes == dict.fromkeys(range(n), "length")
    assert usage is not None and usage.completion_tokens == n * 10
    assert [e.max_batch_seen for e in engines] == [1, 1]
    with pytest.raises(openai.BadRequestError) as info:
        await client(two).completions.create(model=MODEL, n=n, temperature=1.0, seed=1, **body)
    assert info.value.param == "n"
    await two.freed()


async def test_seeded_choices_are_reproducible_and_choice_0_is_n1(two: Swarm) -> None:
    body: dict[str, Any] = {"prompt": "Once", "max_tokens": 16, "temperature": 1.0, "seed": 7,
                            "extra_body": {"ignore_eos": True}}
    first = await client(two).completions.create(model=MODEL, n=3, **body)
    again = await client(two).completions.create(model=MODEL, n=3, **body)
    single = await client(two).completions.create(model=MODEL, **body)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert texts[0] == single.choices[0].text
    assert len(set(texts)) > 1  # seed + i: the choices draw differently
    await two.freed()


def reference_logprobs(prompt: Prompt, n_tokens: int, top: int,
                       picks: list[int] | None = None) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """The stub's own run of the whole model, with the log-softmax of every pick's logits: its greedy picks, or
    ``picks`` teacher-forced (a sampled choice's tokens)."""
    backend = stubs((0, 8))[0]
    tokens = backend.tokenize(prompt)
    backend.open_session("ref", prompt_tokens=tokens, sampling=SamplingParams(temperature=0))
    out = []
    item = StepInput("ref", 0, tokens=tokens, sample=True)
    for i in range(n_tokens):
        sampled = backend.step([item])[0].token
        token = sampled if picks is None else picks[i]
        assert token is not None
        logits = backend.last_logits("ref")
        lp = logits - logits.max()
        lp -= np.log(np.exp(lp).sum())
        best = sorted(range(len(lp)), key=lambda t: (-lp[t], t))[:top]
        out.append((token, float(lp[token]), [(t, float(lp[t])) for t in best]))
        item = StepInput("ref", item.start_position + item.n_positions, tokens=[token], sample=True)
    return out


async def test_chat_logprobs_equal_the_backends_for_every_choice(two: Swarm) -> None:
    # Chat renders the stub's prompt as text; the reference takes the same tokens the head tokenized.
    ref = reference_logprobs(Prompt(text="The fox"), 8, 3)
    got = await client(two).completions.create(model=MODEL, prompt="The fox", max_tokens=8, temperature=0, n=2,
                                               logprobs=3, extra_body={"ignore_eos": True})
    for choice in got.choices:
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.tokens == [chr(t) for t, _, _ in ref]
        assert np.allclose(lp.token_logprobs, [x for _, x, _ in ref], atol=1e-5)
        for entry, (_, _, best) in zip(lp.top_logprobs, ref, strict=True):
            assert set(entry) == {chr(t) for t, _ in best}
            assert np.allclose(sorted(entry.values()), sorted(x for _, x in best), atol=1e-5)
    stream = await client(two).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, n=2,
        logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    entries: dict[int, list[Any]] = {0: [], 1: []}
    texts: dict[int, str] = {0: "", 1: ""}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                entries[c.index] += c.logprobs.content
    assert len(entries[0]) == len(entries[1]) == 6
    assert "".join(e.token for e in entries[0]) == texts[0] == texts[1]
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries[0])
    await two.freed()


async def test_sampled_choices_logprobs_equal_the_backends(two: Swarm) -> None:
    """Forked choices (sampled: each its own sequence on every hop) carry their own tokens' logprobs."""
    ask: list[Any] = [{"role": "user", "content": "hi"}]
    stub = stubs((0, 8))[0]
    got = await client(two).chat.completions.create(model=MODEL, messages=ask, max_tokens=8,
                                                    temperature=1.0, seed=5, n=2, logprobs=True, top_logprobs=3,
                                                    extra_body={"ignore_eos": True})
    picks = {}
    for choice in got.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        # The stub's tokens are bytes (the seed draws no BOS, whose bytes are empty): the bytes give the ids back.
        assert len(content) == 8 and all(len(e.bytes or []) == 1 for e in content)
        picks[choice.index] = [(e.bytes or [])[0] for e in content]
        ref = reference_logprobs(Prompt(messages=ask), 8, 3, picks=picks[choice.index])
        assert np.allclose([e.logprob for e in content], [x for _, x, _ in ref], atol=1e-5)
        for entry, (_, _, best) in zip(content, ref, strict=True):
            assert [bytes(t.bytes or []) for t in entry.top_logprobs] == [stub.token_bytes(t) for t, _ in best]
            assert np.allclose([t.logprob for t in entry.top_logprobs], [x for _, x in best], atol=1e-5)
    assert picks[0] != picks[1]  # seed + i: two sequences that drew differently
    await two.freed()


async def test_n_over_the_route_capacity_is_a_400_naming_n(two: Swarm) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{two.base_url}/completions",
                            json={"model": MODEL, "prompt": "x", "max_tokens": 2, "n": MAX_SESSIONS + 1,
                                  "temperature": 1.0})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"
    await two.freed()


async def test_choices_share_forward_passes(two: Swarm) -> None:
    engines = [n.engine for n in two.nodes]
    for e in engines:
        e.max_batch_seen = 0
    # Sampled: greedy choices would be one sequence (test_greedy_choices_are_one_sequence_on_every_hop).
    await client(two).completions.create(model=MODEL, prompt="batch", max_tokens=24, temperature=1.0, seed=2, n=4,
                                         extra_body={"ignore_eos": True})
    assert all(e.max_batch_seen >= 2 for e in engines)  # the choices decoded batched on every hop
    await two.freed()


async def test_a_node_reserves_a_sequence_per_choice(two: Swarm) -> None:
    """Every choice forks into a sequence of its own after prefill, so a node reserves all of them at open: what
    does not fit is refused at once (429), not half-way through the prefill."""
    node = two.nodes[1]
    route = two.tracker.route(RouteRequest(model=MODEL, session_id="probe")).route
    assert route is not None
    ids = [uuid.uuid4().hex for _ in range(2)]
    opens = [SessionOpen(session_id=ids[i], route=route, hop_index=1, prompt_tokens=[1, 2], max_tokens=4,
                         n=4) for i in range(2)]
    await node.open_session(opens[0])
    try:
        assert node.sequences_in_use() == 4 and node.advertisement().capacity.active_sessions == 4
        with pytest.raises(CapacityError):
            await node.open_session(opens[1])  # 4 + 4 > 6
        with pytest.raises(BadRequestError) as info:
            await node.open_session(opens[1].model_copy(update={"n": MAX_SESSIONS + 1}))
        assert info.value.param == "n"
    finally:
        await node.sessions[ids[0]].close()
    assert node.sequences_in_use() == 0
    await two.freed()
