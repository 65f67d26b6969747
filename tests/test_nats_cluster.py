"""A fleet on a real 3-server NATS cluster with the shipped per-role authorization (deploy/nats/auth.conf):
SIGKILL the server that the tracker and both nodes are connected to while a stream runs. The stream completes
with exactly the text a single node computes, the registry (3 replicas) keeps both nodes, and new sessions route.
And a node whose registry writes are never acknowledged (JetStream without quorum) stays live for the tracker.

Each member lists all three servers, nearest first, with shuffling off (``nats.randomize: false``), so the test
knows where everyone sits: the gateway on s0, tracker and nodes on s1. The servers' /connz confirms it before the
kill, so the kill provably hits the connections it claims to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import openai
import pytest

from actors.node import Node, NodeConfig
from actors.tracker import Tracker
from schemas.session import Prompt
from tests.support.actors import Children
from tests.support.fleet import Proc, stub_reference, write_fleet
from tests.support.nats_cluster import NatsCluster, free_port, start_cluster, wait_jetstream
from tests.support.swarm import make_settings, stub
from tests.support.waiting import eventually, eventually_sync

AUTH_CONF = Path(__file__).resolve().parent.parent / "deploy" / "nats" / "auth.conf"
ROLES = ("tracker", "node", "gateway", "monitor", "admin")
N_TOKENS = 120
KILL_AFTER = 15


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    for role in ROLES:  # the servers read these when they start, the fleet members when they connect
        monkeypatch.setenv(f"SWARMROUTE_NATS_{role.upper()}_PASSWORD", f"test-{role}-password")
    c = start_cluster(tmp_path / "cluster", auth_conf=AUTH_CONF)
    try:
        asyncio.run(wait_jetstream(c.urls, user="admin", password="test-admin-password"))
        yield c
    finally:
        c.stop()


@pytest.fixture
def open_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A cluster without authorization."""
    c = start_cluster(tmp_path / "cluster")
    yield c
    c.stop()


def _fleet(c: NatsCluster, gateway_port: int) -> dict[str, Any]:
    s0, s1, s2 = c.urls
    auth = {role: {"user": role, "password": {"env": f"SWARMROUTE_NATS_{role.upper()}_PASSWORD"}}
            for role in ("tracker", "node", "gateway", "monitor")}
    return {
        "version": 1, "name": "cluster",
        "nats": {"servers": [s0, s1, s2], "randomize": False, "registry_replicas": 3, "auth": auth},
        "settings": {"heartbeat_s": 0.5, "registry_ttl_s": 10.0, "token_timeout_s": 10.0, "hop_timeout_s": 5.0},
        "models": {"stub-model": {"backend": "stub", "n_layers": 8, "stub_delay": 0.02}},
        "trackers": [{"name": "tracker-1", "nats_servers": [s1, s2, s0]}],
        "nodes": [{"name": "head", "nats_servers": [s1, s2, s0]}, {"name": "tail", "nats_servers": [s1, s0, s2]}],
        "gateways": [{"name": "gateway", "listen": f"127.0.0.1:{gateway_port}", "nats_servers": [s0, s2, s1]}],
    }


async def _lead_registry_from(c: NatsCluster, member: str, timeout: float = 30.0) -> None:
    """Move the registry stream's leader onto ``member`` (stepdown with a preferred placement), so the kill below
    always takes the stream's leader with it: the case where no write is acknowledged until a new one is elected."""
    leader: list[str | None] = [None]

    async def led_by_member() -> bool:
        info = await nc.jetstream().stream_info("KV_swarmroute_nodes")
        leader[0] = info.cluster and info.cluster.leader
        if leader[0] == member:
            return True
        with contextlib.suppress(Exception):
            await nc.request("$JS.API.STREAM.LEADER.STEPDOWN.KV_swarmroute_nodes",
                             json.dumps({"placement": {"preferred": member}}).encode(), timeout=5)
        return False

    async with await nats.connect(servers=c.urls, user="admin", password="test-admin-password") as nc:
        await eventually(led_by_member, timeout=timeout, interval=0.5,
                         what=lambda: f"the registry leader moving to {member} (stays on {leader[0]})")


async def _registry(c: NatsCluster, timeout: float = 20.0) -> tuple[list[str], Any]:
    """The registry's keys and stream info, read from the surviving servers (retried while a new stream leader
    is elected: JetStream answers "unavailable" or times out for a moment after losing one)."""
    live = [u for m, u in zip(c.members, c.urls, strict=True) if m.server.pid is not None]
    async with await nats.connect(servers=live, user="admin", password="test-admin-password") as nc:
        info = await eventually(
            lambda: nc.jetstream().stream_info("KV_swarmroute_nodes", subjects_filter="$KV.swarmroute_nodes.>"),
            timeout=timeout, interval=0.5, ignoring=(Exception,), what="the registry stream answering")
    return sorted(s.rsplit(".", 1)[-1] for s in info.state.subjects or {}), info


