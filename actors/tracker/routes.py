"""Route selection: the cheapest ordered chain of live nodes whose contiguous layer ranges cover every layer.

Cost is one per hop (each hop adds a network link to every token) plus the node's load, so a route prefers fewer,
emptier nodes. Nodes without free capacity are used only to tell "busy" (429) from "not covered" (503).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import random
from collections.abc import Callable
from typing import Protocol

from schemas.errors import CapacityError, ModelNotFoundError, NoRouteError
from schemas.node import NODE_FETCHING, NODE_SERVING, LayerRange, NodeAdvertisement
from schemas.route import Hop, Route
from schemas.snapshot import StandbyRef


def serves(advert: NodeAdvertisement, model: str) -> bool:
    return model in (advert.model_id, advert.backend.model_name) or model in advert.aliases


def uncovered_layers(adverts: list[NodeAdvertisement], n_layers: int) -> list[LayerRange]:
    covered = sorted({(a.layers.start, a.layers.end) for a in adverts})
    gaps: list[LayerRange] = []
    reach = 0
    for start, end in covered:
        if start >= n_layers:
            break  # beyond the model: not a gap in it
        if start > reach:
            gaps.append(LayerRange(start=reach, end=start))
        reach = max(reach, end)
    if reach < n_layers:
        gaps.append(LayerRange(start=reach, end=n_layers))
    return gaps


def chain_over_ranges(cheapest: dict[tuple[int, int], tuple[float, NodeAdvertisement]],
                      n_layers: int) -> list[NodeAdvertisement] | None:
    """The cheapest chain from layer 0 to ``n_layers`` over ranges, each with its cost and node, or None."""
    by_start: dict[int, list[tuple[float, NodeAdvertisement]]] = {}
    for (start, _), pick in cheapest.items():
        by_start.setdefault(start, []).append(pick)
    best: dict[int, float] = {0: 0.0}
    back: dict[int, tuple[int, NodeAdvertisement]] = {}
    heap: list[tuple[float, int]] = [(0.0, 0)]
    while heap:
        cost, at = heapq.heappop(heap)
        if at == n_layers:
            break
        if cost > best.get(at, float("inf")):
            continue
        for step, a in by_start.get(at, []):
            end = a.layers.end
            if end <= n_layers and cost + step < best.get(end, float("inf")):
                best[end] = cost + step
                back[end] = (at, a)
                heapq.heappush(heap, (cost + step, end))
    if n_layers not in back:
        return None
    chain: list[NodeAdvertisement] = []
    at = n_layers
    while at != 0:
        at, a = back[at]
        chain.append(a)
    return chain[::-1]


def route_of(chain: list[NodeAdvertisement], session_id: str, n_layers: int,
             sources: list[StandbyRef | None] | None = None) -> Route:
    """The route over ``chain``; ``sources``: per hop, a node it may pull the prompt's prefix from."""
    sources = sources or [None] * len(chain)
    return Route(session_id=session_id, model_id=chain[0].model_id, n_layers=n_layers,
                 hidden_shape=list(chain[0].backend.hidden_shape),
                 context_length=min(a.capacity.max_context for a in chain),
                 max_sessions=min(a.capacity.max_sessions for a in chain),
                 hops=[Hop(node_id=a.node_id, endpoint=a.endpoint, layers=a.layers, prefix_source=source)
                       for a, source in zip(chain, sources, strict=True)])


def routable(adverts: list[NodeAdvertisement], model: str,
             exclude: frozenset[str] = frozenset()) -> tuple[list[NodeAdvertisement], int]:
    """The nodes a route may use (verified, not excluded) and the model's layer count. Only a model no live node
    serves is unknown (404); nodes that exist but may not be used leave their layers uncovered (503)."""
    serving = [a for a in adverts if serves(a, model)]
    if not serving:
        raise ModelNotFoundError(f"no live node serves model {model!r}")
    # One bogus registry entry (a range outside its own model, or another layer count) must not make the real
    # nodes unroutable: tests/test_fuzz.py found a single such advertisement turning every route into a 503.
    consistent = [a for a in serving if a.layers.end <= a.backend.n_layers]
    n_layers = _layer_count(consistent or serving)
    # A node still fetching its range (or in a state this tracker does not know) is never routed to.
    usable = [a for a in consistent if a.verified and a.state == NODE_SERVING and a.node_id not in exclude
              and a.backend.n_layers == n_layers]
    return usable, n_layers


