"""Which layer range a joining node should serve: the tracker's assignment decision, pure (no NATS, no clock).

Inputs: the model as a ``ModelFit`` (layer count, what a range costs this node, where ranges may end, which ranges
the architecture can cut), the ``Claim`` s on the model (live advertisements, serving or fetching, and the leases
of nodes still coming up) and the node's memory budget. A route needs ranges that *chain* exactly from layer 0 to
``n_layers`` (``actors.tracker.routes``), so coverage is measured in chains, not in layers:

1. **No full chain yet**: ``F`` = the boundaries reachable from layer 0 through claimed ranges, ``B`` = the
   boundaries from which ``n_layers`` is reachable. Every ``(p, q)`` with ``p`` in ``F``, ``q`` in ``B`` is a gap
   whose filling completes a route. For each gap the planner's rule (``artifacts.layer_split``) gives the fewest
   nodes of this node's size that cover it; the gap needing the fewest wins (then boundaries that keep the
   architecture's soft groups whole, as the planner prefers, then a range the node already holds, then the
   shortest gap, then the lowest). The node takes the whole gap when it can (``complete``), else the first range
   of the gap's memory-balanced split over that many nodes like it (``extend``): the next node like it then finds
   a smaller gap. A node that cannot start or end any gap (its head or tail extras do not fit) takes the range
   inside a gap that serves the most unserved layers; one that adds none is not given a range.
2. **A full chain exists**: a node that can hold the whole model becomes a one-hop route (a replica of every
   range). Otherwise it replicates a range on a full chain: the busiest one (active sessions over capacity of its
   serving nodes), then the one with the fewest replicas (leases included). A node too small for every such range
   starts a chain of its own size, as in 1, ignoring the claims it could not replicate.

A range the architecture refuses to cut (``artifacts.arch_support``) is never assigned.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence

from schemas.errors import BadRequestError

Range = tuple[int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """A live node's range (serving or still fetching) or a lease held by a node coming up."""

    node_id: str
    start: int
    end: int
    serving: bool = False
    """A verified, serving advertisement (its load counts); False for fetching nodes and bare leases."""
    active_sessions: int = 0
    max_sessions: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFit:
    """The model as seen by one joining node."""

    n_layers: int
    cost: Callable[[int, int], int]
    """Bytes this node needs to serve ``[start, end)`` (weights + KV for its sessions and context)."""
    cut_sets: tuple[tuple[int, ...], ...]
    """Allowed range ends in ``(0, n_layers]``, preferred set first (soft groups whole), then the fallback."""
    allowed: Callable[[int, int], bool]
    """Whether the architecture lets ``[start, end)`` be cut and served (``check_cut``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    start: int
    end: int
    reason: str
    """``complete`` (finishes a route), ``extend`` (covers unserved layers; more nodes needed) or ``replica``."""
    detail: str
    uncovered: tuple[Range, ...]
    """Layers no claim covered before this decision."""


class AssignmentImpossible(BadRequestError):
    """The node cannot hold any range of the model the architecture allows."""

    code = "assignment_impossible"


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _fmt(r: Range) -> str:
    return f"[{r[0]}, {r[1]})"


def uncovered(claims: Iterable[Claim], n_layers: int) -> tuple[Range, ...]:
    """Maximal runs of layers no claim covers."""
    gaps: list[Range] = []
    reach = 0
    for start, end in sorted((c.start, c.end) for c in claims if c.end <= n_layers):
        if start > reach:
            gaps.append((reach, start))
        reach = max(reach, end)
    if reach < n_layers:
        gaps.append((reach, n_layers))
    return tuple(gaps)


def reachable(ranges: Iterable[Range], n_layers: int) -> tuple[set[int], set[int]]:
    """(boundaries reachable from 0, boundaries from which ``n_layers`` is reachable) through chaining ranges."""
    edges = sorted({r for r in ranges if 0 <= r[0] < r[1] <= n_layers})
    forward = {0}
    for start, end in edges:  # sorted by start: a range's start is final before the range is looked at
        if start in forward:
            forward.add(end)
    backward = {n_layers}
    for start, end in sorted(edges, key=lambda r: -r[1]):
        if end in backward:
            backward.add(start)
    return forward, backward


class _Gap:
    """Splitting ``[p, q)`` into ranges this node's size can hold, with ends from one cut set."""

    def __init__(self, fit: ModelFit, cuts: Sequence[int], p: int, q: int) -> None:
        self.fit, self.p, self.q = fit, p, q
        self.ends = [c for c in cuts if p < c < q] + [q]
        self.starts = [p] + self.ends[:-1]

    def ok(self, a: int, b: int, budget: float) -> bool:
        return self.fit.cost(a, b) <= budget and self.fit.allowed(a, b)

    def need(self, budget: float) -> dict[int, int]:
        """Fewest ranges covering ``[start, q)`` within ``budget`` each, per start (absent: impossible)."""
        need = {self.q: 0}
        for a in reversed(self.starts):
            best = min((need[b] for b in self.ends if b > a and b in need and self.ok(a, b, budget)), default=None)
            if best is not None:
                need[a] = best + 1
        return need

    def pieces(self, budget: float) -> int | None:
        return self.need(budget).get(self.p)

    def balanced_first(self, budget: float, k: int) -> Range:
        """The first range of a ``k``-range split of the gap with the smallest largest range (the planner's
        balance): the lowest budget that still allows ``k`` ranges, then the longest first range under it."""
        costs = sorted({self.fit.cost(a, b) for a in self.starts for b in self.ends
                        if b > a and self.fit.cost(a, b) <= budget})
        lo, hi = 0, len(costs) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            found = self.pieces(costs[mid])
            if found is not None and found <= k:
                hi = mid
            else:
                lo = mid + 1
        tight = costs[lo]
        need = self.need(tight)
        end = max(b for b in self.ends if self.ok(self.p, b, tight) and need.get(b, k) <= k - 1)
        return self.p, end

    def longest_inside(self, budget: float, score: Callable[[Range], int]) -> Range | None:
        """The range inside the gap with the best positive ``score`` (then the longest), if any fits."""
        fits = [(a, b) for a in self.starts for b in self.ends
                if b > a and score((a, b)) > 0 and self.ok(a, b, budget)]
        return max(fits, key=lambda r: (score(r), r[1] - r[0], -r[0])) if fits else None


