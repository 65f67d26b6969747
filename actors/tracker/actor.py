"""The tracker actor: watches the node registry and answers route requests over NATS request/reply.

Trackers keep no state of their own beyond a short-lived count of routes they just handed out (so a burst of
requests spreads before the next heartbeats report the new load): run several in the same queue group for
availability.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from actors.registry import RegistryView, open_registry
from actors.services import tracker_service
from actors.tracker.evictions import Evictions, decide, open_evictions, pick_checker, stale
from actors.tracker.pending import PendingRoutes
from actors.tracker.routes import (
    has_full_chain,
    replace_hop,
    routable,
    uncovered_layers,
    with_standbys,
)
from actors.tracker.views import RouteViews
from bus import capability, codec
from bus.actor import NatsActor
from bus.nats_edge import endpoint, error_reply
from bus.subjects import Subjects
from schemas.assignment import AssignmentReply, AssignmentRequest
from schemas.errors import BadRequestError, CapacityError, PeerStatusError, SwarmrouteError
from schemas.node import NODE_FETCHING, LayerRange
from schemas.route import FetchingNode, ModelsReply, RepairRequest, Route, RouteReply, RouteRequest, ServedModel
from schemas.settings import Settings
from schemas.spot_check import CheckerReply, CheckerRequest, Dispute, DisputeReply, Eviction

if TYPE_CHECKING:
    from actors.tracker.assigner import Assigner

log = logging.getLogger(__name__)
QUEUE_GROUP = "tracker"
VIEW_WINDOW_S = 0.25
"""Longest a route view is kept (``actors.tracker.views``; an eighth of a heartbeat when that is shorter)."""


class Tracker(NatsActor):
    """An async context manager (``bus.actor.NatsActor``); ``stop()`` is safe to call twice."""

    def __init__(self, settings: Settings, *, nc: NATS | None = None) -> None:
        super().__init__(settings, nc=nc, name="tracker")
        self.subjects = Subjects(settings.namespace)
        self.registry: RegistryView | None = None
        self.views: RouteViews | None = None
        self.pending = PendingRoutes(self._settled, settings.heartbeat_s * 1.5)
        self._signer = capability.signer_from_settings(settings)
        self.assigner: Assigner | None = None
        self.assigner_missing = ""
        self.evictions: Evictions | None = None
        """Nodes found computing wrong (issue #28): never routed to until their operator clears them."""
        self._spot_subs: list[Any] = []

    async def _on_start(self) -> None:
        kv = await open_registry(self.nc, self.subjects, self.settings.registry_ttl_s,
                                 replicas=self.settings.registry_replicas)
        self.registry = RegistryView(kv, self.settings.registry_ttl_s, nc=self.nc, subjects=self.subjects)
        await self.registry.start()
        self.views = RouteViews(self.registry, min(VIEW_WINDOW_S, self.settings.heartbeat_s / 8))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.registry.ready.wait(), 5.0)
        # Route and models requests are micro-service endpoints (same subjects, queue group "tracker"), so $SRV
        # discovery lists every tracker and $SRV.STATS counts its requests.
        self.assigner = await self._open_assigner()
        await self._open_evictions()
        self._spot_subs = [
            await self.nc.subscribe(self.subjects.spot_checker_request, queue=QUEUE_GROUP,
                                    cb=_responder(endpoint(CheckerRequest, CheckerReply, self._handle_checker))),
            await self.nc.subscribe(self.subjects.dispute_request, queue=QUEUE_GROUP,
                                    cb=_responder(endpoint(Dispute, DisputeReply, self._handle_dispute)))]
        self.service = await tracker_service(self.nc, self.subjects, member=self.settings.member_name or "tracker",
                                              route=endpoint(RouteRequest, RouteReply, self._handle_route),
                                              models=self._handle_models,
                                              assign=endpoint(AssignmentRequest, AssignmentReply, self._handle_assign),
                                              repair=endpoint(RepairRequest, RouteReply, self._handle_repair))
        log.info("tracker ready on %s", self.subjects.route_request)

    async def _on_stop(self) -> None:
        await self._stop_service()
        for sub in self._spot_subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self.evictions is not None:
            await self.evictions.stop()
        if self.registry is not None:
            await self.registry.stop()

    def _evicted(self) -> frozenset[str]:
        """Nodes found computing wrong (issue #28): excluded from every route, repair and standby."""
        return frozenset(self.evictions.evicted) if self.evictions is not None else frozenset()

    def _settled(self, node_id: str) -> int | None:
        assert self.registry is not None
        advert = self.registry.current(node_id)
        return None if advert is None else advert.capacity.sessions_settled

    def route(self, request: RouteRequest) -> RouteReply:
        assert self.registry is not None and self.views is not None
        exclude = frozenset(request.exclude) | self._evicted()
        try:
            index = self.views.index(request.model, exclude)
            route = index.select(request.session_id, pending=self.pending,
                                 prefix_keys=request.prefix_keys, current=self.registry.current)
        except CapacityError as exc:
            return error_reply(RouteReply, exc)
        except SwarmrouteError as exc:
            gaps: list[LayerRange] = []
            with contextlib.suppress(SwarmrouteError):  # the same nodes the route could use, so gaps match the message
                gaps = uncovered_layers(*routable(self.views.live(), request.model, exclude))
            return error_reply(RouteReply, exc, uncovered=gaps)
        if request.standby:
            route = self.views.standbys(exclude).name(route)
        return RouteReply(route=self._hand_out(route))

    def _hand_out(self, route: Route, link: str | None = None) -> Route:
        """Count the route's nodes as busier until their heartbeats say so, and sign its grants."""
        for hop in route.hops:
            self.pending.add(hop.node_id)
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
        exclude = frozenset([*request.exclude, route.hops[request.lost].node_id]) | self._evicted()
        live = self.registry.live()
        try:
            repaired = replace_hop(live, route, request.lost, exclude=exclude, pending=self.pending.counts())
        except SwarmrouteError as exc:
            return error_reply(RouteReply, exc)
        repaired = with_standbys(repaired, live, exclude=exclude)
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

    # ---- spot checks and eviction (issue #28) --------------------------------------------------------------------

    async def _open_evictions(self) -> None:
        """The evictions bucket; a tracker that cannot open it (NATS permissions of an older deployment) still routes,
        and says it cannot evict."""
        try:
            kv = await open_evictions(self.nc, self.subjects, replicas=self.settings.registry_replicas)
            evictions = Evictions(self.nc, self.subjects, kv)
            await evictions.start()
        except Exception as exc:  # noqa: BLE001 - routing must not depend on it
            log.warning("this tracker cannot evict nodes (the evictions bucket: %s: %s)", type(exc).__name__, exc)
            return
        self.evictions = evictions

    async def _handle_checker(self, request: CheckerRequest) -> CheckerReply:
        assert self.registry is not None
        evicted = set(self.evictions.evicted) if self.evictions is not None else set()
        reply = pick_checker(self.registry.live(), request, evicted=evicted)
        if request.node_id and self.evictions is not None:
            reply.clearance = self.evictions.clearance(request.node_id)
        return reply

    async def _handle_dispute(self, dispute: Dispute) -> DisputeReply:
        assert self.registry is not None
        if self.evictions is None:
            raise PeerStatusError(501, "this tracker cannot evict nodes (no evictions bucket)")
        node, reason = decide(dispute, self.registry.live())
        if not node:
            log.warning("dispute over session %s: nobody evicted (%s)", dispute.session_id, reason)
            return DisputeReply(reason=reason)
        if node in self.evictions.evicted:
            return DisputeReply(evicted=node, reason="evicted already")
        if node == dispute.checked and stale(dispute, self.evictions.clearance(node)):
            reason = (f"the disputed work of session {dispute.session_id} predates {node}'s clear by its operator "
                      f"(generation {dispute.clearance} < {self.evictions.clearance(node)})")
            log.warning("dispute: nobody evicted (%s)", reason)
            return DisputeReply(reason=reason)
        layers = dispute.layers
        await self.evictions.evict(Eviction(node_id=node, model_id=dispute.model_id, layers=layers, reason=reason,
                                            session_id=dispute.session_id, checker=dispute.checker,
                                            referee=dispute.referee))
        await self._drop_leases(node, dispute.model_id)
        return DisputeReply(evicted=node, reason=reason)

    async def _drop_leases(self, node: str, model_id: str) -> None:
        """An evicted node's layer leases go, so the assigner can give its range to a node that computes right."""
        if self.assigner is None:
            return
        leases = self.assigner.leases
        try:
            for key, (lease, _) in (await leases.held(model_id)).items():
                if lease.node_id == node:
                    await leases.release(key)
        except Exception as exc:  # noqa: BLE001 - a lease left behind expires once the node stops renewing it
            log.warning("could not drop evicted node %s's leases: %s: %s", node, type(exc).__name__, exc)

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


def _responder(serve: Callable[[bytes], Awaitable[bytes]]) -> Callable[[Msg], Awaitable[None]]:
    async def respond(msg: Msg) -> None:
        await msg.respond(await serve(msg.data))

    return respond
