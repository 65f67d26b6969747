"""Evicted nodes (issue #28): who the trackers no longer route to, why, and until when (an operator clears it).

Trackers share no state but the buckets: an eviction is a key of the evictions bucket (``Subjects.eviction_bucket``,
no TTL), so every tracker stops routing to the node at once and a restarted tracker still knows. The eviction is
also published on ``Subjects.evictions(node)``: heads repair their sessions around the node (the existing repair
path), every node shows it in its metrics, operators' tools see it. The bucket lives in the NATS server's memory,
like the registry: a restart of every NATS server forgets evictions (the checks find a bad node again).

Who is wrong is settled by a third node: a checker that disagreed with a receipt had a referee recompute it; the
node the referee contradicts is evicted (``decide``). Pure decisions here, one class for the bucket.

A clear stays in the bucket as a cleared note with the node's *clearance generation* (how many times it was
cleared). Receipts carry the generation their session opened under, so a dispute of work from before the latest
clear, settled after it, evicts nobody (``stale``): the operator vouched for what the node runs since.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from actors.registry import open_registry
from bus import codec
from bus.subjects import Subjects
from schemas.node import NODE_SERVING, NodeAdvertisement
from schemas.spot_check import CheckerReply, CheckerRequest, Dispute, Eviction, SpotVerdict

log = logging.getLogger(__name__)


def pick_checker(adverts: list[NodeAdvertisement], request: CheckerRequest, *, evicted: set[str],
                 rng: random.Random | None = None) -> CheckerReply:
    """A live, serving, verified node of exactly the request's layers of its model, not excluded or evicted; one of
    the same build when there is one (the exact rule then applies), else one of the same kernel family (the narrow
    band), else any (the wide band)."""
    candidates = [a for a in adverts if a.model_id == request.model_id and a.layers == request.layers
                  and a.state == NODE_SERVING and a.verified and a.endpoint
                  and a.node_id not in request.exclude and a.node_id not in evicted]
    if not candidates:
        return CheckerReply(status=503, error=f"no other node serves layers {request.layers} of "
                                              f"{request.model_id[:16]}")
    same = [a for a in candidates if request.build_id and a.build_id == request.build_id]
    family = [a for a in candidates if request.kernels_id and a.kernels_id == request.kernels_id]
    chosen = (rng or random).choice(same or family or candidates)
    return CheckerReply(node_id=chosen.node_id, endpoint=chosen.endpoint, build_id=chosen.build_id)


def decide(dispute: Dispute, adverts: list[NodeAdvertisement]) -> tuple[str, str]:
    """(the node to evict or "", why). The referee must be a third live node of the same layers; whoever it
    contradicts is wrong: the checked node when it agrees with the checker, else the checker."""
    layers = {a.node_id: a.layers for a in adverts if a.model_id == dispute.model_id}
    checker, referee = dispute.checker.node_id, dispute.referee.node_id
    if dispute.checker.agree:
        return "", "the checker agreed: nothing to settle"
    if not judged(dispute.referee):
        # An unjudged verdict says "agree" only because nothing could be compared (every pass shared its batch):
        # taking it as the referee's word would evict an honest checker.
        return "", "the referee could not judge the receipt (no position it could compare)"
    if len({dispute.checked, checker, referee}) < 3:
        return "", "the referee must be a third node"
    for node in (checker, referee):
        if layers.get(node) != dispute.layers:
            return "", f"{node} does not serve layers {dispute.layers} of the model"
    if not dispute.referee.agree:
        return dispute.checked, (f"{checker} and {referee} both recomputed layers {dispute.layers} of session "
                                 f"{dispute.session_id} and disagree with {dispute.checked}")
    return checker, (f"{referee} agrees with {dispute.checked} on session {dispute.session_id}; {checker}'s "
                     f"recomputation was wrong")


def judged(verdict: SpotVerdict) -> bool:
    """The verdict compared something: the exact rule, or at least one position within a band."""
    return verdict.rule == "exact" or verdict.judged > 0


def stale(dispute: Dispute, clearance: int) -> bool:
    """The disputed work was done before the checked node's latest clear (its generation is ``clearance``)."""
    return dispute.clearance is not None and dispute.clearance < clearance


