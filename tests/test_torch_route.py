"""The torch backend behind real nodes, tracker and gateway (real NATS, HTTP on loopback, the official openai client).

Expected texts come from transformers ``generate()`` in one process on the same weights, decoded in the test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from actors.backends.torch.backend import load_torch
from actors.backends.torch.models import tiny_model_dir
from actors.backends.torch.tokens import TokenCodec
from actors.tracker import Tracker
from bus import frame as frames
from gateway.app import Gateway
from schemas.frame import FrameKind
from schemas.session import Prompt
from schemas.settings import Settings
from tests.support.swarm import Swarms, make_settings, wait_model
from tests.support.torch_route import (
    LONG_PROMPT,
    build_route,
    cache_root,
    expected_text,
    generate_reference,
    reference,
    whole_gguf_model,
)
from tests.support.waiting import eventually

TINY = "tiny-gemma3"


def tiny_codec() -> TokenCodec:
    return TokenCodec.load(tiny_model_dir(TINY, cache_root()), [1])


async def stream_text(client: openai.AsyncOpenAI, model: str, prompt: str | list[int], max_tokens: int) -> str:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True)
    return "".join([c.choices[0].text async for c in stream if c.choices and c.choices[0].text])


async def test_concurrent_streams_through_a_three_node_torch_route_equal_generate(settings: Settings,
                                                                                  swarms: Swarms) -> None:
    codec, ref = tiny_codec(), reference(TINY)
    prompts = [LONG_PROMPT, "Sphinx of black quartz, judge my vow; five boxing wizards jump quickly."]
    expected = [expected_text(codec, generate_reference(ref, codec.tokenize(Prompt(text=p)), 24)) for p in prompts]
    swarm = await swarms.start(settings, build_route(TINY, (0, 2, 4, 6)), model_id=TINY)
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    got = await asyncio.gather(*(stream_text(client, TINY, p, 24) for p in prompts))
    assert list(got) == expected
    messages = [{"role": "user", "content": "Say something about rivers and trees, at length please."}]
    chat_ids = codec.tokenize(Prompt(messages=messages))
    reply = await client.chat.completions.create(model=TINY, messages=messages, max_tokens=16,  # type: ignore[arg-type]
                                                 temperature=0)
    assert reply.choices[0].message.content == expected_text(codec, generate_reference(ref, chat_ids, 16))


async def test_decode_frames_over_http_carry_one_position_whatever_the_context(settings: Settings,
                                                                                swarms: Swarms) -> None:
    swarm = await swarms.start(settings, build_route(TINY, (0, 3, 6)), model_id=TINY)
    proxy = await swarms.proxy(swarm, swarm.nodes[1])  # frames into the tail cross the proxy from now on
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    decode_sizes, payloads = {}, set()
    for length in (20, 300):
        proxy.reset()
        ids = [2] + [3 + (i * 11) % 250 for i in range(length - 1)]
        stream = await client.completions.create(model=TINY, prompt=ids, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            pass
        decoded = [(len(b), frames.decode(b)[0]) for b in proxy.request_bodies() if b[:4] == frames.MAGIC]
        decode = [(size, h) for size, h in decoded if h.kind is FrameKind.DECODE]
        assert len(decode) == 5  # every token after the first is one decode step
        assert all(h.n_positions == 1 for _, h in decode)
        assert sum(h.n_positions for _, h in decoded if h.kind is FrameKind.PREFILL) == length
        decode_sizes[length] = {size for size, _ in decode}
        payloads |= {h.payload_bytes for _, h in decode}
    assert decode_sizes[20] == decode_sizes[300] and len(decode_sizes[20]) == 1
    assert payloads == {swarm.nodes[0].backend.info.hidden_size * 4}


def torch_args(layers: str) -> list[str]:
    return ["--backend", "torch", "--model", TINY, "--layers", layers, "--max-sessions", "4"]


async def test_killing_a_torch_node_mid_decode_fails_the_session_and_the_survivor_frees_it(
        nats_server: object, tmp_path: Path, swarms: Swarms) -> None:
    settings = make_settings(nats_server.url, tmp_path / "home", token_timeout_s=3.0,  # type: ignore[attr-defined]
                             first_token_timeout_s=20.0, hop_timeout_s=2.0, prefill_chunk=8, repair=False)
    head = await swarms.node_process(settings, "head", torch_args("0:3"))
    tail = await swarms.node_process(settings, "tail", torch_args("3:6"))
    tracker = await swarms.actor(Tracker(settings))
    gateway = await swarms.actor(Gateway(settings, port=0))
    await wait_model(tracker, TINY, timeout=60, n_nodes=2)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.completions.create(model=TINY, prompt=LONG_PROMPT, max_tokens=3000, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    seen = 0
    with pytest.raises(openai.APIError) as failure:
        async for _chunk in stream:
            seen += 1
            if seen == 5:
                tail.kill()
    assert seen >= 5
    error = failure.value
    assert "tail" in error.message and "decode" in error.message
    body = error.body if isinstance(error.body, dict) else {}
    assert (body.get("failure") or {}).get("node_id") == "tail"
    assert head.endpoint.startswith("http://127.0.0.1:")  # where it said it serves
    async with httpx.AsyncClient() as http:
        async def freed() -> bool:
            return (await http.get(f"{head.endpoint}/health")).json()["sessions"] == 0

        await eventually(freed, what="the surviving head freeing the session")


@pytest.mark.slow
async def test_bundled_gemma_through_a_two_node_torch_route_equals_generate(settings: Settings, swarms: Swarms,
                                                                            gemma_path: Path) -> None:
    backends = build_route(str(gemma_path), (0, 9, 18), max_sessions=2)
    for b in backends:
        swarms.on_teardown(b.close)  # after the swarm stops
    codec = backends[0].codec
    assert codec is not None
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = codec.tokenize(Prompt(messages=messages))
    expected = expected_text(codec, generate_reference(whole_gguf_model(gemma_path), ids, 8))
    model_id = backends[0].info.model_name
    swarm = await swarms.start(settings, backends, model_id=model_id)
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=300)
    reply = await client.chat.completions.create(model=model_id, messages=messages,  # type: ignore[arg-type]
                                                 max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == expected
    assert expected.strip()  # the model said something: the comparison is not between two empty strings


THINK_TEMPLATE = (  # the tiny template, with a DeepSeek-R1-style generation prompt that opens a think block
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'].split('</think>')[-1] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant><think>\n{% endif %}")


async def test_a_torch_head_reports_the_block_its_template_opened_and_the_reply_comes_back_as_reasoning(
        settings: Settings, swarms: Swarms) -> None:
    route = build_route(TINY, (0, 3, 6))
    head = route[0]
    assert head.codec is not None
    messages = [{"role": "user", "content": "Say something about rivers and trees."}]
    assert head.reasoning_start(head.codec.tokenize(Prompt(messages=messages))) is None  # the tiny template: none
    head.codec.tokenizer.chat_template = THINK_TEMPLATE
    assert head.reasoning_start(head.codec.tokenize(Prompt(messages=messages))) == "open"
    assert route[1].reasoning_start([2, 3]) is None  # only a head reads prompts
    swarm = await swarms.start(settings, route, model_id=TINY)
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)

    async def chat(**extra: object) -> openai.types.chat.ChatCompletion:
        return await client.chat.completions.create(model=TINY, messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=16, temperature=0, extra_body=extra)

    raw = (await chat(reasoning_format="none")).choices[0].message.content  # the reply as the model wrote it
    assert raw is not None
    before, closed, after = raw.partition("</think>")
    reasoning, answer = before.strip(" \t\r\n"), after.lstrip(" \t\r\n")  # as llama.cpp strips them
    assert reasoning  # the tiny model wrote something inside the block
    message = (await chat()).choices[0].message
    assert (message.model_extra or {}).get("reasoning_content") == reasoning
    assert message.content == (answer if closed else "")
    stream = await client.chat.completions.create(model=TINY, messages=messages,  # type: ignore[arg-type]
                                                  max_tokens=16, temperature=0, stream=True)
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content


def test_load_torch_is_what_the_cli_builds() -> None:
    backend = load_torch(model=TINY, layer_start=3, layer_end=6, max_sessions=3, context_length=512, dtype="float32")
    assert (backend.layers.start, backend.layers.end, backend.max_sessions) == (3, 6, 3)
    assert backend.info.context_length == 512 and backend.is_tail and not backend.is_head
