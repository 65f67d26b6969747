"""The node registry in JetStream KV: advertisements keyed by node id, expiring when heartbeats stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from bus import codec
from bus.subjects import Subjects
from schemas.node import NodeAdvertisement

log = logging.getLogger(__name__)


async def open_registry(nc: NATS, subjects: Subjects, ttl_s: float) -> KeyValue:
    """Bind the registry bucket, creating it (history 1, TTL) if this is the first actor to arrive."""
    js = nc.jetstream()
    for _ in range(20):
        try:
            return await js.key_value(subjects.registry_bucket)
        except (BucketNotFoundError, NotFoundError):
            pass
        try:
            return await js.create_key_value(KeyValueConfig(bucket=subjects.registry_bucket, history=1, ttl=ttl_s,
                                                            storage=StorageType.MEMORY,
                                                            description="swarmroute node advertisements"))
        except BadRequestError:
            await asyncio.sleep(0.1)  # another actor created it first with the same name: bind on the next pass
    raise RuntimeError(f"could not bind or create registry bucket {subjects.registry_bucket}")


class RegistryView:
    """A live, local copy of the registry, fed by a KV watcher. A node counts as live while its last heartbeat,
    as received here, is younger than the TTL (KV expiry does not notify watchers)."""

    def __init__(self, kv: KeyValue, ttl_s: float) -> None:
        self._kv = kv
        self._ttl = ttl_s
        self._nodes: dict[str, tuple[NodeAdvertisement, float]] = {}
        self._task: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()

    async def start(self) -> None:
        watcher = await self._kv.watchall()
        self._task = asyncio.create_task(self._watch(watcher), name="registry-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _watch(self, watcher: object) -> None:
        async for entry in watcher:  # type: ignore[attr-defined]
            if entry is None:  # end of the initial values
                self.ready.set()
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self._nodes.pop(entry.key, None)
                continue
            try:
                advert = codec.decode(entry.value, NodeAdvertisement)
            except codec.DecodeError as exc:
                log.warning("ignoring bad advertisement under %s: %s", entry.key, exc)
                continue
            self._nodes[entry.key] = (advert, time.monotonic())

    def live(self) -> list[NodeAdvertisement]:
        cutoff = time.monotonic() - self._ttl
        return [advert for advert, seen in self._nodes.values() if seen >= cutoff]

    def age_s(self, node_id: str) -> float | None:
        entry = self._nodes.get(node_id)
        return None if entry is None else time.monotonic() - entry[1]
