"""actors.tracker over a real nats-server: nodes advertise into the KV registry, trackers answer over request/reply.

The wire contract is exercised with a plain nats-py client plus bus.codec and bus.subjects, as a client written in
any language would.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from actors.node import Node, NodeConfig
from actors.tracker import Tracker
from bus import codec
from bus.subjects import Subjects
from schemas.node import NodeAdvertisement
from schemas.route import ModelsReply, RouteReply, RouteRequest
from schemas.settings import Settings
from tests.support.swarm import Swarms, stub, wait_model
from tests.support.waiting import eventually

MODEL = "stub-model"


class Nodes:
    """Stub nodes started one by one (through the test's ``swarms``, which stops them)."""

    def __init__(self, settings: Settings, swarms: Swarms) -> None:
        self.settings = settings
        self.swarms = swarms

    async def add(self, node_id: str, start: int, end: int, model: str = MODEL, *, verified: bool = True,
                  **kw: Any) -> Node:
        return await self.swarms.actor(Node(NodeConfig(node_id=node_id, model_id=model, verified=verified),
                                            stub(start, end, model=model, **kw), self.settings))


@pytest.fixture
def nodes(settings: Settings, swarms: Swarms) -> Nodes:
    return Nodes(settings, swarms)


@pytest.fixture
async def tracker(settings: Settings, swarms: Swarms) -> Tracker:
    return await swarms.actor(Tracker(settings))


async def ask_route(nc: Any, settings: Settings, model: str = MODEL, exclude: list[str] | None = None) -> RouteReply:
    request = RouteRequest(model=model, session_id=uuid.uuid4().hex, exclude=exclude or [])
    msg = await nc.request(Subjects(settings.namespace).route_request, codec.encode(request), timeout=2)
    return codec.decode(msg.data, RouteReply)


async def ask_models(nc: Any, settings: Settings) -> ModelsReply:
    msg = await nc.request(Subjects(settings.namespace).models_request, b"", timeout=2)
    return codec.decode(msg.data, ModelsReply)


async def test_nodes_advertise_into_kv_and_tracker_routes_over_the_wire(settings: Settings, nc: Any,
                                                                       nodes: Nodes, tracker: Tracker) -> None:
    head = await nodes.add("n1", 0, 3)
    tail = await nodes.add("n2", 3, 8)
    await wait_model(tracker, MODEL, n_nodes=2)

    kv = await nc.jetstream().key_value(Subjects(settings.namespace).registry_bucket)
    advert = codec.decode((await kv.get("n2")).value, NodeAdvertisement)
    assert advert.endpoint == tail.endpoint
    assert (advert.layers.start, advert.layers.end) == (3, 8) and advert.is_tail and not advert.is_head

    reply = await ask_route(nc, settings)
    assert reply.status == 200 and reply.error is None and reply.route is not None
    assert [(h.node_id, h.endpoint) for h in reply.route.hops] == [("n1", head.endpoint), ("n2", tail.endpoint)]
    assert reply.route.n_layers == 8 and reply.route.hidden_shape == [64]


async def test_route_errors_travel_with_status_and_uncovered_layers(settings: Settings, nc: Any, nodes: Nodes,
                                                                   tracker: Tracker) -> None:
    await nodes.add("n1", 0, 4)
    await nodes.add("unverified", 4, 8, verified=False)
    await eventually(lambda: _has_nodes(tracker, 2), timeout=5, interval=0.02, what="the tracker seeing both nodes")

    reply = await ask_route(nc, settings)
    assert reply.route is None and reply.status == 503
    assert "[4, 8)" in (reply.error or "")
    assert [(g.start, g.end) for g in reply.uncovered] == [(4, 8)]

    reply = await ask_route(nc, settings, model="no-such-model")
    assert reply.status == 404 and reply.route is None

    msg = await nc.request(Subjects(settings.namespace).route_request, b"\xc1garbage", timeout=2)
    bad = codec.decode(msg.data, RouteReply)
    assert bad.status == 400 and "RouteRequest" in (bad.error or "")


async def test_routes_handed_out_count_until_heartbeats_report_them(settings: Settings, nc: Any, nodes: Nodes,
                                                                   tracker: Tracker) -> None:
    await nodes.add("solo", 0, 8, max_sessions=1)
    await wait_model(tracker, MODEL)
    first, second = await ask_route(nc, settings), await ask_route(nc, settings)
    assert first.route is not None
    assert second.route is None and second.status == 429


async def _has_nodes(tracker: Tracker, n: int) -> bool:
    assert tracker.registry is not None
    return len(tracker.registry.live()) >= n


async def _listed(nc: Any, settings: Settings, node_id: str) -> bool:
    """Whether the trackers list the node (asking for routes instead would reserve capacity on every call)."""
    return any(node_id in m.nodes for m in (await ask_models(nc, settings)).models)


async def test_clean_stop_disappears_at_once(settings: Settings, nc: Any, nodes: Nodes, tracker: Tracker) -> None:
    node = await nodes.add("n1", 0, 8)
    await wait_model(tracker, MODEL)
    assert await _listed(nc, settings, "n1")
    await node.stop()
    # The last heartbeat is at most heartbeat_s old, so expiry alone would take at least ttl - heartbeat_s.
    started = time.monotonic()
    await eventually(lambda: _not(_listed(nc, settings, "n1")), timeout=settings.registry_ttl_s - settings.heartbeat_s
                     - 0.5, interval=0.02, what="the trackers no longer listing n1")
    took = time.monotonic() - started
    assert took < settings.registry_ttl_s - settings.heartbeat_s
    reply = await ask_route(nc, settings)
    assert reply.status == 404


async def _not(awaitable: Any) -> bool:
    return not await awaitable


async def test_silent_node_stops_being_routed_after_the_ttl(settings: Settings, nc: Any, nodes: Nodes,
                                                           tracker: Tracker) -> None:
    await nodes.add("steady", 0, 8)
    silent = await nodes.add("silent", 0, 8)
    await wait_model(tracker, MODEL, n_nodes=2)
    heartbeat = silent._tasks[0]
    assert heartbeat.get_name() == "heartbeat"
    heartbeat.cancel()
    stopped_at = time.monotonic()

    async def silent_gone() -> bool:
        assert tracker.registry is not None
        return "silent" not in {a.node_id for a in tracker.registry.live()}

    await eventually(silent_gone, timeout=settings.registry_ttl_s + 2.0, interval=0.02,
                     what="the tracker dropping the silent node")
    gone_after = time.monotonic() - stopped_at
    # Not at once (the node said no goodbye), but within the TTL of its last heartbeat.
    assert gone_after >= settings.registry_ttl_s - settings.heartbeat_s - 0.2
    for _ in range(10):
        reply = await ask_route(nc, settings)
        assert reply.route is not None and [h.node_id for h in reply.route.hops] == ["steady"]


async def test_sigkilled_node_process_stops_being_routed(settings: Settings, nc: Any, tracker: Tracker,
                                                         swarms: Swarms) -> None:
    proc = await swarms.node_process(settings, "victim", ["--backend", "stub", "--layers", "0:8", "--model-id", MODEL])
    await wait_model(tracker, MODEL, timeout=30)
    reply = await ask_route(nc, settings)
    assert reply.route is not None and reply.route.hops[0].endpoint == proc.endpoint
    await asyncio.to_thread(proc.kill)
    killed_at = time.monotonic()
    await eventually(lambda: _not(_listed(nc, settings, "victim")), timeout=settings.registry_ttl_s + 2.0,
                     interval=0.02, what="the trackers no longer listing the killed node")
    assert time.monotonic() - killed_at >= settings.registry_ttl_s - settings.heartbeat_s - 0.2
    assert (await ask_route(nc, settings)).status == 404


async def test_two_trackers_share_the_queue_group_and_answer_each_request_once(settings: Settings, nc: Any,
                                                                              nodes: Nodes, swarms: Swarms) -> None:
    await nodes.add("n1", 0, 8, max_sessions=1000)
    t1, t2 = await swarms.actor(Tracker(settings)), await swarms.actor(Tracker(settings))
    answered = {"t1": 0, "t2": 0}

    def spy(tracker: Tracker, name: str) -> None:
        original = tracker.route

        def route(request: RouteRequest) -> RouteReply:
            answered[name] += 1
            return original(request)

        tracker.route = route  # type: ignore[method-assign]

    spy(t1, "t1")
    spy(t2, "t2")
    await wait_model(t1, MODEL)
    await wait_model(t2, MODEL)
    # A tracker's subscription reaches the server shortly after start() returns: wait until both have answered.
    async def both_answered() -> bool:
        assert (await ask_route(nc, settings)).route is not None
        return min(answered.values()) > 0

    await eventually(both_answered, timeout=5, interval=0,
                     what=lambda: f"both trackers answering route requests ({answered})")
    answered.update(t1=0, t2=0)
    inbox = nc.new_inbox()
    replies: list[RouteReply] = []

    async def on_reply(msg: Any) -> None:
        replies.append(codec.decode(msg.data, RouteReply))

    sub = await nc.subscribe(inbox, cb=on_reply)
    n = 60
    sids = [uuid.uuid4().hex for _ in range(n)]
    for sid in sids:
        await nc.publish(Subjects(settings.namespace).route_request,
                         codec.encode(RouteRequest(model=MODEL, session_id=sid)), reply=inbox)
    await nc.flush()
    await eventually(lambda: len(replies) >= n, timeout=5, interval=0.02, what=f"{n} replies")
    await asyncio.sleep(0.3)  # a duplicate answer would arrive in this window
    await sub.unsubscribe()
    assert len(replies) == n
    assert sorted(r.route.session_id for r in replies if r.route) == sorted(sids)
    assert answered["t1"] + answered["t2"] == n
    assert answered["t1"] > 0 and answered["t2"] > 0


async def test_models_lists_complete_and_incomplete_models(settings: Settings, nc: Any, nodes: Nodes,
                                                          tracker: Tracker) -> None:
    await nodes.add("a1", 0, 5, model="alpha")
    await nodes.add("a2", 5, 8, model="alpha")
    await nodes.add("b1", 0, 4, model="beta")
    await nodes.add("c1", 0, 8, model="gamma", verified=False)
    await eventually(lambda: _has_nodes(tracker, 4), timeout=5, interval=0.02, what="the tracker seeing 4 nodes")

    reply = await ask_models(nc, settings)
    by_id = {m.id: m for m in reply.models}
    assert sorted(by_id) == ["alpha", "beta", "gamma"]
    assert by_id["alpha"].complete and sorted(by_id["alpha"].nodes) == ["a1", "a2"]
    assert sorted((r.start, r.end) for r in by_id["alpha"].layer_ranges) == [(0, 5), (5, 8)]
    assert not by_id["beta"].complete and by_id["beta"].nodes == ["b1"]
    assert not by_id["gamma"].complete and by_id["gamma"].nodes == ["c1"]  # listed, but never routable
    assert all(m.n_layers == 8 and m.backend is not None and m.backend.kind == "stub" for m in reply.models)
