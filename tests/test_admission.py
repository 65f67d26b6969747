"""The gateway's admission queue (issue #30): beyond the free capacity a request waits its turn, fairly across API
keys, its stream showing ``queued``; and a request rejected after routing gives its slot back at once.

The queue's order and bounds are checked on ``AdmissionQueue`` with a fake capacity (its collaborator, the session
start); everything else on real swarms on loopback: real nats-server, tracker, stub nodes and gateway, the official
openai client. The same on the default ``swarmroute up`` with the bundled model: ``test_up_*`` (slow).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway import admission
from gateway.admission import CURRENT as WAITER
from gateway.admission import AdmissionQueue, AdmittedSessions, ModelQueue, QueueLimits, Ticket, Waiter
from schemas.errors import CapacityError
from schemas.settings import Settings
from tests.support.actors import Children
from tests.support.prometheus import Scrape
from tests.support.swarm import Swarm, Swarms, make_settings, stub
from tests.support.up import Up, free_port
from tests.support.waiting import eventually

MODEL = "stub-model"
KEYS = ["key-flood-0123456789", "key-other-0123456789"]


# ---- the queue alone, with a fake capacity ------------------------------------------------------------------------

class Slots:
    """The collaborator ``admit`` starts sessions with: ``n`` slots, a start past them finds no capacity."""

    def __init__(self, n: int) -> None:
        self.free = n
        self.started: list[str] = []

    def start(self, name: str) -> Any:
        async def run() -> str:
            await asyncio.sleep(0)
            if self.free <= 0:
                raise CapacityError("full", retry_after=1.0)
            self.free -= 1
            self.started.append(name)
            return name
        return run

    def end(self, queue: AdmissionQueue) -> None:
        self.free += 1
        queue.ended(MODEL)


async def _admit(queue: AdmissionQueue, slots: Slots, key: str, name: str) -> str:
    WAITER.set(Waiter(key))
    return await queue.admit(MODEL, slots.start(name))


def test_turns_go_round_the_keys() -> None:
    queue = ModelQueue()
    tickets = [Ticket(MODEL, "flood", None, float(i)) for i in range(5)]
    for t in tickets:
        queue.join(t)
    other = Ticket(MODEL, "other", None, 9.0)
    queue.join(other)
    assert queue.position(other) == 2  # one flood request (first in line) ahead of it, not five
    assert [t.key for t in queue.order()] == ["flood", "other", "flood", "flood", "flood", "flood"]
    assert [queue.position(t) for t in tickets] == [1, 3, 4, 5, 6]
    queue.remove(tickets[0], served=True)  # flood's head admitted: its line goes to the back of the round
    assert queue.position(other) == 1 and queue.position(tickets[1]) == 2


async def test_a_flood_waits_in_its_own_line_and_the_other_key_is_next() -> None:
    queue = AdmissionQueue(QueueLimits(max_waiting=64, max_wait_s=30, poll_s=0.05))
    slots = Slots(1)
    first = await _admit(queue, slots, "flood", "flood-0")
    flood = [asyncio.create_task(_admit(queue, slots, "flood", f"flood-{i}")) for i in range(1, 9)]
    await eventually(lambda: queue.waiting == 8, what="the flood waiting")
    other = asyncio.create_task(_admit(queue, slots, "other", "other"))
    await eventually(lambda: queue.waiting == 9, what="the other key's request waiting")
    for _ in range(9):
        slots.end(queue)
        await eventually(lambda: slots.free == 0, what="the freed slot taken")
    assert await other == "other" and first == "flood-0"
    await asyncio.gather(*flood)
    # The flood's first waiting request held the turn when the other key arrived: at most that one goes first.
    assert slots.started.index("other") <= 2, slots.started
    assert queue.admitted == 9 and not queue.dropped


async def test_a_full_queue_refuses_with_retry_after_and_a_smaller_key_displaces_the_biggest() -> None:
    queue = AdmissionQueue(QueueLimits(max_waiting=3, max_wait_s=30, poll_s=0.05))
    slots = Slots(0)
    flood = [asyncio.create_task(_admit(queue, slots, "flood", f"f{i}")) for i in range(3)]
    await eventually(lambda: queue.waiting == 3, what="the queue filling")
    with pytest.raises(CapacityError) as err:
        await _admit(queue, slots, "flood", "f3")
    assert err.value.code == "queue_full" and err.value.retry_after >= 1
    other = asyncio.create_task(_admit(queue, slots, "other", "other"))
    await eventually(lambda: queue.dropped["displaced"] == 1, what="the flood's newest displaced")
    with pytest.raises(CapacityError, match="took this one's place"):
        await flood[2]
    slots.end(queue)
    await eventually(lambda: slots.started == ["f0"], what="the flood's first (it held the turn) admitted")
    slots.end(queue)
    assert await other == "other"  # the lone request of its key goes before the flood's second
    assert slots.started == ["f0", "other"]
    for task in flood[:2]:
        task.cancel()
    await asyncio.gather(*flood[:2], return_exceptions=True)
    assert queue.dropped == {"full": 1, "displaced": 1} and queue.waiting == 0


async def test_a_wait_past_the_limit_is_a_429_timeout() -> None:
    queue = AdmissionQueue(QueueLimits(max_waiting=8, max_wait_s=0.3, poll_s=0.05))
    slots = Slots(0)
    started = time.monotonic()
    with pytest.raises(CapacityError) as err:
        await _admit(queue, slots, "k", "late")
    assert err.value.code == "queue_timeout" and time.monotonic() - started >= 0.3
    assert queue.dropped["timeout"] == 1 and queue.waiting == 0


class StaleSlots(Slots):
    """A capacity answered from a view taken when the start began (a tracker that has not yet heard of the slot
    freed meanwhile): the i-th start answers once ``answer(i)`` lets it."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.gates: list[asyncio.Event] = []

    def answer(self, i: int) -> None:
        self.gates[i].set()

    def start(self, name: str) -> Any:
        async def run() -> str:
            free, gate = self.free, asyncio.Event()
            self.gates.append(gate)
            await gate.wait()
            if free <= 0:
                raise CapacityError("full", retry_after=1.0)
            self.free -= 1
            self.started.append(name)
            return name
        return run


