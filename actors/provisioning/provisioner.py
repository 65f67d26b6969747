"""A node that joins with only a model id: learn the manifest from the swarm, get a layer range (the tracker's
assignment, or the operator's explicit range) held as a lease, fetch exactly that range's pieces from the peers
that hold them, verify them and cut the shard. Meanwhile the node is in the registry in state ``fetching`` (never
routed to) with its progress; afterwards it keeps seeding what it holds and renewing its lease until it stops.

Nothing here builds the backend: the caller (``swarmroute.provision``) loads the verified shard through the same
self-checked path as any local file, then starts the ``Node``, which takes over the registry entry.

Waits never end by themselves (a node is started to serve; the operator stops it): a manifest nobody offers, a
tracker that does not answer, pieces nobody seeds. Each wait says what it waits for, in the log and (for pieces)
in the ``FetchProgress`` events and the advertisement.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path

from nats.aio.client import Client as NATS

from actors.provisioning.artifact_sync import ArtifactSync, SyncConfig
from actors.provisioning.leases import LeaseKeeper, Leases, lease_key, open_leases
from actors.registry import RegistrySnapshot, open_registry, registry_snapshot
from artifacts.fetch import FetchOptions
from artifacts.store import Store
from artifacts.torrent import TorrentSession
from bus import codec
from bus.actor import NatsActor
from bus.subjects import Subjects
from bus.tracker_client import TrackerClient
from schemas.artifact import FetchProgress
from schemas.assignment import AssignmentReply, AssignmentRequest, RangeLease
from schemas.errors import NotFoundError, SwarmrouteError
from schemas.manifest import ModelManifest
from schemas.node import (
    NODE_FETCHING,
    NODE_SERVING,
    AllLayers,
    BackendInfo,
    Capacity,
    FetchSummary,
    LayerRange,
    NodeAdvertisement,
    resolve_layers,
)
from schemas.session import CONTEXT_CAP
from schemas.settings import Settings

log = logging.getLogger(__name__)
ASSIGNMENT_FILE = ".assignment"
"""In the model's store directory: the range this node was last given, preferred by the next assignment."""
RETRY_STATUSES = {404, 500, 501, 503}
"""Assignment refusals worth asking again: no manifest reachable yet, a tracker that failed on the way (NATS,
JetStream), a tracker without artifact support (another may have it), lost lease races, no tracker answering."""
ALIAS_LOOKUP_S = 2.0
"""Longest a joining node reads the registry for the names the swarm serves its model under."""
ASSIGN_TIMEOUT_S = 30.0
"""How long one assignment request waits (the tracker may fetch the manifest from the swarm first)."""


class ProvisionError(SwarmrouteError):
    code = "provision_failed"


@dataclasses.dataclass
class ProvisionConfig:
    node_id: str
    """This node's id: registry key, lease holder, artifact peer name."""

    model_id: str
    """sha256 of the model's GGUF: what to fetch."""

    memory_bytes: int
    """Memory the node gives the model (weights + KV): what the assignment sizes its range by."""

    manifest_id: str | None = None
    """Accept only this manifest (pinning); without it, the first manifest whose content hash checks out."""

    layers: tuple[int, int] | AllLayers | None = None
    """An explicit range, or ``ALL_LAYERS`` for the whole model (known once the manifest is): no assignment is asked
    for (a lease is still taken, so assignments see it). ``None``: the tracker assigns one."""

    max_sessions: int = 4
    """KV slots the node will serve (the assignment sizes the cache share by them)."""

    context: int = 4096
    """Tokens per session (the assignment sizes the cache share by them)."""

    allow_unproven: bool = False
    """Accept cuts of an architecture the shard matrix has not proven."""

    aliases: tuple[str, ...] = ()
    """Other names of the model (the operator's), shown while fetching; the names the swarm's serving nodes give
    the model are added to them (``Provisioner.aliases``)."""

    retry_s: float = 2.0
    """How long to wait before asking again for a manifest nobody offered or an assignment nobody gave."""

    fetch_timeout_s: float = math.inf
    """Give up a fetch that has not finished by then (default: wait as long as it takes)."""


@dataclasses.dataclass(frozen=True)
class Provisioned:
    manifest: ModelManifest
    start: int
    end: int
    shard: Path
    """The verified shard (or the whole file for the whole range) in the store."""
    progress: FetchProgress
    """The fetch's last progress: bytes downloaded, hash failures, banned peers."""
    assignment: AssignmentReply | None
    """The tracker's answer (None for an explicit range)."""
    aliases: tuple[str, ...] = ()
    """The names to serve the model under: the operator's, then those the swarm's serving nodes use."""


