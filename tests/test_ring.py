"""How a head groups its concurrent sessions around the ring (``actors.node.ring``): pure, driven with a given clock."""

from __future__ import annotations

import pytest

from actors.node.ring import BETTER, PROBE_EVERY, RingGroups, RingSessions

ROUTE = ("a", "b")


def run_epoch(groups: RingGroups, now: float, rate: dict[int, int], *, sessions: int = 4,
              hops: int = 2) -> tuple[int, float]:
    """One epoch of ``groups.epoch_s``, in which the engine ran ``rate[grouping]`` steps; the grouping used and the
    clock after it."""
    used = groups.groups(sessions, hops, now)
    groups.stepped(rate[used])
    return used, now + groups.epoch_s


def test_a_fixed_grouping_is_kept_and_capped_by_hops_and_sessions() -> None:
    assert RingGroups(1).groups(4, 3, 0.0) == 1
    assert RingGroups(8).groups(4, 3, 0.0) == 3  # never more groups than hops
    assert RingGroups(8).groups(2, 3, 0.0) == 2  # nor than sessions
    assert RingGroups(2).cap(4, 3, 0.0) == 2
    assert RingGroups(2).cap(5, 3, 0.0) == 3  # a share rounds up: nobody is left for a pass of their own


def test_one_session_or_one_hop_is_always_one_group() -> None:
    g = RingGroups()
    assert g.groups(1, 3, 0.0) == 1
    assert g.groups(4, 1, 0.0) == 1
    assert g.cap(0, 2, 0.0) == 1


def test_measuring_tries_the_pipe_first_then_one_pass_and_keeps_the_faster() -> None:
    g = RingGroups(epoch_s=1.0)
    now, used = 0.0, []
    for _ in range(PROBE_EVERY):
        u, now = run_epoch(g, now, {2: 100, 1: 300})
        used.append(u)
    assert used == [2] + [1] * (PROBE_EVERY - 1), "one pass went 3x faster: it stays until the next probe"


def test_the_grouping_not_in_use_is_probed_again_after_a_while() -> None:
    g = RingGroups(epoch_s=1.0)
    now, used = 0.0, []
    for _ in range(3 * PROBE_EVERY):
        u, now = run_epoch(g, now, {2: 300, 1: 100})
        used.append(u)
    assert used[:3] == [2, 1, 2], "the pipe first, one pass measured once, then back to the faster pipe"
    assert 1 in used[3:], "the slower grouping is still probed now and then"
    assert used.count(2) >= 2 * used.count(1)


def test_a_small_difference_does_not_switch() -> None:
    g = RingGroups(epoch_s=1.0)
    now, used = 0.0, []
    rate = {2: 102, 1: 100}
    assert rate[2] < rate[1] * BETTER
    for _ in range(PROBE_EVERY - 1):
        u, now = run_epoch(g, now, rate)
        used.append(u)
    assert used[:2] == [2, 1]
    assert used[2:] == [1] * (PROBE_EVERY - 3), "the pipe was faster, but not by enough to switch back to"


def test_new_sessions_start_from_what_was_best_for_that_many() -> None:
    g = RingGroups(epoch_s=1.0)
    now = 0.0
    for _ in range(3):
        _, now = run_epoch(g, now, {2: 100, 1: 300})
    assert g.groups(3, 2, now) == 2, "3 sessions were never measured: the pipe first"
    assert g.groups(4, 2, now + 0.1) == 1, "4 sessions went faster in one pass"


@pytest.fixture
def ring() -> RingSessions:
    return RingSessions(RingGroups(2), window_s=0.25)


def test_sessions_are_known_by_route_and_forgotten_when_idle_or_closed(ring: RingSessions) -> None:
    ring.taken("s1", ROUTE, 0.0)
    ring.taken("s2", ("a", "c"), 0.0)
    assert ring.on(ROUTE, {"s3"}) == {"s1", "s3"}
    ring.forget("s1")
    assert ring.on(ROUTE, set()) == set()
    ring.taken("s1", ROUTE, 0.0)
    ring.prune(0.3)
    assert ring.on(ROUTE, set()) == set()


def test_a_session_is_due_within_the_hold_of_its_measured_cycle(ring: RingSessions) -> None:
    ring.taken("s1", ROUTE, 0.00)
    assert ring.due(ROUTE, 0.0, 0.05) == set(), "no cycle measured yet"
    ring.taken("s1", ROUTE, 0.02)  # a 20 ms ring
    assert ring.due(ROUTE, 0.03, 0.05) == {"s1"}, "its next step is expected at 40 ms"
    assert ring.due(ROUTE, 0.03, 0.005) == set(), "but not within 5 ms"
    assert ring.due(ROUTE, 0.2, 0.05) == set(), "long overdue: not waited for"


def test_the_cap_splits_a_routes_sessions_into_its_groups(ring: RingSessions) -> None:
    assert ring.cap(ROUTE, 4, 0.0) == 2
    assert ring.cap(ROUTE, 1, 0.0) == 1
