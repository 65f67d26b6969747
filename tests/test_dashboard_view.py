"""gateway/dashboard_view.py: the dashboard's figures from advertisements and telemetry (no browser, no NATS)."""

from __future__ import annotations

from gateway.dashboard_view import coverage, full_chain, model_views, node_view, rtt_matrix, session_view
from schemas.artifact import FetchProgress
from schemas.node import BackendInfo, Capacity, FetchSummary, LayerRange, NodeAdvertisement
from schemas.session import FailureReason, SessionPhase
from schemas.telemetry import GenerationTelemetry, RepairView, RouteHopView, SpeculationView


def advert(node_id: str, start: int, end: int, *, n_layers: int = 8, state: str = "serving", verified: bool = True,
           active: int = 0, rtt: dict[str, float] | None = None, model: str = "m",
           fetch: FetchSummary | None = None) -> NodeAdvertisement:
    return NodeAdvertisement(
        node_id=node_id, endpoint=f"http://127.0.0.1:{9000 + start}", model_id=model,
        layers=LayerRange(start=start, end=end), is_head=start == 0, is_tail=end == n_layers,
        backend=BackendInfo(kind="stub", model_name=model, n_layers=n_layers, hidden_size=4, hidden_shape=[4],
                            context_length=64, threads=2),
        capacity=Capacity(max_sessions=4, active_sessions=active, max_context=64), verified=verified, state=state,
        fetch=fetch, link_rtt_ms=rtt or {})


def test_a_model_is_complete_only_when_ranges_chain_from_the_first_layer_to_the_last() -> None:
    assert coverage("m", [advert("a", 0, 4), advert("b", 4, 8)]).complete
    # every layer is covered, yet no route: [0, 5) and [3, 8) never meet at a boundary
    overlapping = coverage("m", [advert("a", 0, 5), advert("b", 3, 8)])
    assert not overlapping.complete and overlapping.missing == []
    assert all(layer.serving for layer in overlapping.layers)
    gap = coverage("m", [advert("a", 0, 4)])
    assert not gap.complete and gap.missing == ["[4, 8)"]
    assert full_chain([LayerRange(start=0, end=3), LayerRange(start=3, end=8)], 8)
    assert not full_chain([LayerRange(start=0, end=3), LayerRange(start=4, end=8)], 8)


def test_nodes_that_may_not_be_routed_to_serve_no_layer() -> None:
    view = coverage("m", [advert("a", 0, 4), advert("b", 4, 8, verified=False), advert("c", 4, 8, state="fetching")])
    assert not view.complete and view.missing == ["[4, 8)"]
    assert view.layers[5].serving == [] and view.layers[5].fetching == ["c"]


def test_a_second_node_with_the_same_range_is_standby_and_the_least_loaded_serves() -> None:
    view = coverage("m", [advert("a", 0, 4, active=3), advert("a2", 0, 4, active=1), advert("b", 4, 8)])
    assert view.complete
    assert view.layers[0].serving == ["a2"] and view.layers[0].standby == ["a"]
    assert view.layers[6].serving == ["b"] and view.layers[6].standby == []


def test_models_are_kept_apart() -> None:
    views = model_views([advert("a", 0, 8, model="x"), advert("b", 0, 4, model="y")])
    assert [(v.id, v.complete) for v in views] == [("x", True), ("y", False)]


def test_a_bogus_advertisement_cannot_blow_the_bar_up_nor_unroute_the_model() -> None:
    views = model_views([advert("a", 0, 8), advert("b", 4, 8), advert("bogus", 0, 4, n_layers=10**9),
                         advert("odd", 2, 7, n_layers=7)])
    assert [(v.id, v.n_layers, v.complete) for v in views] == [("m", 8, True)]
    assert views[0].layers[2].serving == ["a"]  # "odd" claims another layer count: it serves nothing here


def test_a_fetching_node_shows_the_newest_of_its_advertised_summary_and_its_torrent_progress() -> None:
    summary = FetchSummary(phase="fetching", fraction=0.25, bytes_downloaded=25, bytes_needed=100, eta_s=30.0)
    a = advert("c", 4, 8, state="fetching", fetch=summary)
    shown = node_view(a, lost=False, age_s=1.0, compute_ms_per_layer=None, progress=None)
    assert shown.fetch is not None and shown.fetch.fraction == 0.25 and shown.fetch.eta_s == 30.0
    newer = FetchProgress(node_id="c", model_id="m", start=4, end=8, phase="fetching", pieces_done=3,
                          pieces_wanted=4, bytes_downloaded=75, bytes_needed=100, eta_s=10.0,
                          sent_at=a.sent_at + 1)
    shown = node_view(a, lost=False, age_s=1.0, compute_ms_per_layer=None, progress=newer)
    assert shown.fetch is not None and shown.fetch.fraction == 0.75 and shown.fetch.eta_s == 10.0
    lost = node_view(a, lost=True, age_s=9.0, compute_ms_per_layer=None, progress=newer)
    assert lost.state == "lost" and lost.fetch is None


def test_the_rtt_matrix_holds_what_each_node_measured() -> None:
    matrix = rtt_matrix([advert("a", 0, 4, rtt={"b": 0.4}), advert("b", 4, 8, rtt={"a": 0.5, "c": 2.0})])
    assert matrix.nodes == ["a", "b", "c"]
    assert matrix.rtt_ms == [[None, 0.4, None], [0.5, None, 2.0], [None, None, None]]


def test_a_session_shows_its_route_with_compute_per_hop_and_the_rtt_of_each_link() -> None:
    snap = GenerationTelemetry(
        session_id="s1", phase=SessionPhase.DECODE, model="m", generated_tokens=7, tokens_per_s=12.5,
        hop_overhead_ms=0.8,
        route=[RouteHopView(node_id="a", layers=LayerRange(start=0, end=4), mean_compute_ms=2.0),
               RouteHopView(node_id="b", layers=LayerRange(start=4, end=8), mean_compute_ms=3.0)],
        speculation=SpeculationView(source="ngram", windows=4, drafts_offered=10, drafts_accepted=6, acceptance=0.6),
        repair=RepairView(lost_node="c", layers=LayerRange(start=4, end=8), replacement=["b"], source="snapshot",
                          duration_ms=120.0))
    view = session_view(snap, {("a", "b"): 0.4, ("b", "a"): 0.6})
    assert [(h.node_id, h.compute_ms, h.link_rtt_ms) for h in view.route] == [("a", 2.0, 0.4), ("b", 3.0, 0.6)]
    assert view.speculation_acceptance == 0.6 and view.link_ms == 0.8
    assert view.repair == "lost c [4, 8) -> b from snapshot in 120 ms"
    failed = session_view(snap.model_copy(update={"phase": SessionPhase.FAILED, "failure": FailureReason(
        node_id="b", phase=SessionPhase.DECODE, kind="unreachable", message="connection refused")}), {})
    assert failed.failure is not None and "node b failed during decode" in failed.failure
