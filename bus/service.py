"""NATS micro services (``$SRV.PING|INFO|STATS``) for swarmroute actors, and discovery of them.

Every tracker, node and gateway registers itself as a service named ``<namespace>-<role>``, so ``nats service ls``
or any tool speaking the micro protocol lists the fleet, and ``swarmroute fleet status`` can tell who is alive
without knowing their addresses. The service's metadata says which fleet member it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from importlib import metadata as importlib_metadata

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request, ServiceError
from nats.micro.service import Service

log = logging.getLogger(__name__)

Handler = Callable[[bytes], Awaitable[bytes]]
"""An endpoint: request payload in, reply payload out. Raising SwarmrouteError-like errors is fine: see _wrap."""


def package_version() -> str:
    """The installed swarmroute version (semver, as micro requires)."""
    try:
        return importlib_metadata.version("swarmroute")
    except importlib_metadata.PackageNotFoundError:
        return "0.0.0"


def service_name(namespace: str, role: str) -> str:
    return f"{namespace}-{role}"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    name: str
    subject: str
    handler: Handler
    queue_group: str = "q"
    """Micro's default; trackers keep their own ``tracker`` group so replicas still share route requests."""


def _wrap(handler: Handler) -> Callable[[Request], Awaitable[None]]:
    async def handle(request: Request) -> None:
        try:
            reply = await handler(request.data)
        except Exception as exc:  # noqa: BLE001 - micro would leak repr(exc) as the error description
            status = str(getattr(exc, "status", 500))
            message = getattr(exc, "message", None) or type(exc).__name__
            raise ServiceError(status, message) from None
        await request.respond(reply)

    return handle


async def register(nc: NATS, *, namespace: str, role: str, member: str, description: str,
                   extra: dict[str, str] | None = None, endpoints: list[Endpoint] | None = None) -> Service:
    """Add the actor's service (metadata: namespace, role, member + ``extra``); ``stop()`` it when the actor stops."""
    metadata = {"namespace": namespace, "role": role, "member": member, **(extra or {})}
    service = await add_service(nc, name=service_name(namespace, role), version=package_version(),
                                description=description, metadata=metadata)
    for ep in endpoints or []:
        await service.add_endpoint(name=ep.name, subject=ep.subject, handler=_wrap(ep.handler),
                                   queue_group=ep.queue_group)
    return service


async def gather(nc: NATS, subject: str, payload: bytes = b"", *, wait_s: float = 0.5) -> list[bytes]:
    """Publish one request and collect every reply that arrives within ``wait_s`` (``nc.request`` keeps only one)."""
    replies: list[bytes] = []
    inbox = nc.new_inbox()

    async def on_reply(msg: Msg) -> None:
        replies.append(bytes(msg.data))

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, payload, reply=inbox)
        await nc.flush()
        await asyncio.sleep(wait_s)
    finally:
        await sub.unsubscribe()
    return replies


async def discover(nc: NATS, *, verb: str = "PING", name: str | None = None,
                   wait_s: float = 0.5) -> list[dict[str, object]]:
    """Every service instance answering ``$SRV.<verb>[.<name>]`` within ``wait_s``, as decoded JSON objects."""
    subject = f"$SRV.{verb}" + (f".{name}" if name else "")
    found: list[dict[str, object]] = []
    for data in await gather(nc, subject, wait_s=wait_s):
        if not data:
            continue  # a "no responders" status message: nobody runs a service yet
        try:
            doc = json.loads(data)
        except ValueError:
            log.warning("ignoring a non-JSON reply on %s", subject)
            continue
        if isinstance(doc, dict):
            found.append(doc)
    return found
