"""Fuzzing the three surfaces a stranger can reach (hypothesis, bounded examples), against live actors:

- activation frames posted to a node: random and mutated bytes, wrong sizes, dtypes, positions and sessions;
- NATS messages to the tracker (route, models) and to the registry (advertisement puts);
- OpenAI request bodies to the gateway.

Each answer must be a 4xx with a reason (or a success, when a mutation happens to be valid) — never a 5xx, a hang
or a crash — while a healthy session runs alongside and produces exactly its reference text, and nothing is left
open at the end. The hypothesis loops run in a worker thread with blocking clients, so the actors keep serving on
the test's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import json
import struct
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import codec
from bus import frame as frames
from bus.nodeclient import FRAME_CONTENT_TYPE
from bus.subjects import Subjects
from schemas.frame import FrameHeader, FrameKind, WireDType
from schemas.route import ModelsReply, RouteReply, RouteRequest
from schemas.session import SessionOpen
from schemas.settings import Settings
from tests.support import figures
from tests.support.swarm import Swarm, Swarms, make_settings, stub
from tests.support.waiting import eventually

MODEL = "stub-model"
EXAMPLES = 150
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture
async def swarm(nats_server: object, tmp_path: Path, swarms: Swarms) -> Swarm:
    fuzz_settings = make_settings(nats_server.url, tmp_path / "home", default_max_tokens=8,  # type: ignore[attr-defined]
                                  max_body_bytes=64 * 1024)
    return await swarms.start(fuzz_settings, [stub(0, 4), stub(4, 8, delay_s=0.002)], model_id=MODEL)


async def reference_text(swarm: Swarm, prompt: str, n: int) -> str:
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True})
    return r.choices[0].text


async def healthy_stream(swarm: Swarm, prompt: str, n: int, stop: asyncio.Event) -> list[str]:
    """Greedy sessions back to back until ``stop``: every one must reproduce the reference exactly."""
    client = openai.AsyncOpenAI(base_url=swarm.base_url, api_key="unused", max_retries=0)
    texts: list[str] = []
    while not stop.is_set():
        text = ""
        chunks = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            text += chunk.choices[0].text if chunk.choices else ""
        texts.append(text)
    return texts


def nothing_open(swarm: Swarm) -> bool:
    assert swarm.gateway.serving is not None
    return not swarm.gateway.serving.sessions.live and not any(n.sessions for n in swarm.nodes)


def check_answer(r: httpx.Response, statuses: collections.Counter[int]) -> None:
    statuses[r.status_code] += 1
    assert r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"], r.text


# ---- frames -----------------------------------------------------------------------------------------------------

def valid_frame(session_id: str, start: int, n: int = 1, *, dims: tuple[int, ...] = (64,),
                dtype: WireDType = WireDType.F32, sample: bool = False) -> bytes:
    header = FrameHeader(session_id=frames.session_bytes(session_id), kind=FrameKind.PREFILL, dtype=dtype,
                         start_position=start, n_positions=n, position_shape=dims, sample=sample)
    return frames.encode(header, np.ones((n, *dims), dtype=np.float32))


@st.composite
def frame_bodies(draw: st.DrawFn, session_id: str, position: int) -> bytes:
    kind = draw(st.sampled_from(["random", "flip", "truncate", "extend", "field", "shape"]))
    if kind == "random":
        return draw(st.binary(max_size=2048))
    base = bytearray(valid_frame(session_id, position, draw(st.integers(1, 3))))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(base) - 1))
            base[i] = draw(st.integers(0, 255))
    elif kind == "truncate":
        base = base[:draw(st.integers(0, len(base) - 1))]
    elif kind == "extend":
        base += draw(st.binary(min_size=1, max_size=512))
    elif kind == "field":  # one header field to an arbitrary value: kind, dtype, flags, n_dims, step, start, n, stamps
        offset, fmt = draw(st.sampled_from([(4, "<B"), (5, "<B"), (6, "<B"), (7, "<B"), (24, "<I"), (28, "<I"),
                                            (32, "<I"), (36, "<B")]))
        limit = 255 if fmt == "<B" else 2**32 - 1
        struct.pack_into(fmt, base, offset, draw(st.integers(0, limit)))
    else:  # a well-formed frame of the wrong shape or dtype
        dims = draw(st.lists(st.integers(1, 80), min_size=1, max_size=4).map(tuple))
        dtype = draw(st.sampled_from(list(WireDType)))
        return valid_frame(session_id, position, dims=dims, dtype=dtype)
    return bytes(base)


async def test_fuzzed_frames_get_4xx_and_the_node_keeps_serving(swarm: Swarm) -> None:
    reference = await reference_text(swarm, "steady", 24)
    tail = swarm.nodes[1]
    http = httpx.Client(timeout=10)
    statuses: collections.Counter[int] = collections.Counter()
    current: dict[str, str] = {}

    loop = asyncio.get_running_loop()

    async def route_for(sid: str) -> RouteReply:  # the tracker's state belongs to the event loop's thread
        return swarm.tracker.route(RouteRequest(model=MODEL, session_id=sid))

    def open_target() -> str:
        """A session open on the tail only, as if its head had vanished: the fuzz target."""
        if "sid" in current:
            http.delete(f"{tail.endpoint}/v1/sessions/{current['sid']}")
        sid = uuid.uuid4().hex
        reply = asyncio.run_coroutine_threadsafe(route_for(sid), loop).result(10)
        assert reply.route is not None
        body = SessionOpen(session_id=sid, route=reply.route, hop_index=1, prompt_tokens=[1], max_tokens=4)
        r = http.post(f"{tail.endpoint}/v1/sessions", json=body.model_dump(mode="json"))
        assert r.status_code == 201, r.text
        current["sid"] = sid
        return sid

    def position(sid: str) -> int:
        r = http.get(f"{tail.endpoint}/v1/sessions/{sid}")
        return int(r.json()["position"]) if r.status_code == 200 else -1

    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        sid = current.get("sid") or open_target()
        at = position(sid)
        if at < 0 or at > 3000:
            sid, at = open_target(), 0
        url_sid = data.draw(st.sampled_from([sid] * 8 + [uuid.uuid4().hex, "not-a-session"]))
        body = data.draw(frame_bodies(sid, at))
        content_type = data.draw(st.sampled_from([FRAME_CONTENT_TYPE] * 4 + ["application/json", "text/plain"]))
        r = http.post(f"{tail.endpoint}/v1/sessions/{url_sid}/frames", content=body,
                      headers={"content-type": content_type})
        check_answer(r, statuses)

    stop = asyncio.Event()
    healthy = asyncio.create_task(healthy_stream(swarm, "steady", 24, stop))
    try:
        await asyncio.to_thread(run)
    finally:
        stop.set()
        texts = await healthy
        http.close()
    assert texts and all(t == reference for t in texts)  # the concurrent session never noticed
    assert statuses[400] > 0 and sum(statuses.values()) >= EXAMPLES
    async with httpx.AsyncClient() as client:
        assert (await client.get(f"{tail.endpoint}/health")).status_code == 200
    figures.record("fuzz_frames", cases=sum(statuses.values()), statuses=dict(statuses),
                   healthy_sessions_alongside=len(texts))


# ---- NATS: tracker and registry ---------------------------------------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
                | st.text(max_size=20))  # integers msgpack can carry
json_values = st.recursive(json_scalars,
                           lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=10), children, max_size=4), max_leaves=12)


@st.composite
def route_requests(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "msgpack", "fields"]))
    if kind == "bytes":
        return draw(st.binary(max_size=512))
    if kind == "msgpack":
        return msgpack.packb(draw(json_values), use_bin_type=True)
    body: dict[str, Any] = {"model": draw(st.sampled_from([MODEL, "", "x" * 300, "other"]) | st.text(max_size=30)),
                            "session_id": draw(st.text(max_size=80)),
                            "exclude": draw(st.lists(st.text(max_size=10), max_size=5) | json_values)}
    if draw(st.booleans()):
        body[draw(st.text(max_size=10))] = draw(json_values)
    return msgpack.packb(body, use_bin_type=True)


@st.composite
def advertisements(draw: st.DrawFn, template: dict[str, Any]) -> bytes:
    """Registry puts: junk, or a real advertisement with fields changed (never for the model under test)."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=512))
    advert = json.loads(json.dumps(template))
    advert["model_id"] = "fuzz-" + draw(st.text("abc", min_size=1, max_size=4))
    for _ in range(draw(st.integers(1, 4))):
        field = draw(st.sampled_from(["layers", "capacity", "backend", "node_id", "endpoint", "is_head"]))
        advert[field] = draw(json_values | st.fixed_dictionaries(
            {"start": st.integers(-3, 40), "end": st.integers(-3, 40)}))
    return msgpack.packb(advert, use_bin_type=True)