async def open_evictions(nc: NATS, subjects: Subjects, *, replicas: int = 1) -> KeyValue:
    return await open_registry(nc, subjects, 0, replicas=replicas, bucket=subjects.eviction_bucket,
                               description="swarmroute evicted nodes (issue #28)")


class Evictions:
    """The evictions bucket as trackers (``start``: a live copy) and operators (``clear``) use it."""

    def __init__(self, nc: NATS, subjects: Subjects, kv: KeyValue) -> None:
        self._nc = nc
        self._subjects = subjects
        self.kv = kv
        self.evicted: dict[str, Eviction] = {}
        self.clearances: dict[str, int] = {}
        """Each node's clearance generation: how many times an operator cleared it (absent: never)."""
        self._watching: asyncio.Task[None] | None = None

    async def start(self) -> None:
        watcher = await self.kv.watchall()
        ready = asyncio.Event()
        self._watching = asyncio.create_task(self._watch(watcher, ready), name="evictions-watch")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ready.wait(), 5.0)

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watching

    async def _watch(self, watcher: object, ready: asyncio.Event) -> None:
        async for entry in watcher:  # type: ignore[attr-defined]
            if entry is None:
                ready.set()
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self.evicted.pop(entry.key, None)
                continue
            try:
                self._note(codec.decode(entry.value, Eviction))
            except codec.DecodeError as exc:
                log.warning("ignoring a bad eviction under %s: %s", entry.key, exc)

    def _note(self, eviction: Eviction) -> None:
        node = eviction.node_id
        if eviction.cleared:
            self.evicted.pop(node, None)
            self.clearances[node] = max(self.clearances.get(node, 0), eviction.clearance)
        else:
            self.evicted[node] = eviction

    def clearance(self, node_id: str) -> int:
        return self.clearances.get(node_id, 0)

    async def evict(self, eviction: Eviction) -> None:
        """Keep it in the bucket (every tracker stops routing to the node) and announce it."""
        eviction = eviction.model_copy(update={"clearance": self.clearance(eviction.node_id)})
        self.evicted[eviction.node_id] = eviction
        await self.kv.put(eviction.node_id, codec.encode(eviction))
        await self._nc.publish(self._subjects.evictions(eviction.node_id), codec.encode(eviction))
        log.warning("node %s evicted: %s", eviction.node_id, eviction.reason)

    async def clear(self, node_id: str) -> Eviction | None:
        """The operator's word: the node may be routed to again. The eviction it had, or None."""
        try:
            entry = await self.kv.get(node_id)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        eviction = codec.decode(entry.value, Eviction)
        if eviction.cleared:
            return None
        # Kept, not deleted: the generation outlives the eviction (a dispute of older work must not evict again).
        cleared = eviction.model_copy(update={"cleared": True, "clearance": eviction.clearance + 1})
        await self.kv.put(node_id, codec.encode(cleared))
        self._note(cleared)
        await self._nc.publish(self._subjects.evictions(node_id), codec.encode(cleared))
        return eviction

    async def listing(self) -> list[Eviction]:
        """Every node evicted now, read once from the bucket (the CLI)."""
        found: list[Eviction] = []
        try:
            keys = await self.kv.keys()
        except Exception:  # noqa: BLE001 - nats-py raises NoKeysError (or a timeout) for an empty bucket
            return found
        for key in keys:
            with contextlib.suppress(KeyNotFoundError, codec.DecodeError):
                entry = await self.kv.get(key)
                if entry.value and not (eviction := codec.decode(entry.value, Eviction)).cleared:
                    found.append(eviction)
        return found
