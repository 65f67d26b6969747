"""gateway/dashboard_feed.py: the dashboard's copy of the swarm, fed by a real NATS server as the actors feed it
(advertisements put into the registry bucket, telemetry and fetch progress published), on a clock the test moves."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.registry import open_registry
from bus import codec
from bus.subjects import Subjects
from gateway.dashboard_feed import MAX_SESSIONS, SwarmFeed
from schemas.artifact import FetchProgress
from schemas.node import LayerRange
from schemas.session import FailureReason, SessionPhase
from schemas.telemetry import GenerationTelemetry, RepairView, RouteHopView
from tests.support.waiting import eventually
from tests.test_dashboard_view import advert

SUBJECTS = Subjects("feedtest")
TTL = 6.0


async def _feed(nc: Any, now: list[float]) -> SwarmFeed:
    feed = SwarmFeed(nc, SUBJECTS, ttl_s=TTL, clock=lambda: now[0])
    await feed.start()
    return feed


async def test_advertisements_already_in_the_registry_show_at_once_and_a_silent_node_is_lost(nc: Any) -> None:
    kv = await open_registry(nc, SUBJECTS, TTL)
    for a in (advert("a", 0, 4), advert("b", 4, 8)):
        await kv.put(a.node_id, codec.encode(a))
    now = [100.0]
    feed = await _feed(nc, now)  # started after the puts: it read the bucket
    try:
        state = feed.state()
        assert [n.node_id for n in state.nodes] == ["a", "b"] and state.models[0].complete
        assert state.events == []  # what was there before is no news

        now[0] += 3.0
        fresh = advert("a", 0, 4)
        await kv.put("a", codec.encode(fresh))  # a keeps beating, b has gone silent
        await eventually(lambda: feed.state().nodes[0].heartbeat_age_s == 0.0, timeout=5,
                         what="a's heartbeat arriving")
        now[0] += TTL - 1.0
        state = feed.state()
        assert [n.state for n in state.nodes] == ["serving", "lost"]
        assert not state.models[0].complete and state.models[0].missing == ["[4, 8)"]
        assert "node b lost: no heartbeat for 8 s" in state.events[0].text

        await kv.put("b", codec.encode(advert("b", 4, 8)))
        await eventually(lambda: feed.state().models[0].complete, timeout=5, what="b back")
        assert feed.state().events[0].text.startswith("node b is back: serving layers [4, 8)")
    finally:
        await feed.stop()


async def test_joining_fetching_serving_and_fetch_progress_are_shown_as_they_happen(nc: Any) -> None:
    kv = await open_registry(nc, SUBJECTS, TTL)
    now = [0.0]
    feed = await _feed(nc, now)
    try:
        await kv.put("c", codec.encode(advert("c", 0, 8, state="fetching")))
        await eventually(lambda: feed.state().nodes, timeout=5, what="c's advertisement")
        progress = FetchProgress(node_id="c", model_id="m", start=0, end=8, phase="fetching", pieces_done=1,
                                 pieces_wanted=4, bytes_downloaded=10_000_000, bytes_needed=40_000_000, eta_s=12.0)
        await nc.publish(SUBJECTS.artifact_progress("c"), codec.encode(progress))
        fetch = await eventually(lambda: feed.state().nodes[0].fetch, timeout=5, what="c's fetch progress")
        assert fetch.fraction == 0.25 and fetch.eta_s == 12.0 and fetch.bytes_needed == 40_000_000
        assert feed.state().models[0].layers[3].fetching == ["c"] and not feed.state().models[0].complete

        done = progress.model_copy(update={"phase": "done", "pieces_done": 4, "bytes_downloaded": 40_000_000})
        await nc.publish(SUBJECTS.artifact_progress("c"), codec.encode(done))
        await kv.put("c", codec.encode(advert("c", 0, 8)))
        await eventually(lambda: feed.state().models[0].complete, timeout=5, what="c serving")
        texts = [e.text for e in feed.state().events]
        assert texts == ["node c is serving layers [0, 8) of m", "node c fetched layers [0, 8) (40.0 MB)",
                         "node c joined: fetching layers [0, 8) of m"], texts
        assert feed.state().nodes[0].fetch is None

        await kv.delete("c")
        await eventually(lambda: not feed.state().nodes, timeout=5, what="c gone")
        assert feed.state().events[0].text == "node c left the swarm (stopped or draining)"
    finally:
        await feed.stop()


async def test_repairs_and_failures_are_events_and_sessions_show_their_route(nc: Any) -> None:
    now = [0.0]
    feed = await _feed(nc, now)
    hops = [RouteHopView(node_id="a", layers=LayerRange(start=0, end=4), mean_compute_ms=2.0),
            RouteHopView(node_id="b", layers=LayerRange(start=4, end=8), mean_compute_ms=4.0)]
    lost = RepairView(lost_node="b", layers=LayerRange(start=4, end=8))
    snaps = [
        GenerationTelemetry(session_id="sess-1", seq=1, phase=SessionPhase.DECODE, model="m", route=hops),
        GenerationTelemetry(session_id="sess-1", seq=2, phase=SessionPhase.REPAIRING, model="m", route=hops,
                            repair=lost),
        GenerationTelemetry(session_id="sess-1", seq=3, phase=SessionPhase.DECODE, model="m", route=hops,
                            repair=lost.model_copy(update={"replacement": ["b2"], "source": "snapshot",
                                                           "duration_ms": 250.0})),
        GenerationTelemetry(session_id="sess-2", seq=1, phase=SessionPhase.FAILED, model="m", route=hops,
                            failure=FailureReason(node_id="a", phase=SessionPhase.PREFILL, kind="unreachable",
                                                  message="connection refused")),
    ]
    try:
        for snap in snaps:
            await nc.publish(SUBJECTS.telemetry(snap.session_id), codec.encode(snap))
            await nc.flush()
            await asyncio.sleep(0.05)  # in order, as a head publishes them
        await eventually(lambda: len(feed.state().events) == 3, timeout=5, what="three events")
        texts = [e.text for e in feed.state().events]
        assert texts[2] == "session sess-1: node b lost, repairing layers [4, 8)"
        assert texts[1] == "session sess-1: layers [4, 8) moved from b to b2 (snapshot) in 250 ms"
        assert texts[0].startswith("session sess-2 failed: node a failed during prefill (unreachable)")
        state = feed.state()
        assert [s.session_id for s in state.sessions] == ["sess-1", "sess-2"]  # live ones first
        assert state.sessions[0].phase == "decode" and [h.node_id for h in state.sessions[0].route] == ["a", "b"]
        now[0] += 31.0  # an ended session leaves the page after a while; a live one stays
        assert [s.session_id for s in feed.state().sessions] == ["sess-1"]
    finally:
        await feed.stop()


async def test_a_flood_of_made_up_sessions_is_bounded(nc: Any) -> None:
    now = [0.0]
    feed = await _feed(nc, now)
    try:
        for i in range(MAX_SESSIONS + 20):
            now[0] = float(i)
            snap = GenerationTelemetry(session_id=f"flood-{i}", phase=SessionPhase.DECODE, model="m")
            await nc.publish(SUBJECTS.telemetry(snap.session_id), codec.encode(snap))
        await nc.flush()
        await eventually(lambda: "flood-519" in {s.session_id for s in feed.state().sessions}, timeout=10,
                         what="the last snapshot absorbed")
        shown = {s.session_id for s in feed.state().sessions}
        assert len(shown) == MAX_SESSIONS and "flood-0" not in shown  # the oldest went first
    finally:
        await feed.stop()