async def test_a_session_ending_while_a_try_is_in_flight_wakes_the_next_try(monkeypatch: pytest.MonkeyPatch) -> None:
    """The end of a session is news for the queue even when it comes while the head of the line is asking (and
    gets a stale "no capacity"): it asks again at once, not after the backoff (here longer than the test)."""
    monkeypatch.setattr(admission, "FIRST_RETRY_S", 300.0)
    queue = AdmissionQueue(QueueLimits(max_waiting=8, max_wait_s=600, poll_s=300))
    slots = StaleSlots(0)
    waiting = asyncio.create_task(_admit(queue, slots, "k", "late"))
    await eventually(lambda: len(slots.gates) == 1, what="the first try (before the queue) in flight")
    slots.answer(0)
    await eventually(lambda: len(slots.gates) == 2 and queue.waiting == 1, what="the queue's first try in flight")
    slots.end(queue)  # a slot frees and its session's end reaches the queue while the try is still out...
    slots.answer(1)  # ...which then answers from its stale view
    await eventually(lambda: len(slots.gates) == 3, timeout=20, what="the queue asking again after the end")
    slots.answer(2)
    assert await asyncio.wait_for(waiting, 10) == "late"
    assert queue.admitted == 1


# ---- real swarms --------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Streamed:
    first: dict[str, Any]
    """The first chunk's ``swarmroute`` telemetry."""
    queued: list[dict[str, Any]]
    """Every ``queued`` snapshot the stream showed before its first token."""
    text: str
    admitted_at: float = 0.0
    """When its first non-queued chunk arrived (the request had a route)."""


async def stream_one(client: openai.AsyncOpenAI, max_tokens: int, *, model: str = MODEL,
                     prompt: str | list[int] = "hello") -> Streamed:
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                             temperature=0, extra_body={"ignore_eos": True})
    first: dict[str, Any] | None = None
    queued: list[dict[str, Any]] = []
    text: list[str] = []
    admitted_at = 0.0
    async for chunk in stream:
        telemetry = (chunk.model_extra or {}).get("swarmroute") or {}
        first = first if first is not None else telemetry
        if telemetry.get("phase") == "queued" and not text:
            queued.append(telemetry)
        elif not admitted_at:
            admitted_at = time.monotonic()
        if chunk.choices and chunk.choices[0].text:
            text.append(chunk.choices[0].text)
    assert first is not None
    return Streamed(first, queued, "".join(text), admitted_at)