def _layer_count(adverts: list[NodeAdvertisement]) -> int:
    """The model's layer count: of the counts whose verified nodes chain fully, the one most nodes claim (then the
    largest); with no full chain, the largest claimed (so the 503 names what is missing)."""
    claims = collections.Counter(a.backend.n_layers for a in adverts)
    chained = [n for n in claims
               if has_full_chain([a for a in adverts if a.backend.n_layers == n and a.verified], n)]
    if chained:
        return max(chained, key=lambda n: (claims[n], n))
    return max(claims)


def has_full_chain(adverts: list[NodeAdvertisement], n_layers: int) -> bool:
    """Whether some of these ranges chain exactly from 0 to ``n_layers`` (covering alone is not enough)."""
    return chain_over_ranges({(a.layers.start, a.layers.end): (1.0, a) for a in adverts}, n_layers) is not None


def select_route(adverts: list[NodeAdvertisement], model: str, session_id: str, *,
                 exclude: frozenset[str] = frozenset(), pending: dict[str, int] | None = None,
                 rng: random.Random | None = None, prefix_keys: list[str] | None = None) -> Route:
    """Pick the route, or raise ModelNotFoundError (404), NoRouteError naming the uncovered layers (503),
    or CapacityError when every full route is busy (429). With ``prefix_keys`` (the request's, shortest first),
    a route whose every node kept the longest of them comes first (issue #18: they hold its KV)."""
    index = RouteIndex.build(adverts, model, exclude, rng=rng)
    return index.select(session_id, pending=pending, prefix_keys=prefix_keys)


def _prefix_sources(chain: list[NodeAdvertisement], holders: dict[str, list[NodeAdvertisement]],
                    keys: list[str]) -> list[StandbyRef | None]:
    """For each node of ``chain``: a node off it serving exactly its layers that advertises a longer one of
    ``keys`` (shortest first) than the node itself does, the least loaded first (issue #26: the hop may pull that
    prefix instead of computing it). Busy nodes count: serving KV takes no session slot. ``holders``: prefix key ->
    the routable nodes that kept it (``RouteIndex.holders``)."""
    on_route = {a.node_id for a in chain}
    out: list[StandbyRef | None] = []
    for node in chain:
        held = max((i for i, k in enumerate(keys) if k in node.capacity.prefix_keys), default=-1)
        source = None
        for key in reversed(keys[held + 1:]):
            peers = [a for a in holders.get(key, []) if a.node_id not in on_route and a.endpoint
                     and a.layers == node.layers and a.model_id == node.model_id]
            if peers:
                best = min(peers, key=lambda a: a.capacity.active_sessions / a.capacity.max_sessions)
                source = StandbyRef(node_id=best.node_id, endpoint=best.endpoint, layers=best.layers)
                break
        out.append(source)
    return out


# ---- issue #18: standby holders for snapshots, and replacements for lost hops ---------------------------------------

def with_standbys(route: Route, adverts: list[NodeAdvertisement], *, exclude: frozenset[str] = frozenset()) -> Route:
    """``route`` with a standby holder named for every hop: best a live node serving the same layers that is not on
    the route (it can take the hop over with the snapshots already in its memory), else the node with the most
    room for snapshots off the route, else one on it (never the hop itself). Nodes without room hold nothing."""
    return StandbyPool.build(adverts, exclude).name(route)


@dataclasses.dataclass
class StandbyPool:
    """The nodes with room for snapshots, roomiest first: overall, and by model and layer range (one pass over the
    nodes, reused by every route the tracker hands out meanwhile; issue #28: a pass per hop cost 100 ms at 1,000
    nodes)."""

    roomiest: list[NodeAdvertisement]
    twins: dict[tuple[str, int, int], list[NodeAdvertisement]]

    @classmethod
    def build(cls, adverts: list[NodeAdvertisement], exclude: frozenset[str] = frozenset()) -> StandbyPool:
        room = [a for a in adverts if a.capacity.snapshot_free_bytes > 0 and a.state == NODE_SERVING and a.endpoint
                and a.node_id not in exclude]
        room.sort(key=lambda a: a.capacity.snapshot_free_bytes, reverse=True)  # stable: equals keep their order
        twins: dict[tuple[str, int, int], list[NodeAdvertisement]] = {}
        for a in room:
            twins.setdefault((a.model_id, a.layers.start, a.layers.end), []).append(a)
        return cls(roomiest=room, twins=twins)

    def name(self, route: Route) -> Route:
        on_route = {h.node_id for h in route.hops}

        def best_of(pool: list[NodeAdvertisement], hop: Hop) -> NodeAdvertisement | None:
            # Off the route first, then the roomiest: pools are roomiest first, so the first fit of each kind.
            off = next((a for a in pool if a.node_id not in on_route), None)
            return off or next((a for a in pool if a.node_id != hop.node_id), None)

        hops = []
        for hop in route.hops:
            twin = best_of(self.twins.get((route.model_id, hop.layers.start, hop.layers.end), []), hop)
            best = twin or best_of(self.roomiest, hop)
            standby = None if best is None else StandbyRef(
                node_id=best.node_id, endpoint=best.endpoint,
                layers=best.layers if best.model_id == route.model_id else None)
            hops.append(hop.model_copy(update={"standby": standby}))
        return route.model_copy(update={"hops": hops})


