"""actors/provisioning/holder.py: a node serving the bundled Gemma from its own store shares it with the artifact
swarm. In one process against real parts: nats-server, libtorrent sessions on loopback, the real model's store;
the fetching side is the same ``ArtifactSync.fetch`` a node joining with ``--model-id`` runs."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from actors.provisioning.artifact_sync import ArtifactSync, SyncConfig
from actors.provisioning.holder import SEED_NICE, Holder, HolderConfig, torrent_config
from actors.provisioning.manifest_request import request_manifest
from artifacts.fetch import FetchOptions
from artifacts.shard import needed_byte_ranges
from artifacts.store import Store
from artifacts.torrent import TorrentSession, wanted_pieces
from artifacts.verify import verify_shard
from bus.connection import connect_settings
from bus.subjects import Subjects
from schemas.artifact import FetchProgress
from schemas.errors import ArtifactError
from schemas.manifest import ModelManifest
from schemas.node import LayerRange
from schemas.settings import Settings
from swarmroute.artifact_prep import import_model
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow
SERVED = (0, 9)
"""The range the holding node serves (its head half)."""
CORRUPT_LAYER = 15


@pytest.fixture
def holder_home(tmp_path: Path, gemma_path: Path) -> Path:
    """A node's home whose store holds a copy of the bundled model (a copy: the tests write into it)."""
    home = tmp_path / "holder"
    manifest = import_model(home, gemma_path)
    data = Store(home).data_path(manifest)
    copy = data.with_name("copy.tmp")
    shutil.copyfile(data, copy)
    copy.replace(data)  # no longer a hard link of the shared file
    return home


class Fetcher:
    """A node joining with the model id: its own (empty) store, libtorrent session and artifact agent."""

    def __init__(self, settings: Settings, home: Path, name: str) -> None:
        self.store = Store(home)
        self.session = TorrentSession()
        self.sync = ArtifactSync(settings.model_copy(update={"home": home}), self.store, self.session,
                                 SyncConfig(node_id=name))
        self.events: list[FetchProgress] = []

    async def fetch(self, manifest: ModelManifest, start: int, end: int, timeout_s: float = 600.0) -> Path:
        result = await self.sync.fetch(manifest, start, end, printer=self.events.append,
                                       options=FetchOptions(timeout_s=timeout_s, stall_s=1.0))
        return result.shard

    async def close(self) -> None:
        await self.sync.stop()
        self.session.close()


@pytest.fixture
async def fetchers() -> AsyncIterator[list[Fetcher]]:
    made: list[Fetcher] = []
    yield made
    for f in made:
        await f.close()


async def start_fetcher(fetchers: list[Fetcher], settings: Settings, home: Path, name: str) -> Fetcher:
    fetcher = Fetcher(settings, home, name)
    await fetcher.sync.start()
    fetchers.append(fetcher)
    return fetcher


async def hold(settings: Settings, home: Path, served: tuple[int, int], name: str = "holder") -> Holder:
    manifest = Store(home).load(Store(home).model_ids()[0])
    config = HolderConfig(node_id=name, model_id=manifest.model_id, served=served,
                          torrent=torrent_config(settings, "127.0.0.1"))
    holder = await Holder(config, settings.model_copy(update={"home": home})).start()
    await eventually(holder.shared.wait, timeout=120, what="the holder hashing its file")
    assert not holder.failure, holder.failure
    return holder


def corrupt_piece(home: Path, manifest: ModelManifest, layer: int) -> int:
    """Flip bytes in the middle of the layer's largest tensor, as bit rot would: the piece there fails its SHA-1."""
    tensor = max((manifest.tensor(n) for n in manifest.groups.layers[layer]), key=lambda t: t.size)
    offset = tensor.offset + tensor.size // 2
    with Store(home).data_path(manifest).open("r+b") as f:
        f.seek(offset)
        data = f.read(16)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
    return offset // manifest.torrent.piece_size