def _queue(swarm: Swarm) -> AdmissionQueue:
    assert swarm.gateway.serving is not None
    sessions = swarm.gateway.serving.sessions
    assert isinstance(sessions, AdmittedSessions)
    return sessions.admission


async def _slow_pair(swarms: Swarms, settings: Settings, max_sessions: int, delay_s: float = 0.01) -> Swarm:
    return await swarms.start(settings, [stub(0, 4, max_sessions=max_sessions, delay_s=delay_s),
                                         stub(4, 8, max_sessions=max_sessions, delay_s=delay_s)], model_id=MODEL)


async def test_streams_beyond_capacity_wait_showing_their_place_and_all_complete(nats_server: Any, tmp_path: Path,
                                                                                 swarms: Swarms) -> None:
    swarm = await _slow_pair(swarms, make_settings(nats_server.url, tmp_path / "home"), max_sessions=2)
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    results = await asyncio.gather(*(stream_one(client, 12) for _ in range(10)))
    assert all(r.text for r in results)
    waited = [r for r in results if r.queued]
    assert len(waited) >= 10 - 2, [r.first.get("phase") for r in results]
    for r in waited:  # the first chunk says it, with a place in line, before any token
        assert r.first["phase"] == "queued" and r.first["queue"]["position"] >= 1
        assert r.first["queue"]["waiting"] >= r.first["queue"]["position"]
    assert any(r.queued[-1]["queue"]["eta_s"] is not None for r in waited)  # once sessions ended, a rate exists
    for r in results:
        if not r.queued:
            assert r.first["phase"] == "routing"  # admitted at once: the first chunk carries the route, as before
    queue = _queue(swarm)
    assert queue.admitted == len(waited) and not sum(queue.dropped.values())
    async with httpx.AsyncClient(timeout=10) as http:
        scrape = Scrape((await http.get(f"{swarm.url}/metrics")).text)
    assert scrape.value("swarmroute_gateway_queue_admitted_total") == len(waited)
    assert scrape.value("swarmroute_gateway_queue_waiting") == 0
    assert scrape.value("swarmroute_gateway_queue_wait_seconds_count") == len(waited)
    await swarm.freed()


async def test_a_queued_request_is_admitted_when_a_session_ends_not_on_a_poll(
        monkeypatch: pytest.MonkeyPatch, nats_server: Any, tmp_path: Path, swarms: Swarms) -> None:
    """Continuous batching's promise at the gateway: the next request in line gets its route as soon as a session
    ends, not at the next poll or heartbeat. Here neither comes within the test (the queue's backoff and poll are
    minutes, heartbeats 10 s apart): only the session ends can admit the three requests beyond the one slot."""
    monkeypatch.setattr(admission, "FIRST_RETRY_S", 300.0)
    settings = make_settings(nats_server.url, tmp_path / "home", queue_poll_s=300.0, queue_wait_s=600.0,
                             heartbeat_s=10.0, registry_ttl_s=40.0)
    swarm = await _slow_pair(swarms, settings, max_sessions=1, delay_s=0.01)
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=60)
    results = await asyncio.gather(*(stream_one(client, 8) for _ in range(4)))
    assert all(r.text for r in results)
    assert sum(1 for r in results if r.queued) == 3 and _queue(swarm).admitted == 3
    await swarm.freed()


async def test_a_non_streamed_request_simply_waits(nats_server: Any, tmp_path: Path, swarms: Swarms) -> None:
    swarm = await _slow_pair(swarms, make_settings(nats_server.url, tmp_path / "home"), max_sessions=1)
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    busy = asyncio.create_task(stream_one(client, 40))
    await eventually(lambda: len(_queue(swarm).models) > 0 or bool(swarm.held()), what="the first stream routed")
    reply = await client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert (await busy).text
    assert _queue(swarm).admitted >= 1