def replace_hop(adverts: list[NodeAdvertisement], route: Route, lost: int, *,
                exclude: frozenset[str] = frozenset(), pending: dict[str, int] | None = None) -> Route:
    """``route`` with hop ``lost`` served by another live node holding exactly its layers (one node: the lost hop's
    snapshots are of its whole range), the least loaded first, or ``NoRouteError`` naming the layers."""
    pending = pending or {}
    layers = route.hops[lost].layers
    on_route = {h.node_id for h in route.hops}
    usable, _ = routable(adverts, route.model_id, exclude | on_route)
    fits = [a for a in usable if a.layers == layers and a.capacity.free_sessions - pending.get(a.node_id, 0) > 0]
    if not fits:
        busy = [a.node_id for a in usable if a.layers == layers]
        why = f" ({', '.join(busy)} serve them but are full)" if busy else ""
        raise NoRouteError(f"no live node can take over layers {layers} of model {route.model_id!r} for session "
                           f"{route.session_id}{why}")
    best = min(fits, key=lambda a: (a.capacity.active_sessions + pending.get(a.node_id, 0)) / a.capacity.max_sessions)
    hops = list(route.hops)
    hops[lost] = Hop(node_id=best.node_id, endpoint=best.endpoint, layers=layers)
    return route.model_copy(update={
        "hops": hops, "context_length": min(route.context_length, best.capacity.max_context),
        "max_sessions": min(route.max_sessions or best.capacity.max_sessions, best.capacity.max_sessions)})

# ---- the route index (issue #28): what a route request reads ------------------------------------------------------
#
# Invariant: a route chosen from the index is the one defined above (the cheapest chain of contiguous ranges, one
# per hop plus each node's load, of live, verified, serving, free nodes), without a pass over every node per
# request. Nodes of one range differ only in load, so each range's group is kept least loaded first (ties in a
# random order, which spreads equal choices) and a request walks a group only while a node could still be cheaper
# than the best found: a few nodes per range whatever the fleet's size (at 1,000 nodes a request's passes over the
# nodes cost ~40 ms, so 100 route requests a second needed four cores). The tracker keeps an index for a fraction
# of a heartbeat and counts the routes it hands out meanwhile as ``pending`` load, as between heartbeats anyway.

Range = tuple[int, int]
TIE_SAMPLE = 8
"""Most equally cheap nodes of a range a request chooses among at random (a walk of a few, whatever the fleet)."""
Current = Callable[[str], NodeAdvertisement | None]
"""A node's advertisement now, by id; None once it left."""


class Pending(Protocol):
    """Routes handed out to a node and not yet settled there, by node id (a dict will do)."""

    def get(self, node_id: str, default: int, /) -> int: ...


def _load(a: NodeAdvertisement) -> float:
    return a.capacity.active_sessions / a.capacity.max_sessions