def _overlap(r: Range, prefer: Sequence[Range]) -> int:
    return max((min(r[1], b) - max(r[0], a) for a, b in prefer), default=0)


def _chain_decision(fit: ModelFit, claims: Sequence[Claim], budget: float, prefer: Sequence[Range],
                    gaps_before: tuple[Range, ...]) -> Decision | None:
    """Phase 1: the range that brings a full chain closest, or None when this node can add nothing."""
    forward, backward = reachable([(c.start, c.end) for c in claims], fit.n_layers)
    gaps = sorted((p, q) for p in forward for q in backward if p < q)
    unserved = ", ".join(_fmt(g) for g in gaps_before) or "none"
    options = []
    for rank, cuts in enumerate(fit.cut_sets):
        for p, q in gaps:
            gap = _Gap(fit, cuts, p, q)
            k = gap.pieces(budget)
            if k is not None:
                options.append((k, rank, -_overlap((p, q), prefer), q - p, p, gap))
    if options:
        k, *_, gap = min(options, key=lambda o: o[:5])
        if k == 1:
            return Decision(gap.p, gap.q, "complete", f"no full route yet (unserved layers: {unserved}); "
                            f"{_fmt((gap.p, gap.q))} completes one", gaps_before)
        start, end = gap.balanced_first(budget, k)
        return Decision(start, end, "extend", f"no full route yet (unserved layers: {unserved}); "
                        f"{_fmt((gap.p, gap.q))} needs {k} nodes of this size: taking the first range of its "
                        "balanced split", gaps_before)
    # Neither end of any gap fits (a head or tail too big for this node): a range inside one, counted by the
    # unserved layers it adds, so that nodes like this one do not all pile onto the same middle range.
    def new_layers(r: Range) -> int:
        return sum(max(0, min(r[1], b) - max(r[0], a)) for a, b in gaps_before)

    inside = [r for cuts in fit.cut_sets for p, q in gaps
              if (r := _Gap(fit, cuts, p, q).longest_inside(budget, new_layers)) is not None]
    if inside:
        start, end = max(inside, key=lambda r: (new_layers(r), r[1] - r[0], -r[0]))
        return Decision(start, end, "extend", f"no full route yet (unserved layers: {unserved}); this node cannot "
                        f"hold the first or last range of a gap: it takes the range inside one that serves the most "
                        "unserved layers", gaps_before)
    return None


