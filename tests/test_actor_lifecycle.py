"""bus.actor.NatsActor, as every NATS actor of the tree runs it (tracker, node, gateway, the artifact swarm's agent,
a provisioning node) against a real nats-server: an async context manager whose ``stop()`` is safe twice, that
drains the connection it made and leaves open one it was handed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from actors.node import Node, NodeConfig
from actors.provisioning.artifact_sync import ArtifactSync, SyncConfig
from actors.provisioning.provisioner import ProvisionConfig, Provisioner
from actors.tracker import Tracker
from artifacts.store import Store
from artifacts.torrent import TorrentSession
from bus.actor import NatsActor
from bus.connection import connect_settings
from gateway.app import Gateway
from schemas.settings import Settings
from tests.support.swarm import stub

Make = Callable[[NATS | None], NatsActor]


@pytest.fixture
def torrents() -> Iterator[list[TorrentSession]]:
    made: list[TorrentSession] = []
    yield made
    for session in made:
        session.close()


@pytest.fixture
def actors(settings: Settings, tmp_path: Path, torrents: list[TorrentSession]) -> dict[str, Make]:
    def torrent() -> TorrentSession:
        torrents.append(TorrentSession())
        return torrents[-1]

    return {
        "tracker": lambda nc: Tracker(settings, nc=nc),
        "node": lambda nc: Node(NodeConfig(node_id="n1", model_id="stub-model"), stub(0, 8), settings, nc=nc),
        "gateway": lambda nc: Gateway(settings, port=0, nc=nc),
        "artifact sync": lambda nc: ArtifactSync(settings, Store(tmp_path / "store"), torrent(),
                                                 SyncConfig(node_id="a1"), nc=nc),
        "provisioner": lambda nc: Provisioner(ProvisionConfig(node_id="p1", model_id="0" * 64, memory_bytes=2**30),
                                              settings, torrent(), nc=nc),
    }


async def test_an_actor_drains_the_connection_it_made_and_stops_twice_safely(actors: dict[str, Make]) -> None:
    for name, make in actors.items():
        actor = make(None)
        assert not actor.running
        async with actor as started:
            assert started is actor and actor.running, name
            nc = actor.nc
            assert nc.is_connected, name
        assert not actor.running and nc.is_closed, name
        await actor.stop()  # again: nothing to do, nothing raised
        assert nc.is_closed, name


async def test_an_actor_leaves_open_a_connection_it_was_handed(actors: dict[str, Make], settings: Settings) -> None:
    nc = await connect_settings(settings, name="shared")
    try:
        for name, make in actors.items():
            actor = await make(nc).start()
            assert actor.nc is nc and actor.running, name
            await actor.stop()
            await actor.stop()
            assert not actor.running and nc.is_connected, name
    finally:
        await nc.drain()


async def test_a_stop_before_any_start_does_nothing(actors: dict[str, Make]) -> None:
    for name, make in actors.items():
        actor = make(None)
        await actor.stop()
        assert not actor.running, name
        with pytest.raises(AssertionError, match="is not started"):
            _ = actor.nc  # it never connected
