"""The lifecycle every NATS actor shares (tracker, node, gateway, the artifact swarm's agent, a provisioning node).

``start()`` connects (unless it was handed a connection, which it then never closes), runs the actor's own
``_on_start`` once, and returns the actor; ``stop()`` runs ``_on_stop`` once, then drains the connection the actor
owns. Both are idempotent; a stop before any start does nothing; the actor is an async context manager. An actor
that registers a NATS micro service (``bus.service``) keeps it in ``service`` and leaves discovery with
``_stop_service`` at the point of its shutdown where it stops answering.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Self

from nats.aio.client import Client as NATS
from nats.micro.service import Service

from bus.connection import connect_settings
from schemas.settings import Settings


class NatsActor:
    def __init__(self, settings: Settings, *, nc: NATS | None = None, name: str) -> None:
        self.settings = settings
        self._nc = nc
        self._own_nc = nc is None
        self._name = name
        """How the connection introduces itself to the NATS server (its monitoring shows it)."""
        self._started = False
        self._stopped = False
        self.service: Service | None = None
        """The actor's micro service ($SRV discovery and stats), once it registered one."""

    @property
    def nc(self) -> NATS:
        """The actor's NATS connection (only between ``start`` and ``stop``)."""
        assert self._nc is not None, f"{type(self).__name__} is not started"
        return self._nc

    @property
    def running(self) -> bool:
        return self._started and not self._stopped

    async def start(self) -> Self:
        if self._started:
            return self
        self._started = True
        if self._nc is None:
            self._nc = await connect_settings(self.settings, name=self._name)
        await self._on_start()
        return self

    async def stop(self) -> None:
        if self._stopped or not self._started:
            self._stopped = True
            return
        self._stopped = True
        await self._on_stop()
        if self._own_nc and self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    async def _stop_service(self) -> None:
        """Leave $SRV discovery; a service that cannot say so (NATS already gone) is no reason to stop less."""
        service, self.service = self.service, None
        if service is not None:
            with contextlib.suppress(Exception):
                await service.stop()

    async def _on_start(self) -> None:
        """The actor's own start-up, connected."""

    async def _on_stop(self) -> None:
        """The actor's own shutdown, before its connection is drained."""

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()