def _replica_decision(fit: ModelFit, claims: Sequence[Claim], budget: float, prefer: Sequence[Range],
                      gaps_before: tuple[Range, ...]) -> Decision | None:
    """Phase 2 (a full chain exists): a whole-model replica, else the busiest / least-replicated chain range."""
    n = fit.n_layers
    if fit.cost(0, n) <= budget and fit.allowed(0, n):
        return Decision(0, n, "replica", "every layer is served; this node holds the whole model: a one-hop route",
                        gaps_before)
    forward, backward = reachable([(c.start, c.end) for c in claims], n)
    on_chain = sorted({(c.start, c.end) for c in claims if c.start in forward and c.end in backward})
    options = []
    for r in on_chain:
        if fit.cost(*r) > budget or not fit.allowed(*r):
            continue
        holders = [c for c in claims if (c.start, c.end) == r]
        serving = [c for c in holders if c.serving and c.max_sessions]
        load = sum(c.active_sessions for c in serving) / max(1, sum(c.max_sessions for c in serving))
        options.append((-load, len(holders), -_overlap(r, prefer), r[0], r))
    if not options:
        return None
    neg_load, replicas, _, _, r = min(options)
    why = f"the highest load ({-neg_load:.0%})" if neg_load < 0 else f"the fewest replicas ({replicas})"
    return Decision(r[0], r[1], "replica", f"every layer is served; {_fmt(r)} has {why} among the ranges this "
                    f"node can hold", gaps_before)


def decide(fit: ModelFit, claims: Sequence[Claim], budget: float, *, prefer: Sequence[Range] = ()) -> Decision:
    """The range for a node with ``budget`` bytes; raises ``AssignmentImpossible`` when nothing fits."""
    claims = [c for c in claims if 0 <= c.start < c.end <= fit.n_layers]
    fit = dataclasses.replace(fit, cost=functools.cache(fit.cost), allowed=functools.cache(fit.allowed))
    gaps_before = uncovered(claims, fit.n_layers)
    forward, _ = reachable([(c.start, c.end) for c in claims], fit.n_layers)
    if fit.n_layers not in forward:
        decision = _chain_decision(fit, claims, budget, prefer, gaps_before)
    else:
        decision = _replica_decision(fit, claims, budget, prefer, gaps_before)
        if decision is None:  # too small to replicate anything: build a chain of nodes of this size
            small = [c for c in claims if fit.cost(c.start, c.end) <= budget and fit.allowed(c.start, c.end)]
            decision = _chain_decision(fit, small, budget, prefer, gaps_before)
    if decision is not None:
        return decision
    ranges = [(a, b) for cuts in fit.cut_sets for a in [0, *cuts] for b in cuts if b > a and fit.allowed(a, b)]
    if ranges == [(0, fit.n_layers)] * len(ranges):
        raise AssignmentImpossible("the architecture allows no range of this model to be cut; it must be served "
                                   f"whole, which needs {_mb(fit.cost(0, fit.n_layers))}")
    useful = [r for r in ranges if any(min(r[1], b) > max(r[0], a) for a, b in gaps_before)] or ranges
    cost, smallest = min((fit.cost(*r), r) for r in useful)
    what = (f"serves none of the unserved layers ({', '.join(_fmt(g) for g in gaps_before)})" if gaps_before
            else "holds no range of the model")
    raise AssignmentImpossible(f"no range for this node: what its {_mb(budget)} (after the reserve) can hold {what}; "
                               f"the smallest range that would, {_fmt(smallest)}, needs {_mb(cost)}")
