"""actors.tracker.routes: the cheapest exact chain of live, verified, free nodes; precise errors when there is none."""

from __future__ import annotations

import collections
import random

import pytest

from actors.tracker.routes import select_route, uncovered_layers
from schemas.errors import CapacityError, ModelNotFoundError, NoRouteError
from schemas.node import BackendInfo, Capacity, LayerRange, NodeAdvertisement

MODEL = "m"


def node(node_id: str, start: int, end: int, *, n_layers: int = 18, active: int = 0, max_sessions: int = 4,
         verified: bool = True, model: str = MODEL, ctx: int = 4096) -> NodeAdvertisement:
    return NodeAdvertisement(
        node_id=node_id, endpoint=f"http://127.0.0.1/{node_id}", model_id=model,
        layers=LayerRange(start=start, end=end), is_head=start == 0, is_tail=end == n_layers,
        backend=BackendInfo(kind="stub", model_name=f"{model}-name", n_layers=n_layers, hidden_size=64,
                            hidden_shape=[64], context_length=ctx),
        capacity=Capacity(max_sessions=max_sessions, active_sessions=active, max_context=ctx), verified=verified)


def ids(adverts: list[NodeAdvertisement], **kw: object) -> list[str]:
    route = select_route(adverts, MODEL, "s1", **kw)  # type: ignore[arg-type]
    return [h.node_id for h in route.hops]


def test_route_covers_every_layer_exactly_in_order() -> None:
    adverts = [node("c", 12, 18), node("a", 0, 6), node("b", 6, 12)]
    route = select_route(adverts, MODEL, "s1")
    assert [h.node_id for h in route.hops] == ["a", "b", "c"]
    ranges = [(h.layers.start, h.layers.end) for h in route.hops]
    assert ranges[0][0] == 0 and ranges[-1][1] == 18
    assert all(prev[1] == nxt[0] for prev, nxt in zip(ranges, ranges[1:], strict=False))
    assert route.n_layers == 18 and route.model_id == MODEL and route.session_id == "s1"
    assert route.hops[0].endpoint == "http://127.0.0.1/a"


def test_model_matched_by_id_or_backend_name() -> None:
    adverts = [node("a", 0, 18)]
    assert [h.node_id for h in select_route(adverts, "m-name", "s").hops] == ["a"]


def test_fewer_hops_preferred() -> None:
    adverts = [node("a", 0, 6), node("b", 6, 12), node("c", 12, 18), node("ab", 0, 12), node("whole", 0, 18)]
    assert ids(adverts) == ["whole"]
    adverts = adverts[:4]
    assert ids(adverts) == ["ab", "c"]


def test_least_loaded_preferred_among_equal_hops() -> None:
    adverts = [node("busy-head", 0, 9, active=3), node("idle-head", 0, 9, active=0),
               node("tail1", 9, 18, active=2), node("tail2", 9, 18, active=1)]
    for seed in range(20):
        assert ids(adverts, rng=random.Random(seed)) == ["idle-head", "tail2"]


def test_load_is_relative_to_capacity() -> None:
    # 2 of 16 sessions is emptier than 1 of 2.
    adverts = [node("small", 0, 18, active=1, max_sessions=2), node("big", 0, 18, active=2, max_sessions=16)]
    assert ids(adverts) == ["big"]


def test_pending_routes_count_as_load() -> None:
    adverts = [node("a", 0, 18), node("b", 0, 18)]
    assert ids(adverts, pending={"a": 3}) == ["b"]
    assert ids(adverts, pending={"b": 3}) == ["a"]


def test_equal_choices_are_spread() -> None:
    adverts = [node("a", 0, 18), node("b", 0, 18)]
    picks = collections.Counter(ids(adverts, rng=random.Random(seed))[0] for seed in range(200))
    assert set(picks) == {"a", "b"} and min(picks.values()) > 40


def test_route_context_is_the_smallest_hop_context() -> None:
    route = select_route([node("a", 0, 9, ctx=8192), node("b", 9, 18, ctx=2048)], MODEL, "s")
    assert route.context_length == 2048


def test_route_choices_are_bounded_by_the_smallest_hop() -> None:
    # n > 1 holds one sequence per choice on every hop: the gateway refuses n above this (issue #19).
    route = select_route([node("a", 0, 9, max_sessions=8), node("b", 9, 18, max_sessions=3)], MODEL, "s1")
    assert route.max_sessions == 3


