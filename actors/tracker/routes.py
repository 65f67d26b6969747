"""Route selection: the cheapest ordered chain of live nodes whose contiguous layer ranges cover every layer.

Cost is one per hop (each hop adds a network link to every token) plus the node's load, so a route prefers fewer,
emptier nodes. Nodes without free capacity are used only to tell "busy" (429) from "not covered" (503).
"""

from __future__ import annotations

import collections
import heapq
import random

from schemas.errors import CapacityError, ModelNotFoundError, NoRouteError
from schemas.node import NODE_FETCHING, NODE_SERVING, LayerRange, NodeAdvertisement
from schemas.route import Hop, Route
from schemas.snapshot import StandbyRef


def serves(advert: NodeAdvertisement, model: str) -> bool:
    return model in (advert.model_id, advert.backend.model_name) or model in advert.aliases


def uncovered_layers(adverts: list[NodeAdvertisement], n_layers: int) -> list[LayerRange]:
    covered = sorted((a.layers.start, a.layers.end) for a in adverts)
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


def _cheapest_chain(adverts: list[NodeAdvertisement], n_layers: int,
                    pending: dict[str, int], rng: random.Random) -> list[NodeAdvertisement] | None:
    by_start: dict[int, list[NodeAdvertisement]] = {}
    for a in adverts:
        by_start.setdefault(a.layers.start, []).append(a)
    best: dict[int, float] = {0: 0.0}
    back: dict[int, tuple[int, NodeAdvertisement]] = {}
    heap: list[tuple[float, int]] = [(0.0, 0)]
    while heap:
        cost, at = heapq.heappop(heap)
        if at == n_layers:
            break
        if cost > best.get(at, float("inf")):
            continue
        for a in by_start.get(at, []):
            used = a.capacity.active_sessions + pending.get(a.node_id, 0)
            step = 1.0 + used / a.capacity.max_sessions + rng.random() * 1e-3  # jitter spreads equal choices
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


def _holding_chain(free: list[NodeAdvertisement], n_layers: int, pending: dict[str, int], rng: random.Random,
                   keys: list[str]) -> list[NodeAdvertisement] | None:
    """The cheapest chain of nodes that all advertise the longest of ``keys`` some chain can hold."""
    for key in reversed(keys):
        holders = [a for a in free if key in a.capacity.prefix_keys]
        chain = _cheapest_chain(holders, n_layers, pending, rng) if holders else None
        if chain is not None:
            return chain
    return None


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
    return _cheapest_chain(adverts, n_layers, {}, random.Random(0)) is not None


def select_route(adverts: list[NodeAdvertisement], model: str, session_id: str, *,
                 exclude: frozenset[str] = frozenset(), pending: dict[str, int] | None = None,
                 rng: random.Random | None = None, prefix_keys: list[str] | None = None) -> Route:
    """Pick the route, or raise ModelNotFoundError (404), NoRouteError naming the uncovered layers (503),
    or CapacityError when every full route is busy (429). With ``prefix_keys`` (the request's, shortest first),
    a route whose every node kept the longest of them comes first (issue #18: they hold its KV)."""
    pending = pending or {}
    rng = rng or random.Random()
    candidates, n_layers = routable(adverts, model, exclude)
    gaps = uncovered_layers(candidates, n_layers)
    if gaps:
        names = ", ".join(str(g) for g in gaps)
        fetching = [a for a in adverts if serves(a, model) and a.state == NODE_FETCHING]
        coming = f" ({len(fetching)} node(s) are still fetching their layers)" if fetching else ""
        raise NoRouteError(f"no full route for model {model!r}: layers {names} of {n_layers} are not served by any "
                           f"live, verified node{coming}")
    free = [a for a in candidates if a.capacity.free_sessions - pending.get(a.node_id, 0) > 0]
    chain = _holding_chain(free, n_layers, pending, rng, prefix_keys or [])
    if chain is None:
        chain = _cheapest_chain(free, n_layers, pending, rng)
    if chain is None:
        if _cheapest_chain(candidates, n_layers, {}, rng) is None:
            raise NoRouteError(f"no chain of contiguous layer ranges covers [0, {n_layers}) for model {model!r}")
        raise CapacityError(f"every route for model {model!r} is at capacity", retry_after=1.0)
    return Route(session_id=session_id, model_id=chain[0].model_id, n_layers=n_layers,
                 hidden_shape=list(chain[0].backend.hidden_shape),
                 context_length=min(a.capacity.max_context for a in chain),
                 max_sessions=min(a.capacity.max_sessions for a in chain),
                 hops=[Hop(node_id=a.node_id, endpoint=a.endpoint, layers=a.layers) for a in chain])


# ---- issue #18: standby holders for snapshots, and replacements for lost hops ---------------------------------------

def with_standbys(route: Route, adverts: list[NodeAdvertisement], *, exclude: frozenset[str] = frozenset()) -> Route:
    """``route`` with a standby holder named for every hop: best a live node serving the same layers that is not on
    the route (it can take the hop over with the snapshots already in its memory), else the node with the most
    room for snapshots off the route, else one on it (never the hop itself). Nodes without room hold nothing."""
    on_route = {h.node_id for h in route.hops}
    room = [a for a in adverts if a.capacity.snapshot_free_bytes > 0 and a.state == NODE_SERVING and a.endpoint
            and a.node_id not in exclude]
    hops = []
    for hop in route.hops:
        def rank(a: NodeAdvertisement, hop: Hop = hop) -> tuple[bool, bool, int]:
            return (a.model_id == route.model_id and a.layers == hop.layers, a.node_id not in on_route,
                    a.capacity.snapshot_free_bytes)
        candidates = [a for a in room if a.node_id != hop.node_id]
        best = max(candidates, key=rank, default=None)
        standby = None if best is None else StandbyRef(node_id=best.node_id, endpoint=best.endpoint,
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