async def test_fuzzed_nats_messages_never_stop_the_tracker(swarm: Swarm, nc: Any) -> None:
    subjects = Subjects(swarm.settings.namespace)
    js = nc.jetstream()
    kv = await js.key_value(subjects.registry_bucket)
    template = swarm.nodes[0].advertisement().model_dump(mode="json")
    loop = asyncio.get_running_loop()
    answered: collections.Counter[str] = collections.Counter()

    def call(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(15)

    async def ask(subject: str, payload: bytes) -> None:
        msg = await nc.request(subject, payload, timeout=5)
        if subject == subjects.models_request:
            codec.decode(msg.data, ModelsReply)
        else:
            reply = codec.decode(msg.data, RouteReply)
            assert reply.route is not None or (reply.error and 400 <= reply.status < 600), reply
        answered[subject.rsplit(".", 1)[-1]] += 1

    async def put(key: str, value: bytes) -> None:
        await kv.put(key, value)
        await nc.publish(subjects.registry_key_subject(key), value)  # the tracker's core-NATS view too
        answered["registry"] += 1

    @FUZZ
    @given(target=st.sampled_from(["route", "route", "models", "registry"]), data=st.data())
    def run(target: str, data: st.DataObject) -> None:
        if target == "route":
            call(ask(subjects.route_request, data.draw(route_requests())))
        elif target == "models":
            call(ask(subjects.models_request, data.draw(st.binary(max_size=64))))
        else:
            key = "fuzz-" + data.draw(st.text("abcdef0123", min_size=1, max_size=6))
            call(put(key, data.draw(advertisements(template))))

    await asyncio.to_thread(run)
    # Still answering, and still routing the real model over the real nodes.
    reply = codec.decode((await nc.request(subjects.route_request, codec.encode(
        RouteRequest(model=MODEL, session_id="after-fuzz")), timeout=5)).data, RouteReply)
    assert reply.route is not None and [h.node_id for h in reply.route.hops] == ["n1", "n2"]
    assert await reference_text(swarm, "after", 4)
    assert sum(answered.values()) >= EXAMPLES
    figures.record("fuzz_nats", cases=sum(answered.values()), by_subject=dict(answered))


# ---- the gateway's OpenAI API -----------------------------------------------------------------------------------

valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": st.text(max_size=30)}), min_size=1, max_size=3)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]),
                                           "content": st.text(max_size=30) | json_values}), max_size=3) | json_values