async def test_a_wait_past_queue_wait_s_is_a_429_with_retry_after(nats_server: Any, tmp_path: Path,
                                                                  swarms: Swarms) -> None:
    settings = make_settings(nats_server.url, tmp_path / "home", queue_wait_s=0.5)
    swarm = await _slow_pair(swarms, settings, max_sessions=1, delay_s=0.02)
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    busy = asyncio.create_task(stream_one(client, 200))
    await eventually(lambda: bool(swarm.held()), what="the first stream holding the only slot")
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(f"{swarm.base_url}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
        assert int(r.headers["retry-after"]) >= 1
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True}
        async with http.stream("POST", f"{swarm.base_url}/completions", json=body) as s:
            assert s.status_code == 200  # it showed its place first; the refusal is its error chunk
            lines = [line async for line in s.aiter_lines() if line.startswith("data: ")]
    assert '"phase":"queued"' in lines[0] and "queue_timeout" in lines[-2] and lines[-1] == "data: [DONE]"
    busy.cancel()
    with contextlib.suppress(asyncio.CancelledError, openai.APIError):
        await busy
    assert _queue(swarm).dropped["timeout"] == 2


async def test_a_flood_from_one_key_does_not_delay_another_keys_request_past_one_slot(
        nats_server: Any, tmp_path: Path, swarms: Swarms) -> None:
    settings = make_settings(nats_server.url, tmp_path / "home", api_keys=KEYS)
    swarm = await _slow_pair(swarms, settings, max_sessions=1, delay_s=0.004)
    flood_client, other_client = (openai.AsyncOpenAI(base_url=swarm.base_url, api_key=k, max_retries=0)
                                  for k in KEYS)
    flood = [asyncio.create_task(stream_one(flood_client, 20)) for _ in range(12)]
    queue = _queue(swarm)
    await eventually(lambda: queue.waiting >= 8, timeout=20, what="the flood waiting in the queue")
    joined = time.monotonic()
    other = await stream_one(other_client, 20)
    floods = await asyncio.gather(*flood)
    assert other.text and all(f.text for f in floods)
    # Its place in line was next after the flood's request holding the turn, not behind the whole flood...
    assert other.queued and other.queued[0]["queue"]["position"] <= 2, other.queued[0]
    # ...and at most one flood request that was waiting when it arrived got a route before it.
    before = [f for f in floods if f.queued and joined < f.admitted_at < other.admitted_at]
    assert len(before) <= 1, len(before)


async def test_fifty_requests_rejected_after_routing_leave_the_capacity_as_it_was(nats_server: Any, tmp_path: Path,
                                                                                  swarms: Swarms) -> None:
    # Slow heartbeats: a reservation left to expire would hold its slot for 1.5 of them (9 s), far past this test.
    settings = make_settings(nats_server.url, tmp_path / "home", heartbeat_s=6.0, registry_ttl_s=20.0)
    swarm = await _slow_pair(swarms, settings, max_sessions=4, delay_s=0.004)
    settled = [n.advertisement().capacity.sessions_settled for n in swarm.nodes]
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(50):  # a token id beyond the vocabulary: the head refuses it once routed
            r = await http.post(f"{swarm.base_url}/completions",
                                json={"model": MODEL, "prompt": [999_999], "max_tokens": 4})
            assert r.status_code == 400 and "token ids" in r.json()["error"]["message"], r.text
    # Every node settled every one of them: the head refused it, the tail heard its close before any open.
    assert [n.advertisement().capacity.sessions_settled - s for n, s in zip(swarm.nodes, settled, strict=True)] \
        == [50, 50]
    await eventually(lambda: swarm.tracker.pending.counts() == {}, timeout=3,
                     what=lambda: f"the tracker releasing every reservation ({swarm.tracker.pending.counts()})")
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    valid = await asyncio.gather(*(stream_one(client, 4) for _ in range(4)))
    assert all(v.text for v in valid)
    assert [v.first["phase"] for v in valid] == ["routing"] * 4  # none had to wait for a slot
    queue = _queue(swarm)
    assert queue.admitted == 0 and not sum(queue.dropped.values())


