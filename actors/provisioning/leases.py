"""Layer-range leases in JetStream KV: which node is bringing up (or serves) which range of which model.

A tracker assigning a range creates its lease with create-if-absent, so two trackers (or two requests) that chose
the same range at the same moment cannot both win: the loser decides again with the winner's lease in view. Keys
are ``<model_id>.<start>-<end>.<slot>``; replicas of a range take further slots. The bucket has the registry's TTL
and history 1: a node renews its lease every heartbeat (an update against the revision it last wrote, so it never
overwrites a lease that expired and went to another node) and deletes it on drain or stop; a node that dies frees
its lease when the TTL passes, exactly as it leaves the registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from nats.aio.client import Client as NATS
from nats.js.errors import KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from actors.registry import open_registry
from bus import codec
from bus.subjects import Subjects
from schemas.assignment import RangeLease

log = logging.getLogger(__name__)


def lease_key(model_id: str, start: int, end: int, slot: int) -> str:
    return f"{model_id}.{start}-{end}.{slot}"


async def open_leases(nc: NATS, subjects: Subjects, ttl_s: float, *, replicas: int = 1) -> Leases:
    kv = await open_registry(nc, subjects, ttl_s, replicas=replicas, bucket=subjects.lease_bucket,
                             description="swarmroute layer-range leases")
    return Leases(kv)


class Leases:
    """The lease bucket, as trackers and nodes use it."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def held(self, model_id: str) -> dict[str, tuple[RangeLease, int]]:
        """Every live lease of the model: key -> (lease, revision). Undecodable entries are skipped."""
        watcher = await self.kv.watch(f"{model_id}.>", ignore_deletes=True)
        found: dict[str, tuple[RangeLease, int]] = {}
        try:
            async for entry in watcher:
                if entry is None:  # the end of the current values
                    break
                if entry.value and entry.operation is None:
                    with contextlib.suppress(codec.DecodeError):
                        found[entry.key] = (codec.decode(entry.value, RangeLease), int(entry.revision or 0))
        except NoKeysError:
            pass
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]
        return found

    async def take(self, lease: RangeLease) -> tuple[str, int] | None:
        """Create the lease's key if nobody holds it: (key, revision), or None when it is taken."""
        key = lease_key(lease.model_id, lease.start, lease.end, lease.slot)
        try:
            return key, await self.kv.create(key, codec.encode(lease))
        except KeyWrongLastSequenceError:
            return None

    async def take_free_slot(self, lease: RangeLease, *, max_slots: int = 1024) -> tuple[RangeLease, str, int]:
        """The lowest free slot of the lease's range (a node with an explicit range, or one whose lease was lost)."""
        for slot in range(max_slots):
            candidate = lease.model_copy(update={"slot": slot})
            taken = await self.take(candidate)
            if taken is not None:
                return candidate, *taken
        raise RuntimeError(f"every one of {max_slots} lease slots of [{lease.start}, {lease.end}) is taken")

    async def renew(self, key: str, lease: RangeLease, revision: int) -> int:
        """Rewrite the lease against ``revision``; ``KeyWrongLastSequenceError`` when it expired or changed hands."""
        return await self.kv.update(key, codec.encode(lease.model_copy(update={"renewed_at": time.time()})),
                                    last=revision)

    async def release(self, key: str) -> None:
        await self.kv.delete(key)


class LeaseKeeper:
    """A node's own lease: renewed every ``interval_s`` until ``release()``. A lease that expired meanwhile (the
    node was paused past the TTL) is taken again, in a free slot of the same range if another node took its key:
    the node holds that range either way, and assignments must see it."""

    def __init__(self, leases: Leases, lease: RangeLease, key: str, revision: int, *, interval_s: float,
                 timeout_s: float) -> None:
        self.leases, self.lease, self.key, self.revision = leases, lease, key, revision
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._task: asyncio.Task[None] | None = None
        self._released = False

    def start(self) -> LeaseKeeper:
        if self._task is None and not self._released:
            self._task = asyncio.create_task(self._loop(), name="lease-keeper")
        return self

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self.renew_once()
            except Exception as exc:  # noqa: BLE001 - a NATS outage must not kill the node; retry next beat
                log.warning("lease %s not renewed: %s", self.key, type(exc).__name__)

    async def renew_once(self) -> None:
        try:
            self.revision = await self.leases.renew(self.key, self.lease, self.revision)
            return
        except KeyWrongLastSequenceError:
            pass
        self.lease, self.key, self.revision = await self.leases.take_free_slot(self.lease)
        log.warning("lease on layers [%d, %d) had lapsed; holding it again as %s", self.lease.start, self.lease.end,
                    self.key)

    async def release(self) -> None:
        """Stop renewing and delete the lease; safe to call twice."""
        if self._released:
            return
        self._released = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.timeout_s):
                await self.leases.release(self.key)