async def _registry_listing(c: NatsCluster, want: list[str], timeout: float) -> tuple[list[str], Any]:
    """The registry's keys and stream info once it lists ``want`` (or what it lists at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        keys, info = await _registry(c)
        if keys == want or time.monotonic() > deadline:
            return keys, info
        await asyncio.sleep(0.5)


def _new_session_routes(port: int, prompt: str, timeout: float) -> str:
    """Retry until the fleet routes a new session again (the tracker reconnects, the stream leader moves)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=15)
    reply = eventually_sync(lambda: client.completions.create(model="stub-model", prompt=prompt, max_tokens=12,
                                                              temperature=0, extra_body={"ignore_eos": True}),
                            timeout=timeout, interval=0.5, ignoring=(openai.APIError,),
                            what="a new session being routed again")
    return reply.choices[0].text


def test_killing_a_nats_server_mid_stream_loses_nothing(cluster: NatsCluster, tmp_path: Path,
                                                       children: Children) -> None:
    port = free_port()
    fleet_file = write_fleet(tmp_path / "fleet.yaml", _fleet(cluster, port))
    up = children.add(Proc(["fleet", "up", str(fleet_file), "--home", str(tmp_path / "home"), "--timeout", "120"]))
    up.wait_for(r"fleet cluster is up", timeout=150)
    keys, info = asyncio.run(_registry(cluster))
    assert keys == ["head", "tail"]
    assert info.config.num_replicas == 3 and info.cluster is not None and len(info.cluster.replicas or []) == 2

    s0, s1, _ = cluster.members
    asyncio.run(_lead_registry_from(cluster, "s1"))
    assert {"node-head", "node-tail", "tracker"} <= s1.connection_names()
    assert "gateway" in s0.connection_names() and "gateway" not in s1.connection_names()

    prompt = "a stream that outlives its NATS server"
    expected = stub_reference(Prompt(text=prompt), N_TOKENS)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="stub-model", prompt=prompt, max_tokens=N_TOKENS, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    pieces: list[str] = []
    arrived: list[float] = []
    finish = None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            arrived.append(time.monotonic())
            finish = chunk.choices[0].finish_reason or finish
        if len(pieces) == KILL_AFTER:
            s1.server.kill()  # SIGKILL: no goodbye to the tracker, the nodes or the cluster
    assert s1.server.pid is None
    assert "".join(pieces) == expected and finish == "length"
    gaps = sorted(b - a for a, b in zip(arrived[1:], arrived[2:], strict=False))
    print(f"\nfailover: longest gap between tokens {gaps[-1] * 1e3:.0f} ms, "
          f"median {gaps[len(gaps) // 2] * 1e3:.1f} ms")

    # everyone moved to a surviving server, and the fleet keeps routing new sessions
    assert cluster.where("node-head") is not None and cluster.where("tracker") is not None
    again = _new_session_routes(port, "after the failover", timeout=40)
    assert again == stub_reference(Prompt(text="after the failover"), 12)
    # The registry is soft state (TTL 10 s, renewed every heartbeat): what the kill took is whatever the old leader
    # had not replicated, and the nodes' next acknowledged heartbeats on the new leader put it back. Seen once in
    # CI: a read right after the failover listed no key at all, so the keys are awaited, within one TTL.
    started = time.monotonic()
    keys, info = asyncio.run(_registry_listing(cluster, ["head", "tail"], timeout=10.0))
    print(f"registry: both nodes listed {time.monotonic() - started:.1f} s after the first new session")
    assert keys == ["head", "tail"]
    assert info.cluster is not None and info.cluster.leader in ("s0", "s2")

    status = Proc(["fleet", "status", str(fleet_file), "--json", "--nats", ",".join(cluster.urls[::2])])
    assert status.run(60) == 0, "\n".join(status.lines)


async def test_a_node_stays_live_while_its_registry_writes_go_unacknowledged(open_cluster: NatsCluster,
                                                                             tmp_path: Path) -> None:
    """Two of three servers SIGKILLed: the registry stream (3 replicas) has no quorum, so no heartbeat is
    acknowledged for as long as the outage lasts. Each put still reaches the tracker's live feed on the surviving
    server; a node that waited the client's default 5 s for every ack (and as long again to rebind) fell silent
    for longer than the TTL and the tracker dropped it."""
    c = open_cluster
    await wait_jetstream(c.urls)
    settings = make_settings(c.urls[0], tmp_path / "home", heartbeat_s=0.5, registry_ttl_s=3.0,
                             registry_replicas=3)
    backend = stub(0, 8)
    async with Tracker(settings) as tracker, Node(NodeConfig(node_id="n1", model_id="stub-model"), backend,
                                                 settings):
        registry = tracker.registry
        assert registry is not None
        await eventually(lambda: "n1" in {a.node_id for a in registry.live()}, what="the tracker seeing n1")
        for member in c.members[1:]:
            member.server.kill()
        async with await nats.connect(c.urls[0]) as probe:
            with pytest.raises(TimeoutError):  # the outage is real: JetStream acknowledges nothing now
                await probe.jetstream().publish("$KV.swarmroute_nodes.probe", b"x", timeout=2.0)

        # Not a wait: the tracker's view of n1 is sampled throughout two TTLs of the outage.
        oldest = 0.0
        window_end = time.monotonic() + 2 * settings.registry_ttl_s
        while time.monotonic() < window_end:
            oldest = max(oldest, tracker.registry.age_s("n1") or float("inf"))
            await asyncio.sleep(0.05)
        assert oldest < settings.registry_ttl_s, f"the tracker heard nothing from n1 for {oldest:.1f}s"
        assert "n1" in {a.node_id for a in tracker.registry.live()}
