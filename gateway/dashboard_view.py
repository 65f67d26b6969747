"""What the dashboard shows, computed from the swarm's telemetry: per-model layer coverage, nodes, sessions, link RTTs.

Pure functions of what ``dashboard_feed`` collected (advertisements, telemetry snapshots, fetch progress), so the
page's figures are tested without a browser. A layer's nodes are in one of three roles:

- **serving**: a node a route may use (verified, state ``serving``) covers it; of several nodes with exactly the same
  range, the least loaded is counted serving and the others **standby**: a repair moves a lost hop's layers only to a
  node holding exactly that range (issue #18), so standby nodes are what a session survives losing a node with;
- **fetching**: a node still downloading it (never routed to yet).

A model is **complete** only when some chain of serving nodes' ranges runs exactly from layer 0 to the last, as the
tracker's routes need (ranges that overlap without meeting at a boundary cover every layer and still form no route).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from pydantic import BaseModel, Field

from schemas.artifact import FetchProgress
from schemas.node import NODE_FETCHING, NODE_SERVING, LayerRange, NodeAdvertisement
from schemas.telemetry import GenerationTelemetry

MAX_LAYERS = 4096
"""A model claiming more layers than this gets no bar (one bogus advertisement must not make the page build a
billion cells); its nodes still show in the nodes table."""
NODE_LOST = "lost"
"""A node whose heartbeats stopped (older than the registry TTL): shown until it comes back or is forgotten."""


class LayerView(BaseModel):
    serving: list[str] = Field(default_factory=list)
    standby: list[str] = Field(default_factory=list)
    fetching: list[str] = Field(default_factory=list)


class ModelView(BaseModel):
    id: str
    name: str
    aliases: list[str] = Field(default_factory=list, description="other names clients may request it by")
    n_layers: int
    complete: bool
    layers: list[LayerView]
    missing: list[str] = Field(default_factory=list, description="layer ranges no serving node covers, e.g. [12, 18)")


class FetchView(BaseModel):
    phase: str
    fraction: float
    bytes_downloaded: int = 0
    bytes_needed: int = 0
    rate_bps: float = 0.0
    eta_s: float | None = None
    peers: int = 0
    message: str = ""


class NodeView(BaseModel):
    node_id: str
    model: str
    state: str
    layers: list[int]
    head: bool
    tail: bool
    endpoint: str
    threads: int
    rss_bytes: int
    kv_bytes: int
    active_sessions: int
    max_sessions: int
    compute_ms_per_layer: float | None = None
    fetch: FetchView | None = None
    heartbeat_age_s: float


class HopView(BaseModel):
    node_id: str
    layers: list[int]
    health: str
    compute_ms: float | None = None
    link_rtt_ms: float | None = Field(default=None, description="the measured RTT from this hop to the next one")


class SessionView(BaseModel):
    session_id: str
    model: str
    phase: str
    route: list[HopView]
    health: str
    generated_tokens: int
    tokens_per_s: float
    prefill_done: int
    prefill_total: int
    ttft_ms: float | None = None
    link_ms: float | None = Field(default=None, description="mean per-link cost of a decode step (telemetry)")
    speculation_acceptance: float | None = None
    speculation_windows: int = 0
    failure: str | None = None
    repair: str | None = None
    finish_reason: str | None = None


class RttMatrix(BaseModel):
    nodes: list[str]
    rtt_ms: list[list[float | None]] = Field(description="row: from, column: to")


def _served_by(advert: NodeAdvertisement, model: str) -> bool:
    return model in (advert.model_id, advert.backend.model_name) or model in advert.aliases


def _routable(advert: NodeAdvertisement, n_layers: int) -> bool:
    return (advert.state == NODE_SERVING and advert.verified and advert.backend.n_layers == n_layers
            and advert.layers.end <= n_layers)


def full_chain(ranges: Iterable[LayerRange], n_layers: int) -> bool:
    """Whether some of ``ranges`` chain exactly from 0 to ``n_layers`` (each starting where the last ended)."""
    ends: dict[int, set[int]] = collections.defaultdict(set)
    for r in ranges:
        ends[r.start].add(r.end)
    reached, frontier = {0}, [0]
    while frontier:
        at = frontier.pop()
        for end in ends.get(at, ()):
            if end not in reached and end <= n_layers:
                reached.add(end)
                frontier.append(end)
    return n_layers in reached


def _gaps(flags: list[bool]) -> list[str]:
    gaps, start = [], None
    for i, ok in enumerate([*flags, True]):
        if not ok and start is None:
            start = i
        elif ok and start is not None:
            gaps.append(str(LayerRange(start=start, end=i)))
            start = None
    return gaps


def model_views(adverts: list[NodeAdvertisement]) -> list[ModelView]:
    """One view per model some live node advertises, sorted by id."""
    by_model: dict[str, list[NodeAdvertisement]] = collections.defaultdict(list)
    for a in adverts:
        if a.backend.n_layers <= MAX_LAYERS:
            by_model[a.model_id].append(a)
    return [coverage(model, nodes) for model, nodes in sorted(by_model.items())]


def coverage(model: str, adverts: list[NodeAdvertisement]) -> ModelView:
    nodes = [a for a in adverts if _served_by(a, model)]
    n_layers = collections.Counter(a.backend.n_layers for a in nodes).most_common(1)[0][0] if nodes else 1
    routable = [a for a in nodes if _routable(a, n_layers)]
    layers = [LayerView() for _ in range(n_layers)]
    same_range: dict[tuple[int, int], list[NodeAdvertisement]] = collections.defaultdict(list)
    for a in routable:
        same_range[(a.layers.start, a.layers.end)].append(a)
    for (start, end), group in same_range.items():
        group.sort(key=lambda a: (a.capacity.active_sessions / a.capacity.max_sessions, a.node_id))
        for i in range(start, end):
            layers[i].serving.append(group[0].node_id)
            layers[i].standby.extend(a.node_id for a in group[1:])
    for a in nodes:
        if a.state == NODE_FETCHING:
            for i in range(a.layers.start, min(a.layers.end, n_layers)):
                layers[i].fetching.append(a.node_id)
    name = next((a.backend.model_name for a in nodes if a.backend.model_name), model)
    aliases = sorted({alias for a in nodes for alias in a.aliases} - {name})
    return ModelView(id=model, name=name, aliases=aliases, n_layers=n_layers, layers=layers,
                     complete=full_chain((a.layers for a in routable), n_layers),
                     missing=_gaps([bool(layer.serving) for layer in layers]))


def fetch_view(advert: NodeAdvertisement, progress: FetchProgress | None) -> FetchView | None:
    """A fetching node's progress: the torrent's own report when it is newer than the advertisement's summary."""
    if progress is not None and progress.sent_at >= advert.sent_at and progress.phase not in ("done", "seeding"):
        return FetchView(phase=progress.phase, fraction=round(progress.fraction, 4),
                         bytes_downloaded=progress.bytes_downloaded, bytes_needed=progress.bytes_needed,
                         rate_bps=progress.rate_bps, eta_s=progress.eta_s, peers=progress.peers,
                         message=progress.message)
    if advert.state != NODE_FETCHING or advert.fetch is None:
        return None
    f = advert.fetch
    return FetchView(phase=f.phase, fraction=round(f.fraction, 4), bytes_downloaded=f.bytes_downloaded,
                     bytes_needed=f.bytes_needed, rate_bps=f.rate_bps, eta_s=f.eta_s, peers=f.peers,
                     message=f.message)


