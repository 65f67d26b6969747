"""A fleet on a real 3-server NATS cluster with the shipped per-role authorization (deploy/nats/auth.conf):
SIGKILL the server that the tracker and both nodes are connected to while a stream runs. The stream completes
with exactly the text a single node computes, the registry (3 replicas) keeps both nodes, and new sessions route.

Each member lists all three servers, nearest first, with shuffling off (``nats.randomize: false``), so the test
knows where everyone sits: the gateway on s0, tracker and nodes on s1. The servers' /connz confirms it before the
kill, so the kill provably hits the connections it claims to.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import nats
import openai
import pytest

from schemas.session import Prompt
from tests.support.fleet import Proc, stub_reference, write_fleet
from tests.support.nats_cluster import NatsCluster, free_port, start_cluster, wait_jetstream

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


async def _registry(c: NatsCluster, timeout: float = 20.0) -> tuple[list[str], Any]:
    """The registry's keys and stream info, read from the surviving servers (retried while a new stream leader
    is elected: JetStream answers "unavailable" or times out for a moment after losing one)."""
    live = [u for m, u in zip(c.members, c.urls, strict=True) if m.server.pid is not None]
    nc = await nats.connect(servers=live, user="admin", password="test-admin-password")
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                info = await nc.jetstream().stream_info("KV_swarmroute_nodes", subjects_filter="$KV.swarmroute_nodes.>")
                return sorted(s.rsplit(".", 1)[-1] for s in info.state.subjects or {}), info
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


def _new_session_routes(port: int, prompt: str, timeout: float) -> str:
    """Retry until the fleet routes a new session again (the tracker reconnects, the stream leader moves)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=15)
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = client.completions.create(model="stub-model", prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
            return reply.choices[0].text
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_killing_a_nats_server_mid_stream_loses_nothing(cluster: NatsCluster, tmp_path: Path) -> None:
    port = free_port()
    fleet_file = write_fleet(tmp_path / "fleet.yaml", _fleet(cluster, port))
    up = Proc(["fleet", "up", str(fleet_file), "--home", str(tmp_path / "home"), "--timeout", "120"])
    try:
        up.wait_for(r"fleet cluster is up", timeout=150)
        keys, info = asyncio.run(_registry(cluster))
        assert keys == ["head", "tail"]
        assert info.config.num_replicas == 3 and info.cluster is not None and len(info.cluster.replicas or []) == 2

        s0, s1, _ = cluster.members
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
        keys, info = asyncio.run(_registry(cluster))
        assert keys == ["head", "tail"]
        assert info.cluster is not None and info.cluster.leader in ("s0", "s2")

        status = Proc(["fleet", "status", str(fleet_file), "--json", "--nats", ",".join(cluster.urls[::2])])
        assert status.run(60) == 0, "\n".join(status.output)
    finally:
        up.stop()
