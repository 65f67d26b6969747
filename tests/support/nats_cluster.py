"""A real 3-server NATS cluster with JetStream on loopback, for failover tests.

Each server gets a config generated into its own directory with random free ports (client, cluster route,
monitoring), the cluster block naming every route, and ``include ./auth.conf`` when given an authorization file
(copied beside it: nats-server resolves includes relative to the including file).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import urllib.request
from pathlib import Path
from typing import Any

from bus.server import EmbeddedNats, NatsServerConfig
from tests.support.up import free_port
from tests.support.waiting import eventually


@dataclasses.dataclass
class ClusterMember:
    name: str
    server: EmbeddedNats
    client_port: int
    monitor_port: int

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    def connections(self) -> list[dict[str, Any]]:
        """Client connections on this server (monitoring /connz): name, ip, port, ..."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/connz?limit=1000", timeout=5) as r:
            conns: list[dict[str, Any]] = json.load(r).get("connections") or []
            return conns

    def connection_names(self) -> set[str]:
        return {str(c.get("name", "")) for c in self.connections()}


@dataclasses.dataclass
class NatsCluster:
    members: list[ClusterMember]

    @property
    def urls(self) -> list[str]:
        return [m.url for m in self.members]

    def stop(self) -> None:
        for m in self.members:
            m.server.stop()

    def where(self, connection_name: str) -> ClusterMember | None:
        """The member a named client connection sits on (None if it is not connected anywhere)."""
        for m in self.members:
            if m.server.pid is not None and connection_name in m.connection_names():
                return m
        return None


def _config(name: str, client: int, route: int, monitor: int, routes: list[int], auth: bool) -> str:
    """The store directory comes from EmbeddedNats' command line (--store_dir), so it is not repeated here."""
    route_urls = "\n    ".join(f"nats://127.0.0.1:{p}" for p in routes)
    return f"""server_name: {name}
listen: 127.0.0.1:{client}
http: 127.0.0.1:{monitor}
jetstream {{
  max_memory_store: 64MB
  max_file_store: 64MB
}}
cluster {{
  name: swarmroute-test
  listen: 127.0.0.1:{route}
  routes: [
    {route_urls}
  ]
}}
{"include ./auth.conf" if auth else ""}
"""


def _distinct_ports(size: int) -> list[tuple[int, int, int]]:
    """(client, route, monitor) per member, no two the same: ``free_port`` may hand out a port twice, and a member
    that cannot bind its port never starts."""
    ports: list[int] = []
    while len(ports) < 3 * size:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return [(ports[i], ports[i + 1], ports[i + 2]) for i in range(0, 3 * size, 3)]


def start_cluster(base: Path, *, size: int = 3, auth_conf: Path | None = None) -> NatsCluster:
    ports = _distinct_ports(size)
    routes = [r for _, r, _ in ports]
    members: list[ClusterMember | None] = [None] * size
    errors: list[BaseException] = []

    def start(i: int) -> None:
        client, route, monitor = ports[i]
        home = base / f"nats-{i}"
        home.mkdir(parents=True, exist_ok=True)
        if auth_conf is not None:
            shutil.copy(auth_conf, home / "auth.conf")
        conf = home / "server.conf"
        conf.write_text(_config(f"s{i}", client, route, monitor, routes, auth_conf is not None))
        server = EmbeddedNats(NatsServerConfig(store_dir=home / "js", port=client, config_file=conf,
                                               server_name=f"s{i}", ready_timeout_s=30))
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - reported after every thread finished
            errors.append(exc)
            return
        members[i] = ClusterMember(f"s{i}", server, client, monitor)

    # Started together: a JetStream cluster member waits for its peers before it reports ready.
    threads = [threading.Thread(target=start, args=(i,)) for i in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cluster = NatsCluster([m for m in members if m is not None])
    if errors:
        cluster.stop()
        raise errors[0]
    return cluster


async def wait_jetstream(urls: list[str], *, user: str | None = None, password: str | None = None,
                         timeout: float = 60.0) -> None:
    """Until the cluster has a JetStream meta leader (account info answers). Seen once in the suite, right after a
    llama.cpp swarm's teardown: no leader within 30 s (it takes 2-5 s on a quiet machine)."""
    import nats

    async with await nats.connect(servers=urls, user=user, password=password) as nc:
        await eventually(nc.jetstream().account_info, timeout=timeout, interval=0.25, ignoring=(Exception,),
                         what="a JetStream meta leader answering account info")