def node_view(advert: NodeAdvertisement, *, lost: bool, age_s: float, compute_ms_per_layer: float | None,
              progress: FetchProgress | None) -> NodeView:
    c = advert.capacity
    return NodeView(node_id=advert.node_id, model=advert.backend.model_name or advert.model_id,
                    state=NODE_LOST if lost else advert.state, layers=[advert.layers.start, advert.layers.end],
                    head=advert.is_head, tail=advert.is_tail, endpoint=advert.endpoint,
                    threads=advert.backend.threads, rss_bytes=advert.rss_bytes, kv_bytes=c.kv_bytes_in_use,
                    active_sessions=c.active_sessions, max_sessions=c.max_sessions,
                    compute_ms_per_layer=compute_ms_per_layer,
                    fetch=None if lost else fetch_view(advert, progress), heartbeat_age_s=round(age_s, 1))


def compute_per_layer(snap: GenerationTelemetry) -> dict[str, float]:
    """Each hop's mean compute per layer in this session (ms), for the hops that reported any."""
    return {h.node_id: round(h.mean_compute_ms / len(h.layers), 3) for h in snap.route
            if h.mean_compute_ms is not None and len(h.layers)}


def session_view(snap: GenerationTelemetry, rtt: dict[tuple[str, str], float],
                 names: dict[str, str] | None = None) -> SessionView:
    """``names``: model id -> the name to show (a content-derived id is 64 hex digits)."""
    hops = snap.route
    route = [HopView(node_id=h.node_id, layers=[h.layers.start, h.layers.end], health=h.health,
                     compute_ms=None if h.mean_compute_ms is None else round(h.mean_compute_ms, 3),
                     link_rtt_ms=rtt_between(rtt, h.node_id, hops[(i + 1) % len(hops)].node_id)
                     if len(hops) > 1 else None)
             for i, h in enumerate(hops)]
    spec = snap.speculation
    repair = None
    if snap.repair is not None:
        r = snap.repair
        took = ", ".join(r.replacement) or "(looking for a replacement)"
        done = f" from {r.source} in {r.duration_ms:.0f} ms" if r.duration_ms is not None and r.source else ""
        repair = f"lost {r.lost_node} {r.layers} -> {took}{done}"
    return SessionView(session_id=snap.session_id, model=(names or {}).get(snap.model, snap.model),
                       phase=snap.phase.value, route=route,
                       health=snap.route_health, generated_tokens=snap.generated_tokens,
                       tokens_per_s=snap.tokens_per_s, prefill_done=snap.prefill.done,
                       prefill_total=snap.prefill.total, ttft_ms=snap.ttft_ms,
                       link_ms=None if snap.hop_overhead_ms is None else round(snap.hop_overhead_ms, 3),
                       speculation_acceptance=spec.acceptance if spec is not None else None,
                       speculation_windows=spec.windows if spec is not None else 0,
                       failure=snap.failure.describe() if snap.failure is not None else None,
                       repair=repair, finish_reason=snap.finish_reason)


def rtt_pairs(adverts: Iterable[NodeAdvertisement]) -> dict[tuple[str, str], float]:
    """(from, to) -> the RTT ``from`` measured and advertised."""
    return {(a.node_id, peer): ms for a in adverts for peer, ms in a.link_rtt_ms.items()}


def rtt_between(rtt: dict[tuple[str, str], float], a: str, b: str) -> float | None:
    """The link's RTT as either end measured it (a round trip is the same both ways)."""
    return rtt.get((a, b), rtt.get((b, a)))


def rtt_matrix(adverts: list[NodeAdvertisement]) -> RttMatrix:
    """Every node that measured or was measured, sorted; None where no one measured the pair."""
    pairs = rtt_pairs(adverts)
    names = sorted({n for pair in pairs for n in pair})
    return RttMatrix(nodes=names, rtt_ms=[[None if a == b else pairs.get((a, b)) for b in names] for a in names])
