"""Prefix reuse (issue #18) on the stub backend, through the gateway and the official client: the next turn of a
chat computes only its new positions on every hop, and says so; its text equals a cold run's (the stub computes
exactly, so a reused KV that differed in any value would change the text)."""

from __future__ import annotations

from typing import Any

import openai

from actors.node.spot_check import SCRATCH_PREFIX
from schemas.settings import Settings
from tests.support.swarm import Swarm, Swarms, make_settings, stub

MODEL = "stub-model"
CHUNK = 4


def settings_for(nats_url: str, home: Any, **kw: Any) -> Settings:
    return make_settings(nats_url, home, prefill_chunk=CHUNK, prefix_reuse="token", **kw)


async def chat(swarm: Swarm, messages: list[dict[str, str]], max_tokens: int = 24) -> tuple[str, dict[str, Any]]:
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                                 temperature=0, extra_body={"ignore_eos": True})
    return reply.choices[0].message.content or "", (reply.model_extra or {})["swarmroute"]


def computed(swarm: Swarm) -> list[dict[str, int]]:
    """Positions each node computed per closed session: the clients' sessions, not a spot check's scratch one (a
    node checks another's receipt at the default rate, 5% of sessions)."""
    return [{k: v for k, v in node.backend.closed_positions.items()  # type: ignore[attr-defined]
             if not k.startswith(SCRATCH_PREFIX)} for node in swarm.nodes]


async def test_the_second_turn_prefills_only_what_is_new(nats_server: Any, tmp_path: Any, swarms: Swarms) -> None:
    settings = settings_for(nats_server.url, tmp_path / "home")
    swarm = await swarms.start(settings, [stub(0, 3), stub(3, 6), stub(6, 8)], model_id=MODEL)
    turn1 = [{"role": "system", "content": "You answer in short sentences about the sea and its boats."},
             {"role": "user", "content": "Tell me about sailing."}]
    reply1, _ = await chat(swarm, turn1)
    turn2 = [*turn1, {"role": "assistant", "content": reply1}, {"role": "user", "content": "And rowing?"}]
    before = computed(swarm)
    tokens = swarm.nodes[0].backend.tokenize(  # type: ignore[attr-defined]
        __import__("schemas.session", fromlist=["Prompt"]).Prompt(messages=turn2))
    held = swarm.nodes[0].reuse.cache.match(tokens)  # type: ignore[attr-defined]
    shared = held[2] if held is not None else 0
    reply2, telemetry = await chat(swarm, turn2)
    after = computed(swarm)
    new = [{k: v for k, v in a.items() if k not in b} for a, b in zip(after, before, strict=True)]
    assert all(len(n) == 1 for n in new), new
    prompt = len(swarm.nodes[0].backend.tokenize(  # type: ignore[attr-defined]
        __import__("schemas.session", fromlist=["Prompt"]).Prompt(messages=turn2)))
    reused = telemetry["prefill"]["reused"]
    assert reused > prompt // 2 and reused == shared, (reused, shared, prompt)  # down to the token (issue #26)
    for positions in new:  # every hop computed the prompt's new positions and the reply, nothing else
        assert next(iter(positions.values())) == prompt - reused + 24 - 1, (positions, prompt, reused)
    cold = await swarms.start(settings_for(nats_server.url, tmp_path / "cold", prefix_cache_mb=0,
                                           namespace="cold"), [stub(0, 3), stub(3, 6), stub(6, 8)], model_id=MODEL)
    cold_reply, cold_telemetry = await chat(cold, turn2)
    assert reply2 == cold_reply
    assert "reused" not in cold_telemetry["prefill"]


async def test_a_kept_piece_that_fails_its_hash_is_recomputed_never_used(nats_server: Any, tmp_path: Any,
                                                                        swarms: Swarms) -> None:
    settings = settings_for(nats_server.url, tmp_path / "home")
    swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)], model_id=MODEL)
    turn = [{"role": "user", "content": "Tell me about the tides of the northern harbours, please."}]
    reply, _ = await chat(swarm, turn)
    tail = swarm.nodes[1]
    (entry,) = tail.reuse.cache._entries.values()  # type: ignore[attr-defined]  # noqa: SLF001
    assert not entry.resident and entry.pieces  # the stub keeps host pieces only
    entry.pieces[0] = bytes([entry.pieces[0][0] ^ 1]) + entry.pieces[0][1:]  # one bit of the first piece flipped
    before = computed(swarm)
    again, telemetry = await chat(swarm, turn)
    new = [{k: v for k, v in a.items() if k not in b} for a, b in zip(computed(swarm), before, strict=True)]
    prompt = len(swarm.nodes[0].backend.tokenize(  # type: ignore[attr-defined]
        __import__("schemas.session", fromlist=["Prompt"]).Prompt(messages=turn)))
    assert "reused" not in telemetry["prefill"]
    for positions in new:  # every hop computed the whole prompt again, and the reply
        assert list(positions.values()) == [prompt + 24 - 1], (positions, prompt)
    assert again == reply
    assert tail.reuse.rejected == 1 and tail.metrics.prefix_rejected._value.get() == 1  # noqa: SLF001


async def test_a_prompt_sharing_only_its_first_few_tokens_computes_cold(nats_server: Any, tmp_path: Any,
                                                                        swarms: Swarms) -> None:
    """Issue #26: below ``MIN_TOKEN_REUSE`` shared positions (the chat template's opening) nothing is reused: the
    saving is nil, and on llama.cpp the rest would round otherwise than a cold run (tests/test_swarm_up_join.py's
    second prompt parted from llama.cpp's after a BOS-only reuse)."""
    from actors.node.reuse import MIN_TOKEN_REUSE
    from schemas.session import Prompt

    swarm = await swarms.start(settings_for(nats_server.url, tmp_path / "home"), [stub(0, 4), stub(4, 8)],
                               model_id=MODEL)
    await chat(swarm, [{"role": "user", "content": "Tell me about the tides."}])
    other = [{"role": "user", "content": "Which boats sail tonight?"}]
    tokens = swarm.nodes[0].backend.tokenize(Prompt(messages=other))  # type: ignore[attr-defined]
    held = swarm.nodes[0].reuse.cache.match(tokens)  # type: ignore[attr-defined]
    assert held is not None and 0 < held[2] < MIN_TOKEN_REUSE, held  # the template's opening is shared, no more
    before = computed(swarm)
    _, telemetry = await chat(swarm, other)
    new = [{k: v for k, v in a.items() if k not in b} for a, b in zip(computed(swarm), before, strict=True)]
    assert "reused" not in telemetry["prefill"]
    for positions in new:
        assert list(positions.values()) == [len(tokens) + 24 - 1], (positions, len(tokens))
