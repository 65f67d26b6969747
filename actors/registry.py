"""The node registry in JetStream KV: advertisements keyed by node id, expiring when heartbeats stop.

The one place that reads it: ``open_registry`` binds (or creates) the bucket for the actors that write or watch it;
``registry_snapshot`` reads it once with only what the read-only ``monitor`` role may do (stream info, direct
gets: no consumer); ``RegistryView`` keeps a live copy, fed by a KV watcher (trackers) or, for monitors, by the
snapshot plus the puts on core NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue

from bus import codec
from bus.subjects import Subjects
from schemas.node import NodeAdvertisement

log = logging.getLogger(__name__)


async def open_registry(nc: NATS, subjects: Subjects, ttl_s: float, *, replicas: int = 1,
                        unavailable_wait_s: float = 30.0, bucket: str | None = None,
                        description: str = "swarmroute node advertisements") -> KeyValue:
    """Bind the registry bucket (or another TTL bucket: ``bucket``, e.g. the layer leases), creating it (history 1,
    TTL, ``replicas``) if this is the first actor to arrive.

    A cluster that is still electing its JetStream leader answers "unavailable" for a few seconds: wait it out,
    since every actor of a fleet started at once meets exactly that.
    """
    js = nc.jetstream()
    name = bucket or subjects.registry_bucket
    deadline = time.monotonic() + unavailable_wait_s
    while True:
        try:
            return await js.key_value(name)
        except (BucketNotFoundError, NotFoundError):
            pass
        except (ServiceUnavailableError, NatsTimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)
            continue
        try:
            return await js.create_key_value(KeyValueConfig(bucket=name, history=1, ttl=ttl_s,
                                                            storage=StorageType.MEMORY, replicas=replicas,
                                                            description=description))
        except (BadRequestError, ServiceUnavailableError, NatsTimeoutError):
            # Another actor created it first (bind on the next pass), or the cluster is not ready yet.
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not bind or create bucket {name}") from None
            await asyncio.sleep(0.1)


@dataclasses.dataclass
class RegistrySnapshot:
    adverts: dict[str, NodeAdvertisement]
    """Node id -> its last advertisement, as the bucket holds it."""
    replication: dict[str, Any]
    """The bucket's replication (replicas, leader, replicas current), or ``error`` if it could not be read."""


async def registry_snapshot(nc: NATS, subjects: Subjects) -> RegistrySnapshot:
    """Every advertisement and the bucket's replication, with reads the read-only monitor role may make: stream
    info (which lists the keys) and direct gets, no consumer. An empty or unreachable registry is a finding."""
    js = nc.jetstream()
    stream = f"KV_{subjects.registry_bucket}"
    adverts: dict[str, NodeAdvertisement] = {}
    replication: dict[str, Any] = {}
    try:
        info = await js.stream_info(stream, subjects_filter=subjects.registry_key_subject(">"))
        cluster = info.cluster
        replication.update(replicas=info.config.num_replicas, leader=cluster.leader if cluster else None,
                           current=sum(1 for r in (cluster.replicas or []) if r.current) + 1 if cluster else 1)
        kv = await js.key_value(subjects.registry_bucket)
        for subject in sorted(info.state.subjects or {}):
            key = subject.rsplit(".", 1)[-1]
            with contextlib.suppress(KeyNotFoundError, codec.DecodeError):  # expired or deleted since listed
                entry = await kv.get(key)
                if entry.value:
                    adverts[key] = codec.decode(entry.value, NodeAdvertisement)
    except Exception as exc:  # noqa: BLE001 - reported to the operator, not raised
        replication["error"] = f"{type(exc).__name__}: {exc}"
    return RegistrySnapshot(adverts, replication)


def _identity(a: NodeAdvertisement) -> tuple[object, ...]:
    """What routing reads of a node besides its load."""
    return (a.model_id, a.backend.model_name, a.backend.n_layers, tuple(a.aliases), a.layers.start, a.layers.end,
            a.state, a.verified, a.endpoint, a.started_at)


