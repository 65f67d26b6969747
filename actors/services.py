"""Trackers and nodes as NATS micro services, so ``$SRV.PING|INFO|STATS`` discovery (``nats service ls``,
``swarmroute fleet status``) lists them.

The tracker's route and models requests are its service endpoints, on their existing subjects and queue group, so
the request counts in ``$SRV.STATS`` are the real ones. A node's ``info`` endpoint answers with its advertisement.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.micro.service import Service

from bus.service import Endpoint, register
from bus.subjects import Subjects
from schemas.node import NodeAdvertisement

TRACKER_QUEUE = "tracker"


async def tracker_service(nc: NATS, subjects: Subjects, *, member: str, route: Callable[[bytes], Awaitable[bytes]],
                          models: Callable[[bytes], Awaitable[bytes]],
                          assign: Callable[[bytes], Awaitable[bytes]] | None = None,
                          repair: Callable[[bytes], Awaitable[bytes]] | None = None) -> Service:
    endpoints = [Endpoint("route", subjects.route_request, route, TRACKER_QUEUE),
                 Endpoint("models", subjects.models_request, models, TRACKER_QUEUE)]
    if assign is not None:
        endpoints.append(Endpoint("assign", subjects.assign_request, assign, TRACKER_QUEUE))
    if repair is not None:
        endpoints.append(Endpoint("repair", subjects.repair_request, repair, TRACKER_QUEUE))
    return await register(nc, namespace=subjects.namespace, role="tracker", member=member,
                          description="swarmroute tracker: picks Inference Routes from the node registry",
                          endpoints=endpoints)


async def node_service(nc: NATS, subjects: Subjects, advertisement: Callable[[], NodeAdvertisement]) -> Service:
    ad = advertisement()

    async def info(_: bytes) -> bytes:
        return advertisement().model_dump_json().encode()

    return await register(nc, namespace=subjects.namespace, role="node", member=ad.node_id,
                          description="swarmroute node: serves one layer range over binary HTTP",
                          extra={"node_id": ad.node_id, "model_id": ad.model_id, "endpoint": ad.endpoint,
                                 "layers": f"{ad.layers.start}:{ad.layers.end}"},
                          endpoints=[Endpoint("info", subjects.node_info(ad.node_id), info)])