class Provisioner(NatsActor):
    """An async context manager (``bus.actor.NatsActor``); ``stop()`` is safe to call twice. Its ``ArtifactSync``
    runs on its connection, which the serving ``Node`` takes over afterwards."""

    def __init__(self, config: ProvisionConfig, settings: Settings, session: TorrentSession, *,
                 nc: NATS | None = None) -> None:
        super().__init__(settings, nc=nc, name=f"node-{config.node_id}")
        self.config, self.session = config, session
        self.subjects = Subjects(settings.namespace)
        self.store = Store(settings.home)
        self.sync: ArtifactSync | None = None
        self.leases: Leases | None = None
        self.keeper: LeaseKeeper | None = None
        self.latest: FetchProgress | None = None
        self.phase = "starting"
        self.layers: tuple[int, int] | None = None
        self.manifest: ModelManifest | None = None
        self.aliases: tuple[str, ...] = config.aliases
        """The operator's names for the model, then the names the swarm already serves it under."""
        self._presence: asyncio.Task[None] | None = None
        self._advertised = False

    async def _on_start(self) -> None:
        config = SyncConfig(node_id=self.config.node_id, allow_unproven=self.config.allow_unproven)
        self.sync = await ArtifactSync(self.settings, self.store, self.session, config, nc=self.nc).start()
        self.leases = await open_leases(self.nc, self.subjects, self.settings.registry_ttl_s,
                                        replicas=self.settings.registry_replicas)

    # ---- the steps ---------------------------------------------------------------------------------------------

    async def provision(self, *, printer: Callable[[FetchProgress], None] | None = None,
                        cancel: threading.Event | None = None) -> Provisioned:
        """Manifest -> range (lease) -> fetch -> verified shard. Raises ``ProvisionError`` for what waiting cannot
        fix (the node cannot hold any range), ``FetchCancelled`` when ``cancel`` is set."""
        assert self.sync is not None
        manifest = self.manifest = await self.learn_manifest()
        await self.sync.hold(manifest)  # answer manifest requests and announce ourselves (we seed what we hold)
        self.aliases = await self._swarm_aliases(manifest)
        reply = await self.take_range(manifest)
        start, end = self.layers = self._range(manifest, reply)
        self._remember(manifest, start, end)
        self._presence = asyncio.create_task(self._presence_loop(), name="fetching-presence")
        self.phase = "fetching"
        options = FetchOptions(timeout_s=self.config.fetch_timeout_s, cancel=cancel,
                               allow_unproven=self.config.allow_unproven)
        result = await self.sync.fetch(manifest, start, end, printer=self._sink(printer), options=options)
        self.phase = "loading"
        log.info("layers [%d, %d) of %s verified: %d bytes downloaded for %d needed (%.3fx), %d bad pieces, "
                 "banned peers: %s", start, end, manifest.model_id[:12], result.progress.bytes_downloaded,
                 result.progress.bytes_needed, result.progress.bytes_downloaded / max(1, result.progress.bytes_needed),
                 result.progress.hash_failures, ", ".join(result.progress.banned_peers) or "none")
        return Provisioned(manifest, start, end, result.shard, result.progress, reply, self.aliases)

    async def _swarm_aliases(self, manifest: ModelManifest) -> tuple[str, ...]:
        """The operator's aliases, then every name the verified serving nodes of this very manifest give the model
        (e.g. ``gemma-3-270m`` from ``swarmroute up``): a node joining with only the content id is routed to under
        the names clients already use. A registry this node may not read (NATS roles) adds none."""
        snapshot = RegistrySnapshot({}, {})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ALIAS_LOOKUP_S):
                snapshot = await registry_snapshot(self.nc, self.subjects)
        names = [name for advert in snapshot.adverts.values()
                 if advert.model_id == manifest.model_id and advert.manifest_id == manifest.manifest_id
                 and advert.state == NODE_SERVING and advert.verified for name in advert.aliases]
        adopted = tuple(dict.fromkeys(n for n in [*self.config.aliases, *names] if n != manifest.model_id))
        if adopted != self.config.aliases:
            log.info("serving model %s also as %s (the names the swarm serves it under)", manifest.model_id[:12],
                     ", ".join(adopted))
        return adopted

    async def learn_manifest(self) -> ModelManifest:
        assert self.sync is not None
        pinned = self.config.manifest_id
        while True:
            try:
                manifest = await self.sync.manifest_for(self.config.model_id, expect_id=pinned)
            except NotFoundError as exc:
                log.warning("%s; asking again in %gs", exc.message, self.config.retry_s)
                await asyncio.sleep(self.config.retry_s)
                continue
            if pinned and manifest.manifest_id != pinned:  # the store held another manifest of this model
                raise ProvisionError(f"the store holds manifest {manifest.manifest_id[:16]}... for model "
                                     f"{self.config.model_id[:16]}..., not the pinned {pinned[:16]}...")
            log.info("manifest %s of %s (%s, %d layers, %d bytes)", manifest.manifest_id[:16],
                     manifest.model_id[:12], manifest.name or manifest.architecture, manifest.n_layers,
                     manifest.file_size)
            return manifest

    async def take_range(self, manifest: ModelManifest) -> AssignmentReply | None:
        """The explicit range under a lease of its own, or the tracker's assignment (asked until one answers)."""
        assert self.leases is not None
        if self.config.layers is not None:
            a, b = resolve_layers(self.config.layers, manifest.n_layers)
            if not 0 <= a < b <= manifest.n_layers:
                raise ProvisionError(f"layers [{a}, {b}) are not within the {manifest.n_layers} layers of model "
                                     f"{manifest.model_id[:12]}")
            lease, key, revision = await self.leases.take_free_slot(
                RangeLease(node_id=self.config.node_id, model_id=manifest.model_id, start=a, end=b))
            self._keep(lease, key, revision)
            return None
        request = AssignmentRequest(node_id=self.config.node_id, model_id=manifest.model_id,
                                    manifest_id=manifest.manifest_id, memory_bytes=self.config.memory_bytes,
                                    max_sessions=self.config.max_sessions, context=self.config.context,
                                    allow_unproven=self.config.allow_unproven, prefer=self._held_ranges(manifest))
        tracker = TrackerClient(self.nc, self.subjects, timeout_s=ASSIGN_TIMEOUT_S)
        while (reply := await self._ask(tracker, request)) is None:
            await asyncio.sleep(self.config.retry_s)
        assert reply.layers is not None
        log.info("assigned layers %s (%s): %s", reply.layers, reply.reason, reply.detail)
        lease = RangeLease(node_id=request.node_id, model_id=manifest.model_id, start=reply.layers.start,
                           end=reply.layers.end, slot=int(reply.lease_key.rsplit(".", 1)[-1]))
        self._keep(lease, reply.lease_key, reply.lease_revision)
        return reply

    async def _ask(self, tracker: TrackerClient, request: AssignmentRequest) -> AssignmentReply | None:
        """The tracker's assignment; None when asking again may get one, ``ProvisionError`` when it cannot."""
        try:
            return await tracker.assign(request)
        except codec.DecodeError as exc:
            log.warning("unreadable assignment reply: %s", exc)
        except SwarmrouteError as exc:
            if exc.status not in RETRY_STATUSES:
                raise ProvisionError(f"no layer assignment for node {self.config.node_id}: {exc.message}") from None
            log.warning("no tracker answers with an assignment yet (%d: %s); asking again in %gs", exc.status,
                        exc.message, self.config.retry_s)
        return None

    def _keep(self, lease: RangeLease, key: str, revision: int) -> None:
        assert self.leases is not None and key == lease_key(lease.model_id, lease.start, lease.end, lease.slot)
        self.keeper = LeaseKeeper(self.leases, lease, key, revision, interval_s=self.settings.heartbeat_s,
                                  timeout_s=max(0.5, min(self.settings.heartbeat_s, self.settings.registry_ttl_s / 4)))
        self.keeper.start()

    def _range(self, manifest: ModelManifest, reply: AssignmentReply | None) -> tuple[int, int]:
        if reply is None:  # an explicit range
            assert self.config.layers is not None
            return resolve_layers(self.config.layers, manifest.n_layers)
        assert reply.layers is not None
        return reply.layers.start, reply.layers.end

    # ---- what the node holds and was given -----------------------------------------------------------------------

    def _held_ranges(self, manifest: ModelManifest) -> list[LayerRange]:
        """Ranges this node's store has a shard of, and the range it was last given: preferred on a restart."""
        directory = self.store.model_dir(manifest.model_id)
        found: set[tuple[int, int]] = set()
        for shard in directory.glob("shard-*-*.gguf"):
            with contextlib.suppress(ValueError):
                a, b = (int(x) for x in shard.stem.split("-")[1:3])
                found.add((a, b))
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            last = json.loads((directory / ASSIGNMENT_FILE).read_text())
            found.add((int(last["start"]), int(last["end"])))
        return [LayerRange(start=a, end=b) for a, b in sorted(found) if 0 <= a < b <= manifest.n_layers]

    def _remember(self, manifest: ModelManifest, start: int, end: int) -> None:
        with contextlib.suppress(OSError):
            (self.store.model_dir(manifest.model_id) / ASSIGNMENT_FILE).write_text(
                json.dumps({"start": start, "end": end, "node_id": self.config.node_id}))

    # ---- being seen while fetching -----------------------------------------------------------------------------

    def _sink(self, printer: Callable[[FetchProgress], None] | None) -> Callable[[FetchProgress], None]:
        """Called on the fetch thread: remember the latest snapshot for the advertisement, log what a person must
        know (a wait for pieces nobody seeds, a banned peer) once each, and draw the progress bar."""
        last_message, banned = "", 0

        def sink(p: FetchProgress) -> None:
            nonlocal last_message, banned
            self.latest = p
            if p.message and p.message != last_message:
                log.warning("layers [%d, %d): %s", p.start, p.end, p.message)
            last_message = p.message
            for peer in p.banned_peers[banned:]:
                # 'node-id (HOST:PORT)' when the peer announced itself on the artifact swarm, else HOST:PORT
                log.warning("peer %s banned: it sent pieces of model %s that failed their SHA-1", peer,
                            p.model_id[:12])
            banned = len(p.banned_peers)
            if printer is not None:
                printer(p)

        return sink

    def advertisement(self) -> NodeAdvertisement:
        """The registry entry of a node that is not serving yet: state ``fetching``, unverified, no endpoint."""
        manifest, layers = self.manifest, self.layers
        assert manifest is not None and layers is not None
        context = min(self.config.context, CONTEXT_CAP)
        info = BackendInfo(kind="llamacpp", model_name=manifest.name, architecture=manifest.architecture,
                           file_type=manifest.file_type, n_layers=manifest.n_layers, hidden_size=manifest.hidden_size,
                           hidden_shape=[manifest.hidden_size], n_vocab=manifest.n_vocab, context_length=context)
        p = self.latest
        phase = self.phase if self.phase != "fetching" or p is None else p.phase
        summary = FetchSummary(phase=phase, fraction=p.fraction if p else 0.0,
                               bytes_downloaded=p.bytes_downloaded if p else 0,
                               bytes_needed=p.bytes_needed if p else 0, rate_bps=p.rate_bps if p else 0.0,
                               peers=p.peers if p else 0, eta_s=p.eta_s if p else None,
                               message=p.message if p else "")
        return NodeAdvertisement(node_id=self.config.node_id, endpoint="", model_id=manifest.model_id,
                                 layers=LayerRange(start=layers[0], end=layers[1]), is_head=layers[0] == 0,
                                 is_tail=layers[1] == manifest.n_layers, backend=info,
                                 capacity=Capacity(max_sessions=self.config.max_sessions, max_context=context),
                                 verified=False, manifest_id=manifest.manifest_id, aliases=list(self.aliases),
                                 state=NODE_FETCHING, fetch=summary)

    async def _presence_loop(self) -> None:
        kv = await open_registry(self.nc, self.subjects, self.settings.registry_ttl_s,
                                 replicas=self.settings.registry_replicas)
        timeout = max(0.5, min(self.settings.heartbeat_s, self.settings.registry_ttl_s / 4))
        while True:
            try:
                async with asyncio.timeout(timeout):
                    await kv.put(self.config.node_id, codec.encode(self.advertisement()))
                self._advertised = True
            except Exception as exc:  # noqa: BLE001 - a NATS hiccup must not stop the fetch; next beat retries
                log.warning("fetching-state heartbeat failed: %s", type(exc).__name__)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def hand_over(self) -> None:
        """Stop the fetching-state heartbeats: the serving ``Node`` takes over the registry entry (its first
        heartbeat replaces this one, so no stale ``fetching`` entry can land after it)."""
        task, self._presence = self._presence, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._advertised = False

    async def release_lease(self) -> None:
        """Give the range up (a draining node: a replacement joining now may be assigned it). Safe twice."""
        if self.keeper is not None:
            await self.keeper.release()

    async def _on_stop(self) -> None:
        """Release the lease, withdraw a fetching-state entry, stop seeding (then ``stop`` drains the connection
        it owns)."""
        advertised = self._advertised
        await self.hand_over()
        await self.release_lease()
        if advertised:
            with contextlib.suppress(Exception):
                kv = await open_registry(self.nc, self.subjects, self.settings.registry_ttl_s,
                                         unavailable_wait_s=1.0)
                async with asyncio.timeout(2.0):
                    await kv.delete(self.config.node_id)
        if self.sync is not None:
            await self.sync.stop()

