"""actors/tracker/assignment.py: which range a joining node gets, from the claims on the model and its memory.

The costs are the planner's own (``artifacts.layer_split.range_costs``) over hand-made model shapes, so the
numbers are easy to follow: weight bytes only, per layer, plus head and tail extras.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from actors.tracker.assignment import AssignmentImpossible, Claim, ModelFit, decide, reachable, uncovered
from artifacts.layer_split import NodeSpec, PlanSettings, cut_points, range_costs, split
from artifacts.model_shape import LayerShape, ModelShape


def shape(n: int = 12, layer: int = 10, head: int = 0, tail: int = 0, tied: bool = False) -> ModelShape:
    return ModelShape(name="m", arch="llama", hidden_size=8, hop_shape=(8,), context_length=1024,
                      layers=tuple(LayerShape(i, "full", layer) for i in range(n)), head_bytes=head, tail_bytes=tail,
                      tail_needs_embedding=tied)


def fit_of(s: ModelShape, allowed: Callable[[int, int], bool] | None = None) -> ModelFit:
    cost = range_costs(s, PlanSettings(context=16, sessions=1))
    return ModelFit(s.n_layers, cost, (tuple(cut_points(s, soft=True)),), allowed or (lambda a, b: True))


def serving(node: str, a: int, b: int, active: int = 0, cap: int = 4) -> Claim:
    return Claim(node, a, b, serving=True, active_sessions=active, max_sessions=cap)


def join_until_routable(fit: ModelFit, budget: float, limit: int = 30) -> list[tuple[int, int]]:
    claims: list[Claim] = []
    while fit.n_layers not in reachable([(c.start, c.end) for c in claims], fit.n_layers)[0]:
        assert len(claims) < limit, claims
        d = decide(fit, claims, budget)
        claims.append(Claim(f"n{len(claims)}", d.start, d.end))
    return [(c.start, c.end) for c in claims]


def test_a_node_that_holds_the_whole_model_completes_a_route_alone() -> None:
    d = decide(fit_of(shape()), [], 120)
    assert (d.start, d.end, d.reason) == (0, 12, "complete")
    assert d.uncovered == ((0, 12),)


@pytest.mark.parametrize("budget", [25, 40, 55, 65, 95, 119])
def test_nodes_joining_one_by_one_build_one_chain_with_as_few_nodes_as_the_planner(budget: int) -> None:
    s = shape(head=7, tail=5)
    fit = fit_of(s)
    ranges = join_until_routable(fit, budget)
    # disjoint, chaining from 0 to the end, each within the node's budget
    chain = sorted(ranges)
    assert all(a[1] == b[0] for a, b in zip(chain, chain[1:], strict=False)) and chain[0][0] == 0
    assert chain[-1][1] == 12
    assert all(fit.cost(a, b) <= budget for a, b in ranges)
    planner = split(s, [NodeSpec("n", budget)] * 12, PlanSettings(context=16, sessions=1, reserve=0.0,
                                                                   balance=False))
    assert len(ranges) == len(planner.assignments)


def test_a_node_that_cannot_complete_takes_the_first_range_of_the_balanced_split() -> None:
    # 95 bytes hold 9 layers, but 12 layers need 2 nodes anyway: 6 + 6, not 9 + 3
    d = decide(fit_of(shape()), [], 95)
    assert (d.start, d.end, d.reason) == (0, 6, "extend")
    assert "needs 2 nodes" in d.detail


def test_leases_count_as_claims_so_the_next_node_completes_the_route() -> None:
    fit = fit_of(shape())
    first = decide(fit, [], 95)
    second = decide(fit, [Claim("n1", first.start, first.end)], 95)
    assert (second.start, second.end, second.reason) == (6, 12, "complete")
    assert second.uncovered == ((6, 12),)


def test_ranges_that_cover_every_layer_but_do_not_chain_are_completed() -> None:
    # [0, 9) and [6, 12) cover everything, yet no route chains them: [0, 6) or [9, 12) does; the smaller wins
    claims = [serving("a", 0, 9), serving("b", 6, 12)]
    d = decide(fit_of(shape()), claims, 65)
    assert (d.start, d.end, d.reason) == (9, 12, "complete")
    assert 12 in reachable([(c.start, c.end) for c in claims] + [(d.start, d.end)], 12)[0]
    assert d.uncovered == ()
    too_small_for_the_tail = decide(fit_of(shape(tail=40)), claims, 65)
    assert (too_small_for_the_tail.start, too_small_for_the_tail.end) == (0, 6)


def test_with_a_route_a_node_replicates_the_busiest_range_then_the_least_replicated() -> None:
    fit = fit_of(shape())
    route = [serving("a", 0, 6), serving("b", 6, 12)]
    busy = decide(fit, [serving("a", 0, 6, active=1), serving("b", 6, 12, active=3)], 65)
    assert (busy.start, busy.end, busy.reason) == (6, 12, "replica")
    assert "load" in busy.detail
    fewest = decide(fit, [*route, serving("c", 0, 6)], 65)
    assert (fewest.start, fewest.end) == (6, 12)
    assert "fewest replicas" in fewest.detail
    leased = decide(fit, [*route, Claim("d", 6, 12)], 65)  # a node still fetching counts as a replica
    assert (leased.start, leased.end) == (0, 6)


def test_a_node_that_holds_everything_becomes_a_one_hop_route() -> None:
    d = decide(fit_of(shape()), [serving("a", 0, 6), serving("b", 6, 12)], 200)
    assert (d.start, d.end, d.reason) == (0, 12, "replica")


def test_a_node_too_small_for_the_existing_ranges_starts_a_chain_of_its_size() -> None:
    fit = fit_of(shape())
    big = [serving("big", 0, 12)]
    first = decide(fit, big, 65)
    second = decide(fit, [*big, Claim("s1", first.start, first.end)], 65)
    assert sorted([(first.start, first.end), (second.start, second.end)]) == [(0, 6), (6, 12)]


def test_a_restart_is_given_the_range_it_held_among_equal_choices() -> None:
    fit = fit_of(shape())
    route = [serving("a", 0, 6), serving("b", 6, 12)]
    for held in [(0, 6), (6, 12)]:
        d = decide(fit, route, 65, prefer=[held])
        assert (d.start, d.end) == held


def test_ranges_the_architecture_refuses_are_never_assigned() -> None:
    # like a sliding-window model whose every 4th layer is global: a range of only global layers is refused
    def allowed(a: int, b: int) -> bool:
        return not all(i % 4 == 3 for i in range(a, b))

    fit = fit_of(shape(), allowed)
    for budget in (25, 35, 45):
        for a, b in join_until_routable(fit, budget):
            assert allowed(a, b), (budget, a, b)
    with pytest.raises(AssignmentImpossible, match=r"\[2, 4\), needs"):  # a lone global layer is no range
        join_until_routable(fit, 15)


def test_a_node_that_cannot_hold_the_head_or_tail_serves_new_middle_layers_not_the_same_ones() -> None:
    fit = fit_of(shape(head=100, tail=100))
    first = decide(fit, [], 40)
    second = decide(fit, [Claim("n1", first.start, first.end)], 40)
    assert first.reason == second.reason == "extend"
    assert first.start > 0 and first.end < 12 and second.start > 0 and second.end < 12
    assert second.start >= first.end or second.end <= first.start  # no pile-up on one range


def test_a_node_that_holds_nothing_useful_is_told_what_it_would_need() -> None:
    fit = fit_of(shape(head=100, tail=100))
    with pytest.raises(AssignmentImpossible, match=r"the smallest range that would, \[0, 1\), needs"):
        decide(fit, [serving("m", 1, 11)], 40)
    with pytest.raises(AssignmentImpossible, match=r"the smallest range that would, \[0, 1\), needs"):
        decide(fit_of(shape()), [], 5)
    with pytest.raises(AssignmentImpossible, match="holds no range of the model"):
        decide(fit_of(shape()), [serving("a", 0, 6), serving("b", 6, 12)], 5)


def test_an_architecture_that_cannot_be_cut_is_served_whole_or_not_at_all() -> None:
    fit = fit_of(shape(), lambda a, b: (a, b) == (0, 12))
    assert (decide(fit, [], 120).start, decide(fit, [], 120).end) == (0, 12)
    with pytest.raises(AssignmentImpossible, match="must be served whole"):
        decide(fit, [], 100)


def test_coverage_helpers() -> None:
    claims = [Claim("a", 0, 3), Claim("b", 5, 8), Claim("c", 2, 4)]
    assert uncovered(claims, 10) == ((4, 5), (8, 10))
    forward, backward = reachable([(0, 3), (3, 6), (6, 10), (2, 10)], 10)
    assert forward == {0, 3, 6, 10} and backward == {10, 6, 2, 3, 0}
