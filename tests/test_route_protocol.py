"""The Route Session protocol end to end on stub nodes: prefill once, one position per decode hop, the ring."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from bus import frame as frames
from schemas.frame import FrameKind
from schemas.settings import Settings
from tests.support.swarm import Swarms, stub
from tests.support.waiting import eventually

MODEL = "stub-model"


async def complete(base_url: str, prompt: str, max_tokens: int, **kw: object) -> openai.types.Completion:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    return await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           extra_body={"ignore_eos": True}, **kw)  # type: ignore[arg-type]


async def test_two_node_route_equals_single_node_and_prefills_once(settings: Settings, swarms: Swarms) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    single = await swarms.start(settings, [stub(0, 8)], model_id=MODEL)
    reference = await complete(single.base_url, prompt, 24)
    await single.stop()
    head, tail = stub(0, 3), stub(3, 8)
    swarm = await swarms.start(settings, [head, tail], model_id=MODEL)
    result = await complete(swarm.base_url, prompt, 24)
    assert result.choices[0].text == reference.choices[0].text
    assert result.usage is not None and result.usage.completion_tokens == 24
    n_prompt = result.usage.prompt_tokens
    # Every position crossed the seam exactly once: the prompt once, then one per decode step (the last
    # sampled token is never fed back).
    telemetry = result.model_extra["swarmroute"]  # type: ignore[index]
    sid = telemetry["session_id"]
    assert [h["node_id"] for h in telemetry["route"]] == ["n1", "n2"]
    await eventually(lambda: sid in head.closed_positions and sid in tail.closed_positions, timeout=2.0,
                     interval=0.02, what=f"both nodes closing session {sid}")
    # A local cache computes each position once (prompt + 23 fed-back tokens); a recompute would be quadratic.
    assert head.closed_positions[sid] == n_prompt + 23
    assert tail.closed_positions[sid] == n_prompt + 23


async def test_decode_hops_carry_one_position_and_prompt_crosses_once(settings: Settings, swarms: Swarms) -> None:
    """Count real bytes on the wire with a TCP proxy in front of the tail."""
    head, tail = stub(0, 4), stub(4, 8)
    swarm = await swarms.start(settings, [head, tail], model_id=MODEL)
    proxy = await swarms.proxy(swarm, swarm.nodes[1])
    frames_seen: list[tuple[FrameKind, int, int, int]] = []

    for prompt_len, max_tokens in ((40, 16), (400, 16)):
        proxy.reset()
        result = await complete(swarm.base_url, "x" * prompt_len, max_tokens)
        n_prompt = result.usage.prompt_tokens  # type: ignore[union-attr]
        bodies = proxy.request_bodies()
        decoded = [frames.decode(b)[0] for b in bodies if b[:4] == b"SRF1"]
        prefill = [h for h in decoded if h.kind is FrameKind.PREFILL]
        decode = [h for h in decoded if h.kind is FrameKind.DECODE]
        assert sum(h.n_positions for h in prefill) == n_prompt  # the prompt crossed the seam once
        assert [h.n_positions for h in decode] == [1] * (max_tokens - 1)
        decode_sizes = {len(b) for b in bodies if b[:4] == b"SRF1" and frames.decode(b)[0].kind is FrameKind.DECODE}
        frames_seen.append((FrameKind.DECODE, n_prompt, len(decode), max(decode_sizes)))
        assert max(decode_sizes) <= 64 * 4 + 128
    # Bytes per decode hop do not grow with the context.
    assert frames_seen[0][3] == frames_seen[1][3]


async def test_concurrent_sessions_never_mix_state(settings: Settings, swarms: Swarms) -> None:
    prompts = [f"session {i}: " + "abcdefgh"[i] * (10 + 7 * i) for i in range(6)]
    single = await swarms.start(settings, [stub(0, 8)], model_id=MODEL)
    expected = [(await complete(single.base_url, p, 20)).choices[0].text for p in prompts]
    await single.stop()
    # A little compute time per step makes steps of different sessions meet in the engine, as on a real model.
    swarm = await swarms.start(settings, [stub(0, 2, delay_s=0.003), stub(2, 5, delay_s=0.003),
                                          stub(5, 8, delay_s=0.003)], model_id=MODEL)
    results = await asyncio.gather(*(complete(swarm.base_url, p, 20) for p in prompts))
    assert [r.choices[0].text for r in results] == expected
    assert len(set(expected)) > 1  # the prompts really lead to different continuations
    assert max(n.engine.max_batch_seen for n in swarm.nodes) > 1  # steps of several sessions shared a pass


async def test_sessions_are_freed_on_every_hop_after_completion(settings: Settings, swarms: Swarms) -> None:
    backends = [stub(0, 4), stub(4, 8)]
    swarm = await swarms.start(settings, backends, model_id=MODEL)
    await complete(swarm.base_url, "free me", 5)
    await eventually(lambda: not any(b.open_sessions for b in backends), timeout=2.5,
                     what=lambda: f"every hop freeing the session (open: {[b.open_sessions for b in backends]})")
    assert [b.open_sessions for b in backends] == [[], []]
    assert all(not n.sessions for n in swarm.nodes)


async def test_multi_stream_hidden_shape_travels_through_the_route(settings: Settings, swarms: Swarms) -> None:
    """Models like DeepSeek-V4 carry several residual streams per position: the frame carries the model's shape."""
    shape = (4, 32)
    single = await swarms.start(settings, [stub(0, 8, hidden_shape=shape)], model_id=MODEL)
    expected = (await complete(single.base_url, "streams", 12)).choices[0].text
    await single.stop()
    head, tail = stub(0, 5, hidden_shape=shape), stub(5, 8, hidden_shape=shape)
    swarm = await swarms.start(settings, [head, tail], model_id=MODEL)
    proxy = await swarms.proxy(swarm, swarm.nodes[1])
    assert (await complete(swarm.base_url, "streams", 12)).choices[0].text == expected
    headers = [frames.decode(b)[0] for b in proxy.request_bodies() if b[:4] == b"SRF1"]
    assert headers and all(h.position_shape == shape for h in headers)
    decode = [b for b in proxy.request_bodies()
              if b[:4] == b"SRF1" and frames.decode(b)[0].kind is FrameKind.DECODE]
    # One position of (4, 32) float32 values, and the one token id it stands for.
    assert decode and all(len(b) - frames.header_size(2, len(frames.decode(b)[0].stamps)) == 4 * 32 * 4 + 4
                          for b in decode)