# ---- step-boundary admission of prefill on a real llama.cpp route --------------------------------------------------

BURST = 32
BURST_PROMPT = 64
"""Tokens per prompt of the burst: 8 of them fill a 512-token pass exactly (a decode step found no room beside
them before), and the 32 are 4 such passes on every hop."""


def _full_pass_s(gemma_path: Path, shards: Path) -> float:
    """How long one full pass (512 positions) of the route's tail shard takes on this machine now: the test's hop
    timeout is a multiple of it, so it is short for this machine whatever its load (a loaded 2-core machine took
    5-13 s where an idle one takes well under one)."""
    import numpy as np

    from actors.backend import StepInput
    from actors.backends import load_backend
    from schemas.session import SamplingParams

    shards.mkdir(parents=True, exist_ok=True)
    backend = load_backend("llamacpp", model_path=gemma_path, n_ctx=1024, max_sessions=2, threads=1,
                           layer_start=9, layer_end=18, shard_dir=shards)
    try:
        backend.open_session("probe", prompt_tokens=[2] * 512, sampling=SamplingParams(temperature=0.0))
        began = time.perf_counter()
        backend.step([StepInput("probe", 0, hidden=np.zeros((512, 640), dtype=np.float32), sample=True)])
        return time.perf_counter() - began
    finally:
        backend.close()


def _burst_prompt(i: int) -> list[int]:
    return [2, *((1000 + 37 * i + 11 * k) % 20000 + 100 for k in range(BURST_PROMPT - 1))]


