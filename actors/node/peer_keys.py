"""A node's data-plane TLS (issue #29): its identity, the client context it reaches its peers with, and, when it
serves TLS, the trust its server holds, kept in step with the registry (``bus.tls``).

The node follows the registry the way a monitor does (its snapshot, then the puts on core NATS): every advertised
key's certificate goes into the server's trust store as it appears, so a node that joins is accepted by its peers by
the time a tracker can route to it; a key is admitted only while its node is live in the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl

from nats.aio.client import Client as NATS

from actors.registry import RegistryView
from bus.identity import Identity, identity_from_settings
from bus.subjects import Subjects
from bus.tls import ServerTrust, client_context, is_loopback, pin_endpoint, split_pin
from schemas.node import NodeAdvertisement
from schemas.settings import Settings

log = logging.getLogger(__name__)


def serves_tls(settings: Settings, host: str) -> bool:
    """Whether a server on ``host`` speaks TLS: ``auto`` means off loopback; ``off`` off loopback is warned about."""
    if settings.tls == "off" and not is_loopback(host):
        log.warning("TLS is off on %s: every frame (the prompt's activations), token, session token and snapshot "
                    "this node sends or receives crosses the network in clear, and anyone who can reach the port "
                    "may call it", host)
    return settings.tls == "on" or (settings.tls == "auto" and not is_loopback(host))


class PeerKeys:
    """``client``: None only with ``tls = off``. ``trust``: the server's, None when it serves plain HTTP."""

    def __init__(self, settings: Settings, node_id: str, host: str) -> None:
        self._settings = settings
        serving = serves_tls(settings, host)
        self.identity: Identity | None = None
        self.client: ssl.SSLContext | None = None
        self.trust: ServerTrust | None = None
        self._view: _TrustFeed | None = None
        self._retain: asyncio.Task[None] | None = None
        if settings.tls == "off":
            return
        self.identity = identity_from_settings(settings, node_id)
        self.client = client_context(self.identity, settings.tls_ca_file)
        if serving:
            self.trust = ServerTrust(self.identity, ca_file=settings.tls_ca_file,
                                     trusted_certs=settings.tls_trusted_certs)

    def endpoint(self, advertised: str) -> str:
        """The URL to advertise: pinned to this node's key when it serves TLS."""
        if self.trust is None or self.identity is None:
            return advertised
        bare, pin = split_pin(advertised)
        if not bare.startswith("https://"):
            raise ValueError(f"this node serves TLS, so it cannot be reached at {advertised!r}: advertise https://")
        if pin is not None and pin != self.identity.fingerprint:
            raise ValueError(f"advertised URL {advertised!r} pins another key than this node's")
        return pin_endpoint(bare, self.identity.fingerprint)

    @property
    def fingerprint(self) -> str:
        """What the advertisement names: this node's key when it serves TLS, else nothing."""
        return self.identity.fingerprint if self.trust is not None and self.identity is not None else ""

    @property
    def certificate(self) -> str:
        return self.identity.cert_pem if self.trust is not None and self.identity is not None else ""

    async def follow(self, nc: NATS, subjects: Subjects) -> None:
        """Feed the server's trust from the registry until ``stop()``."""
        if self.trust is None:
            return
        self._view = _TrustFeed(self.trust, nc, subjects, self._settings.registry_ttl_s)
        await self._view.start()
        self._retain = asyncio.create_task(self._retain_live(), name="peer-keys")

    def seen(self, node_id: str) -> bool:
        """Whether the registry feed has an advertisement of ``node_id``."""
        return self._view is not None and node_id in self._view.all()

    async def _retain_live(self) -> None:
        """Registry expiry notifies nobody: a node whose heartbeats stopped loses its admission here."""
        assert self._view is not None and self.trust is not None
        while True:
            await asyncio.sleep(self._settings.registry_ttl_s / 3)
            self.trust.retain(a.node_id for a in self._view.live())

    async def stop(self) -> None:
        task, self._retain = self._retain, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        view, self._view = self._view, None
        if view is not None:
            await view.stop()


class _TrustFeed(RegistryView):
    """A registry view that registers every advertised key with ``trust`` as it arrives."""

    def __init__(self, trust: ServerTrust, nc: NATS, subjects: Subjects, ttl_s: float) -> None:
        super().__init__(None, ttl_s, nc=nc, subjects=subjects)
        self._trust = trust

    def _apply(self, key: str, value: bytes | None, operation: str | None) -> None:
        super()._apply(key, value, operation)
        advert: NodeAdvertisement | None = self.all().get(key)
        if advert is None:
            self._trust.forget(key)
        elif advert.fingerprint and advert.certificate:
            self._trust.register(advert.node_id, advert.fingerprint, advert.certificate)
