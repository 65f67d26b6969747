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
from types import TracebackType

from nats.aio.client import Client as NATS
from nats.micro.service import Service

from actors.registry import RegistryView, open_registry
from actors.routes import routable, select_route, uncovered_layers
from actors.services import tracker_service
from bus import capability, codec
from bus.connection import connect_settings
from bus.subjects import Subjects
from schemas.errors import CapacityError, SwarmrouteError
from schemas.node import LayerRange
from schemas.route import ModelsReply, RouteReply, RouteRequest, ServedModel
from schemas.settings import Settings

log = logging.getLogger(__name__)
OPEN_GRACE_S = 0.25
"""Longest expected time from handing out a route to the node's heartbeat that includes the opened session."""
QUEUE_GROUP = "tracker"


class Tracker:
    def __init__(self, settings: Settings, *, nc: NATS | None = None) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.namespace)
        self._nc = nc
        self._own_nc = nc is None
        self._service: Service | None = None
        self.registry: RegistryView | None = None
        self._pending: dict[str, list[float]] = {}
        self._signer = capability.signer_from_settings(settings)
        self._started = False
        self._stopped = False

    async def start(self) -> Tracker:
        if self._started:
            return self
        self._started = True
        if self._nc is None:
            self._nc = await connect_settings(self.settings, name="tracker")
        kv = await open_registry(self._nc, self.subjects, self.settings.registry_ttl_s,
                                 replicas=self.settings.registry_replicas)
        self.registry = RegistryView(kv, self.settings.registry_ttl_s, nc=self._nc, subjects=self.subjects)
        await self.registry.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.registry.ready.wait(), 5.0)
        # Route and models requests are micro-service endpoints (same subjects, queue group "tracker"), so $SRV
        # discovery lists every tracker and $SRV.STATS counts its requests.
        self._service = await tracker_service(self._nc, self.subjects, member=self.settings.member_name or "tracker",
                                              route=self._handle_route, models=self._handle_models)
        log.info("tracker ready on %s", self.subjects.route_request)
        return self

    async def stop(self) -> None:
        if self._stopped or not self._started:
            self._stopped = True
            return
        self._stopped = True
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        if self.registry is not None:
            await self.registry.stop()
        if self._own_nc and self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    async def __aenter__(self) -> Tracker:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.stop()

    def _pending_counts(self) -> dict[str, int]:
        # A route handed out counts against its nodes until a heartbeat sent after the session opened reports it
        # (at the latest 1.5 heartbeats): counting it beyond that counts the session twice, and a swarm with free
        # slots refuses routes (tests/test_load.py). OPEN_GRACE_S covers routing -> open -> heartbeat received.
        now = time.monotonic()
        horizon = now - self.settings.heartbeat_s * 1.5
        counts: dict[str, int] = {}
        for node, stamps in list(self._pending.items()):
            age = self.registry.age_s(node) if self.registry is not None else None
            cutoff = horizon if age is None else max(horizon, now - age - OPEN_GRACE_S)
            stamps[:] = [t for t in stamps if t > cutoff]
            if stamps:
                counts[node] = len(stamps)
            else:
                del self._pending[node]
        return counts

    def route(self, request: RouteRequest) -> RouteReply:
        assert self.registry is not None
        try:
            route = select_route(self.registry.live(), request.model, request.session_id,
                                 exclude=frozenset(request.exclude), pending=self._pending_counts())
        except CapacityError as exc:
            return RouteReply(error=exc.message, status=exc.status)
        except SwarmrouteError as exc:
            gaps: list[LayerRange] = []
            with contextlib.suppress(SwarmrouteError):  # the same nodes the route could use, so gaps match the message
                gaps = uncovered_layers(*routable(self.registry.live(), request.model, frozenset(request.exclude)))
            return RouteReply(error=exc.message, status=exc.status, uncovered=gaps)
        now = time.monotonic()
        for hop in route.hops:
            self._pending.setdefault(hop.node_id, []).append(now)
        if self._signer is not None:
            route = capability.issue(route, self._signer, self.settings.capability_ttl_s)
        return RouteReply(route=route)

    async def _handle_route(self, data: bytes) -> bytes:
        try:
            request = codec.decode(data, RouteRequest)
        except codec.DecodeError as exc:
            return codec.encode(RouteReply(error=str(exc), status=400))
        reply = self.route(request)
        if reply.route:
            log.info("session %s routed: %s", request.session_id, reply.route.describe())
        return codec.encode(reply)

    def models(self) -> ModelsReply:
        assert self.registry is not None
        by_model: dict[str, ServedModel] = {}
        for a in self.registry.live():
            m = by_model.setdefault(a.model_id, ServedModel(id=a.model_id, name=a.backend.model_name,
                                                            n_layers=a.backend.n_layers, backend=a.backend))
            m.nodes.append(a.node_id)
            m.layer_ranges.append(a.layers)
        for m in by_model.values():
            adverts = [a for a in self.registry.live() if a.model_id == m.id and a.verified]
            m.complete = not uncovered_layers(adverts, m.n_layers)
        return ModelsReply(models=sorted(by_model.values(), key=lambda m: m.id))

    async def _handle_models(self, data: bytes) -> bytes:
        return codec.encode(self.models())