async def test_f16_wire_halves_decode_payload(settings: Settings, swarms: Swarms) -> None:
    swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)], model_id=MODEL, wire_dtype="f16")
    proxy = await swarms.proxy(swarm, swarm.nodes[1])
    result = await complete(swarm.base_url, "half precision", 8)
    assert result.usage is not None and result.usage.completion_tokens == 8
    decode = [frames.decode(b) for b in proxy.request_bodies()
              if b[:4] == b"SRF1" and frames.decode(b)[0].kind is FrameKind.DECODE]
    assert decode and all(h.dtype.label == "f16" and h.payload_bytes == 64 * 2 for h, _ in decode)


@pytest.mark.parametrize("n", [1])
async def test_unknown_session_frame_is_404(settings: Settings, swarms: Swarms, n: int) -> None:
    swarm = await swarms.start(settings, [stub(0, 4), stub(4, 8)], model_id=MODEL)
    async with httpx.AsyncClient() as client:
        r = await client.post(f"{swarm.nodes[1].server.url}/v1/sessions/{'0' * 32}/frames", content=b"SRF1")
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "session_not_found"


async def test_sessions_end_while_client_probes_are_in_flight(settings: Settings, swarms: Swarms) -> None:
    """A head probes its client every 10 ms here, so a session usually ends while a probe is in flight, and the
    probe's reply and the cancellation can land in the same loop turn (Python 3.11's wait_for then drops the
    cancellation). Every session must still end with its text: the watcher used to go on probing, and the head's
    close() waited for it for good (a stall the gateway reported as a timeout)."""
    swarm = await swarms.start(settings.model_copy(update={"client_probe_s": 0.01}), [stub(0, 4), stub(4, 8)],
                               model_id=MODEL)
    reference = (await complete(swarm.base_url, "probed", 6)).choices[0].text
    for _ in range(80):
        assert (await complete(swarm.base_url, "probed", 6)).choices[0].text == reference
    assert not any(n.sessions for n in swarm.nodes)