class RegistryView:
    """A live, local copy of the registry, fed by a KV watcher. A node counts as live while its last heartbeat,
    as received here, is younger than the TTL (KV expiry does not notify watchers).

    With ``nc`` and ``subjects`` it also listens to the puts themselves on core NATS (``$KV.<bucket>.*``): that
    subscription is back within a reconnect when a cluster server dies, while the watcher's ephemeral consumer
    may have lived on the dead server and only comes back after missing two idle heartbeats (~10 s), long enough
    for every node to look expired.
    """

    def __init__(self, kv: KeyValue | None, ttl_s: float, *, nc: NATS | None = None,
                 subjects: Subjects | None = None) -> None:
        """Without ``kv`` (a monitor, which may not create consumers) it starts from ``registry_snapshot`` and
        follows the puts on core NATS (``nc`` and ``subjects`` required)."""
        self._kv = kv
        self._ttl = ttl_s
        self._nodes: dict[str, tuple[NodeAdvertisement, float]] = {}
        self._retired: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._nc = nc
        self._subjects = subjects
        self._sub: Subscription | None = None
        self.ready = asyncio.Event()
        self.membership = 0
        """Bumped whenever a node appears, is deleted, or changes what a route depends on (model, names, range,
        state, verification, endpoint): a view derived from the registry is current while this is unchanged and
        none of its nodes expired. A heartbeat that only renews (load, timestamps) leaves it."""

    async def start(self) -> None:
        if self._nc is not None and self._subjects is not None:
            self._sub = await self._nc.subscribe(self._subjects.registry_key_subject(), cb=self._on_put)
        if self._kv is None:
            assert self._nc is not None and self._subjects is not None, "a monitor's view needs nc and subjects"
            for key, advert in (await registry_snapshot(self._nc, self._subjects)).adverts.items():
                self._apply(key, codec.encode(advert), None)
            self.ready.set()
            return
        watcher = await self._kv.watchall()
        self._task = asyncio.create_task(self._watch(watcher), name="registry-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _watch(self, watcher: object) -> None:
        async for entry in watcher:  # type: ignore[attr-defined]
            if entry is None:  # end of the initial values
                self.ready.set()
                continue
            self._apply(entry.key, entry.value, entry.operation)

    async def _on_put(self, msg: Msg) -> None:
        operation = (msg.headers or {}).get("KV-Operation")
        self._apply(msg.subject.rsplit(".", 1)[-1], msg.data, operation)

    def _apply(self, key: str, value: bytes | None, operation: str | None) -> None:
        if operation in ("DEL", "PURGE") or not value:
            removed = self._nodes.pop(key, None)
            if removed is not None:
                # The two feeds race: the other one may still replay the put this delete retired.
                self._retired[key] = removed[0].sent_at
                self.membership += 1
            return
        try:
            advert = codec.decode(value, NodeAdvertisement)
        except codec.DecodeError as exc:
            log.warning("ignoring bad advertisement under %s: %s", key, exc)
            return
        known = self._nodes.get(key)
        if known is not None and known[0].sent_at > advert.sent_at:
            return  # the watcher replaying an older value after the live subscription saw a newer one
        if advert.sent_at <= self._retired.get(key, float("-inf")):
            return  # a replay of an advertisement its node has since deleted (drain, clean stop)
        self._retired.pop(key, None)
        if known is None or _identity(known[0]) != _identity(advert):
            self.membership += 1
        self._nodes[key] = (advert, time.monotonic())

    def all(self) -> dict[str, NodeAdvertisement]:
        """Every advertisement seen and not deleted, fresh or not (a monitor shows stale ones too)."""
        return {key: advert for key, (advert, _) in self._nodes.items()}

    def live(self) -> list[NodeAdvertisement]:
        cutoff = time.monotonic() - self._ttl
        return [advert for advert, seen in self._nodes.values() if seen >= cutoff]

    def current(self, node_id: str) -> NodeAdvertisement | None:
        """The node's last advertisement while it is live (``live()``'s rule), else None."""
        entry = self._nodes.get(node_id)
        if entry is None or entry[1] < time.monotonic() - self._ttl:
            return None
        return entry[0]

    def age_s(self, node_id: str) -> float | None:
        entry = self._nodes.get(node_id)
        return None if entry is None else time.monotonic() - entry[1]
