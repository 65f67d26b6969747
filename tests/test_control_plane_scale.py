"""The control plane at scale (issue #28 item 4), reduced for CI: the route views' invariant on the real registry
view, and a simulated fleet against real trackers.

``actors.tracker.views``: a view is reused while only heartbeats renew the nodes, and derived again when a node
joins, leaves or changes state; a request never gets a node that left, nor one that filled up meanwhile (capacity is
read from the registry, not the view). Then ``tests/bench/control_plane.py`` at reduced size (200 simulated nodes,
2 joins or leaves a second, 20 route requests a second, two tracker processes): every request is answered with a
route, none names a node gone longer than the TTL, and a model covered during the run becomes routable.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from actors.registry import RegistryView, open_registry
from actors.tracker.routes import RouteIndex
from actors.tracker.views import RouteViews
from bus import codec
from bus.subjects import Subjects
from tests.bench.control_plane import Load, run_step
from tests.support.sim_fleet import SimModel, even_ranges
from tests.support.waiting import eventually

MODEL = SimModel("views-model", n_layers=8, ranges=even_ranges(8, 2))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


STARTED = {"h1": 1.0, "t1": 2.0, "t2": 3.0}
"""Each node's start time: the same in every heartbeat of it, as a real node's."""


async def put(nc: Any, subjects: Subjects, node_id: str, layers: tuple[int, int], *, active: int = 0,
              state: str = "serving") -> None:
    advert = MODEL.advert(node_id, layers, max_sessions=2)
    advert.started_at = STARTED[node_id]
    advert.capacity.active_sessions = active
    advert.state = state
    await nc.jetstream().publish(subjects.registry_key_subject(node_id), codec.encode(advert))


def hops(views: RouteViews, registry: RegistryView) -> list[str]:
    route = views.index(MODEL.name, frozenset()).select("s", current=registry.current)
    return [h.node_id for h in route.hops]


async def test_a_view_is_kept_while_heartbeats_only_renew_and_requests_read_capacity_now(nats_server: Any) -> None:
    import nats

    subjects = Subjects("viewstest")
    nc = await nats.connect(nats_server.url)
    try:
        kv = await open_registry(nc, subjects, ttl_s=30)
        registry = RegistryView(kv, 30, nc=nc, subjects=subjects)
        await registry.start()
        try:
            await put(nc, subjects, "h1", (0, 4))
            await put(nc, subjects, "t1", (4, 8))
            await eventually(lambda: len(registry.live()) == 2, what="both nodes in the view")
            clock = Clock()
            views = RouteViews(registry, window_s=10.0, clock=clock)
            assert hops(views, registry) == ["h1", "t1"] and views.builds == 1

            # A heartbeat with new load only: the same view, and the load read now (t1 full: no route).
            membership = registry.membership
            await put(nc, subjects, "t1", (4, 8), active=2)
            await eventually(lambda: registry.current("t1") is not None
                             and registry.current("t1").capacity.active_sessions == 2,  # type: ignore[union-attr]
                             what="t1's new load")
            assert registry.membership == membership
            with pytest.raises(Exception, match="at capacity"):
                hops(views, registry)
            assert views.builds == 1

            # A join: a new view that has it.
            await put(nc, subjects, "t2", (4, 8))
            await eventually(lambda: registry.current("t2") is not None, what="t2 joining")
            assert hops(views, registry) == ["h1", "t2"] and views.builds == 2

            # A clean leave inside the window: never routed, even before the view is derived again.
            await kv.delete("t2")
            await eventually(lambda: registry.current("t2") is None, what="t2 leaving")
            await put(nc, subjects, "t1", (4, 8))
            await eventually(lambda: registry.current("t1").capacity.active_sessions == 0,  # type: ignore[union-attr]
                             what="t1 free again")
            index = views.index(MODEL.name, frozenset())
            assert index.select("s", current=registry.current).hops[1].node_id == "t1"

            # A state change (serving -> fetching) is a membership change too; past the window, a new view anyway.
            await put(nc, subjects, "t1", (4, 8), state="fetching")
            await eventually(lambda: registry.current("t1").state == "fetching",  # type: ignore[union-attr]
                             what="t1 fetching")
            with pytest.raises(Exception, match="not served"):
                hops(views, registry)
            builds = views.builds
            clock.now += 11
            views.live()
            assert views.builds == builds + 1
        finally:
            await registry.stop()
    finally:
        await nc.close()


def test_an_index_spreads_equal_nodes_and_prefers_the_least_loaded() -> None:
    nodes = [MODEL.advert(f"h{i}", (0, 4), 4) for i in range(6)] + [MODEL.advert("t", (4, 8), 64)]
    nodes[3].capacity.active_sessions = 0
    for i in (0, 1, 2, 4, 5):
        nodes[i].capacity.active_sessions = 2
    index = RouteIndex.build(nodes, MODEL.name)
    assert index.select("s").hops[0].node_id == "h3"
    # Once h3 has routes pending, the others (now as loaded) take turns rather than one taking them all.
    chosen = {index.select("s", pending={"h3": 4}).hops[0].node_id for _ in range(1)}
    assert chosen <= {"h0", "h1", "h2", "h4", "h5"}
    heads = {RouteIndex.build(nodes, MODEL.name).select("s", pending={"h3": 4}).hops[0].node_id for _ in range(40)}
    assert len(heads) > 1, "equal nodes are chosen in a random order, not always the same one"


async def test_a_simulated_fleet_routes_every_request_through_two_trackers(tmp_path: Path) -> None:
    load = Load(nodes=200, churn_per_s=2, routes_per_s=20, trackers=2, seconds=5)
    result = await asyncio.wait_for(run_step(load, tmp_path), timeout=240)
    print(f"\n{result.row()}")
    assert result.routed == result.sent == 100, result.outcomes
    assert result.stale_routes == 0
    assert result.routable_after_s is not None, "a model covered during the run never became routable"
    assert result.put_errors == 0
    assert result.churned["joins"] + result.churned["clean_leaves"] + result.churned["crashes"] > 0
