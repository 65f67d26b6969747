"""The artifact swarm's control plane on NATS: peer discovery, manifest exchange, progress events, and the
loading of a fetch's manifest.

Subjects (``bus.subjects.Subjects``):

* ``artifact_peer_query(model_id)`` request -> every holder replies with its ``ArtifactPeer`` (torrent address and
  *verified* layer ranges); the asker gathers replies for a short window.
* ``artifact_peers(model_id)``: every holder re-announces its ``ArtifactPeer`` every few seconds, so fetchers learn
  about peers that join later (including other fetchers, which seed what they already hold).
* ``artifact_manifest(model_id)`` request -> the manifest JSON, zlib-compressed; the receiver checks that its
  ``manifest_id`` is the hash of its content (and the id it was told to expect, when given).
* ``artifact_progress(node_id)``: ``FetchProgress`` snapshots while fetching.

Bytes move over BitTorrent between the announced loopback/private addresses (``artifacts.torrent``); this module
only tells libtorrent whom to dial. A range is announced only after ``artifacts.verify`` passed it. The commands
that drive it (``swarmroute artifact fetch|seed``, ``swarmroute seeder``) live in ``swarmroute``; a provisioning
node runs it on its own connection (``actors.provisioning.provisioner``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from actors.provisioning.manifest_request import gather, request_manifest
from artifacts.fetch import FetchOptions, FetchResult, fetch_range
from artifacts.manifest import load_manifest
from artifacts.shard import ShardSource, write_shard
from artifacts.store import Store
from artifacts.torrent import TorrentSession, is_private_address, peer_address
from artifacts.verify import RangeVerdict, StoreReport, verify_store
from bus.actor import NatsActor
from bus.codec import DecodeError, decode, encode
from bus.subjects import Subjects
from schemas.artifact import ArtifactPeer, FetchProgress
from schemas.errors import BadRequestError, NotFoundError, SwarmrouteError
from schemas.manifest import ModelManifest
from schemas.node import LayerRange
from schemas.settings import Settings

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SyncConfig:
    node_id: str
    """This node's id in announcements and progress subjects."""

    announce_s: float = 2.0
    """How often a holder re-announces itself on ``artifact_peers``."""

    discover_s: float = 0.5
    """How long a peer query gathers replies."""

    progress_interval_s: float = 0.5
    """Minimum spacing of progress events (phase changes are always sent)."""

    allow_unproven: bool = False
    """This node's unproven-architecture override: without it a shard of an architecture the matrix has not proven
    is neither verified (so never announced) nor rewritten by ``seed``, whoever cut it."""


@dataclasses.dataclass
class _Held:
    manifest: ModelManifest
    ranges: list[LayerRange] = dataclasses.field(default_factory=list)
    peers: dict[str, ArtifactPeer] = dataclasses.field(default_factory=dict)
    static_peers: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    addresses: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    """Snapshot read by the fetch thread; replaced, never mutated."""
    names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """``HOST:PORT`` -> the node id announcing it: how a banned peer is named. Replaced, never mutated (as
    ``addresses``)."""


