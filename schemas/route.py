"""Route selection: what the gateway asks the tracker and what it gets back."""

from __future__ import annotations

from pydantic import Field

from schemas.base import WireModel
from schemas.node import BackendInfo, FetchSummary, LayerRange
from schemas.snapshot import StandbyRef


class RouteRequest(WireModel):
    """Ask the tracker for an Inference Route serving ``model``; ``exclude`` lists node ids to avoid."""

    model: str = Field(min_length=1)
    session_id: str = Field(min_length=1, max_length=64)
    exclude: list[str] = Field(default_factory=list)
    standby: bool = Field(default=False, exclude_if=lambda v: not v,
                          description="name a standby holder for every hop's snapshots (issue #18)")
    prefix_keys: list[str] = Field(default_factory=list, exclude_if=lambda v: not v, max_length=64,
                                   description="hashes of the request's prefixes, longest last "
                                               "(schemas.prefix): prefer nodes that kept the longest")


class Hop(WireModel):
    """One node of a route, in order: hop 0 is the head (token lookup), the last hop is the tail (sampling)."""

    node_id: str
    endpoint: str
    layers: LayerRange
    capability: str = Field(default="", description="signed session grant for this hop (bus.capability); empty "
                                                     "when the swarm runs without a secret")
    standby: StandbyRef | None = Field(default=None, exclude_if=lambda v: v is None,
                                       description="where this hop sends its snapshots (issue #18)")
    prefix_source: StandbyRef | None = Field(default=None, exclude_if=lambda v: v is None,
                                             description="a node of the same layers off the route that kept more "
                                                         "of the request's prefix: this hop may pull it from there "
                                                         "(issue #26)")


class Route(WireModel):
    """An ordered list of hops whose layer ranges cover ``[0, n_layers)`` exactly. Sticky for the session."""

    session_id: str
    model_id: str
    n_layers: int
    hidden_shape: list[int]
    context_length: int = Field(ge=1, description="smallest per-session context among the hops")
    hops: list[Hop] = Field(min_length=1)
    max_sessions: int | None = Field(default=None, ge=1, exclude_if=lambda v: v is None,
                                     description="smallest max_sessions among the hops: the most choices (n) a "
                                                 "session on this route can ever have (issue #19)")

    @property
    def head(self) -> Hop:
        return self.hops[0]

    @property
    def tail(self) -> Hop:
        return self.hops[-1]

    def describe(self) -> str:
        return " -> ".join(f"{h.node_id}{h.layers}" for h in self.hops)


class RouteReply(WireModel):
    """The tracker's answer: a route, or an error (status + message) such as the uncovered layers."""

    route: Route | None = None
    error: str | None = None
    status: int = 200
    code: str | None = Field(default=None, exclude_if=lambda v: v is None,
                             description="the error's code (schemas.errors), so the gateway rebuilds its class")
    uncovered: list[LayerRange] = Field(default_factory=list)


class FetchingNode(WireModel):
    """A node coming up: it holds a lease on ``layers`` and is fetching them (never routed to yet)."""

    node_id: str
    layers: LayerRange
    fetch: FetchSummary | None = None


class ServedModel(WireModel):
    """A model some live nodes serve; ``complete`` when their verified ranges cover every layer."""

    id: str
    name: str = ""
    n_layers: int
    complete: bool = False
    nodes: list[str] = Field(default_factory=list)
    layer_ranges: list[LayerRange] = Field(default_factory=list)
    aliases: list[str] = Field(default_factory=list)
    backend: BackendInfo | None = None
    fetching: list[FetchingNode] = Field(default_factory=list, description="nodes still fetching their layers; "
                                                                           "not in ``nodes`` until they serve")


class ModelsReply(WireModel):
    models: list[ServedModel] = Field(default_factory=list)


class RepairRequest(WireModel):
    """A head asks the tracker to replace hop ``lost`` of its route (issue #18): the reply's route is ``route``
    with that hop replaced by nodes serving exactly its layers, capabilities issued with the session's own
    ``session_token`` (so the hops that stay keep admitting the session)."""

    route: Route
    lost: int = Field(ge=0, description="the hop to replace (0: the head, lost; the gateway asks, issue #31)")
    exclude: list[str] = Field(default_factory=list, description="nodes never to use (the lost one at least)")
    session_token: str | None = None


class RouteUpdate(WireModel):
    """The head tells a hop that stays on a repaired route where the session goes on (issue #18)."""

    session_id: str
    epoch: int = Field(ge=1)
    route: Route
    hop_index: int = Field(ge=0)
    capability: str = Field(default="", description="this hop's grant for the new route")
    truncate_to: int | None = Field(default=None, ge=0, description="drop the KV positions from here on first")
    generated: list[int] | None = Field(default=None, description="tail: the tokens sampled so far (its sampler "
                                                                  "and stop rules start over from them)")
    quiet_below: int | None = Field(default=None, ge=0, description="tail: frames starting before this are "
                                                                    "computed, not sampled (their tokens are known)")


class HopPosition(WireModel):
    """A hop's answer to a ``RouteUpdate``: where its KV ends once its in-flight steps are done."""

    session_id: str
    node_id: str
    position: int = Field(ge=0)
    journal_start: int | None = Field(default=None, description="the first position its journal can replay "
                                                                "(None: it keeps no journal)")


class ReplayRequest(WireModel):
    """The head asks the hop before a replacement to resend what it computed from ``start`` on (its journal)."""

    epoch: int = Field(ge=1)
    start: int = Field(ge=0)