@pytest.mark.slow
async def test_a_burst_of_prompts_admitted_at_once_all_complete_and_a_running_stream_keeps_decoding(
        nats_server: Any, gemma_path: Path, tmp_path: Path) -> None:
    """32 sessions admitted at once on one 2-node llama.cpp route (capacity for all of them, as up's
    memory-derived sessions give), their prompts arriving together, with a hop timeout of 3 full passes of the
    tail: the head lets a share of the hop timeout's prefill at a time onto the route, so no frame waits at the
    tail behind every other prompt (before, the tail's queue held all 32 prompts, 4 full passes, and the last
    frames timed out), and every pass takes the running stream's decode step first, so it keeps producing tokens
    while the burst prefills (before, 8 queued prompts filled a pass and it waited)."""
    from tests.support.swarm import gemma_route

    hop_timeout = max(3.0, 3 * await asyncio.to_thread(_full_pass_s, gemma_path, tmp_path / "shards"))
    async with gemma_route(nats_server.url, gemma_path, tmp_path, namespace="burst", max_sessions=BURST + 2,
                           threads=1, cuts=(0, 9, 18), hop_timeout_s=hop_timeout, liveness_probe_s=0.0,
                           registry_ttl_s=60.0, session_idle_ttl_s=900.0) as swarm:
        client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0, timeout=600)
        arrivals: list[float] = []

        async def running() -> None:
            stream = await client.completions.create(model="gemma", prompt="Once upon a time", max_tokens=400,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    arrivals.append(time.monotonic())

        runner = asyncio.create_task(running())
        await eventually(lambda: len(arrivals) >= 4, timeout=120, what="the running stream decoding")
        async def prompt(i: int) -> tuple[str, float]:
            stream = await client.completions.create(model="gemma", prompt=_burst_prompt(i), max_tokens=4,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            text, first = "", 0.0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first = first or time.monotonic()
                    text += chunk.choices[0].text
            return text, first

        sent = time.monotonic()
        burst = await asyncio.gather(*(prompt(i) for i in range(BURST)))
        assert all(text for text, _ in burst), burst
        prefilled = max(first for _, first in burst)  # the last prompt's first token: the burst is prefilled
        during = sum(1 for t in arrivals if sent <= t <= prefilled)
        assert during >= 8, f"the running stream got {during} tokens while the burst was prefilled"
        head = swarm.nodes[0]
        assert head.engine.prefills.waited > 0 and head.engine.prefills.in_flight == 0
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError, openai.APIError):
            await runner


# ---- `swarmroute up`: 2 llama.cpp nodes of 4 sessions, the bundled model -----------------------------------------

GEMMA = "gemma-3-270m"
UP_STREAMS = 64
UP_CAPACITY = 4
"""Routes the up below holds at once: both nodes are on every route, each holds 4 sessions (``--max-sessions 4``:
the default, from this machine's memory, holds far more than 64 streams of the bundled model, so none would wait)."""


@pytest.mark.slow
async def test_up_serves_64_concurrent_streams_through_the_queue_and_rejections_hold_nothing(
        children: Children, tmp_path: Path) -> None:
    # The default queue wait (120 s) is a client-facing limit; on a machine shared with other jobs 64 streams can
    # take longer than that to get through 4 slots, and every stream completing is what this test is about. The
    # gateway's liveness probe is on (its default): a head probed after it freed a completed session, before its end
    # arrived, says the session ended (tests/test_endings.py).
    up = children.add(Up("--max-sessions", str(UP_CAPACITY),
                         env={"SWARMROUTE_HOME": str(tmp_path / "home"), "SWARMROUTE_GATEWAY_PORT": str(free_port()),
                              "SWARMROUTE_QUEUE_WAIT_S": "900"}))
    assert await asyncio.to_thread(up.banner.wait, 600), up.output
    assert up.proc.poll() is None, up.output
    url = up.gateway_url()
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)

    # 50 requests refused after routing (a token id beyond the 262,144-token vocabulary: the head refuses it)...
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(50):
            r = await http.post(f"{url}/v1/completions", json={"model": GEMMA, "prompt": [262144], "max_tokens": 4})
            assert r.status_code == 400 and "token ids" in r.json()["error"]["message"], r.text
    # ...then 4 valid concurrent requests, once the nodes' immediate heartbeats are in (milliseconds; a reservation
    # left to expire held its slot for 3 s): all served at once, none waits for a slot.
    await asyncio.sleep(0.2)
    valid = await asyncio.gather(*(stream_one(client, 4, model=GEMMA, prompt="The capital of France is")
                                   for _ in range(UP_CAPACITY)))
    assert all(v.text for v in valid) and [v.first["phase"] for v in valid] == ["routing"] * UP_CAPACITY

    began = time.monotonic()
    results = await asyncio.gather(*(stream_one(client, 4, model=GEMMA, prompt=f"Write about the number {i}:")
                                     for i in range(UP_STREAMS)))
    at_once = time.monotonic() - began
    assert all(r.text for r in results), [r.text for r in results]
    waited = [r for r in results if r.queued]
    for each in results:  # before its first token, a stream that waited says so first, with its place in line
        if each.queued:
            assert each.first["phase"] == "queued" and each.first["queue"]["position"] >= 1, each.first
        else:
            assert each.first["phase"] == "routing", each.first
    assert len(waited) >= UP_STREAMS - 2 * UP_CAPACITY, len(waited)
    async with httpx.AsyncClient(timeout=30) as http:
        scrape = Scrape((await http.get(f"{url}/metrics")).text)
    assert scrape.value("swarmroute_gateway_queue_admitted_total") == len(waited)
    assert sum(s.value for s in scrape.samples if s.name == "swarmroute_gateway_queue_dropped_total") == 0
    assert scrape.value("swarmroute_gateway_sessions_total", outcome="complete") == UP_STREAMS + UP_CAPACITY
    # What queueing costs: the same work in 16 waves of 4, each sent when the last ended. Printed, not asserted
    # (a shared machine's timings are no test); issue #30 aims at 1.2x at most (tests/bench/bench_admission.py).
    began = time.monotonic()
    for wave in range(UP_STREAMS // UP_CAPACITY):
        done = await asyncio.gather(*(stream_one(client, 4, model=GEMMA, prompt=f"Write about the number {i}:")
                                      for i in range(wave * UP_CAPACITY, (wave + 1) * UP_CAPACITY)))
        assert all(d.text for d in done)
    in_waves = time.monotonic() - began
    print(f"{UP_STREAMS} streams at once: {at_once:.1f} s; in {UP_STREAMS // UP_CAPACITY} waves of {UP_CAPACITY}: "
          f"{in_waves:.1f} s ({at_once / in_waves:.2f}x)")
