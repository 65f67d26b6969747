"""bus.tracker_client: the one client of the trackers (gateway: routes and models; a head: a replacement hop; a
joining node: its assignment), against a real tracker and stub nodes on a real nats-server. Every failure is an
error of the tree: nobody answering or silence a 503, the tracker's refusal the class it raised."""

from __future__ import annotations

import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from actors.node import Node, NodeConfig
from actors.tracker import Tracker
from bus import codec
from bus.nats_edge import endpoint
from bus.service import Endpoint, register
from bus.subjects import Subjects
from bus.tracker_client import TrackerClient
from schemas.assignment import AssignmentReply, AssignmentRequest
from schemas.errors import BadRequestError, ModelNotFoundError, NoRouteError, NotFoundError, PeerStatusError
from schemas.node import LayerRange
from schemas.route import RepairRequest
from schemas.settings import Settings
from tests.support.swarm import STUB_MODEL, Swarms, stub, wait_model
from tests.support.waiting import eventually

HEX = "ab" * 32


def _assignment(node_id: str = "j1") -> AssignmentRequest:
    return AssignmentRequest(node_id=node_id, model_id=HEX, manifest_id=HEX, memory_bytes=2**30)


async def _node(swarms: Swarms, settings: Settings, node_id: str, start: int, end: int) -> Node:
    return await swarms.actor(Node(NodeConfig(node_id=node_id, model_id=STUB_MODEL), stub(start, end), settings))


async def test_route_models_and_repair_from_a_real_tracker(settings: Settings, nc: NATS, swarms: Swarms) -> None:
    tracker = await swarms.actor(Tracker(settings))
    for node_id, start, end in [("head", 0, 4), ("tail-a", 4, 8), ("tail-b", 4, 8)]:
        await _node(swarms, settings, node_id, start, end)
    await wait_model(tracker, STUB_MODEL, n_nodes=3)
    client = TrackerClient(nc, Subjects(settings.namespace))

    route = await client.route(STUB_MODEL, "s" * 32)
    assert route.session_id == "s" * 32 and [h.layers for h in route.hops] == [LayerRange(start=0, end=4),
                                                                                 LayerRange(start=4, end=8)]
    [served] = [m for m in (await client.models()).models if m.id == STUB_MODEL]
    assert sorted(served.nodes) == ["head", "tail-a", "tail-b"] and served.complete

    repaired = await client.repair(RepairRequest(route=route, lost=1))
    tails = {route.hops[1].node_id, repaired.hops[1].node_id}
    assert tails == {"tail-a", "tail-b"} and repaired.hops[0].node_id == "head"

    with pytest.raises(NoRouteError, match="no live node can take over layers"):
        await client.repair(RepairRequest(route=route, lost=1, exclude=[repaired.hops[1].node_id]))


async def test_the_trackers_refusals_are_raised_as_its_errors(settings: Settings, nc: NATS, swarms: Swarms) -> None:
    tracker = await swarms.actor(Tracker(settings))
    await _node(swarms, settings, "head", 0, 4)
    await eventually(lambda: tracker.registry is not None and len(tracker.registry.live()) == 1,
                     what="the tracker seeing the head")
    client = TrackerClient(nc, Subjects(settings.namespace))

    with pytest.raises(ModelNotFoundError) as unknown:
        await client.route("no-such-model", "s1")
    assert unknown.value.status == 404 and "no-such-model" in unknown.value.message
    with pytest.raises(NoRouteError) as gap:
        await client.route(STUB_MODEL, "s2")
    assert "[4, 8)" in gap.value.message and gap.value.code == "no_route"

    if tracker.assigner is not None:  # the gguf extra is installed: the tracker asks the swarm for the manifest
        tracker.assigner.manifest_timeout_s = 0.3
        with pytest.raises(NotFoundError, match="cannot assign layers"):
            await client.assign(_assignment())
    else:
        with pytest.raises(PeerStatusError, match="cannot assign layers") as missing:
            await client.assign(_assignment())
        assert missing.value.status == 501


async def test_a_repair_of_a_hop_the_route_has_not_is_a_400(settings: Settings, nc: NATS, swarms: Swarms) -> None:
    tracker = await swarms.actor(Tracker(settings))
    for node_id, start, end in [("head", 0, 4), ("tail", 4, 8)]:
        await _node(swarms, settings, node_id, start, end)
    await wait_model(tracker, STUB_MODEL, n_nodes=2)
    client = TrackerClient(nc, Subjects(settings.namespace))
    route = await client.route(STUB_MODEL, "s" * 32)
    with pytest.raises(BadRequestError, match="the route has no hop 5") as bad:
        await client.repair(RepairRequest(route=route, lost=5))
    assert type(bad.value) is BadRequestError and bad.value.status == 400


async def test_nobody_answering_is_a_503_naming_the_subject(settings: Settings, nc: NATS) -> None:
    client = TrackerClient(nc, Subjects(settings.namespace))
    with pytest.raises(NoRouteError, match=r"no tracker is running \(nobody answers on the route subject\)"):
        await client.route(STUB_MODEL, "s1")
    with pytest.raises(NoRouteError, match="nobody answers on the models subject"):
        await client.models()
    with pytest.raises(NoRouteError, match="nobody answers on the assign subject"):
        await client.assign(_assignment())


async def test_silence_is_a_503_after_the_timeout(settings: Settings, nc: NATS) -> None:
    subjects = Subjects(settings.namespace)
    heard: list[bytes] = []

    async def silent(msg: Msg) -> None:
        heard.append(msg.data)

    await nc.subscribe(subjects.route_request, cb=silent)
    with pytest.raises(NoRouteError, match=r"no tracker answered within 0\.2s"):
        await TrackerClient(nc, subjects, timeout_s=0.2).route(STUB_MODEL, "s1")
    assert len(heard) == 1  # the request went out; nobody answered it


async def test_an_assignment_and_an_unreadable_reply(settings: Settings, nc: NATS) -> None:
    """A fake tracker (the client's collaborator) on the assign subject: an assignment comes back as the reply, a
    reply that is not an ``AssignmentReply`` raises the codec's error."""
    subjects = Subjects(settings.namespace)
    given = AssignmentReply(layers=LayerRange(start=0, end=4), lease_key=f"{HEX}.0-4.0", lease_revision=3,
                            reason="extend")
    asked: list[AssignmentRequest] = []

    async def assign(request: AssignmentRequest) -> AssignmentReply:
        asked.append(request)
        return given

    async def garbage(data: bytes) -> bytes:
        return b"\xc1"

    service = await register(nc, namespace=settings.namespace, role="tracker", member="fake", description="fake",
                             endpoints=[Endpoint("assign", subjects.assign_request,
                                                 endpoint(AssignmentRequest, AssignmentReply, assign)),
                                        Endpoint("route", subjects.route_request, garbage)])
    try:
        client = TrackerClient(nc, subjects)
        assert await client.assign(_assignment("j7")) == given
        assert [r.node_id for r in asked] == ["j7"]
        with pytest.raises(codec.DecodeError, match="RouteReply"):
            await client.route(STUB_MODEL, "s1")
    finally:
        await service.stop()
