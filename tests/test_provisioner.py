"""actors/provisioning/provisioner.py in one process against real parts: nats-server, a tracker, seeders (ArtifactSync
with their
own stores and libtorrent sessions) and a small llama GGUF: the node learns the manifest, is assigned a range under
a lease, shows as ``fetching`` in the registry, fetches and verifies; when nobody seeds its layers it waits and
says which."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from actors.provisioning.artifact_sync import ArtifactSync, SyncConfig
from actors.provisioning.leases import open_leases
from actors.provisioning.provisioner import ProvisionConfig, Provisioned, Provisioner, ProvisionError
from actors.tracker import Tracker
from actors.tracker.assigner import RESERVE, fit_from_manifest
from artifacts.fetch import fetch_range
from artifacts.store import Store
from artifacts.torrent import SwarmConfig, TorrentSession
from artifacts.verify import verify_shard
from bus import codec
from bus.subjects import Subjects
from schemas.artifact import FetchProgress
from schemas.manifest import ModelManifest
from schemas.node import NodeAdvertisement
from schemas.settings import Settings
from swarmroute.cli import build_parser
from tests.support.gguf_factory import write_tiny_gguf
from tests.support.waiting import eventually

N_LAYERS = 8


@pytest.fixture
def model(tmp_path: Path) -> Path:
    # ~30 MB, so that a throttled fetch takes a few heartbeats
    return write_tiny_gguf(tmp_path / "tiny.gguf", n_layers=N_LAYERS, n_embd=256, n_ff=1024, n_vocab=2000)


class Seeder:
    """A store holding (part of) the model, seeding it with its own libtorrent session."""

    def __init__(self, nc: Any, settings: Settings, home: Path, name: str) -> None:
        self.session = TorrentSession()
        self.sync = ArtifactSync(settings, Store(home), self.session, SyncConfig(node_id=name), nc=nc)

    async def seed(self, model_id: str) -> Seeder:
        await self.sync.start()
        await self.sync.seed(model_id)
        return self

    async def close(self) -> None:
        await self.sync.stop()
        self.session.close()


@pytest.fixture
async def seeders() -> AsyncIterator[list[Seeder]]:
    started: list[Seeder] = []
    yield started
    for s in started:
        await s.close()


def half_memory(manifest: ModelManifest, sessions: int, context: int) -> int:
    fit = fit_from_manifest(manifest, context=context, sessions=sessions, allow_unproven=False)
    return int(0.8 * fit.cost(0, N_LAYERS) / (1 - RESERVE))


async def registry_entry(nc: Any, settings: Settings, node_id: str) -> NodeAdvertisement | None:
    kv = await nc.jetstream().key_value(Subjects(settings.namespace).registry_bucket)
    with contextlib.suppress(Exception):
        entry = await kv.get(node_id)
        if entry.value:
            return codec.decode(entry.value, NodeAdvertisement)
    return None


async def test_a_node_is_assigned_a_range_shows_as_fetching_and_ends_with_a_verified_shard(
        settings: Settings, nc: Any, tmp_path: Path, model: Path, seeders: list[Seeder]) -> None:
    manifest = Store(tmp_path / "seed").import_gguf(model)
    seeders.append(await Seeder(nc, settings, tmp_path / "seed", "seed").seed(manifest.model_id))
    node_settings = settings.model_copy(update={"home": tmp_path / "node"})
    config = ProvisionConfig(node_id="j1", model_id=manifest.model_id, manifest_id=manifest.manifest_id,
                             memory_bytes=half_memory(manifest, 1, 64), max_sessions=1, context=64)
    session = TorrentSession(SwarmConfig(download_limit=4_000_000))  # slow enough to be seen while fetching
    states: list[tuple[str, bool, float]] = []
    async with Tracker(settings):
        provisioner = await Provisioner(config, node_settings, session).start()
        try:
            task = asyncio.create_task(provisioner.provision())
            while not task.done():
                advert = await registry_entry(nc, settings, "j1")
                if advert is not None:
                    states.append((advert.state, advert.verified, advert.fetch.fraction if advert.fetch else -1))
                await asyncio.sleep(0.1)
            got: Provisioned = task.result()
            assert got.assignment is not None and got.assignment.reason == "extend" and got.start == 0
            assert verify_shard(manifest, got.shard, got.start, got.end).ok
            assert got.progress.bytes_downloaded <= 1.05 * got.progress.bytes_needed
            # a node coming up: in the registry as fetching, unverified, with growing progress
            assert states and {(s, v) for s, v, _ in states} == {("fetching", False)}
            fractions = [f for _, _, f in states]
            assert fractions == sorted(fractions) and fractions[-1] > fractions[0]
            leases = await open_leases(nc, Subjects(settings.namespace), settings.registry_ttl_s)
            held = [(v.node_id, v.start, v.end) for v, _ in (await leases.held(manifest.model_id)).values()]
            assert held == [("j1", got.start, got.end)]
            await asyncio.sleep(3 * settings.registry_ttl_s / 2)  # renewed past the TTL
            assert len(await leases.held(manifest.model_id)) == 1
        finally:
            await provisioner.stop()
            await provisioner.stop()  # safe twice
            session.close()
        assert await leases.held(manifest.model_id) == {}  # released on stop
        assert await registry_entry(nc, settings, "j1") is None  # its fetching entry withdrawn


async def test_a_node_waits_for_layers_nobody_seeds_without_advertising_them(
        settings: Settings, nc: Any, tmp_path: Path, model: Path, seeders: list[Seeder]) -> None:
    manifest = Store(tmp_path / "full").import_gguf(model)
    # a peer that holds only layers [0, 4): fetched from a full seeder that then leaves
    full = await Seeder(nc, settings, tmp_path / "full", "full").seed(manifest.model_id)
    part_session = TorrentSession()
    await asyncio.to_thread(fetch_range, Store(tmp_path / "part"), manifest, 0, 4, session=part_session,
                            peers=lambda: [full.session.address])
    part_session.close()
    await full.close()
    seeders.append(await Seeder(nc, settings, tmp_path / "part", "part").seed(manifest.model_id))

    node_settings = settings.model_copy(update={"home": tmp_path / "node"})
    config = ProvisionConfig(node_id="j2", model_id=manifest.model_id, memory_bytes=2**30, layers=(4, 8))
    session = TorrentSession()
    provisioner = await Provisioner(config, node_settings, session).start()
    try:
        task = asyncio.create_task(provisioner.provision())

        def waiting() -> FetchProgress | None:
            assert not task.done(), task
            latest = provisioner.latest
            return latest if latest is not None and latest.unseeded_layers else None

        latest = await eventually(waiting, timeout=15, what="the fetch waiting for a seeder")
        assert [(r.start, r.end) for r in latest.unseeded_layers] == [(4, 8)]
        assert "output" in latest.unseeded_parts and "layers [4, 8)" in latest.message

        async def advertised() -> NodeAdvertisement | None:  # the next heartbeat carries the wait
            advert = await registry_entry(nc, settings, "j2")
            return advert if advert is not None and advert.fetch is not None and advert.fetch.message else None

        advert = await eventually(advertised, timeout=5, what="the registry entry saying what it waits for")
        assert advert.state == "fetching" and not advert.verified
        assert advert.fetch is not None and "layers [4, 8)" in advert.fetch.message
        assert advert.fetch.eta_s is None  # no ETA while waiting for a seeder
        # an honest seeder appears: the same fetch goes on and ends verified
        seeders.append(await Seeder(nc, settings, tmp_path / "full", "full2").seed(manifest.model_id))
        got = await asyncio.wait_for(task, 120)
        assert (got.start, got.end) == (4, 8) and verify_shard(manifest, got.shard, 4, 8).ok
        assert not got.progress.unseeded_layers
    finally:
        await provisioner.stop()
        session.close()


async def test_layers_all_takes_the_whole_model_without_asking_the_tracker(
        settings: Settings, nc: Any, tmp_path: Path, model: Path, seeders: list[Seeder]) -> None:
    """``node --model-id SHA --layers all``: no tracker runs here, so a node that asked for an assignment would wait
    for one forever; it takes [0, n_layers) as soon as the manifest tells it n_layers, under a lease of its own."""
    manifest = Store(tmp_path / "seed").import_gguf(model)
    seeders.append(await Seeder(nc, settings, tmp_path / "seed", "seed").seed(manifest.model_id))
    node_settings = settings.model_copy(update={"home": tmp_path / "node"})
    args = build_parser().parse_args(["node", "--model-id", manifest.model_id, "--layers", "all"])
    config = ProvisionConfig(node_id="j5", model_id=manifest.model_id, memory_bytes=2**30, layers=args.layers)
    session = TorrentSession()
    try:
        async with Provisioner(config, node_settings, session) as p:
            got = await asyncio.wait_for(p.provision(), 120)
            assert got.assignment is None and (got.start, got.end) == (0, N_LAYERS)
            assert p.advertisement().is_head and p.advertisement().is_tail
            leases = await open_leases(nc, Subjects(settings.namespace), settings.registry_ttl_s)
            held = [(v.node_id, v.start, v.end) for v, _ in (await leases.held(manifest.model_id)).values()]
            assert held == [("j5", 0, N_LAYERS)]
        assert verify_shard(manifest, got.shard, 0, N_LAYERS).ok
        assert got.progress.bytes_needed >= sum(t.size for t in manifest.tensors)  # every tensor, not a range's
    finally:
        session.close()


async def test_a_range_outside_the_model_or_a_wrong_pin_is_refused(settings: Settings, nc: Any, tmp_path: Path,
                                                                    model: Path, seeders: list[Seeder]) -> None:
    manifest = Store(tmp_path / "seed").import_gguf(model)
    seeders.append(await Seeder(nc, settings, tmp_path / "seed", "seed").seed(manifest.model_id))
    node_settings = settings.model_copy(update={"home": tmp_path / "node"})
    session = TorrentSession()
    try:
        bad_range = ProvisionConfig(node_id="j3", model_id=manifest.model_id, memory_bytes=2**30, layers=(4, 12))
        async with Provisioner(bad_range, node_settings, session) as p:
            with pytest.raises(ProvisionError, match=r"layers \[4, 12\) are not within the 8 layers"):
                await p.provision()
        # the store now holds this manifest: a different pin is refused, not silently replaced
        pinned = ProvisionConfig(node_id="j4", model_id=manifest.model_id, memory_bytes=2**30,
                                 manifest_id="0" * 64)
        async with Provisioner(pinned, node_settings, session) as p:
            with pytest.raises(ProvisionError, match="not the pinned"):
                await p.provision()
    finally:
        session.close()
