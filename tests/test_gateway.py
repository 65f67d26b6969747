"""The OpenAI gateway with the official client against a real swarm (real NATS, stub nodes on loopback): what it
serves and what its streams promise.

The route on the first chunk before any token; usage on the last chunk when asked; choice-less telemetry chunks
only when asked; telemetry before the first token and during decode, in order, on NATS and as SSE; stop strings cut
exactly; a client that goes away frees the session everywhere. Its errors (bad input, limits, API keys) are
tests/test_gateway_errors.py's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import openai
import pytest
import pytest_asyncio

from bus import codec
from bus.server import EmbeddedNats
from bus.subjects import Subjects
from schemas.session import Prompt
from schemas.telemetry import GenerationTelemetry
from tests.support.gateway import GREEDY, MESSAGES, MODEL, client, prompt_tokens, stub_swarm
from tests.support.swarm import Swarm
from tests.support.waiting import eventually

# One NATS server and two swarms (in their own namespaces) serve the whole module: starting a swarm per test
# would cost about a second each.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    async with stub_swarm(module_nats, tmp_path_factory.mktemp("swarm")) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def slow_swarm(module_nats: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Swarm]:
    """A few ms of compute per step, so a generation lasts long enough to watch it (and to walk away from it)."""
    async with stub_swarm(module_nats, tmp_path_factory.mktemp("slow"), delay_s=0.003) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module")
async def nc(module_nats: EmbeddedNats) -> AsyncIterator[Any]:
    """A plain nats-py client, as a monitoring tool would use."""
    client = await nats.connect(module_nats.url)
    yield client
    await client.drain()


class TelemetryTap:
    """A plain nats-py subscriber on ``<ns>.telemetry.>``, as any monitoring tool would run."""

    def __init__(self) -> None:
        self.snaps: list[tuple[float, GenerationTelemetry]] = []

    async def on_msg(self, msg: Any) -> None:
        self.snaps.append((time.monotonic(), codec.decode(msg.data, GenerationTelemetry)))

    def of(self, sid: str) -> list[tuple[float, GenerationTelemetry]]:
        return [(t, s) for t, s in self.snaps if s.session_id == sid]


@pytest_asyncio.fixture(loop_scope="module")
async def tap(nc: Any, slow_swarm: Swarm) -> TelemetryTap:
    t = TelemetryTap()
    await nc.subscribe(Subjects(slow_swarm.settings.namespace).telemetry_all, cb=t.on_msg)
    await nc.flush()
    return t


# ---- chat and completions -----------------------------------------------------------------------------------------

async def test_chat_non_streaming(swarm: Swarm) -> None:
    result = await client(swarm).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, **GREEDY)
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert result.id.startswith("chatcmpl-") and result.model == MODEL
    assert result.usage is not None
    assert result.usage.prompt_tokens == prompt_tokens(swarm, messages=MESSAGES)
    assert result.usage.completion_tokens == 12
    assert result.usage.total_tokens == result.usage.prompt_tokens + 12
    telemetry = result.model_extra["swarmroute"]  # type: ignore[index]
    assert telemetry["phase"] == "complete" and telemetry["generated_tokens"] == 12
    assert [h["node_id"] for h in telemetry["route"]] == ["n1", "n2"]


async def test_chat_streaming_text_equals_non_streaming(swarm: Swarm) -> None:
    c = client(swarm)
    whole = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, **GREEDY)
    stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, stream=True, **GREEDY)
    chunks = [chunk async for chunk in stream]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.id == chunks[0].id for ch in chunks)


async def test_completions_streaming_and_not(swarm: Swarm) -> None:
    c = client(swarm)
    whole = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, **GREEDY)
    assert whole.choices[0].finish_reason == "length" and whole.choices[0].text
    assert whole.usage is not None and whole.usage.prompt_tokens == prompt_tokens(swarm, text="Once upon a time")
    stream = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, stream=True, **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_completions_token_prompt_and_echo(swarm: Swarm) -> None:
    c = client(swarm)
    text = await c.completions.create(model=MODEL, prompt="abc", max_tokens=6, **GREEDY)
    ids = swarm.nodes[0].backend.tokenize(Prompt(text="abc"))
    tokens = await c.completions.create(model=MODEL, prompt=ids, max_tokens=6, **GREEDY)
    assert tokens.choices[0].text == text.choices[0].text
    echoed = await c.completions.create(model=MODEL, prompt="abc", max_tokens=6, echo=True, **GREEDY)
    assert echoed.choices[0].text == "abc" + text.choices[0].text
    # OpenAI would add the prompt tokens' logprobs, which the route does not compute: a 400 naming both.
    with pytest.raises(openai.BadRequestError) as info:
        await c.completions.create(model=MODEL, prompt="abc", max_tokens=6, echo=True, logprobs=2, **GREEDY)
    assert info.value.param == "logprobs" and "echo" in info.value.message


async def test_models_lists_the_served_model(swarm: Swarm) -> None:
    models = await client(swarm).models.list()
    cards = {m.id: m for m in models.data}
    assert MODEL in cards and cards[MODEL].model_extra["complete"] is True  # type: ignore[index]


# ---- what the stream carries --------------------------------------------------------------------------------------

async def test_first_chunk_carries_the_route_before_any_token(swarm: Swarm) -> None:
    stream = await client(swarm).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=True,
                                                         **GREEDY)
    chunks = [chunk async for chunk in stream]
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    telemetry = first.model_extra["swarmroute"]  # type: ignore[index]
    assert [(h["node_id"], h["layers"]["start"], h["layers"]["end"]) for h in telemetry["route"]] == [
        ("n1", 0, 3), ("n2", 3, 8)]
    assert telemetry["generated_tokens"] == 0
    assert telemetry["session_id"] == first.id.removeprefix("chatcmpl-")


async def test_first_completion_chunk_carries_the_route_too(swarm: Swarm) -> None:
    stream = await client(swarm).completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True, **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].text == ""
    assert [h["node_id"] for h in chunks[0].model_extra["swarmroute"]["route"]] == ["n1", "n2"]  # type: ignore[index]


async def test_usage_on_the_last_chunk_with_include_usage(swarm: Swarm) -> None:
    stream = await client(swarm).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=9, stream=True, stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 9
    assert last.usage.prompt_tokens == prompt_tokens(swarm, messages=MESSAGES)
    assert last.usage.total_tokens == last.usage.prompt_tokens + 9
    assert chunks[-2].choices[0].finish_reason == "length"
    # Only the usage chunk is choice-less: telemetry was not asked for.
    assert [i for i, ch in enumerate(chunks) if not ch.choices] == [len(chunks) - 1]
    assert all(ch.usage is None for ch in chunks[:-1])


@pytest.mark.parametrize("options", [None, {"include_usage": False}, {"include_telemetry": False}])
async def test_no_choiceless_chunks_unless_asked(slow_swarm: Swarm, options: dict[str, Any] | None) -> None:
    extra = {"stream_options": options} if options is not None else {}
    stream = await client(slow_swarm).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60,
                                                              stream=True, **extra, **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert len(chunks) >= 60
    assert all(ch.choices for ch in chunks)
    # Telemetry still rides along, on chunks that carry a choice.
    assert sum(1 for ch in chunks if ch.model_extra and "swarmroute" in ch.model_extra) > 1


async def test_telemetry_chunks_when_asked_before_first_token_and_during_decode(slow_swarm: Swarm) -> None:
    max_tokens = 120
    stream = await client(slow_swarm).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, stream=True,
        stream_options={"include_telemetry": True, "include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    kinds: list[tuple[str, GenerationTelemetry | None]] = []
    for ch in chunks:
        snap = GenerationTelemetry.model_validate(ch.model_extra["swarmroute"]) if (
            ch.model_extra and "swarmroute" in ch.model_extra) else None
        if ch.choices and ch.choices[0].delta.content:
            kinds.append(("token", snap))
        elif not ch.choices and ch.usage is None:
            assert snap is not None, "a choice-less chunk without usage must carry telemetry"
            kinds.append(("telemetry", snap))
        else:
            kinds.append(("other", snap))
    first_token = next(i for i, (k, _) in enumerate(kinds) if k == "token")
    last_token = max(i for i, (k, _) in enumerate(kinds) if k == "token")
    before = [s for k, s in kinds[:first_token] if k == "telemetry"]
    during = [s for k, s in kinds[first_token:last_token] if k == "telemetry"]
    assert before and all(s is not None and s.generated_tokens == 0 for s in before)
    assert any(s is not None and s.phase.value == "prefill" for s in before)
    assert len(during) >= 2
    assert all(s is not None and s.phase.value == "decode" and 0 < s.generated_tokens < max_tokens for s in during)
    seqs = [s.seq for k, s in kinds if k == "telemetry" and s is not None]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    every = [s.seq for _, s in kinds if s is not None]
    assert every == sorted(every)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == max_tokens


async def test_telemetry_on_nats_in_order_before_first_token_and_during_decode(slow_swarm: Swarm,
                                                                               tap: TelemetryTap) -> None:
    max_tokens = 120
    stream = await client(slow_swarm).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens,
                                                              stream=True, **GREEDY)
    first_token_at: float | None = None
    sid = ""
    async for chunk in stream:
        sid = chunk.id.removeprefix("chatcmpl-")
        if first_token_at is None and chunk.choices and chunk.choices[0].delta.content:
            first_token_at = time.monotonic()
    assert first_token_at is not None
    await eventually(lambda: any(s.phase.terminal for _, s in tap.of(sid)), interval=0.02,
                     what=f"a terminal snapshot of {sid} on NATS")
    snaps = tap.of(sid)
    seqs = [s.seq for _, s in snaps]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
    phases = [s.phase.value for _, s in snaps]
    order = ["routing", "prefill", "decode", "complete"]
    assert [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p] == order
    assert snaps[-1][1].finish_reason == "length" and snaps[-1][1].generated_tokens == max_tokens
    early = [(t, s) for t, s in snaps if s.generated_tokens == 0 and s.phase.value == "prefill"]
    assert early and early[0][0] < first_token_at
    during = [s for _, s in snaps if s.phase.value == "decode" and 0 < s.generated_tokens < max_tokens]
    assert len(during) >= 2
    # The first token comes out of prefill; from the first decode step on, the per-link overhead is measured: per
    # link, the mean over the decode steps so far of (step wall time - the hops' compute and queueing), at least 0.
    # The steps so far (tokens 2..n, timed from one token's arrival to the next) all fall inside the session's
    # elapsed time, so the mean cannot exceed elapsed / (n - 1) split over the route's links.
    links = len(snaps[-1][1].route)
    measured = [s for s in during if s.generated_tokens >= 2]
    assert measured and all(s.hop_overhead_ms is not None
                            and 0 <= s.hop_overhead_ms < s.elapsed_ms / (links * (s.generated_tokens - 1))
                            for s in measured), [(s.hop_overhead_ms, s.elapsed_ms, s.generated_tokens)
                                                 for s in measured]
    assert [h.node_id for h in snaps[-1][1].route] == ["n1", "n2"]
    assert all(h.mean_compute_ms is not None for h in snaps[-1][1].route)


async def test_session_telemetry_sse_endpoint(slow_swarm: Swarm) -> None:
    max_tokens = 150
    c = client(slow_swarm)
    async with c.chat.completions.with_streaming_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=max_tokens, stream=True, **GREEDY) as response:
        sid = response.headers["x-swarmroute-session"]
        chat_chunks: list[Any] = []

        async def read_chat() -> None:
            async for chunk in await response.parse():
                chat_chunks.append(chunk)

        async def read_telemetry() -> list[dict[str, Any]]:
            events: list[dict[str, Any]] = []
            async with httpx.AsyncClient(timeout=20) as http, http.stream(
                    "GET", f"{slow_swarm.url}/v1/sessions/{sid}/telemetry") as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        assert line == "" or line.startswith(":"), line  # only data lines and comments
                        continue
                    if line == "data: [DONE]":
                        return events
                    events.append(json.loads(line[6:]))
            raise AssertionError("telemetry stream ended without [DONE]")

        _, events = await asyncio.gather(read_chat(), read_telemetry())
    assert chat_chunks[0].id == f"chatcmpl-{sid}"
    snaps = [GenerationTelemetry.model_validate(e) for e in events]
    assert snaps and all(s.session_id == sid for s in snaps)
    seqs = [s.seq for s in snaps]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
    assert snaps[-1].phase.value == "complete" and snaps[-1].generated_tokens == max_tokens
    assert any(s.phase.value == "decode" and 0 < s.generated_tokens < max_tokens for s in snaps)

    # After the session, the endpoint still answers with its final snapshot.
    async with httpx.AsyncClient(timeout=5) as http:
        r = await http.get(f"{slow_swarm.url}/v1/sessions/{sid}/telemetry")
    lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["phase"] == "complete"


async def test_session_header_on_non_streaming_response(swarm: Swarm) -> None:
    raw = await client(swarm).chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES,
                                                                        max_tokens=3, **GREEDY)
    sid = raw.headers["x-swarmroute-session"]
    result = raw.parse()
    assert result.id == f"chatcmpl-{sid}"
    assert result.model_extra["swarmroute"]["session_id"] == sid  # type: ignore[index]


# ---- stop strings ---------------------------------------------------------------------------------------------

def pick_stop(text: str) -> tuple[str, str]:
    """A 3-character stop string from the middle of ``text`` whose first occurrence is not at the start."""
    for i in range(8, len(text) - 3):
        stop = text[i:i + 3]
        if text.index(stop) >= 4:
            return stop, text[: text.index(stop)]
    raise AssertionError(f"no usable stop string in {text!r}")


async def test_stop_string_cut_exactly_through_the_gateway(swarm: Swarm) -> None:
    c = client(swarm)
    prompt = "The quick brown fox"
    full = (await c.completions.create(model=MODEL, prompt=prompt, max_tokens=48, **GREEDY)).choices[0].text
    stop, expected = pick_stop(full)
    cut = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=48, stop=[stop, "\x00never"], **GREEDY)
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=48, stop=stop, stream=True, **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_stop_string_in_chat(swarm: Swarm) -> None:
    c = client(swarm)
    full = (await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=48, **GREEDY)
            ).choices[0].message.content or ""
    stop, expected = pick_stop(full)
    stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=48, stop=stop, stream=True,
                                             **GREEDY)
    chunks = [chunk async for chunk in stream]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


# ---- a client that goes away --------------------------------------------------------------------------------------

async def test_client_disconnect_mid_stream_frees_the_session_everywhere(slow_swarm: Swarm,
                                                                         tap: TelemetryTap) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    tokens = 0
    async with httpx.AsyncClient(timeout=10) as http, http.stream(
            "POST", f"{slow_swarm.base_url}/chat/completions", json=body) as r:
        sid = r.headers["x-swarmroute-session"]
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                tokens += 1
            if tokens >= 5:
                break
        assert any(n.sessions for n in slow_swarm.nodes)  # still generating when we walk away
    # The response is closed here: the client went away mid-stream.
    await slow_swarm.freed()
    await eventually(lambda: any(s.phase.value == "cancelled" for _, s in tap.of(sid)), timeout=5, interval=0.02,
                     what=f"a cancelled snapshot of {sid} on NATS")
    generated = max(s.generated_tokens for _, s in tap.of(sid))
    assert generated < 3000  # generation really stopped, it did not run to max_tokens
    cancelled = [s for _, s in tap.of(sid) if s.phase.value == "cancelled"]
    assert len(cancelled) == 1


async def test_client_disconnect_during_non_streaming_request_frees_the_session(slow_swarm: Swarm) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=10) as http:
        request = asyncio.create_task(http.post(f"{slow_swarm.base_url}/chat/completions", json=body))
        await eventually(lambda: any(n.sessions for n in slow_swarm.nodes), timeout=5, interval=0.02,
                         what="the request opening a session on the nodes")
        await asyncio.sleep(0.3)
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)
    await slow_swarm.freed()  # after the client went away


async def _collect_sse(events: AsyncIterator[bytes], timeout: float) -> list[bytes]:
    out: list[bytes] = []

    async def run() -> None:
        async for item in events:
            out.append(item)

    await asyncio.wait_for(run(), timeout)
    return out


async def test_telemetry_sse_of_a_session_that_just_ended_terminates(nc: Any) -> None:
    """A watcher arriving between the session's last snapshot and its cleanup gets that snapshot and [DONE]."""
    from types import SimpleNamespace

    from gateway.app import _telemetry_events
    from schemas.session import SessionPhase

    final = GenerationTelemetry(session_id="s" * 32, seq=9, phase=SessionPhase.COMPLETE, finish_reason="stop")
    live = SimpleNamespace(telemetry=final)
    out = await _collect_sse(_telemetry_events(nc, Subjects(), final.session_id, live, None), 3.0)
    assert out[-1] == b"data: [DONE]\n\n"
    assert [json.loads(o[6:])["seq"] for o in out[:-1]] == [9]


