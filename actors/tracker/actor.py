"""The tracker actor: watches the node registry and answers route requests over NATS request/reply.

Trackers keep no state of their own beyond a short-lived count of routes they just handed out (so a burst of
requests spreads before the next heartbeats report the new load): run several in the same queue group for
availability.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS

from actors.registry import RegistryView, open_registry
from actors.services import tracker_service
from actors.tracker.routes import (
    has_full_chain,
    replace_hop,
    routable,
    select_route,
    uncovered_layers,
    with_standbys,
)
from bus import capability, codec
from bus.actor import NatsActor
from bus.nats_edge import endpoint, error_reply
from bus.subjects import Subjects
from schemas.assignment import AssignmentReply, AssignmentRequest
from schemas.errors import BadRequestError, CapacityError, PeerStatusError, SwarmrouteError
from schemas.node import NODE_FETCHING, LayerRange
from schemas.route import FetchingNode, ModelsReply, RepairRequest, Route, RouteReply, RouteRequest, ServedModel
from schemas.settings import Settings

if TYPE_CHECKING:
    from actors.tracker.assigner import Assigner

log = logging.getLogger(__name__)
QUEUE_GROUP = "tracker"


class Tracker(NatsActor):
    """An async context manager (``bus.actor.NatsActor``); ``stop()`` is safe to call twice."""

    def __init__(self, settings: Settings, *, nc: NATS | None = None) -> None:
        super().__init__(settings, nc=nc, name="tracker")
        self.subjects = Subjects(settings.namespace)
        self.registry: RegistryView | None = None
        self._pending: dict[str, list[tuple[float, int]]] = {}
        """node id -> (when a route was handed out, the node's sessions_opened then), oldest first."""
        self._signer = capability.signer_from_settings(settings)
        self.assigner: Assigner | None = None
        self.assigner_missing = ""

    async def _on_start(self) -> None:
        kv = await open_registry(self.nc, self.subjects, self.settings.registry_ttl_s,
                                 replicas=self.settings.registry_replicas)
        self.registry = RegistryView(kv, self.settings.registry_ttl_s, nc=self.nc, subjects=self.subjects)
        await self.registry.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.registry.ready.wait(), 5.0)
        # Route and models requests are micro-service endpoints (same subjects, queue group "tracker"), so $SRV
        # discovery lists every tracker and $SRV.STATS counts its requests.
        self.assigner = await self._open_assigner()
        self.service = await tracker_service(self.nc, self.subjects, member=self.settings.member_name or "tracker",
                                              route=endpoint(RouteRequest, RouteReply, self._handle_route),
                                              models=self._handle_models,
                                              assign=endpoint(AssignmentRequest, AssignmentReply, self._handle_assign),
                                              repair=endpoint(RepairRequest, RouteReply, self._handle_repair))
        log.info("tracker ready on %s", self.subjects.route_request)

    async def _on_stop(self) -> None:
        await self._stop_service()
        if self.registry is not None:
            await self.registry.stop()

    def _pending_counts(self) -> dict[str, int]:
        # A route handed out counts against its nodes until the node reports the session settled (its
        # sessions_opened + sessions_refused passed the value seen at hand-out: a refused or abandoned route is
        # released with the node's next, immediate, heartbeat), at the latest for 1.5 heartbeats (a gateway that
        # died while opening). Counting an arrived session as pending too counts it twice, and under fast churn a swarm
        # with free slots refuses routes (tests/test_load.py).
        horizon = time.monotonic() - self.settings.heartbeat_s * 1.5
        opened = self._opened_counts()
        counts: dict[str, int] = {}
        for node, stamps in list(self._pending.items()):
            stamps[:] = [(t, seen) for t, seen in stamps if t > horizon]
            if not stamps:
                del self._pending[node]
                continue
            arrived = max(0, opened.get(node, 0) - stamps[0][1])
            if len(stamps) > arrived:
                counts[node] = len(stamps) - arrived
        return counts

    def _opened_counts(self) -> dict[str, int]:
        assert self.registry is not None
        return {a.node_id: a.capacity.sessions_settled for a in self.registry.live()}

    def route(self, request: RouteRequest) -> RouteReply:
        assert self.registry is not None
        try:
            route = select_route(self.registry.live(), request.model, request.session_id,
                                 exclude=frozenset(request.exclude), pending=self._pending_counts(),
                                 prefix_keys=request.prefix_keys)
        except CapacityError as exc:
            return error_reply(RouteReply, exc)
        except SwarmrouteError as exc:
            gaps: list[LayerRange] = []
            with contextlib.suppress(SwarmrouteError):  # the same nodes the route could use, so gaps match the message
                gaps = uncovered_layers(*routable(self.registry.live(), request.model, frozenset(request.exclude)))
            return error_reply(RouteReply, exc, uncovered=gaps)
        if request.standby:
            route = with_standbys(route, self.registry.live(), exclude=frozenset(request.exclude))
        return RouteReply(route=self._hand_out(route))

    def _hand_out(self, route: Route, link: str | None = None) -> Route:
        """Count the route's nodes as busier until their heartbeats say so, and sign its grants."""
        now, opened = time.monotonic(), self._opened_counts()
        for hop in route.hops:
            self._pending.setdefault(hop.node_id, []).append((now, opened.get(hop.node_id, 0)))
        if self._signer is not None:
            route = capability.issue(route, self._signer, self.settings.capability_ttl_s, link=link)
        return route

    def repair(self, request: RepairRequest) -> RouteReply:
        """Replace hop ``request.lost`` (issue #18); the other hops stay, with standbys named again around the
        nodes that are gone."""
        assert self.registry is not None
        route = request.route
        if request.lost >= len(route.hops):
            return error_reply(RouteReply, BadRequestError(f"the route has no hop {request.lost}"))
        exclude = frozenset([*request.exclude, route.hops[request.lost].node_id])
        try:
            repaired = replace_hop(self.registry.live(), route, request.lost, exclude=exclude,
                                   pending=self._pending_counts())
        except SwarmrouteError as exc:
            return error_reply(RouteReply, exc)
        repaired = with_standbys(repaired, self.registry.live(), exclude=exclude)
        if self._signer is not None and not request.session_token:
            return error_reply(RouteReply, BadRequestError("a repair needs the session's token when the swarm "
                                                           "signs capabilities"))
        return RouteReply(route=self._hand_out(repaired, link=request.session_token))

    async def _handle_repair(self, request: RepairRequest) -> RouteReply:
        reply = self.repair(request)
        if reply.route:
            log.info("session %s repaired: %s", request.route.session_id, reply.route.describe())
        return reply

    async def _handle_route(self, request: RouteRequest) -> RouteReply:
        reply = self.route(request)
        if reply.route:
            log.info("session %s routed: %s", request.session_id, reply.route.describe())
        return reply

    def models(self) -> ModelsReply:
        assert self.registry is not None
        by_model: dict[str, ServedModel] = {}
        for a in self.registry.live():
            m = by_model.setdefault(a.model_id, ServedModel(id=a.model_id, name=a.backend.model_name,
                                                            n_layers=a.backend.n_layers, backend=a.backend))
            m.aliases.extend(x for x in a.aliases if x not in m.aliases)
            if a.state == NODE_FETCHING:
                m.fetching.append(FetchingNode(node_id=a.node_id, layers=a.layers, fetch=a.fetch))
                continue
            m.nodes.append(a.node_id)
            m.layer_ranges.append(a.layers)
        for m in by_model.values():
            adverts = [a for a in self.registry.live() if a.model_id == m.id and a.verified]
            m.complete = has_full_chain(adverts, m.n_layers)
        return ModelsReply(models=sorted(by_model.values(), key=lambda m: m.id))

    async def _handle_models(self, data: bytes) -> bytes:
        return codec.encode(self.models())

    # ---- layer assignment (nodes joining with only a model id) --------------------------------------------------

    async def _open_assigner(self) -> Assigner | None:
        # Assignment reads manifests and model shapes (the gguf extra): a tracker without it still routes.
        try:
            from actors.provisioning.leases import open_leases
            from actors.tracker.assigner import Assigner
        except ImportError as exc:
            self.assigner_missing = f"this tracker cannot assign layers ({exc.name} is not installed)"
            return None
        assert self.registry is not None
        leases = await open_leases(self.nc, self.subjects, self.settings.registry_ttl_s,
                                   replicas=self.settings.registry_replicas)
        return Assigner(self.nc, self.subjects, self.registry, leases)

    async def _handle_assign(self, request: AssignmentRequest) -> AssignmentReply:
        if self.assigner is None:
            # 501, which the tree has no class for: a joining node asks again (another tracker may assign)
            raise PeerStatusError(501, self.assigner_missing or "tracker not started")
        try:
            return await self.assigner.assign(request)
        except Exception as exc:  # noqa: BLE001 - a NATS or JetStream failure: the node asks again, told why
            log.warning("assignment for node %s failed: %s: %s", request.node_id, type(exc).__name__, exc)
            raise SwarmrouteError(f"the tracker could not assign layers: {type(exc).__name__}: {exc}") from None