async def test_a_node_serving_its_local_file_answers_manifest_requests_and_seeds_a_joining_node(
        settings: Settings, holder_home: Path, tmp_path: Path, fetchers: list[Fetcher]) -> None:
    holder = await hold(settings, holder_home, SERVED)
    manifest = holder.store.load(holder.config.model_id)
    try:
        nc = await connect_settings(settings, name="asker")
        try:
            got = await request_manifest(nc, Subjects(settings.namespace), manifest.model_id)
        finally:
            await nc.drain()
        assert got.manifest_id == manifest.manifest_id
        assert holder.job is not None and all(holder.job.have())
        fetcher = await start_fetcher(fetchers, settings, tmp_path / "joiner", "joiner")
        peers = await fetcher.sync.discover(manifest.model_id)
        assert [(p.node_id, p.ranges, p.complete) for p in peers] == [
            ("holder", [LayerRange(start=SERVED[0], end=SERVED[1])], 1.0)]
        shard = await fetcher.fetch(manifest, 6, 12)  # pieces only the holder has: the only peer
        assert verify_shard(manifest, shard, 6, 12).ok
        done = fetcher.events[-1]
        assert done.phase == "done" and done.hash_failures == 0
        needed = sum(hi - lo for lo, hi in needed_byte_ranges(manifest, 6, 12))
        assert needed <= done.bytes_downloaded <= 1.05 * needed
    finally:
        await holder.stop()


async def test_a_holder_never_offers_a_local_piece_that_fails_its_hash(
        settings: Settings, holder_home: Path, tmp_path: Path, fetchers: list[Fetcher]) -> None:
    store = Store(holder_home)
    manifest = store.load(store.model_ids()[0])
    bad = corrupt_piece(holder_home, manifest, CORRUPT_LAYER)
    holder = await hold(settings, holder_home, SERVED)
    # the same store served by a node whose (earlier verified) shard holds the rotten layer: not announced
    tail = await hold(settings, holder_home, (12, 18), name="tail-holder")
    try:
        assert holder.job is not None and tail.job is not None
        have = holder.job.have()
        assert not have[bad] and sum(have) == len(have) - 1, "exactly the corrupted piece is withheld"
        fetcher = await start_fetcher(fetchers, settings, tmp_path / "joiner", "joiner")
        peers = {p.node_id: p for p in await fetcher.sync.discover(manifest.model_id)}
        assert peers["holder"].ranges == [LayerRange(start=SERVED[0], end=SERVED[1])]
        assert peers["tail-holder"].ranges == []
        assert peers["holder"].complete < 1.0
        with pytest.raises(ArtifactError, match=f"nobody seeds layer {CORRUPT_LAYER}"):
            await fetcher.fetch(manifest, 14, 16, timeout_s=20)
        stalled = [e for e in fetcher.events if e.unseeded_layers]
        assert stalled and stalled[-1].unseeded_layers == [LayerRange(start=CORRUPT_LAYER, end=CORRUPT_LAYER + 1)]
        assert all(e.hash_failures == 0 for e in fetcher.events), "the bad piece was offered and sent"
        job = fetcher.session.job(manifest.torrent.info_hash)
        assert job is not None
        wanted = wanted_pieces(manifest, needed_byte_ranges(manifest, 14, 16))
        assert [p for p in wanted if not job.have()[p]] == [bad], "every other piece came from the holders"
    finally:
        await holder.stop()
        await tail.stop()


async def test_a_holder_uploads_within_the_setting_and_below_the_nodes_cpu_priority(
        settings: Settings, holder_home: Path) -> None:
    limited = settings.model_copy(update={"seed_upload_limit": 5_000_000})
    before = _niced_threads()
    holder = await hold(limited, holder_home, SERVED)
    try:
        assert holder.job is not None
        assert holder.job.handle.upload_limit() == 5_000_000
        assert len(_niced_threads()) > len(before), "libtorrent's threads run at the holder's niceness"
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0, "the node's own threads keep theirs"
    finally:
        await holder.stop()


def _niced_threads() -> set[int]:
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) == SEED_NICE:
                found.add(int(tid))
        except OSError:
            pass
    return found