async def test_telemetry_sse_never_repeats_or_reorders_a_snapshot(nc: Any) -> None:
    """Snapshots already shown (the session's latest) are not sent again when they also arrive on NATS."""
    from types import SimpleNamespace

    from gateway.app import _telemetry_events
    from schemas.session import SessionPhase

    subjects = Subjects()
    sid = "a" * 32
    live = SimpleNamespace(telemetry=GenerationTelemetry(session_id=sid, seq=5, phase=SessionPhase.DECODE))
    events = _telemetry_events(nc, subjects, sid, live, None)
    first = await anext(events)  # subscribes, then yields the latest snapshot
    for seq, phase in ((4, SessionPhase.DECODE), (5, SessionPhase.DECODE), (6, SessionPhase.DECODE),
                       (7, SessionPhase.COMPLETE)):
        await nc.publish(subjects.telemetry(sid), codec.encode(GenerationTelemetry(session_id=sid, seq=seq,
                                                                                   phase=phase)))
    rest = await _collect_sse(events, 3.0)
    seqs = [json.loads(o[6:])["seq"] for o in [first, *rest] if o.startswith(b"data: {")]
    assert seqs == [5, 6, 7]
    assert rest[-1] == b"data: [DONE]\n\n"


async def test_telemetry_sse_ends_on_a_terminal_snapshot_even_with_a_lagging_seq(nc: Any) -> None:
    from types import SimpleNamespace

    from gateway.app import _telemetry_events
    from schemas.session import SessionPhase

    subjects = Subjects()
    sid = "b" * 32
    live = SimpleNamespace(telemetry=GenerationTelemetry(session_id=sid, seq=8, phase=SessionPhase.DECODE))
    events = _telemetry_events(nc, subjects, sid, live, None)
    await anext(events)
    await nc.publish(subjects.telemetry(sid), codec.encode(GenerationTelemetry(session_id=sid, seq=7,
                                                                               phase=SessionPhase.CANCELLED)))
    rest = await _collect_sse(events, 3.0)
    assert json.loads(rest[0][6:])["phase"] == "cancelled"
    assert rest[-1] == b"data: [DONE]\n\n"