def test_uncovered_layers_named_in_the_error() -> None:
    adverts = [node("a", 0, 6), node("b", 6, 12)]
    with pytest.raises(NoRouteError) as info:
        select_route(adverts, MODEL, "s")
    assert "[12, 18)" in info.value.message
    assert "of 18" in info.value.message
    assert info.value.status == 503


def test_several_gaps_all_named() -> None:
    adverts = [node("a", 2, 5), node("b", 9, 12)]
    with pytest.raises(NoRouteError) as info:
        select_route(adverts, MODEL, "s")
    for gap in ("[0, 2)", "[5, 9)", "[12, 18)"):
        assert gap in info.value.message


def test_uncovered_layers_helper() -> None:
    gaps = uncovered_layers([node("a", 0, 4), node("b", 2, 8), node("c", 10, 12)], 18)
    assert [(g.start, g.end) for g in gaps] == [(8, 10), (12, 18)]
    assert uncovered_layers([node("a", 0, 18)], 18) == []


def test_all_full_routes_busy_is_capacity_error() -> None:
    adverts = [node("a", 0, 9, active=4), node("b", 9, 18), node("c", 0, 18, active=4)]
    with pytest.raises(CapacityError) as info:
        select_route(adverts, MODEL, "s")
    assert info.value.status == 429 and info.value.retry_after > 0


def test_pending_can_fill_a_node() -> None:
    adverts = [node("a", 0, 18, active=3)]
    with pytest.raises(CapacityError):
        select_route(adverts, MODEL, "s", pending={"a": 1})


def test_busy_node_avoided_when_another_route_is_free() -> None:
    adverts = [node("whole", 0, 18, active=4), node("a", 0, 9), node("b", 9, 18)]
    assert ids(adverts) == ["a", "b"]


def test_unverified_nodes_never_routed() -> None:
    adverts = [node("unverified", 0, 18, verified=False), node("a", 0, 9), node("b", 9, 18)]
    for seed in range(10):
        assert ids(adverts, rng=random.Random(seed)) == ["a", "b"]


def test_unverified_node_leaves_its_layers_uncovered() -> None:
    adverts = [node("a", 0, 12), node("b", 12, 18, verified=False)]
    with pytest.raises(NoRouteError, match=r"\[12, 18\)"):
        select_route(adverts, MODEL, "s")


def test_only_unverified_nodes_is_no_route_not_unknown_model() -> None:
    with pytest.raises(NoRouteError, match=r"\[0, 18\)"):
        select_route([node("a", 0, 18, verified=False)], MODEL, "s")


def test_exclude_honored() -> None:
    adverts = [node("whole", 0, 18), node("a", 0, 9), node("b", 9, 18)]
    assert ids(adverts) == ["whole"]
    assert ids(adverts, exclude=frozenset({"whole"})) == ["a", "b"]
    with pytest.raises(NoRouteError, match=r"\[9, 18\)"):
        select_route(adverts, MODEL, "s", exclude=frozenset({"whole", "b"}))


def test_excluding_every_node_is_no_route_not_unknown_model() -> None:
    with pytest.raises(NoRouteError, match=r"\[0, 18\)"):
        select_route([node("whole", 0, 18)], MODEL, "s", exclude=frozenset({"whole"}))


def test_unknown_model_is_not_found() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        select_route([node("a", 0, 18)], "other", "s")
    assert info.value.status == 404 and "'other'" in info.value.message
    with pytest.raises(ModelNotFoundError):
        select_route([], MODEL, "s")


def test_overlapping_ranges_that_do_not_chain_are_no_route() -> None:
    adverts = [node("a", 0, 10), node("b", 8, 18)]
    assert uncovered_layers(adverts, 18) == []  # every layer is served somewhere...
    with pytest.raises(NoRouteError) as info:  # ...but no chain of contiguous ranges covers [0, 18)
        select_route(adverts, MODEL, "s")
    assert "[0, 18)" in info.value.message


def test_overlapping_ranges_with_a_chain_use_it() -> None:
    adverts = [node("a", 0, 10), node("b", 8, 18), node("c", 10, 18)]
    assert ids(adverts) == ["a", "c"]


def test_other_models_nodes_do_not_help() -> None:
    adverts = [node("a", 0, 9), node("x", 9, 18, model="other")]
    with pytest.raises(NoRouteError, match=r"\[9, 18\)"):
        select_route(adverts, MODEL, "s")


# ---- issue #18: prefix keys, standby holders, replacements ------------------------------------------------------

