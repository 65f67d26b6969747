"""actors.tracker.pending: a route counts against its nodes until they report it settled, at most for the horizon."""

from __future__ import annotations

from actors.tracker.pending import PendingRoutes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_route_counts_until_its_node_reports_it_settled() -> None:
    settled = {"a": 5, "b": 0}
    pending = PendingRoutes(settled.get, horizon_s=3.0, clock=Clock())
    pending.add("a")
    pending.add("a")
    pending.add("b")
    assert (pending.get("a"), pending.get("b"), pending.get("c")) == (2, 1, 0)
    assert pending.counts() == {"a": 2, "b": 1}
    settled["a"] = 6  # one of the two arrived (or was refused) there
    assert pending.get("a") == 1
    settled["a"] = 9  # more settled than were pending: none left, never negative
    assert pending.get("a") == 0


def test_a_route_never_reported_stops_counting_after_the_horizon() -> None:
    clock = Clock()
    pending = PendingRoutes({"a": 0}.get, horizon_s=3.0, clock=clock)
    pending.add("a")
    clock.now += 2.0
    pending.add("a")
    assert pending.get("a") == 2
    clock.now += 1.5  # the first is older than the horizon
    assert pending.get("a") == 1
    clock.now += 2.0
    assert pending.get("a", 0) == 0 and pending.nodes() == []


def test_a_node_that_left_counts_from_zero_and_old_stamps_are_pruned() -> None:
    clock = Clock()
    pending = PendingRoutes({}.get, horizon_s=1.0, clock=clock)
    for node in ("x", "y", "z"):
        pending.add(node)
    assert pending.get("x") == 1  # no advertisement: settled counts as 0
    clock.now += 5.0
    pending.add("w")  # the next hand-out after a horizon drops every expired stamp, asked about or not
    assert pending.nodes() == ["w"]
