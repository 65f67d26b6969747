"""actors.tracker over a real nats-server: nodes advertise into the KV registry, trackers answer over request/reply.

The wire contract is exercised with a plain nats-py client plus bus.codec and bus.subjects, as a client written in
any language would.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
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


# ---- layer assignment (issue #17): nodes joining with only a model id -------------------------------------------

@pytest.fixture
async def holder(settings: Settings, nc: Any, tmp_path: Any) -> AsyncIterator[Any]:
    """A node that holds a small model's manifest and answers manifest requests, as a seeder does."""
    from actors.provisioning.artifact_sync import ArtifactSync, SyncConfig
    from artifacts.store import Store
    from artifacts.torrent import TorrentSession
    from tests.support.gguf_factory import write_tiny_gguf

    store = Store(tmp_path / "holder")
    manifest = store.import_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", n_layers=8, n_embd=128, n_ff=512))
    session = TorrentSession()
    sync = await ArtifactSync(settings, store, session, SyncConfig(node_id="holder"), nc=nc).start()
    await sync.hold(manifest)
    yield manifest
    await sync.stop()
    session.close()


def _request(manifest: Any, node_id: str, memory: int, **kw: Any) -> Any:
    from schemas.assignment import AssignmentRequest

    return AssignmentRequest(node_id=node_id, model_id=manifest.model_id, manifest_id=manifest.manifest_id,
                             memory_bytes=memory, max_sessions=1, context=64, **kw)


def _half_memory(manifest: Any) -> int:
    """Too little for the whole model, enough for half of it (the tracker's own cost model decides)."""
    from actors.tracker.assigner import RESERVE, fit_from_manifest

    fit = fit_from_manifest(manifest, context=64, sessions=1, allow_unproven=False)
    assert fit.cost(0, 4) < 0.8 * fit.cost(0, 8) and fit.cost(4, 8) < 0.8 * fit.cost(0, 8)
    return int(0.8 * fit.cost(0, 8) / (1 - RESERVE))


async def _ask_assign(nc: Any, settings: Settings, request: Any) -> Any:
    from schemas.assignment import AssignmentReply

    msg = await nc.request(Subjects(settings.namespace).assign_request, codec.encode(request), timeout=10)
    return codec.decode(msg.data, AssignmentReply)


async def test_a_joining_node_is_assigned_a_range_held_by_a_lease(settings: Settings, nc: Any, tracker: Tracker,
                                                                  holder: Any) -> None:
    from actors.provisioning.leases import open_leases

    reply = await _ask_assign(nc, settings, _request(holder, "j1", _half_memory(holder)))
    assert reply.status == 200 and reply.layers is not None and reply.reason == "extend"
    assert reply.layers.start == 0 and reply.layers.end < 8 and [(g.start, g.end) for g in reply.uncovered] == [(0, 8)]
    leases = await open_leases(nc, Subjects(settings.namespace), settings.registry_ttl_s)
    held = await leases.held(holder.model_id)
    assert {k: (v.node_id, v.start, v.end, rev) for k, (v, rev) in held.items()} == {
        reply.lease_key: ("j1", reply.layers.start, reply.layers.end, reply.lease_revision)}
    # the same node asking again (a restart) is given its range back, under one lease
    again = await _ask_assign(nc, settings, _request(holder, "j1", _half_memory(holder)))
    assert again.layers == reply.layers
    assert [v.node_id for v, _ in (await leases.held(holder.model_id)).values()] == ["j1"]
    # the next node completes the route
    second = await _ask_assign(nc, settings, _request(holder, "j2", _half_memory(holder)))
    assert second.layers is not None and second.reason == "complete"
    assert (second.layers.start, second.layers.end) == (reply.layers.end, 8)


async def test_two_nodes_asking_two_trackers_at_once_get_different_ranges(settings: Settings, nc: Any,
                                                                         holder: Any) -> None:
    """Both trackers decide from the same view at the same moment; the lease's create-if-absent lets one win, and
    the other decides again with the winner's lease in view."""
    from actors.provisioning.leases import open_leases

    memory = _half_memory(holder)
    leases = await open_leases(nc, Subjects(settings.namespace), settings.registry_ttl_s)
    async with Tracker(settings) as t1, Tracker(settings) as t2:
        assert t1.assigner is not None and t2.assigner is not None
        for round_ in range(4):
            for key in await leases.held(holder.model_id):
                await leases.release(key)
            a, b = await asyncio.gather(t1.assigner.assign(_request(holder, f"a{round_}", memory)),
                                        t2.assigner.assign(_request(holder, f"b{round_}", memory)))
            assert a.layers is not None and b.layers is not None, (a.error, b.error)
            ranges = sorted([(a.layers.start, a.layers.end), (b.layers.start, b.layers.end)])
            assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 8, ranges
        # and through NATS, the queue group spreading the two requests over the trackers
        for key in await leases.held(holder.model_id):
            await leases.release(key)
        a, b = await asyncio.gather(_ask_assign(nc, settings, _request(holder, "qa", memory)),
                                    _ask_assign(nc, settings, _request(holder, "qb", memory)))
        assert a.layers is not None and b.layers is not None and a.layers != b.layers


async def test_assignment_refusals_say_why(settings: Settings, nc: Any, tracker: Tracker, holder: Any) -> None:
    small = await _ask_assign(nc, settings, _request(holder, "tiny", 1))
    assert small.layers is None and small.status == 400 and "needs" in (small.error or "")
    assert tracker.assigner is not None
    tracker.assigner.manifest_timeout_s = 0.5
    pinned = _request(holder, "p1", 2**30).model_copy(update={"manifest_id": "f" * 64})
    unknown = await _ask_assign(nc, settings, pinned)
    assert unknown.layers is None and unknown.status == 404 and "manifest" in (unknown.error or "")
    garbage = await nc.request(Subjects(settings.namespace).assign_request, b"\xc1", timeout=5)
    from schemas.assignment import AssignmentReply

    assert codec.decode(garbage.data, AssignmentReply).status == 400


async def test_a_fetching_node_is_shown_but_never_routed_to(settings: Settings, nc: Any, nodes: Nodes,
                                                            tracker: Tracker) -> None:
    from schemas.node import FetchSummary

    await nodes.add("n1", 0, 4)
    serving = (await nc.jetstream().key_value(Subjects(settings.namespace).registry_bucket))
    template = codec.decode((await serving.get("n1")).value, NodeAdvertisement)
    coming = template.model_copy(update={
        "node_id": "coming", "endpoint": "", "layers": template.layers.model_copy(update={"start": 4, "end": 8}),
        "is_head": False, "is_tail": True, "verified": False, "state": "fetching",
        "fetch": FetchSummary(phase="fetching", fraction=0.4, bytes_downloaded=40, bytes_needed=100)})
    await serving.put("coming", codec.encode(coming))
    await eventually(lambda: _has_nodes(tracker, 2), timeout=5, interval=0.02, what="the tracker seeing both nodes")
    reply = await ask_route(nc, settings)
    assert reply.route is None and reply.status == 503 and "still fetching" in (reply.error or "")
    # even claiming to be verified, a node in state "fetching" (or any state but serving) is not routed to
    await serving.put("coming", codec.encode(coming.model_copy(update={"verified": True, "endpoint": "http://x"})))
    await asyncio.sleep(0.1)
    assert (await ask_route(nc, settings)).status == 503
    models = (await ask_models(nc, settings)).models
    assert [m.nodes for m in models] == [["n1"]]
    assert [(f.node_id, f.layers.start, f.fetch.fraction if f.fetch else None) for f in models[0].fetching] == [
        ("coming", 4, 0.4)]
