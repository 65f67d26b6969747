"""A node serving a model from its own store shares what it holds with the model's artifact swarm.

In a torrent swarm whoever holds a piece shares it. A node that loaded its layers from a local GGUF (or from a
shard already in its store) holds the model's file, or part of it: it answers manifest requests for the model and
seeds its pieces to nodes that join with only the model id, exactly as a ``swarmroute seeder`` or a node that
fetched its range does (those hold through ``ArtifactSync`` already).

* **Only good pieces**: the torrent is added without resume data, so libtorrent hashes every piece of the file
  against the manifest's SHA-1s before it offers any; a piece that fails (bit rot, a write into the store) is
  never offered, and the log names the layers it holds. The announcement lists the served range only if every
  piece that range needs passed (that range was verified tensor by tensor when the node started).
* **Within its share of the machine**: uploads are capped at ``Settings.seed_upload_limit`` and libtorrent's
  threads run at ``SEED_NICE``, below decoding (tests/bench/bench_seed_while_serving.py measures the decode rate
  of a node that seeds against one that does not).
* **Never in the way of serving**: the hashing runs in the background after the node serves; a store the torrent
  cannot open costs the swarm this holder, never the node its sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

from nats.aio.client import Client as NATS

from actors.provisioning.artifact_sync import ArtifactSync, SyncConfig
from artifacts.availability import unseeded
from artifacts.shard import needed_byte_ranges
from artifacts.store import Store
from artifacts.torrent import SwarmConfig, TorrentJob, TorrentSession, wanted_pieces
from artifacts.verify import RangeVerdict
from bus.actor import NatsActor
from schemas.manifest import ModelManifest
from schemas.settings import Settings

log = logging.getLogger(__name__)
SEED_NICE = 10
"""Niceness of a serving node's libtorrent threads: under CFS a thread at 10 gets about a tenth of the CPU a thread
at 0 gets when both want it, so uploads take what decoding leaves."""
CHECK_POLL_S = 0.2
"""How often the background task looks whether libtorrent has finished hashing the file."""
_CHECKING = ("checking_files", "checking_resume_data")


@dataclasses.dataclass(frozen=True)
class HolderConfig:
    node_id: str
    """The serving node's id: its name in announcements."""

    model_id: str
    """The model it serves, in its store."""

    served: tuple[int, int]
    """The layer range it serves (verified when it started): announced once the file's pieces under it passed."""

    torrent: SwarmConfig
    """Where it seeds from, at what upload limit and niceness (``torrent_config``)."""

    allow_unproven: bool = False


def torrent_config(settings: Settings, host: str, port: int = 0, upload_limit: int | None = None) -> SwarmConfig:
    """The torrent session of a node that serves: ``upload_limit`` (the CLI's) else the setting, at ``SEED_NICE``."""
    limit = settings.seed_upload_limit if upload_limit is None else upload_limit
    return SwarmConfig(listen_host=host, listen_port=port, upload_limit=limit, nice=SEED_NICE)


class Holder(NatsActor):
    """An async context manager (``bus.actor.NatsActor``), started on the serving node's connection (``nc``);
    ``stop()`` is safe twice and leaves that connection open."""

    def __init__(self, config: HolderConfig, settings: Settings, *, nc: NATS | None = None) -> None:
        super().__init__(settings, nc=nc, name=f"holder-{config.node_id}")
        self.config = config
        self.store = Store(settings.home)
        self.session: TorrentSession | None = None
        self.sync: ArtifactSync | None = None
        self.job: TorrentJob | None = None
        self.shared = asyncio.Event()
        """Set once libtorrent hashed the file and the holder announced what it seeds (or gave up: ``failure``)."""
        self.failure = ""
        self._task: asyncio.Task[None] | None = None

    async def _on_start(self) -> None:
        manifest = self.store.load(self.config.model_id)  # checked against its manifest_id on load
        self.session = TorrentSession(self.config.torrent)
        self.sync = await ArtifactSync(self.settings, self.store, self.session,
                                       SyncConfig(node_id=self.config.node_id,
                                                  allow_unproven=self.config.allow_unproven), nc=self.nc).start()
        await self.sync.hold(manifest)  # manifest requests are answered at once; no range announced yet
        self._task = asyncio.create_task(self._share(manifest), name="holder-share")
        log.info("node %s seeds model %s from %s:%d (upload limit %s)", self.config.node_id,
                 manifest.model_id[:12], *self.session.address, _rate(self.config.torrent.upload_limit))

    async def _share(self, manifest: ModelManifest) -> None:
        assert self.session is not None and self.sync is not None
        try:
            self.job = job = self.session.add(manifest, self.store.model_dir(manifest.model_id), [], resume=None)
            while str(job.status().state) in _CHECKING:
                await asyncio.sleep(CHECK_POLL_S)
            self.session.pump()
            if job.counters.errors:
                raise OSError(job.counters.errors[-1])
            have = job.have()
            a, b = self.config.served
            needed = wanted_pieces(manifest, needed_byte_ranges(manifest, a, b))
            if all(have[p] for p in needed):
                self.sync.advertise(manifest.model_id, [RangeVerdict(a, b, "held", ())])
            self._log_held(manifest, have)
            await self.sync.announce(manifest.model_id)
        except Exception as exc:  # noqa: BLE001 - seeding is a service to the swarm; serving goes on without it
            self.failure = f"{type(exc).__name__}: {exc}"
            log.warning("node %s does not seed model %s: %s", self.config.node_id, manifest.model_id[:12],
                        self.failure)
        finally:
            self.shared.set()

    def _log_held(self, manifest: ModelManifest, have: list[bool]) -> None:
        bad = [i for i, held in enumerate(have) if not held]
        if not bad:
            log.info("node %s seeds every piece of model %s (%d)", self.config.node_id, manifest.model_id[:12],
                     len(have))
            return
        where = unseeded(manifest, 0, manifest.n_layers, bad).describe() or "no layer"
        log.warning("node %s seeds %d of %d pieces of model %s: %d fail their SHA-1 or are not on disk, never "
                    "offered (%s)", self.config.node_id, len(have) - len(bad), len(have), manifest.model_id[:12],
                    len(bad), where)

    async def _on_stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.sync is not None:
            await self.sync.stop()
        if self.session is not None:
            self.session.close()


def _rate(limit: int) -> str:
    return f"{limit / 1e6:g} MB/s" if limit else "none"