# Per field: mostly values the API accepts, sometimes type-correct edges just outside (``edge_fields``), or
# anything at all (``junk_fields``). Mostly-valid bodies reach generation, where the deeper bugs live.
def _mostly(valid: st.SearchStrategy[Any], edge: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, valid, edge)


edge_fields = {
    "max_tokens": _mostly(st.integers(1, 10), st.integers(-2, 0) | st.just(10**20)),
    "temperature": _mostly(st.floats(0, 2), st.floats(-1, 3, allow_nan=False)),
    "top_p": _mostly(st.floats(0.01, 1), st.floats(-0.5, 1.5, allow_nan=False)),
    "top_k": _mostly(st.integers(0, 300), st.integers(-5, -1)),
    "min_p": _mostly(st.floats(0, 1), st.floats(-0.5, 1.5, allow_nan=False)),
    "n": _mostly(st.just(1), st.integers(-1, 3)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans(), "include_telemetry": st.booleans()}),
    "stop": _mostly(st.text(min_size=1, max_size=5), st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20)),
    "seed": st.integers(-(2**70), 2**70),
    "logprobs": _mostly(st.just(False), st.just(True)),
    "presence_penalty": _mostly(st.floats(-2, 2), st.floats(-3, 3, allow_nan=False)),
    "frequency_penalty": _mostly(st.floats(-2, 2), st.floats(-3, 3, allow_nan=False)),
    "repeat_penalty": _mostly(st.floats(0.1, 10), st.floats(-1, 12, allow_nan=False)),
    "echo": st.booleans(),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=10),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
}
junk_fields = {**{name: json_values for name in edge_fields}, "tools": json_values}


@st.composite
def openai_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/chat/completions", "/completions"]))
    kind = draw(st.sampled_from(["bytes", "json", "junk", "edge", "edge", "edge"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=300))
    if kind == "json":
        return path, json.dumps(draw(json_values)).encode()
    fields = edge_fields if kind == "edge" else junk_fields
    model = MODEL if kind == "edge" else draw(st.sampled_from([MODEL, "nope", ""]) | json_values)
    body: dict[str, Any] = {"model": model}
    if path == "/chat/completions":
        body["messages"] = draw(valid_messages if kind == "edge" else messages)
    else:
        body["prompt"] = draw(st.text(max_size=40) | st.lists(st.integers(-3, 300), max_size=8)
                              if kind == "edge" else json_values)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True)):
        body[name] = draw(fields[name])
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 10:
        body["max_tokens"] = 10**20  # over the context: refused, never generated
    return path, json.dumps(body).encode()