def holding(advert: NodeAdvertisement, *keys: str, snapshot_room: int = 0) -> NodeAdvertisement:
    capacity = advert.capacity.model_copy(update={"prefix_keys": list(keys), "snapshot_free_bytes": snapshot_room})
    return advert.model_copy(update={"capacity": capacity})


def test_a_route_whose_nodes_kept_the_longest_prefix_comes_first() -> None:
    adverts = [holding(node("h1", 0, 9), "k1", "k2"), holding(node("t1", 9, 18), "k1", "k2"),
               holding(node("h2", 0, 9, active=0), "k1"), holding(node("t2", 9, 18), "k1"),
               node("h3", 0, 9), node("t3", 9, 18)]
    for seed in range(20):
        assert ids(adverts, rng=random.Random(seed), prefix_keys=["k1", "k2", "k3"]) == ["h1", "t1"]
        assert ids(adverts, rng=random.Random(seed), prefix_keys=["k1"])[0] in ("h1", "h2")
    # A key only half the route holds is no reason: the cheapest route as usual.
    adverts = [holding(node("h1", 0, 9, active=3), "k9"), node("t1", 9, 18), node("h2", 0, 9)]
    assert ids(adverts, prefix_keys=["k9"]) == ["h2", "t1"]


def test_a_hop_is_named_a_source_off_the_route_that_kept_more_of_the_prefix() -> None:
    """Issue #26, prefixes across routes: a full route A kept the prefix; the route B given names, for each of its
    hops, A's node of the same layers (its own holding a shorter key, none, or the longest already: no source)."""
    a = [holding(node("a-head", 0, 9, active=4), "k1", "k2"), holding(node("a-tail", 9, 18, active=4), "k1", "k2"),
         holding(node("half", 0, 6), "k1", "k2")]
    b = [holding(node("b-head", 0, 9), "k1"), node("b-tail", 9, 18)]
    route = select_route([*a, *b], MODEL, "s1", prefix_keys=["k1", "k2", "k3"])
    assert [h.node_id for h in route.hops] == ["b-head", "b-tail"]
    assert [h.prefix_source.node_id if h.prefix_source else None for h in route.hops] == ["a-head", "a-tail"]
    assert route.hops[0].prefix_source is not None and route.hops[0].prefix_source.endpoint.endswith("/a-head")
    # none where the hop holds the longest key any node holds already, nor without keys
    route = select_route([*a, *b], MODEL, "s1", prefix_keys=["k1"])
    assert route.hops[0].prefix_source is None and route.hops[1].prefix_source is not None
    assert all(h.prefix_source is None for h in select_route([*a, *b], MODEL, "s1").hops)


def test_every_hop_gets_a_standby_off_the_route_serving_its_layers_when_there_is_one() -> None:
    from actors.tracker.routes import with_standbys

    adverts = [holding(node("h", 0, 9), snapshot_room=10), holding(node("t", 9, 18), snapshot_room=10),
               holding(node("spare", 9, 18), snapshot_room=10), holding(node("other", 0, 18, model="x"),
                                                                        snapshot_room=99)]
    route = select_route(adverts[:2], MODEL, "s1")
    standbys = [h.standby.node_id if h.standby else None for h in with_standbys(route, adverts).hops]
    assert standbys == ["other", "spare"]  # the tail's twin; the head has none, so the roomiest node off the route
    roomless = [node("h", 0, 9), node("t", 9, 18)]
    assert all(h.standby is None for h in with_standbys(select_route(roomless, MODEL, "s1"), roomless).hops)


def test_a_lost_hop_is_replaced_by_a_free_node_serving_exactly_its_layers() -> None:
    from actors.tracker.routes import replace_hop

    adverts = [node("h", 0, 6), node("m", 6, 12), node("t", 12, 18), node("m2", 6, 12, active=1),
               node("m3", 6, 12), node("wide", 6, 18)]
    route = select_route(adverts[:3], MODEL, "s1")
    repaired = replace_hop(adverts, route, 1, exclude=frozenset({"m"}))
    assert [h.node_id for h in repaired.hops] == ["h", "m3", "t"]  # the least loaded; never a wider range
    with pytest.raises(NoRouteError, match=r"layers \[6, 12\)"):
        replace_hop(adverts, route, 1, exclude=frozenset({"m", "m2", "m3"}))
    full = [node("h", 0, 6), node("m", 6, 12), node("t", 12, 18), node("m2", 6, 12, active=4)]
    with pytest.raises(NoRouteError, match="are full"):
        replace_hop(full, route, 1, exclude=frozenset({"m"}))