@dataclasses.dataclass
class RouteIndex:
    model: str
    n_layers: int
    gaps: list[LayerRange]
    fetching: int
    """Nodes of the model still fetching their layers (named in a 503)."""
    groups: dict[Range, list[NodeAdvertisement]]
    """Routable nodes by layer range, least loaded first."""
    holders: dict[str, list[NodeAdvertisement]]
    """Prefix key -> the routable nodes that kept it."""
    rng: random.Random = dataclasses.field(default_factory=random.Random)
    """Breaks ties between equally loaded nodes per request: an index lives for many requests, and its shuffled
    order alone would send every one of them to the same node."""

    @classmethod
    def build(cls, adverts: list[NodeAdvertisement], model: str, exclude: frozenset[str] = frozenset(), *,
              rng: random.Random | None = None) -> RouteIndex:
        """Raises ``ModelNotFoundError`` when no live node serves ``model`` (``routes.routable``)."""
        rng = rng or random.Random()
        candidates, n_layers = routable(adverts, model, exclude)
        shuffled = candidates[:]
        rng.shuffle(shuffled)
        groups: dict[Range, list[NodeAdvertisement]] = {}
        holders: dict[str, list[NodeAdvertisement]] = {}
        for a in shuffled:
            if a.layers.end <= n_layers:
                groups.setdefault((a.layers.start, a.layers.end), []).append(a)
            for key in a.capacity.prefix_keys:
                holders.setdefault(key, []).append(a)
        for group in groups.values():
            group.sort(key=_load)  # stable: equal loads keep the shuffled order
        fetching = sum(1 for a in adverts if a.state == NODE_FETCHING and serves(a, model))
        return cls(model=model, n_layers=n_layers, gaps=uncovered_layers(candidates, n_layers), fetching=fetching,
                   groups=groups, holders=holders, rng=rng)

    def select(self, session_id: str, *, pending: Pending | None = None,
               prefix_keys: list[str] | None = None, current: Current | None = None) -> Route:
        """The route, or ``NoRouteError`` naming the uncovered layers (503), or ``CapacityError`` when every full
        route is busy (429). With ``prefix_keys`` (shortest first), a route whose every node kept the longest of
        them comes first. ``current`` gives a node's advertisement now (None once it left): an index kept a while
        then judges capacity by what the nodes say now, never by what they said when it was built."""
        pending = pending or {}
        if self.gaps:
            names = ", ".join(str(g) for g in self.gaps)
            coming = f" ({self.fetching} node(s) are still fetching their layers)" if self.fetching else ""
            raise NoRouteError(f"no full route for model {self.model!r}: layers {names} of {self.n_layers} are not "
                               f"served by any live, verified node{coming}")
        chain = self._holding_chain(pending, prefix_keys or [], current)
        if chain is None:
            chain = chain_over_ranges(self._cheapest_free(pending, current), self.n_layers)
        if chain is None:
            every = {rng: (1.0, group[0]) for rng, group in self.groups.items()}
            if chain_over_ranges(every, self.n_layers) is None:
                raise NoRouteError(f"no chain of contiguous layer ranges covers [0, {self.n_layers}) for model "
                                   f"{self.model!r}")
            raise CapacityError(f"every route for model {self.model!r} is at capacity", retry_after=1.0)
        return route_of(chain, session_id, self.n_layers, _prefix_sources(chain, self.holders, prefix_keys or []))

    def _cheapest_free(self, pending: Pending,
                       current: Current | None) -> dict[Range, tuple[float, NodeAdvertisement]]:
        """Each range's cheapest node with a free session once ``pending`` counts: the walk stops at the first node
        whose load alone is no cheaper than the best found (loads only grow with pending)."""
        cheapest: dict[Range, tuple[float, NodeAdvertisement]] = {}
        for rng, group in self.groups.items():
            ties: list[tuple[float, NodeAdvertisement]] = []
            for built in group:
                if ties and (1.0 + _load(built) > ties[0][0] or len(ties) >= TIE_SAMPLE):
                    break
                pick = _priced(built, pending, current)
                if pick is None or (ties and pick[0] > ties[0][0]):
                    continue
                ties = [pick] if not ties or pick[0] < ties[0][0] else [*ties, pick]
            if ties:
                cheapest[rng] = self.rng.choice(ties)
        return cheapest

    def _holding_chain(self, pending: Pending, keys: list[str],
                       current: Current | None) -> list[NodeAdvertisement] | None:
        """The cheapest chain of free nodes that all kept the longest of ``keys`` some chain can hold."""
        for key in reversed(keys):
            cheapest: dict[Range, tuple[float, NodeAdvertisement]] = {}
            for built in self.holders.get(key, []):
                pick = _priced(built, pending, current) if built.layers.end <= self.n_layers else None
                rng = (built.layers.start, built.layers.end)
                if pick is not None and (rng not in cheapest or pick[0] < cheapest[rng][0]):
                    cheapest[rng] = pick
            chain = chain_over_ranges(cheapest, self.n_layers) if cheapest else None
            if chain is not None:
                return chain
        return None


def _priced(built: NodeAdvertisement, pending: Pending,
            current: Current | None) -> tuple[float, NodeAdvertisement] | None:
    """The node as it is now (``current``; as built without it) and its cost with ``pending``, or None if it left
    or has no free session."""
    a = built if current is None else current(built.node_id)
    if a is None:
        return None
    if a is not built and (a.state != NODE_SERVING or not a.verified or a.layers.start != built.layers.start
                           or a.layers.end != built.layers.end):
        return None  # no longer what the index holds it for, since the index was built
    extra = pending.get(a.node_id, 0)
    if a.capacity.free_sessions - extra <= 0:
        return None
    return 1.0 + (a.capacity.active_sessions + extra) / a.capacity.max_sessions, a