async def test_fuzzed_openai_requests_get_4xx_and_leave_no_session(swarm: Swarm) -> None:
    statuses: collections.Counter[int] = collections.Counter()
    http = httpx.Client(timeout=30)

    @FUZZ
    @given(case=openai_bodies())
    def run(case: tuple[str, bytes]) -> None:
        path, body = case
        with http.stream("POST", swarm.base_url + path, content=body,
                         headers={"content-type": "application/json"}) as r:
            r.read()  # a stream must also end on its own
        check_answer(r, statuses)
        if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]")

    await asyncio.to_thread(run)
    http.close()
    await eventually(lambda: nothing_open(swarm), what="every session ending with its request")
    assert statuses[400] > 0 and sum(statuses.values()) >= EXAMPLES
    figures.record("fuzz_gateway", cases=sum(statuses.values()), statuses=dict(statuses))


async def test_fuzzed_frames_on_a_secured_node_are_refused_before_parsing(nats_server: object, tmp_path: Path,
                                                                          swarms: Swarms) -> None:
    secured: Settings = make_settings(nats_server.url, tmp_path / "home",  # type: ignore[attr-defined]
                                      swarm_secret="fuzz-secret-0123456789abcdef")
    s = await swarms.start(secured, [stub(0, 4), stub(4, 8)], model_id=MODEL)
    statuses: collections.Counter[int] = collections.Counter()
    http = httpx.Client(timeout=10)
    swarms.on_teardown(http.close)
    sid = uuid.uuid4().hex
    reply = s.tracker.route(RouteRequest(model=MODEL, session_id=sid))
    assert reply.route is not None
    from bus import capability as caps

    open_body = SessionOpen(session_id=sid, route=caps.strip(reply.route), hop_index=1, prompt_tokens=[1],
                            max_tokens=4, capability=reply.route.hops[1].capability)
    assert (await asyncio.to_thread(http.post, f"{s.nodes[1].endpoint}/v1/sessions",
                                    json=open_body.model_dump(mode="json"))).status_code == 201

    @FUZZ
    @given(body=frame_bodies(sid, 0), token=st.sampled_from(["", "x" * 32]) | st.text(
        st.characters(min_codepoint=33, max_codepoint=126), max_size=40))
    def run(body: bytes, token: str) -> None:
        r = http.post(f"{s.nodes[1].endpoint}/v1/sessions/{sid}/frames", content=body,
                      headers={"content-type": FRAME_CONTENT_TYPE, "x-swarmroute-session-token": token})
        check_answer(r, statuses)
        assert r.status_code in (401, 403)

    await asyncio.to_thread(run)
    figures.record("fuzz_frames_secured", cases=sum(statuses.values()), statuses=dict(statuses))


def test_bogus_registry_entries_cannot_unroute_a_model() -> None:
    """Regression found by the NATS fuzzing above: one advertisement whose range lies beyond its model, or that
    claims another layer count for the same model, made every route for the real nodes a 503."""
    from actors.tracker.routes import select_route
    from schemas.node import BackendInfo, Capacity, LayerRange, NodeAdvertisement

    def advert(node_id: str, start: int, end: int, n_layers: int = 8) -> NodeAdvertisement:
        return NodeAdvertisement(
            node_id=node_id, endpoint=f"http://127.0.0.1:1/{node_id}", model_id=MODEL,
            layers=LayerRange(start=start, end=end), is_head=start == 0, is_tail=end == n_layers,
            backend=BackendInfo(kind="stub", model_name=MODEL, n_layers=n_layers, hidden_size=64, hidden_shape=[64],
                                context_length=64),
            capacity=Capacity(max_sessions=4, max_context=64))

    real = [advert("n1", 0, 4), advert("n2", 4, 8)]
    for bogus in (advert("beyond", 20, 36), advert("more-layers", 0, 40, n_layers=40),
                  advert("inconsistent", 0, 12, n_layers=8)):
        route = select_route([*real, bogus], MODEL, "s")
        assert [h.node_id for h in route.hops] == ["n1", "n2"], bogus.node_id