class ArtifactSync(NatsActor):
    """One node's participation in the artifact swarms of the models it holds or fetches. A NATS actor
    (``bus.actor.NatsActor``): started before use, an async context manager, ``stop()`` safe to call twice; given
    ``nc``, it runs on that connection and leaves it open."""

    def __init__(self, settings: Settings, store: Store, session: TorrentSession, config: SyncConfig, *,
                 nc: NATS | None = None, name: str | None = None) -> None:
        super().__init__(settings, nc=nc, name=name or f"artifact-{config.node_id}")
        self.subjects = Subjects(settings.namespace)
        self.store, self.session, self.config = store, session, config
        self._held: dict[str, _Held] = {}
        self._subs: list[object] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._last_progress: tuple[str, float] = ("", 0.0)

    # -- holding a model -------------------------------------------------------------------------------------------

    async def hold(self, manifest: ModelManifest, *, static_peers: Iterable[tuple[str, int]] = ()) -> None:
        """Answer queries and manifest requests for this model, watch its announcements and announce ourselves."""
        model_id = manifest.model_id
        if model_id in self._held:
            return
        self._held[model_id] = _Held(manifest, static_peers=[p for p in static_peers if is_private_address(p[0])])
        self._refresh_addresses(model_id)
        self._subs.append(await self.nc.subscribe(self.subjects.artifact_peer_query(model_id), cb=self._on_query))
        self._subs.append(await self.nc.subscribe(self.subjects.artifact_manifest(model_id), cb=self._on_manifest))
        self._subs.append(await self.nc.subscribe(self.subjects.artifact_peers(model_id), cb=self._on_announce))
        self._tasks.append(asyncio.create_task(self._announce_loop(model_id)))

    def me(self, model_id: str) -> ArtifactPeer:
        held = self._held[model_id]
        host, port = self.session.address
        job = self.session.job(held.manifest.torrent.info_hash)
        complete = 0.0
        if job is not None:
            have = job.have()
            complete = sum(have) / len(have) if have else 0.0
        return ArtifactPeer(node_id=self.config.node_id, model_id=model_id, manifest_id=held.manifest.manifest_id,
                            host=host, port=port, ranges=list(held.ranges), complete=complete)

    def advertise(self, model_id: str, verdicts: Iterable[RangeVerdict]) -> list[LayerRange]:
        """Set the ranges this node announces: exactly the verdicts that passed verification."""
        ranges = sorted({(v.start, v.end) for v in verdicts if v.ok})
        self._held[model_id].ranges = [LayerRange(start=a, end=b) for a, b in ranges]
        return self._held[model_id].ranges

    async def announce(self, model_id: str) -> None:
        await self.nc.publish(self.subjects.artifact_peers(model_id), encode(self.me(model_id)))

    async def _announce_loop(self, model_id: str) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.announce(model_id)
            await asyncio.sleep(self.config.announce_s)

    async def _on_query(self, msg: Msg) -> None:
        model_id = msg.subject.rsplit(".", 1)[-1]
        if msg.reply and model_id in self._held:
            await msg.respond(encode(self.me(model_id)))

    async def _on_manifest(self, msg: Msg) -> None:
        model_id = msg.subject.rsplit(".", 1)[-1]
        if msg.reply and model_id in self._held:
            await msg.respond(zlib.compress(self._held[model_id].manifest.model_dump_json().encode()))

    async def _on_announce(self, msg: Msg) -> None:
        try:
            peer = decode(msg.data, ArtifactPeer)
        except DecodeError:
            return
        self._learn(peer)

    def _learn(self, peer: ArtifactPeer) -> None:
        held = self._held.get(peer.model_id)
        if held is None or peer.node_id == self.config.node_id or peer.manifest_id != held.manifest.manifest_id:
            return
        if not is_private_address(peer.host):
            log.warning("ignoring artifact peer %s at non-private address %s", peer.node_id, peer.host)
            return
        held.peers[peer.node_id] = peer
        self._refresh_addresses(peer.model_id)

    def _refresh_addresses(self, model_id: str) -> None:
        held = self._held[model_id]
        held.addresses = list(dict.fromkeys([*held.static_peers, *((p.host, p.port) for p in held.peers.values())]))
        held.names = {peer_address(p.host, p.port): p.node_id for p in held.peers.values()}

    def peers(self, model_id: str) -> list[ArtifactPeer]:
        return list(self._held[model_id].peers.values())

    # -- discovery and manifests -----------------------------------------------------------------------------------

    async def _gather(self, subject: str, wait_s: float) -> list[bytes]:
        return await gather(self.nc, subject, wait_s)

    async def discover(self, model_id: str) -> list[ArtifactPeer]:
        """Ask every holder of the model at once and learn all who answer within ``discover_s``."""
        found = []
        for data in await self._gather(self.subjects.artifact_peer_query(model_id), self.config.discover_s):
            with contextlib.suppress(DecodeError):
                peer = decode(data, ArtifactPeer)
                self._learn(peer)
                found.append(peer)
        return found

    async def fetch_manifest(self, model_id: str, *, expect_id: str | None = None, timeout_s: float = 5.0
                             ) -> ModelManifest:
        """The manifest from any holder; a reply that fails its content hash (or ``expect_id``) is skipped."""
        return await request_manifest(self.nc, self.subjects, model_id, expect_id=expect_id, timeout_s=timeout_s,
                                      gather_s=self.config.discover_s)

    async def manifest_for(self, model_id: str | None, *, manifest_file: Path | None = None,
                           expect_id: str | None = None) -> ModelManifest:
        """The manifest of a fetch: from a file, else the store, else the swarm (checked against ``expect_id``);
        added to the store either way."""
        if manifest_file is not None:
            manifest = load_manifest(manifest_file, expect_id=expect_id)
            self.store.add_manifest(manifest)
            return manifest
        if not model_id:
            raise NotFoundError("give --model-id or --manifest")
        with contextlib.suppress(NotFoundError):
            return self.store.load(self.store.resolve(model_id))
        manifest = await self.fetch_manifest(model_id, expect_id=expect_id)
        self.store.add_manifest(manifest)
        return manifest

    # -- fetching and seeding --------------------------------------------------------------------------------------

    def _progress_sink(self, loop: asyncio.AbstractEventLoop, printer: Callable[[FetchProgress], None] | None
                       ) -> Callable[[FetchProgress], None]:
        """Called on the fetch thread: print, and hand the event to the loop for NATS (rate-limited)."""

        def sink(p: FetchProgress) -> None:
            if printer is not None:
                printer(p)
            phase, last = self._last_progress
            now = time.monotonic()
            if p.phase != phase or now - last >= self.config.progress_interval_s:
                self._last_progress = (p.phase, now)
                data = encode(p)
                loop.call_soon_threadsafe(lambda: asyncio.ensure_future(
                    self.nc.publish(self.subjects.artifact_progress(self.config.node_id), data)))

        return sink

    async def fetch(self, manifest: ModelManifest, start: int, end: int, *,
                    printer: Callable[[FetchProgress], None] | None = None,
                    options: FetchOptions | None = None) -> FetchResult:
        """Fetch ``[start, end)`` from the swarm; on success the verified range is announced at once."""
        await self.hold(manifest)
        await self.discover(manifest.model_id)
        loop = asyncio.get_running_loop()
        sink = self._progress_sink(loop, printer)
        held = self._held[manifest.model_id]
        # A peer banned for corrupt pieces is named by the node id its announcement carries, not only its address.
        named = dataclasses.replace(options or FetchOptions(), peer_names=lambda: held.names)

        def run() -> FetchResult:
            return fetch_range(self.store, manifest, start, end, session=self.session, peers=lambda: held.addresses,
                               progress=sink, node_id=self.config.node_id, options=named)

        try:
            result = await asyncio.to_thread(run)
        except SwarmrouteError as exc:
            p = FetchProgress(node_id=self.config.node_id, model_id=manifest.model_id, start=start, end=end,
                              phase="failed", message=exc.message)
            await self.nc.publish(self.subjects.artifact_progress(self.config.node_id), encode(p))
            raise
        held_before = [RangeVerdict(r.start, r.end, "held", ()) for r in held.ranges]  # verified earlier
        self.advertise(manifest.model_id, [*held_before, result.verdict])
        await self.announce(manifest.model_id)
        await self.nc.flush()
        return result

    async def seed(self, model_id: str) -> StoreReport:
        """Verify what the store holds (repairing shards the data can rebuild), let libtorrent hash-check the file
        so it only serves good pieces, then hold the model and announce the verified ranges."""
        manifest = self.store.load(model_id)
        report = await asyncio.to_thread(_verify_and_repair, self.store, model_id, self.config.allow_unproven)
        self.session.add(manifest, self.store.model_dir(model_id), [], resume=None)
        await self.hold(manifest)
        self.advertise(model_id, report.shards + report.data_ranges)
        await self.announce(model_id)
        return report

    async def _on_stop(self) -> None:
        """No more announcements or answers; the torrent session is the caller's (it may outlive this)."""
        await self._stop_service()
        for task in self._tasks:
            task.cancel()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]
        self._tasks, self._subs = [], []


def _verify_and_repair(store: Store, model_id: str, allow_unproven: bool) -> StoreReport:
    report = verify_store(store, model_id, allow_unproven=allow_unproven)
    good_data = {(v.start, v.end) for v in report.data_ranges if v.ok}
    repaired = False
    for v in report.shards:
        if not v.ok and any(a <= v.start and v.end <= b for a, b in good_data):
            log.warning("rewriting shard [%d, %d) from verified data: %s", v.start, v.end, v.describe())
            manifest = report.manifest
            try:
                # Whoever cut it before, an unproven architecture is rewritten only under this node's own override.
                write_shard(ShardSource.from_manifest(manifest, store.data_path(manifest)),
                            store.shard_path(model_id, v.start, v.end), v.start, v.end,
                            allow_unproven=allow_unproven)
            except BadRequestError as exc:
                log.warning("not rewriting shard [%d, %d): %s", v.start, v.end, exc.message)
                continue
            repaired = True
    return verify_store(store, model_id, allow_unproven=allow_unproven) if repaired else report
