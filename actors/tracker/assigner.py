"""The tracker's ``assign`` endpoint: a joining node's layer range, decided from the live registry and the leases,
and held as a lease before the answer goes out.

The model's shape comes from its manifest, fetched from whichever node holds it
(``actors.provisioning.manifest_request``,
checked against the ``manifest_id`` the node verified) and cached per manifest. The decision itself is
``actors.tracker.assignment.decide``; this module turns the registry and the lease bucket into its claims and makes
the decision stick: the lease is created with create-if-absent, and a request that lost the race to another
tracker decides again with the winner's lease in view.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from nats.aio.client import Client as NATS

from actors.provisioning.leases import Leases, lease_key
from actors.provisioning.manifest_request import request_manifest
from actors.registry import RegistryView
from actors.tracker.assignment import AssignmentImpossible, Claim, Decision, ModelFit, decide
from artifacts.arch_support import check_cut
from artifacts.gguf_shape import shape_from_manifest
from artifacts.layer_split import PlanSettings, cut_points, range_costs
from artifacts.shard import manifest_cut_request
from bus.nats_edge import error_reply
from bus.subjects import Subjects
from schemas.assignment import AssignmentReply, AssignmentRequest, RangeLease
from schemas.errors import BadRequestError, NoRouteError, NotFoundError
from schemas.manifest import ModelManifest
from schemas.node import NODE_FETCHING, NODE_SERVING, LayerRange, NodeAdvertisement

log = logging.getLogger(__name__)

RESERVE = PlanSettings().reserve
"""Fraction of a node's declared memory kept free for compute buffers, the runtime and the OS (the planner's)."""
MAX_ATTEMPTS = 8
"""Decisions per request when other trackers keep winning the lease race (each loss adds one lease to the view)."""


def fit_from_manifest(manifest: ModelManifest, *, context: int, sessions: int, allow_unproven: bool) -> ModelFit:
    """What the decision needs to know about a model, for a node with this context and these sessions."""
    shape = shape_from_manifest(manifest)
    cost = range_costs(shape, PlanSettings(context=context, sessions=sessions))
    soft, hard = tuple(cut_points(shape, soft=True)), tuple(cut_points(shape, soft=False))

    @functools.cache
    def allowed(start: int, end: int) -> bool:
        try:
            check_cut(manifest_cut_request(manifest, start, end), allow_unproven=allow_unproven)
        except BadRequestError:
            return False
        return True

    return ModelFit(manifest.n_layers, functools.cache(cost), (soft, hard) if soft != hard else (soft,), allowed)


def claims_of(adverts: list[NodeAdvertisement], leases: dict[str, tuple[RangeLease, int]], model_id: str,
              asking: str) -> list[Claim]:
    """Every other node's hold on the model: serving or fetching advertisements, and leases of nodes not (yet)
    advertising. A node advertising and leasing counts once, by its advertisement (it carries the load)."""
    claims: dict[str, Claim] = {}
    for a in adverts:
        if a.model_id != model_id or a.node_id == asking or a.state not in (NODE_SERVING, NODE_FETCHING):
            continue
        if a.state == NODE_SERVING and not a.verified:
            continue  # never routed to: its layers are not covered by it
        serving = a.state == NODE_SERVING
        claims[a.node_id] = Claim(a.node_id, a.layers.start, a.layers.end, serving=serving,
                                  active_sessions=a.capacity.active_sessions if serving else 0,
                                  max_sessions=a.capacity.max_sessions if serving else 0)
    extra = [Claim(lease.node_id, lease.start, lease.end) for lease, _ in leases.values()
             if lease.node_id != asking and lease.node_id not in claims]
    return [*claims.values(), *extra]


class Assigner:
    """Serves assignment requests for one tracker; requests are decided one at a time."""

    def __init__(self, nc: NATS, subjects: Subjects, registry: RegistryView, leases: Leases, *,
                 manifest_timeout_s: float = 5.0) -> None:
        self.nc, self.subjects, self.registry, self.leases = nc, subjects, registry, leases
        self.manifest_timeout_s = manifest_timeout_s
        self._manifests: dict[str, ModelManifest] = {}
        self._fits: dict[tuple[str, int, int, bool], ModelFit] = {}
        self._lock = asyncio.Lock()

    async def manifest(self, request: AssignmentRequest) -> ModelManifest:
        cached = self._manifests.get(request.manifest_id)
        if cached is None or cached.model_id != request.model_id:
            cached = await request_manifest(self.nc, self.subjects, request.model_id, expect_id=request.manifest_id,
                                            timeout_s=self.manifest_timeout_s)
            self._manifests[request.manifest_id] = cached
        return cached

    async def assign(self, request: AssignmentRequest) -> AssignmentReply:
        try:
            manifest = await self.manifest(request)
        except NotFoundError as exc:
            return error_reply(AssignmentReply, NotFoundError(f"cannot assign layers: {exc.message}"))
        fit_key = (manifest.manifest_id, request.context, request.max_sessions, request.allow_unproven)
        fit = self._fits.get(fit_key)
        if fit is None:
            fit = self._fits[fit_key] = fit_from_manifest(manifest, context=request.context,
                                                          sessions=request.max_sessions,
                                                          allow_unproven=request.allow_unproven)
        budget = request.memory_bytes * (1 - RESERVE)
        prefer = [(r.start, r.end) for r in request.prefer]
        async with self._lock:
            for _ in range(MAX_ATTEMPTS):
                held = await self.leases.held(request.model_id)
                for key, (lease, _rev) in held.items():
                    if lease.node_id == request.node_id:  # a restart of the asker: its old lease is void
                        await self.leases.release(key)
                claims = claims_of(self.registry.live(), held, request.model_id, request.node_id)
                try:
                    decision = decide(fit, claims, budget, prefer=prefer)
                except AssignmentImpossible as exc:
                    return error_reply(AssignmentReply, exc)
                reply = await self._lease(request, decision, held)
                if reply is not None:
                    log.info("node %s assigned layers [%d, %d) of %s (%s): %s", request.node_id, decision.start,
                             decision.end, request.model_id[:12], decision.reason, decision.detail)
                    return reply
                log.info("lease on [%d, %d) went to another node first; deciding again", decision.start,
                         decision.end)
        return error_reply(AssignmentReply, NoRouteError("cannot assign layers: other nodes kept taking the chosen "
                                                         "ranges first; retry"))

    async def _lease(self, request: AssignmentRequest, decision: Decision,
                     held: dict[str, tuple[RangeLease, int]]) -> AssignmentReply | None:
        used = {lease.slot for lease, _ in held.values()
                if (lease.start, lease.end) == (decision.start, decision.end) and lease.node_id != request.node_id}
        slot = next(i for i in range(len(used) + 1) if i not in used)
        lease = RangeLease(node_id=request.node_id, model_id=request.model_id, start=decision.start,
                           end=decision.end, slot=slot)
        taken = await self.leases.take(lease)
        if taken is None:
            return None
        key, revision = taken
        assert key == lease_key(lease.model_id, lease.start, lease.end, lease.slot)
        return AssignmentReply(layers=LayerRange(start=decision.start, end=decision.end), lease_key=key,
                               lease_revision=revision, reason=decision.reason, detail=decision.detail,
                               uncovered=[LayerRange(start=a, end=b) for a, b in decision.uncovered])

